//! The checkpoint: what the agent knew when it last ran, so that on restart it can tell which
//! nodes disappeared while it was down (the deletions it never saw) and retry cleanups that had
//! not succeeded.
//!
//! [`format`] is the byte encoding (pure), framing the bincode payload of `payload/`; the errors
//! of both are in `error`, beneath them, as each version's payload module reports them too;
//! [`store`] is the file, its lock and its atomic replacement (the only I/O in this crate).

pub mod clock;
mod error;
pub mod format;
mod node_records;
mod payload;
pub mod store;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ids::AllocatorState;
use crate::node::Node;

pub use clock::BootTime;
pub use error::{DecodeError, EncodeError, PayloadError};
pub use format::{FORMAT_VERSION, MAGIC, decode, encode};
pub use node_records::NodeRecords;
pub use store::{
    CheckpointStore, LoadOutcome, StoreError, Unusable, lock_held_by, lock_holder, lock_pin_dir,
    read,
};

/// A restored node whose cleanup has not succeeded yet. It is carried from checkpoint to
/// checkpoint until its deletes succeed, so a failed or braked cleanup is retried after the next
/// restart too (invariant 7).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingDelete {
    pub node: Node,
    /// Cleanups tried and failed so far; 0 for a node held by the brake and never tried.
    pub attempts: u32,
    /// The brake held this removal when the record was written: a restarted agent keeps holding
    /// it until a confirmation, as the agent before the restart would have. Since format
    /// version 3.
    pub held: Option<Held>,
}

/// A hold of the brake, as the record keeps it across restarts (invariant 16).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    /// Since the Unix epoch: when the hold began.
    pub at: Duration,
    /// Held as part of a near-total wipe: only an operator releases it.
    pub wipe: bool,
}

/// The checkpoint content.
///
/// Every node record carries the node ID it had (`node.node_id` is `Some`), since that is how the
/// planner finds the xfrm objects and map entries of a node whose addresses changed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub agent_version: String,
    /// Agent time ([`clock`]): since the Unix epoch, as the wall clock said when the agent's
    /// clock was last taken from it.
    pub written_at: Duration,
    /// Where `written_at` sat on the kernel's boot clock, when it could be read: an agent
    /// started on the same boot continues its clock from here. Since format version 4.
    pub boot: Option<BootTime>,
    /// The node this agent runs on. Its record is never stored: ID 0 is implicit and its state
    /// is not ours to delete, so [`format::encode`] drops it and the planner ignores it.
    pub local_node: String,
    pub nodes: NodeRecords,
    pub pending_deletes: Vec<PendingDelete>,
    /// Freed node IDs and when, so the cool-down outlives a restart.
    pub ids: AllocatorState,
    /// Removals carried out recently: the brake's window, kept so that a mass deletion cannot
    /// get past the brake split across restarts (invariant 9). Since format version 2.
    pub removals: Vec<RecentRemovals>,
    /// The IPsec keys the agent has seen, by SPI, with when it first saw each, so a key rotation
    /// interrupted by a restart resumes on its original schedule. Since format version 2.
    pub ipsec_keys: Vec<KeySeen>,
    /// Orphan objects the brake held when the record was written: when the first hold began,
    /// and whether any was part of a near-total wipe. The orphans themselves are not listed; a
    /// restarted agent holds every orphan it finds from that time, which only ever holds more.
    /// Since format version 3.
    pub orphans_held: Option<Held>,
}

impl Checkpoint {
    /// Whether the two say the same about the nodes, IDs, removals and keys: everything but when
    /// they were written (by either clock). Compares in place, so the daemon can tell a changed record from an
    /// unchanged one without copying a large one.
    pub fn same_content(&self, other: &Self) -> bool {
        let Self {
            agent_version,
            written_at: _,
            boot: _,
            local_node,
            nodes,
            pending_deletes,
            ids,
            removals,
            ipsec_keys,
            orphans_held,
        } = self;
        *agent_version == other.agent_version
            && *local_node == other.local_node
            && *nodes == other.nodes
            && *pending_deletes == other.pending_deletes
            && *ids == other.ids
            && *removals == other.removals
            && *ipsec_keys == other.ipsec_keys
            && *orphans_held == other.orphans_held
    }

    /// Puts the record of an event-sized plan into this one: the nodes and pending deletes
    /// named in `names` are replaced by `part`'s, everything that is not per node (IDs,
    /// removals, keys, held orphans, version, time) comes from `part`. The records of each name
    /// are replaced where they stand ([`NodeRecords::replace`]), so the cost follows the names,
    /// not the size of the record.
    pub fn splice(&mut self, names: &[String], part: Checkpoint) -> Spliced {
        let Checkpoint {
            agent_version,
            written_at,
            boot,
            local_node: _,
            mut nodes,
            pending_deletes,
            ids,
            removals,
            ipsec_keys,
            orphans_held,
        } = part;
        let mut changed = self.agent_version != agent_version
            || self.ids != ids
            || self.removals != removals
            || self.ipsec_keys != ipsec_keys
            || self.orphans_held != orphans_held;
        let mut records_written = 0;
        for name in spliced_names(names, &nodes) {
            let group = nodes.take(&name);
            if self.nodes.named(&name) != &group[..] {
                changed = true;
                records_written += self.nodes.replace(&name, group);
            }
        }
        let before = self.pending_deletes.len();
        self.pending_deletes
            .retain(|p| !names.contains(&p.node.name));
        changed |= self.pending_deletes.len() != before || !pending_deletes.is_empty();
        records_written += before - self.pending_deletes.len() + pending_deletes.len();
        self.pending_deletes.extend(pending_deletes);
        self.agent_version = agent_version;
        self.written_at = written_at;
        self.boot = boot;
        self.ids = ids;
        self.removals = removals;
        self.ipsec_keys = ipsec_keys;
        self.orphans_held = orphans_held;
        Spliced {
            changed,
            records_written,
        }
    }
}

/// What [`Checkpoint::splice`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spliced {
    /// Anything but the time changed.
    pub changed: bool,
    /// Records taken out and put in: an event's work on the record, the same at any size of
    /// cluster (`state/tests/per_event.rs`).
    pub records_written: usize,
}

/// The names whose records [`Checkpoint::splice`] replaces: those named and those of the part's
/// nodes, sorted, each once. [`crate::plan::ClaimIndex::splice`] follows the same names.
pub(crate) fn spliced_names(names: &[String], part: &NodeRecords) -> Vec<String> {
    let mut spliced: Vec<String> = names.to_vec();
    spliced.extend(part.iter().map(|n| n.name.clone()));
    spliced.sort_unstable();
    spliced.dedup();
    spliced
}

/// Removals the brake let through at one time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecentRemovals {
    /// Since the Unix epoch.
    pub at: Duration,
    /// Known remote nodes removed.
    pub nodes: u32,
    /// Orphan objects removed.
    pub objects: u32,
}

/// An IPsec key the agent has seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySeen {
    /// 1..=15.
    pub spi: u8,
    /// Since the Unix epoch.
    pub first_seen: Duration,
}

impl Checkpoint {
    /// All records, live then pending, with the local node filtered out.
    pub fn records(&self) -> impl Iterator<Item = &Node> {
        self.nodes
            .iter()
            .chain(self.pending_deletes.iter().map(|p| &p.node))
            .filter(|n| n.name != self.local_node)
    }
}

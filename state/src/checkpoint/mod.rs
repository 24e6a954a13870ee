//! The checkpoint: what the agent knew when it last ran, so that on restart it can tell which
//! nodes disappeared while it was down (the deletions it never saw) and retry cleanups that had
//! not succeeded.
//!
//! [`format`] is the byte encoding (pure), framing the bincode payload of `payload.rs`;
//! [`store`] is the file, its lock and its atomic replacement (the only I/O in this crate).

pub mod format;
mod payload;
pub mod store;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ids::AllocatorState;
use crate::node::{Node, name_range};

pub use format::{DecodeError, EncodeError, FORMAT_VERSION, MAGIC, PayloadError, decode, encode};
pub use store::{CheckpointStore, LoadOutcome, StoreError, lock_holder};

/// A restored node whose cleanup has not succeeded yet. It is carried from checkpoint to
/// checkpoint until its deletes succeed, so a failed or braked cleanup is retried after the next
/// restart too (invariant 7).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingDelete {
    pub node: Node,
    /// Cleanups tried and failed so far; 0 for a node held by the brake and never tried.
    pub attempts: u32,
}

/// The checkpoint content.
///
/// Every node record carries the node ID it had (`node.node_id` is `Some`), since that is how the
/// planner finds the xfrm objects and map entries of a node whose addresses changed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub agent_version: String,
    /// Since the Unix epoch.
    pub written_at: Duration,
    /// The node this agent runs on. Its record is never stored: ID 0 is implicit and its state
    /// is not ours to delete, so [`format::encode`] drops it and the planner ignores it.
    pub local_node: String,
    pub nodes: Vec<Node>,
    pub pending_deletes: Vec<PendingDelete>,
    /// Freed node IDs and when, so the cool-down outlives a restart.
    pub ids: AllocatorState,
    /// Removals carried out recently: the brake's window, kept so that a mass deletion cannot
    /// get past the brake split across restarts (invariant 9). Since format version 2.
    pub removals: Vec<RecentRemovals>,
    /// The IPsec keys the agent has seen, by SPI, with when it first saw each, so a key rotation
    /// interrupted by a restart resumes on its original schedule. Since format version 2.
    pub ipsec_keys: Vec<KeySeen>,
}

impl Checkpoint {
    /// Whether the two say the same about the nodes, IDs, removals and keys: everything but when
    /// they were written. Compares in place, so the daemon can tell a changed record from an
    /// unchanged one without copying a large one.
    pub fn same_content(&self, other: &Self) -> bool {
        let Self {
            agent_version,
            written_at: _,
            local_node,
            nodes,
            pending_deletes,
            ids,
            removals,
            ipsec_keys,
        } = self;
        *agent_version == other.agent_version
            && *local_node == other.local_node
            && *nodes == other.nodes
            && *pending_deletes == other.pending_deletes
            && *ids == other.ids
            && *removals == other.removals
            && *ipsec_keys == other.ipsec_keys
    }

    /// Puts the record of an event-sized plan into this one: the nodes and pending deletes
    /// named in `names` are replaced by `part`'s, everything that is not per node (IDs,
    /// removals, keys, version, time) comes from `part`. Returns whether anything but the time
    /// changed. A name with as many records before as after is replaced in place, so the cost
    /// of a readdress follows the names; names added or removed are merged into the record in
    /// one pass. Splicing them in one by one moved the rest of the record once per name: with a
    /// few thousand new nodes at 65,000, that was a seventh of a restart.
    pub fn splice(&mut self, names: &[String], part: Checkpoint) -> bool {
        let Checkpoint {
            agent_version,
            written_at,
            local_node: _,
            mut nodes,
            pending_deletes,
            ids,
            removals,
            ipsec_keys,
        } = part;
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        let mut changed = self.agent_version != agent_version
            || self.ids != ids
            || self.removals != removals
            || self.ipsec_keys != ipsec_keys;
        let spliced = spliced_names(names, &nodes);
        let mut incoming = nodes.into_iter().peekable();
        // Names whose count of records changes, and their new records, both in name order.
        let mut resized: Vec<&str> = Vec::new();
        let mut arriving: Vec<Node> = Vec::new();
        for name in &spliced {
            let mut group = Vec::new();
            while let Some(n) = incoming.next_if(|n| n.name == *name) {
                group.push(n);
            }
            let at = name_range(&self.nodes, name);
            if at.len() == group.len() {
                // A node readdressed: replaced in place, the rest of the record unmoved.
                for (slot, n) in self.nodes[at].iter_mut().zip(group) {
                    changed |= *slot != n;
                    *slot = n;
                }
            } else {
                resized.push(name);
                arriving.extend(group);
            }
        }
        if !resized.is_empty() {
            changed = true;
            let old = std::mem::take(&mut self.nodes);
            let staying = old
                .into_iter()
                .filter(|n| resized.binary_search(&n.name.as_str()).is_err());
            self.nodes = merged_by_name(staying, arriving);
        }
        let before = self.pending_deletes.len();
        self.pending_deletes
            .retain(|p| !names.contains(&p.node.name));
        changed |= self.pending_deletes.len() != before || !pending_deletes.is_empty();
        self.pending_deletes.extend(pending_deletes);
        self.agent_version = agent_version;
        self.written_at = written_at;
        self.ids = ids;
        self.removals = removals;
        self.ipsec_keys = ipsec_keys;
        changed
    }
}

/// `a` and `b`, each in name order and sharing no name, as one list in name order.
fn merged_by_name(a: impl Iterator<Item = Node>, b: Vec<Node>) -> Vec<Node> {
    let mut out = Vec::with_capacity(a.size_hint().0 + b.len());
    let mut b = b.into_iter().peekable();
    for n in a {
        while let Some(m) = b.next_if(|m| m.name < n.name) {
            out.push(m);
        }
        out.push(n);
    }
    out.extend(b);
    out
}

/// The names whose records [`Checkpoint::splice`] replaces: those named and those of the part's
/// nodes, sorted, each once. [`crate::plan::ClaimIndex::splice`] follows the same names.
pub(crate) fn spliced_names(names: &[String], part: &[Node]) -> Vec<String> {
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

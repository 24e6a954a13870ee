//! What the brake remembers from one plan to the next, what it reports, and its decision as the
//! later steps ask it: which removals go ahead. The rule itself, and how a plan asks it, are
//! [`super::brake`]'s; the steps after it and the plan's input only need these.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use foldhash::HashSet;

use super::nodes::Record;
use super::ops::Delete;
use crate::checkpoint::{Checkpoint, Held, RecentRemovals};
use crate::ids::AllocatorState;
use crate::objects::{NodeId, ObjectId};

/// Something a plan would remove for good.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Removal {
    /// A known remote node (by name and UID: a node replaced under its name is a removal too).
    Node { name: String, uid: String },
    /// An object of ours that belongs to nobody.
    Orphan(ObjectId),
}

/// When an item's hold began.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldSince {
    /// Since the Unix epoch.
    pub at: Duration,
    /// The source's count of full lists (with the local node) at that time.
    pub relists: u64,
    /// It was held as part of a near-total wipe: only an operator releases it.
    pub wipe: bool,
}

/// What the brake remembers from one plan to the next.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BrakeMemory {
    /// Items held, and since when.
    pub held: BTreeMap<Removal, HeldSince>,
    /// Removals carried out recently; the checkpoint keeps these across restarts.
    pub window: Vec<RecentRemovals>,
    /// Restored from a checkpoint whose orphans were held (which orphans, the record does not
    /// say): every orphan the first plan after the restart finds counts as held since then.
    pub orphans_held: Option<HeldSince>,
    /// Restored from a checkpoint older than the kernel's record of recent removals (a crash
    /// between the kernel writes and the checkpoint write): removals the checkpoint still names
    /// that were made after it was written (their node IDs freed since), which the window's
    /// entries from the kernel already count. The first plan that asks for them releases them
    /// without counting them again.
    pub done: BTreeSet<Removal>,
}

impl BrakeMemory {
    /// What the record keeps of the holds: the held nodes (by name and UID) and the orphans'
    /// hold (the first time one began, and whether any is a wipe's). The source's count of
    /// lists is this process's own and is not kept: after a restart, any full list is newer.
    pub fn held_for_record(&self) -> (BTreeMap<(&str, &str), Held>, Option<Held>) {
        let mut nodes = BTreeMap::new();
        let mut orphans: Option<Held> = self.orphans_held.map(HeldSince::kept);
        for (item, since) in &self.held {
            match item {
                Removal::Node { name, uid } => {
                    nodes.insert((name.as_str(), uid.as_str()), since.kept());
                }
                Removal::Orphan(_) => {
                    let h = since.kept();
                    orphans = Some(orphans.map_or(h, |o| Held {
                        at: o.at.min(h.at),
                        wipe: o.wipe || h.wipe,
                    }));
                }
            }
        }
        (nodes, orphans)
    }

    /// The memory a restarted agent begins with: the window and the holds from its checkpoint
    /// (a restart never releases a hold: what was held stays held until a confirmation, however
    /// the ratio looks after it). Without a checkpoint, the window is the kernel's own record of
    /// recent removals (`kept`); where the kernel has none from before this start either (an
    /// agent that did not keep one), the IDs it remembers freeing (`freed`, merged into the
    /// allocator state) stand in, each one a node removed at that time. With both, each removal
    /// is counted once, as [`counted_once`] says. Entries older than the window fall away at
    /// the first plan.
    pub fn restored(
        cp: Option<&Checkpoint>,
        kept: Option<Vec<RecentRemovals>>,
        freed: &AllocatorState,
    ) -> Self {
        let (window, done) = match (cp, kept) {
            (Some(c), Some(kept)) => counted_once(c, kept, freed),
            (Some(c), None) => (c.removals.clone(), BTreeSet::new()),
            (None, Some(kept)) => (kept, BTreeSet::new()),
            (None, None) => (
                freed
                    .freed
                    .iter()
                    .map(|f| RecentRemovals {
                        at: f.freed_at,
                        nodes: 1,
                        objects: 0,
                    })
                    .collect(),
                BTreeSet::new(),
            ),
        };
        let restored = |h: Held| HeldSince {
            at: h.at,
            relists: 0,
            wipe: h.wipe,
        };
        let held = cp
            .into_iter()
            .flat_map(|c| &c.pending_deletes)
            .filter_map(|p| {
                let item = Removal::Node {
                    name: p.node.name.clone(),
                    uid: p.node.uid.to_string(),
                };
                Some((item, restored(p.held?)))
            })
            .filter(|(item, _)| !done.contains(item))
            .collect();
        Self {
            held,
            window,
            orphans_held: cp.and_then(|c| c.orphans_held).map(restored),
            done,
        }
    }
}

/// The window from the checkpoint and the kernel's record together, each removal once, and the
/// removals of the checkpoint's records that the window already counts.
///
/// Both are times on the agent's clock (one clock across a restart on the same boot), and the
/// checkpoint's window is complete up to its `written_at`: it is the brake's memory as of the
/// last plan before that write. So the kernel's entries up to then are the checkpoint's own (or
/// a full ring's merge of them, which the checkpoint has unmerged) and are skipped; its entries
/// after then are removals the checkpoint could not record (a crash between the kernel writes
/// and the checkpoint write, or checkpoint writes that failed). Such a removal is of a node the
/// checkpoint may still list, which the first plan would ask for again and count a second
/// time. Those are told by identity, from what the kernel remembers: a record (listed, or a
/// pending delete not released before) whose node ID the kernel freed after `written_at` was
/// removed after the checkpoint was written, by the agent that wrote those entries; at most as
/// many are taken as those entries count. A removal the kernel freed no ID for (its cleanup
/// failed, or its ID is still in use) is counted by both, which only holds more; so is what a
/// full ring merged from before `written_at` into an entry after it.
fn counted_once(
    cp: &Checkpoint,
    kept: Vec<RecentRemovals>,
    freed: &AllocatorState,
) -> (Vec<RecentRemovals>, BTreeSet<Removal>) {
    let after: Vec<RecentRemovals> = kept.into_iter().filter(|k| k.at > cp.written_at).collect();
    let unrecorded: usize = after.iter().map(|k| k.nodes as usize).sum();
    let freed_since: HashSet<NodeId> = freed
        .freed
        .iter()
        .filter(|f| f.freed_at > cp.written_at)
        .map(|f| f.id)
        .collect();
    let unreleased = cp.pending_deletes.iter().filter(|p| p.attempts == 0);
    let done = cp
        .nodes
        .iter()
        .chain(unreleased.map(|p| &p.node))
        .filter(|n| n.name != cp.local_node)
        .filter(|n| n.node_id.is_some_and(|id| freed_since.contains(&id)))
        .map(|n| Removal::Node {
            name: n.name.clone(),
            uid: n.uid.to_string(),
        })
        .take(unrecorded)
        .collect();
    let mut window = cp.removals.clone();
    window.extend(after);
    window.sort_by_key(|r| r.at);
    (window, done)
}

impl HeldSince {
    fn kept(self) -> Held {
        Held {
            at: self.at,
            wipe: self.wipe,
        }
    }
}

/// Why the brake holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldKind {
    /// Removals over the allowed share: a fresh full list after the confirm delay releases them.
    Ratio,
    /// Removals of the wipe share or more: only an operator releases them.
    Wipe,
    /// The list lacks the local node, or a valid record of it with an InternalIP: it is no
    /// view of this cluster from this node, and nothing changes.
    NoLocalNode,
}

/// What the brake holds, for logs, metrics, readiness and reports.
#[derive(Clone, Debug, PartialEq)]
pub struct BrakeHold {
    pub kind: HoldKind,
    /// Names the held set, for an operator's confirmation (`node-agent prune confirm <id>`);
    /// for [`HoldKind::NoLocalNode`], the local node's name.
    pub id: String,
    /// The held nodes, in name order.
    pub nodes: Vec<String>,
    /// How many orphan objects are held.
    pub orphans: usize,
    /// The numbers the brake decided by; the message prints these.
    pub count: BrakeCount,
    pub max_ratio: f64,
    /// When the oldest held item's hold began (since the Unix epoch).
    pub since: Duration,
    /// When a fresh full list may confirm the hold (since the Unix epoch); `None` when only an
    /// operator can, or nothing can.
    pub confirmable_at: Option<Duration>,
    /// The objects kept because of the hold.
    pub deletes: Vec<Delete>,
}

impl BrakeHold {
    pub(super) fn local_node_missing(local: &str) -> Self {
        Self {
            kind: HoldKind::NoLocalNode,
            id: local.to_string(),
            nodes: Vec::new(),
            orphans: 0,
            count: BrakeCount::default(),
            max_ratio: 0.0,
            since: Duration::ZERO,
            confirmable_at: None,
            deletes: Vec::new(),
        }
    }
}

impl fmt::Display for BrakeHold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.kind == HoldKind::NoLocalNode {
            return write!(
                f,
                "the node list does not contain this node ({}), or no valid record of it with \
                 an InternalIP: it is not a view of this cluster from this node (a partial or \
                 filtered list, another cluster's, or this node malformed or registering); \
                 nothing is changed until a list contains it",
                self.id
            );
        }
        let c = &self.count;
        write!(
            f,
            "holding the removal of {} remote nodes and {} orphan objects ({} objects in all): \
             {} of {} known remote nodes ({:.0}%) and {} of {} of our objects ({:.0}%) counting \
             what was removed within the window ({} nodes, {} objects), against {:.0}% allowed; \
             a partial node list, the wrong cluster or an RBAC error can look like this",
            self.nodes.len(),
            self.orphans,
            self.deletes.len(),
            c.removed_nodes(),
            c.known_nodes,
            c.node_ratio() * 100.0,
            c.removed_objects(),
            c.objects,
            c.orphan_ratio() * 100.0,
            c.window_nodes,
            c.window_objects,
            self.max_ratio * 100.0,
        )?;
        match self.kind {
            HoldKind::Wipe => write!(
                f,
                ". A near-total wipe: only an operator releases it, with `node-agent prune \
                 confirm {}` (a running daemon) or --force-prune",
                self.id
            ),
            _ => write!(
                f,
                ". A fresh full list after the confirm delay releases it (daemon), or \
                 `node-agent prune confirm {}`, or --force-prune",
                self.id
            ),
        }
    }
}

/// What [`decide`](super::brake::decide) decided.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Decision {
    pub released: BTreeSet<Removal>,
    pub memory: BrakeMemory,
    /// When something stays held: its kind and ratios.
    pub hold: Option<(HoldKind, BrakeCount)>,
}

/// What the brake counted: [`decide`](super::brake::decide) fills it and decides by it, and a
/// hold's message prints it, so the two cannot tell different numbers. Each removal is counted
/// once (a removal the window counts is not counted again as asked for now).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BrakeCount {
    /// Known remote nodes the plan asks to remove now (those a sweep removes by ID included).
    pub asked_nodes: usize,
    /// Known remote nodes removed within the window.
    pub window_nodes: usize,
    /// Known remote nodes: the record's (or the map's), with those removed within the window.
    pub known_nodes: usize,
    /// Orphan objects the plan asks to remove now.
    pub asked_orphans: usize,
    /// Orphan objects removed within the window.
    pub window_objects: usize,
    /// Our objects, with those removed within the window.
    pub objects: usize,
}

impl BrakeCount {
    /// Known remote nodes removed now and within the window.
    pub fn removed_nodes(&self) -> usize {
        self.asked_nodes + self.window_nodes
    }

    /// Orphan objects removed now and within the window.
    pub fn removed_objects(&self) -> usize {
        self.asked_orphans + self.window_objects
    }

    pub fn node_ratio(&self) -> f64 {
        ratio(self.removed_nodes(), self.known_nodes)
    }

    pub fn orphan_ratio(&self) -> f64 {
        ratio(self.removed_objects(), self.objects)
    }
}

fn ratio(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// A short, stable name for a set of removals: FNV-1a over its items, in order.
pub fn hold_id<'a>(items: impl IntoIterator<Item = &'a Removal>) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for item in items {
        match item {
            Removal::Node { name, uid } => {
                feed(b"n");
                feed(name.as_bytes());
                feed(b"\0");
                feed(uid.as_bytes());
            }
            Removal::Orphan(id) => {
                feed(b"o");
                feed(format!("{id:?}").as_bytes());
            }
        }
        feed(b"\n");
    }
    format!("{:012x}", h >> 16)
}

/// The brake applied to one plan.
pub(super) struct Brake {
    pub(super) synced: bool,
    pub(super) decision: Decision,
    /// The records (name and UID) whose removal goes ahead.
    pub(super) released_nodes: HashSet<(String, String)>,
    pub(super) max_ratio: f64,
    pub(super) confirm_delay: Duration,
    pub(super) confirm_by_relist: bool,
}

impl Brake {
    /// Whether the removal of record `r` (a record with no live node) goes ahead.
    pub fn releases(&self, r: &Record<'_>) -> bool {
        self.synced
            && self
                .released_nodes
                .contains(&(r.node.name.clone(), r.node.uid.to_string()))
    }

    /// Whether an orphan may be deleted: after sync, unless the brake holds it.
    pub fn releases_orphan(&self, id: &ObjectId) -> bool {
        self.synced
            && !self
                .decision
                .memory
                .held
                .contains_key(&Removal::Orphan(id.clone()))
    }

    /// The hold to report (with the objects it keeps) and the memory for the next plan.
    pub fn finish(self, kept: Vec<Delete>) -> (Option<BrakeHold>, BrakeMemory) {
        let memory = self.decision.memory;
        let hold = self.decision.hold.map(|(kind, count)| {
            let since = memory.held.values().map(|s| s.at).min().unwrap_or_default();
            BrakeHold {
                kind,
                id: hold_id(memory.held.keys()),
                nodes: memory
                    .held
                    .keys()
                    .filter_map(|r| match r {
                        Removal::Node { name, .. } => Some(name.clone()),
                        Removal::Orphan(_) => None,
                    })
                    .collect(),
                orphans: memory
                    .held
                    .keys()
                    .filter(|r| matches!(r, Removal::Orphan(_)))
                    .count(),
                count,
                max_ratio: self.max_ratio,
                since,
                confirmable_at: (kind == HoldKind::Ratio && self.confirm_by_relist)
                    .then(|| since.saturating_add(self.confirm_delay)),
                deletes: kept,
            }
        });
        (hold, memory)
    }
}

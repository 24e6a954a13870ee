//! The reconcile planner: `(restored checkpoint, live view, kernel inventory, config) -> plan`.
//!
//! Pure: no clock, no I/O. This is where the invariants of `DESIGN.md` are enforced; the backends
//! only apply [`Plan::ops`] and report failures back through [`Plan::checkpoint_after`].
//!
//! # How a plan is made
//!
//! 1. **Classify live nodes**, in name order (the order decides conflicts: on a duplicate name the
//!    first in the live list wins, on an IP or pod CIDR claimed twice the node whose name sorts
//!    first wins and the other is reported). A live node is *programmed* or *held*: held nodes
//!    (no addresses yet, bad input, no ID or map room left) keep whatever they had, untouched
//!    (invariants 8 and 12).
//! 2. **Assign node IDs**: IDs restored from the map win (an IP's map entry says which ID it had;
//!    confirmed by the node's checkpoint record first; never an ID the checkpoint gives to a node
//!    of another name, so a recycled IP or a renamed node gets a fresh ID and its entry is updated
//!    in place), then the record's ID, then a fresh ID from the [`IdAllocator`] (invariant 5). Every ID seen in the inventory or the checkpoint is
//!    reserved first, so a fresh ID never collides with one still in the kernel.
//! 3. **Desired objects** of programmed nodes ([`crate::desired`]). An inventory object with the
//!    same identity and content needs nothing (invariant 10); different content is an update.
//! 4. **Deletes**: every object in the inventory or derivable from a restored record that no
//!    programmed node desires *by identity* and no held node may still own. Ownership by identity
//!    is what makes recycled IPs, renames and reassigned CIDRs safe (invariant 3): the live
//!    owner's desired object has the same identity, so it is upserted over, never deleted.
//!    Each delete gets a reason by who the object is attributed to, in this order: a map entry
//!    for a local address is an `Orphan` (ID 0 is the local node, so such an entry was never
//!    ours to have; deleting it is always right); then by the object's key resource (map entry
//!    IP, route or policy destination, state's remote endpoint), then by its node ID, then by a
//!    secondary resource (route gateway, policy tunnel endpoint): a programmed live node's current
//!    resources make it `Superseded`, a live node's restored record `ChangedWhileDown`, a stale
//!    restored record `StaleNode` (invariant 2: stale records are only ever deleted), nothing
//!    `Orphan` (invariant 6).
//! 5. **Sync and brake**: before the live view is synced nothing is deleted (invariant 1). After,
//!    if the stale nodes are more than `max_prune_ratio` of the known remote nodes, their deletes
//!    are held unless `force_prune` (invariant 9); orphans and changed-while-down deletes are
//!    never held. Held stale nodes stay in the next checkpoint as pending deletes.

use std::cmp::Ordering;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::hash::Hash;
use std::net::IpAddr;
use std::time::Duration;

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use ipnet::IpNet;

use crate::checkpoint::{Checkpoint, PendingDelete};
use crate::desired::{desired_objects, maps_address};
use crate::ids::{AllocatorState, IdAllocator, IdError, IdSet};
use crate::node::{Family, Node};
use crate::objects::{KernelObject, NodeId, ObjectId, ObjectKind, Op, XfrmDir};

/// IPsec settings that shape the desired objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpsecConfig {
    /// The SPI in use (0..=15, it lives in 4 mark bits).
    pub spi: u8,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlanConfig {
    /// The node this agent runs on; never treated as a remote node.
    pub local_node: String,
    /// This node's InternalIPs; the first of each family is the xfrm endpoint. Map entries for
    /// any of them are deleted (ID 0, the local node, is implicit).
    pub local_addresses: Vec<IpAddr>,
    pub ipsec: Option<IpsecConfig>,
    /// Largest share of known remote nodes one plan may prune as stale without `force_prune`.
    pub max_prune_ratio: f64,
    pub force_prune: bool,
    /// Entries the node-ID map holds.
    pub map_capacity: usize,
    pub id_cooldown: Duration,
    /// Whether ExternalIPs get map entries too (InternalIPs always do).
    pub include_external_ips: bool,
    /// Written into the checkpoint.
    pub agent_version: String,
}

impl Default for PlanConfig {
    fn default() -> Self {
        Self {
            local_node: String::new(),
            local_addresses: Vec::new(),
            ipsec: None,
            max_prune_ratio: 0.5,
            force_prune: false,
            map_capacity: 65_536,
            id_cooldown: Duration::from_secs(15 * 60),
            include_external_ips: true,
            agent_version: String::new(),
        }
    }
}

/// The nodes the source reports now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LiveView {
    pub nodes: Vec<Node>,
    /// The source completed its first full list (Kubernetes: `InitDone`).
    pub synced: bool,
}

#[derive(Clone, Copy, Debug)]
pub struct PlanInput<'a> {
    pub restored: Option<&'a Checkpoint>,
    pub live: &'a LiveView,
    /// Every object in the kernel carrying our mark.
    pub inventory: &'a [KernelObject],
    pub allocator: &'a AllocatorState,
    /// Since the Unix epoch.
    pub now: Duration,
    pub config: &'a PlanConfig,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeleteReason {
    /// The node is in the checkpoint but no longer live: deleted while the agent was down.
    StaleNode,
    /// The node is live but its addresses or CIDRs changed while the agent was down.
    ChangedWhileDown,
    /// Ours (marked) but belonging to no live node and no restored record.
    Orphan,
    /// A live node's object replaced by one with a different identity (new node ID or SPI).
    Superseded,
}

impl fmt::Display for DeleteReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::StaleNode => "stale node",
            Self::ChangedWhileDown => "changed while down",
            Self::Orphan => "orphan",
            Self::Superseded => "superseded",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delete {
    pub object: KernelObject,
    pub reason: DeleteReason,
    /// The node the object was reached through; `None` for orphans.
    pub node: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upsert {
    pub object: KernelObject,
    pub node: String,
    /// An object with this identity exists with other content.
    pub update: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub node: String,
    pub id: NodeId,
}

/// What is wrong with one live node's input.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InputProblem {
    #[error("name listed twice in the live view; the first entry is used")]
    DuplicateName,
    #[error("address {ip} is already claimed by node {by}")]
    IpClaimedTwice { ip: IpAddr, by: String },
    #[error("pod CIDR {cidr} is already claimed by node {by}")]
    CidrClaimedTwice { cidr: IpNet, by: String },
    #[error("address {ip} belongs to the local node")]
    LocalAddress { ip: IpAddr },
    #[error("pod CIDR {cidr} has no {family} InternalIP to route via; the CIDR is skipped")]
    NoGateway { cidr: IpNet, family: Family },
    #[error("node-ID map is full: {needed} more entries do not fit its {limit} entries")]
    MapFull { limit: usize, needed: usize },
    #[error(transparent)]
    Ids(#[from] IdError),
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("node {node}: {problem}")]
pub struct InputError {
    pub node: String,
    pub problem: InputProblem,
}

/// Stale-node deletions held by the brake.
#[derive(Clone, Debug, PartialEq)]
pub struct BrakeHold {
    pub nodes: Vec<String>,
    pub deletes: Vec<Delete>,
    pub stale_nodes: usize,
    pub known_nodes: usize,
    pub ratio: f64,
    pub max_ratio: f64,
}

impl fmt::Display for BrakeHold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "holding deletion of {} stale of {} known remote nodes ({:.0}% > {:.0}% allowed, {} objects); \
             a partial node list, the wrong cluster or an RBAC error can look like this: confirm with a \
             fresh full list or allow with force-prune",
            self.stale_nodes,
            self.known_nodes,
            self.ratio * 100.0,
            self.max_ratio * 100.0,
            self.deletes.len()
        )
    }
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub deletes: Vec<Delete>,
    pub upserts: Vec<Upsert>,
    pub allocations: Vec<Allocation>,
    pub frees: Vec<NodeId>,
    pub errors: Vec<InputError>,
    pub brake: Option<BrakeHold>,
    /// The checkpoint to write once the ops have succeeded; see [`Plan::checkpoint_after`].
    pub checkpoint: Checkpoint,
    /// Stale records whose deletes are in this plan, with their previous attempt counts, so a
    /// failure can put them back as pending deletes.
    stale_attempted: BTreeMap<String, PendingDelete>,
}

fn kind_rank(kind: ObjectKind) -> u8 {
    match kind {
        ObjectKind::MapEntry => 0,
        ObjectKind::Route => 1,
        ObjectKind::XfrmState => 2,
        ObjectKind::XfrmPolicy => 3,
    }
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.deletes.is_empty() && self.upserts.is_empty()
    }

    /// The changes in a safe order: deletes first (policies, states, routes, map entries: users
    /// before what they use, and map room freed before it is filled), then upserts the other way
    /// round. No delete has the identity of an upsert, so an upsert never gets undone.
    pub fn ops(&self) -> Vec<Op> {
        let mut deletes: Vec<&Delete> = self.deletes.iter().collect();
        deletes.sort_by_key(|d| std::cmp::Reverse(kind_rank(d.object.kind())));
        let mut upserts: Vec<&Upsert> = self.upserts.iter().collect();
        upserts.sort_by_key(|u| kind_rank(u.object.kind()));
        deletes
            .into_iter()
            .map(|d| Op::Delete(d.object.clone()))
            .chain(upserts.into_iter().map(|u| Op::Upsert(u.object.clone())))
            .collect()
    }

    /// The checkpoint to write after applying [`Plan::ops`], given the ops that failed. A stale
    /// node with a failed delete stays a pending delete (one more attempt counted), and the IDs
    /// its objects carry are not freed, so the cleanup is retried after a restart too.
    pub fn checkpoint_after(&self, failed: &[Op]) -> Checkpoint {
        let mut cp = self.checkpoint.clone();
        let failed_ids: HashSet<ObjectId> = failed
            .iter()
            .filter(|o| matches!(o, Op::Delete(_)))
            .map(|o| o.object().id())
            .collect();
        if failed_ids.is_empty() {
            return cp;
        }
        let mut still_used: HashSet<NodeId> = HashSet::new();
        let mut retry: BTreeSet<&str> = BTreeSet::new();
        for d in &self.deletes {
            if !failed_ids.contains(&d.object.id()) {
                continue;
            }
            still_used.extend(d.object.node_id());
            if d.reason == DeleteReason::StaleNode
                && let Some(n) = &d.node
            {
                retry.insert(n);
            }
        }
        for name in retry {
            if let Some(p) = self.stale_attempted.get(name) {
                still_used.extend(p.node.node_id);
                cp.pending_deletes.push(PendingDelete {
                    node: p.node.clone(),
                    attempts: p.attempts.saturating_add(1),
                });
            }
        }
        cp.ids.freed.retain(|f| !still_used.contains(&f.id));
        cp
    }
}

/// Who an undesired object belongs to, highest priority first. Within a kind the lower index
/// wins; live nodes and restored records are both indexed in name order, so that is the owner
/// whose name sorts first, whatever order the owners were added in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Owner {
    /// A held live node (index into the live nodes).
    Held(usize),
    /// A programmed live node (index into the live nodes).
    Current(usize),
    /// The restored record of a live node (index into the restored records).
    Old(usize),
    /// A stale restored record (index into the restored records).
    Stale(usize),
}

struct OwnerIndex {
    ips: HashMap<IpAddr, Owner>,
    cidrs: HashMap<IpNet, Owner>,
    ids: HashMap<NodeId, Owner>,
}

fn put<K: Hash + Eq>(m: &mut HashMap<K, Owner>, k: K, o: Owner) {
    m.entry(k).and_modify(|e| *e = (*e).min(o)).or_insert(o);
}

impl OwnerIndex {
    /// Sized for `nodes` records of two addresses and two pod CIDRs each, the usual.
    fn with_capacity(nodes: usize) -> Self {
        Self {
            ips: HashMap::with_capacity(2 * nodes),
            cidrs: HashMap::with_capacity(2 * nodes),
            ids: HashMap::with_capacity(nodes),
        }
    }

    fn add_node(&mut self, n: &Node, o: Owner, id: Option<NodeId>) {
        for ip in n.ips() {
            put(&mut self.ips, ip, o);
        }
        for c in &n.pod_cidrs {
            put(&mut self.cidrs, *c, o);
        }
        if let Some(id) = id {
            put(&mut self.ids, id, o);
        }
    }

    fn owner(&self, obj: &KernelObject) -> Option<Owner> {
        let (primary, secondary) = match obj {
            KernelObject::MapEntry(e) => (self.ips.get(&e.ip), None),
            KernelObject::Route(r) => (self.cidrs.get(&r.dst), self.ips.get(&r.gateway)),
            KernelObject::XfrmState(s) => {
                let remote = if s.dir == XfrmDir::Out { s.dst } else { s.src };
                (self.ips.get(&remote), None)
            }
            KernelObject::XfrmPolicy(p) => (self.cidrs.get(&p.dst), self.ips.get(&p.tmpl_dst)),
        };
        primary
            .or_else(|| obj.node_id().and_then(|id| self.ids.get(&id)))
            .or(secondary)
            .copied()
    }
}

/// A restored record, one per name.
struct Restored<'a> {
    node: &'a Node,
    /// From its pending delete; 0 for a record of the checkpoint's live list.
    attempts: u32,
    /// From the checkpoint's live list rather than its pending deletes: before sync, an unseen
    /// record is carried over as it came.
    listed: bool,
    /// The live node of the same name.
    live: Option<usize>,
}

impl Restored<'_> {
    fn pending(&self) -> PendingDelete {
        PendingDelete {
            node: self.node.clone(),
            attempts: self.attempts,
        }
    }
}

/// A live node, local node and repeated names excluded.
struct LiveNode<'a> {
    node: &'a Node,
    /// Its restored record.
    record: Option<usize>,
    /// Its node ID, once it has one.
    id: Option<NodeId>,
    /// Its desired objects are in the plan; otherwise it is held (or has a repeated name).
    programmed: bool,
}

/// Whether `rec` derives exactly the objects the live node `l` desires: a programmed node that
/// did not change, the common case. Such a record adds no delete (all its objects are desired)
/// and no owner (the live node owns the same resources, at a higher priority), so the planner
/// skips it rather than derive and look up its objects a second time.
fn unchanged(rec: &Node, l: &LiveNode<'_>) -> bool {
    l.programmed
        && rec.node_id == l.id
        && rec.addresses == l.node.addresses
        && rec.pod_cidrs == l.node.pod_cidrs
}

/// One identity found in the inventory. A dump may list an identity twice; the last copy is
/// what an upsert is compared with, the first is what a delete names.
struct Found {
    last: usize,
    desired: bool,
    /// Already a delete candidate.
    pooled: bool,
}

/// Makes the plan. Never panics on input.
///
/// Each object's identity is hashed once into one index of the inventory, which then answers
/// "is it there", "is it desired" and "was it seen" for the rest of the pass; names are matched
/// by a merge of two sorted lists, never hashed; node-ID sets are bit sets. Maps use foldhash
/// rather than SipHash, which was a quarter of the plan time; its per-process random seed still
/// keeps node data from choosing collisions. That keeps a 5,000-node plan around 10 ms
/// (`cargo bench -p state`).
pub fn plan(input: &PlanInput<'_>) -> Plan {
    let cfg = input.config;
    let local = cfg.local_node.as_str();
    let mut errors: Vec<InputError> = Vec::new();
    let err = |errors: &mut Vec<InputError>, node: &str, problem| {
        errors.push(InputError {
            node: node.to_string(),
            problem,
        })
    };

    // Local addresses: configured, plus whatever the live view says the local node has.
    let mut local_ips: HashSet<IpAddr> = cfg.local_addresses.iter().copied().collect();
    for n in input.live.nodes.iter().filter(|n| n.name == local) {
        local_ips.extend(n.ips());
    }

    // Restored records in name order, local node excluded. One per name: a record of the live
    // list before a pending delete, a pending delete keeping its attempt count.
    let mut restored: Vec<Restored<'_>> = Vec::new();
    if let Some(cp) = input.restored {
        restored.reserve(cp.nodes.len() + cp.pending_deletes.len());
        let listed = cp.nodes.iter().map(|n| (n, 0, true));
        let pending = cp
            .pending_deletes
            .iter()
            .map(|p| (&p.node, p.attempts, false));
        restored.extend(listed.chain(pending).filter(|(n, ..)| n.name != local).map(
            |(node, attempts, listed)| Restored {
                node,
                attempts,
                listed,
                live: None,
            },
        ));
        // Stable, so the first record of a name stays first. Checkpoints are written in name
        // order, which makes this one linear pass in the common case.
        restored.sort_by(|a, b| a.node.name.cmp(&b.node.name));
        restored.dedup_by(|later, first| later.node.name == first.node.name);
    }

    // 1. Classify live nodes.
    let mut sorted: Vec<&Node> = input
        .live
        .nodes
        .iter()
        .filter(|n| n.name != local)
        .collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut live: Vec<LiveNode<'_>> = Vec::with_capacity(sorted.len());
    let mut ip_claims: HashMap<IpAddr, usize> = HashMap::with_capacity(2 * sorted.len());
    let mut cidr_claims: HashMap<IpNet, usize> = HashMap::with_capacity(2 * sorted.len());
    let mut candidates: Vec<usize> = Vec::with_capacity(sorted.len());
    let mut held: Vec<usize> = Vec::new();
    for n in sorted {
        // Stable sort: a repeated name follows the first entry with it, which wins.
        if live.last().is_some_and(|l| l.node.name == n.name) {
            err(&mut errors, &n.name, InputProblem::DuplicateName);
            continue;
        }
        let i = live.len();
        live.push(LiveNode {
            node: n,
            record: None,
            id: None,
            programmed: false,
        });
        if n.addresses.is_empty() {
            held.push(i);
            continue;
        }
        let mut problem = None;
        for ip in n.ips() {
            if local_ips.contains(&ip) {
                problem = Some(InputProblem::LocalAddress { ip });
            } else if let Some(by) = ip_claims.get(&ip) {
                problem = Some(InputProblem::IpClaimedTwice {
                    ip,
                    by: live[*by].node.name.clone(),
                });
            }
            if problem.is_some() {
                break;
            }
        }
        if problem.is_none()
            && let Some((cidr, by)) = n
                .pod_cidrs
                .iter()
                .find_map(|c| cidr_claims.get(c).map(|by| (*c, *by)))
        {
            problem = Some(InputProblem::CidrClaimedTwice {
                cidr,
                by: live[by].node.name.clone(),
            });
        }
        if let Some(p) = problem {
            err(&mut errors, &n.name, p);
            held.push(i);
            continue;
        }
        for ip in n.ips() {
            ip_claims.insert(ip, i);
        }
        for c in &n.pod_cidrs {
            cidr_claims.insert(*c, i);
        }
        candidates.push(i);
    }
    // Pair live nodes with their records: a merge, both lists being in name order.
    let (mut l, mut r) = (0, 0);
    while l < live.len() && r < restored.len() {
        match live[l].node.name.cmp(&restored[r].node.name) {
            Ordering::Less => l += 1,
            Ordering::Greater => r += 1,
            Ordering::Equal => {
                live[l].record = Some(r);
                restored[r].live = Some(l);
                l += 1;
                r += 1;
            }
        }
    }

    // 2. Node IDs. Reserve everything seen so fresh IDs never collide with the kernel.
    let mut alloc = IdAllocator::new(cfg.id_cooldown, input.allocator);
    let mut seen_ids = IdSet::new();
    let mut found: Vec<Found> = Vec::with_capacity(input.inventory.len());
    let mut found_at: HashMap<ObjectId, usize> = HashMap::with_capacity(input.inventory.len());
    // Per inventory object, its entry in `found`.
    let mut found_of: Vec<usize> = Vec::with_capacity(input.inventory.len());
    for (i, o) in input.inventory.iter().enumerate() {
        if let Some(id) = o.node_id() {
            seen_ids.insert(id);
        }
        let f = match found_at.entry(o.id()) {
            Entry::Occupied(e) => {
                found[*e.get()].last = i;
                *e.get()
            }
            Entry::Vacant(e) => {
                found.push(Found {
                    last: i,
                    desired: false,
                    pooled: false,
                });
                *e.insert(found.len() - 1)
            }
        };
        found_of.push(f);
    }
    for id in restored.iter().filter_map(|r| r.node.node_id) {
        seen_ids.insert(id);
    }
    for id in seen_ids.iter() {
        alloc.reserve(id);
    }
    // The ID the node-ID map gives a remote IP.
    let map_id = |ip: IpAddr| {
        if local_ips.contains(&ip) {
            return None;
        }
        match &input.inventory[found[*found_at.get(&ObjectId::MapEntry { ip })?].last] {
            KernelObject::MapEntry(e) => Some(e.node_id),
            _ => None,
        }
    };
    // Which restored record an ID belongs to (an index into `restored`, one per name;
    // `SEVERAL` when records of different names carry it). An ID is a node's, not an address's:
    // a map entry whose ID the checkpoint gives to another node (its IP was recycled to a new
    // node, or the node was re-created under a new name) is not inherited, or a dead node's ID
    // would be handed out again without its cool-down, and shared with its held leftovers.
    // Without a checkpoint the map entry is all there is, and its ID is inherited.
    const SEVERAL: usize = usize::MAX;
    let mut recorded_owner: HashMap<NodeId, usize> = HashMap::with_capacity(restored.len());
    for (r, rec) in restored.iter().enumerate() {
        if let Some(id) = rec.node.node_id {
            recorded_owner
                .entry(id)
                .and_modify(|o| *o = SEVERAL)
                .or_insert(r);
        }
    }
    // Whether the live node with record `record` may take `id` from the map.
    let inheritable = |id: NodeId, record: Option<usize>| {
        recorded_owner
            .get(&id)
            .is_none_or(|&owner| Some(owner) == record)
    };
    let mut claimed = IdSet::new();
    // Pass 0: map IDs the record confirms (or no record contradicts); pass 1: any map ID no
    // other node's record owns; pass 2: the record's ID.
    for pass in 0..3 {
        for &i in candidates.iter().chain(&held) {
            let l = &live[i];
            if l.id.is_some() {
                continue;
            }
            let record_id = l.record.and_then(|r| restored[r].node.node_id);
            let mut from_map = l
                .node
                .ips()
                .filter_map(map_id)
                .filter(|id| inheritable(*id, l.record));
            let pick = match pass {
                0 => {
                    from_map.find(|id| record_id.is_none_or(|r| r == *id) && !claimed.contains(*id))
                }
                1 => from_map.find(|id| !claimed.contains(*id)),
                _ => record_id.filter(|id| !claimed.contains(*id)),
            };
            if let Some(id) = pick {
                live[i].id = Some(id);
                claimed.insert(id);
            }
        }
    }

    // Capacity, fresh IDs and desired objects, in name order.
    let mut desired: Vec<KernelObject> = Vec::with_capacity(input.inventory.len() + 64);
    // Per desired object, the live node desiring it.
    let mut desired_by: Vec<usize> = Vec::with_capacity(desired.capacity());
    let mut allocations = Vec::new();
    let mut map_used = 0usize;
    let mut problems = Vec::new();
    for &i in &candidates {
        let n = live[i].node;
        let needed = n
            .addresses
            .iter()
            .filter(|a| maps_address(cfg, a.kind))
            .count();
        if map_used + needed > cfg.map_capacity {
            err(
                &mut errors,
                &n.name,
                InputProblem::MapFull {
                    limit: cfg.map_capacity,
                    needed,
                },
            );
            held.push(i);
            continue;
        }
        let id = match live[i].id {
            Some(id) => id,
            None => match alloc.allocate(input.now) {
                Ok(id) => {
                    allocations.push(Allocation {
                        node: n.name.clone(),
                        id,
                    });
                    live[i].id = Some(id);
                    claimed.insert(id);
                    id
                }
                Err(e) => {
                    err(&mut errors, &n.name, e.into());
                    held.push(i);
                    continue;
                }
            },
        };
        map_used += needed;
        desired_objects(n, id, cfg, &mut desired, &mut problems);
        for p in problems.drain(..) {
            err(&mut errors, &n.name, p);
        }
        desired_by.resize(desired.len(), i);
        live[i].programmed = true;
    }

    // 3. Upserts. Claims keep desired identities distinct (an IP, a CIDR, an xfrm endpoint
    // pair belongs to one programmed node), so each is looked up once.
    let mut upserts = Vec::new();
    // Desired identities the inventory lacks; with `Found::desired`, all desired identities.
    let mut added: HashSet<ObjectId> = HashSet::new();
    for (o, i) in desired.into_iter().zip(desired_by) {
        let oid = o.id();
        let have = match found_at.get(&oid) {
            Some(&f) => {
                found[f].desired = true;
                Some(&input.inventory[found[f].last])
            }
            None => {
                added.insert(oid);
                None
            }
        };
        if have != Some(&o) {
            upserts.push(Upsert {
                update: have.is_some(),
                object: o,
                node: live[i].node.name.clone(),
            });
        }
    }

    // 4. Deletes. Candidates: the inventory, then record-derived objects the inventory does not
    // show (a backend treats deleting an absent object as success); each identity once, desired
    // ones never.
    let synced = input.live.synced;
    let mut pool: Vec<&KernelObject> = Vec::new();
    for (o, &f) in input.inventory.iter().zip(&found_of) {
        let f = &mut found[f];
        if !f.desired && !f.pooled {
            f.pooled = true;
            pool.push(o);
        }
    }
    let mut derived = Vec::new();
    for r in &restored {
        let Some(id) = r.node.node_id else { continue };
        if r.live.is_some_and(|l| unchanged(r.node, &live[l])) {
            continue;
        }
        desired_objects(r.node, id, cfg, &mut derived, &mut problems);
    }
    problems.clear();
    let mut pooled: HashSet<ObjectId> = HashSet::new();
    for o in &derived {
        let oid = o.id();
        if !found_at.contains_key(&oid) && !added.contains(&oid) && pooled.insert(oid) {
            pool.push(o);
        }
    }
    let stale: Vec<&Restored<'_>> = restored.iter().filter(|r| r.live.is_none()).collect();
    let mut deletes = Vec::new();
    let mut stale_deletes = Vec::new();
    let mut kept_ids = IdSet::new();
    if !pool.is_empty() {
        // Owners: held live nodes (current and restored record), programmed live nodes,
        // restored records of live nodes, stale records.
        let mut index = OwnerIndex::with_capacity(live.len() + stale.len());
        for &i in &held {
            let l = &live[i];
            index.add_node(l.node, Owner::Held(i), l.id);
            if let Some(r) = l.record {
                let rec = restored[r].node;
                index.add_node(rec, Owner::Held(i), rec.node_id.or(l.id));
            }
        }
        for (i, l) in live.iter().enumerate().filter(|(_, l)| l.programmed) {
            index.add_node(l.node, Owner::Current(i), l.id);
        }
        for (r, rec) in restored.iter().enumerate() {
            match rec.live {
                Some(l) if unchanged(rec.node, &live[l]) => {}
                Some(_) => index.add_node(rec.node, Owner::Old(r), rec.node.node_id),
                None => index.add_node(rec.node, Owner::Stale(r), rec.node.node_id),
            }
        }
        for o in pool {
            let local_entry = matches!(o, KernelObject::MapEntry(e) if local_ips.contains(&e.ip));
            let (reason, node) = if local_entry {
                (DeleteReason::Orphan, None)
            } else {
                match index.owner(o) {
                    Some(Owner::Held(_)) => {
                        if let Some(id) = o.node_id() {
                            kept_ids.insert(id);
                        }
                        continue;
                    }
                    Some(Owner::Current(i)) => (DeleteReason::Superseded, Some(live[i].node)),
                    Some(Owner::Old(r)) => (DeleteReason::ChangedWhileDown, Some(restored[r].node)),
                    Some(Owner::Stale(r)) => (DeleteReason::StaleNode, Some(restored[r].node)),
                    None => (DeleteReason::Orphan, None),
                }
            };
            let d = Delete {
                object: o.clone(),
                reason,
                node: node.map(|n| n.name.clone()),
            };
            if !synced {
                if let Some(id) = o.node_id() {
                    kept_ids.insert(id);
                }
            } else if reason == DeleteReason::StaleNode {
                stale_deletes.push(d);
            } else {
                deletes.push(d);
            }
        }
    }

    // 5. Brake.
    let known = restored.len() + live.len() - (restored.len() - stale.len());
    let mut brake = None;
    let mut pending = Vec::new();
    let mut stale_attempted = BTreeMap::new();
    if !synced {
        // Nothing is known to be stale yet: carry every unseen record over as it was.
    } else if !stale.is_empty() {
        let ratio = stale.len() as f64 / known as f64;
        if ratio > cfg.max_prune_ratio && !cfg.force_prune {
            for id in stale_deletes.iter().filter_map(|d| d.object.node_id()) {
                kept_ids.insert(id);
            }
            brake = Some(BrakeHold {
                nodes: stale.iter().map(|r| r.node.name.clone()).collect(),
                deletes: stale_deletes,
                stale_nodes: stale.len(),
                known_nodes: known,
                ratio,
                max_ratio: cfg.max_prune_ratio,
            });
            pending.extend(stale.iter().map(|r| r.pending()));
        } else {
            deletes.extend(stale_deletes);
            stale_attempted.extend(stale.iter().map(|r| (r.node.name.clone(), r.pending())));
        }
    }

    // The next checkpoint and the IDs still carried by something.
    let mut cp_nodes: Vec<Node> = Vec::with_capacity(live.len() + stale.len());
    for l in live.iter().filter(|l| l.programmed) {
        let mut n = l.node.clone();
        n.node_id = l.id;
        cp_nodes.push(n);
    }
    for &i in &held {
        let l = &live[i];
        if let Some(r) = l.record {
            cp_nodes.push(restored[r].node.clone());
        }
        if let Some(id) = l.id {
            kept_ids.insert(id);
        }
    }
    if !synced {
        for r in &stale {
            if r.listed {
                cp_nodes.push(r.node.clone());
            } else {
                pending.push(r.pending());
            }
        }
    }
    for id in cp_nodes
        .iter()
        .chain(pending.iter().map(|p| &p.node))
        .filter_map(|n| n.node_id)
    {
        kept_ids.insert(id);
    }
    cp_nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let mut frees = Vec::new();
    for id in seen_ids.iter() {
        if !kept_ids.contains(id) && !claimed.contains(id) {
            alloc.free(id, input.now);
            frees.push(id);
        }
    }
    let checkpoint = Checkpoint {
        agent_version: cfg.agent_version.clone(),
        written_at: input.now,
        local_node: cfg.local_node.clone(),
        nodes: cp_nodes,
        pending_deletes: pending,
        ids: alloc.state(),
    };
    Plan {
        deletes,
        upserts,
        allocations,
        frees,
        errors,
        brake,
        checkpoint,
        stale_attempted,
    }
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;

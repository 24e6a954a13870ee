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
//!    confirmed by the node's checkpoint record first), then the record's ID, then a fresh ID from
//!    the [`IdAllocator`] (invariant 5). Every ID seen in the inventory or the checkpoint is
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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;

use crate::checkpoint::{Checkpoint, PendingDelete};
use crate::desired::{desired_objects, maps_address};
use crate::ids::{AllocatorState, IdAllocator, IdError};
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

/// Who an undesired object belongs to, highest priority first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Owner<'a> {
    Held(&'a str),
    Current(&'a str),
    Old(&'a str),
    Stale(&'a str),
}

#[derive(Default)]
struct OwnerIndex<'a> {
    ips: HashMap<IpAddr, Owner<'a>>,
    cidrs: HashMap<IpNet, Owner<'a>>,
    ids: HashMap<NodeId, Owner<'a>>,
}

fn put<'a, K: std::hash::Hash + Eq>(m: &mut HashMap<K, Owner<'a>>, k: K, o: Owner<'a>) {
    m.entry(k).and_modify(|e| *e = (*e).min(o)).or_insert(o);
}

impl<'a> OwnerIndex<'a> {
    fn add_node(&mut self, n: &'a Node, o: Owner<'a>, id: Option<NodeId>) {
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

    fn owner(&self, obj: &KernelObject) -> Option<Owner<'a>> {
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

/// Makes the plan. Never panics on input.
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

    // Restored records by name, local node excluded; a pending delete keeps its attempt count.
    let mut restored: BTreeMap<&str, PendingDelete> = BTreeMap::new();
    let mut restored_live_list: HashSet<&str> = HashSet::new();
    if let Some(cp) = input.restored {
        for n in cp.nodes.iter().filter(|n| n.name != local) {
            restored_live_list.insert(&n.name);
            restored.entry(&n.name).or_insert_with(|| PendingDelete {
                node: n.clone(),
                attempts: 0,
            });
        }
        for p in cp.pending_deletes.iter().filter(|p| p.node.name != local) {
            restored.entry(&p.node.name).or_insert_with(|| p.clone());
        }
    }

    // 1. Classify live nodes.
    let mut live: Vec<&Node> = input
        .live
        .nodes
        .iter()
        .filter(|n| n.name != local)
        .collect();
    live.sort_by(|a, b| a.name.cmp(&b.name));
    let mut live_names: BTreeSet<&str> = BTreeSet::new();
    let mut ip_claims: HashMap<IpAddr, &str> = HashMap::new();
    let mut cidr_claims: HashMap<IpNet, &str> = HashMap::new();
    let mut candidates: Vec<&Node> = Vec::new();
    let mut held: Vec<&Node> = Vec::new();
    for n in live {
        if !live_names.insert(&n.name) {
            err(&mut errors, &n.name, InputProblem::DuplicateName);
            continue;
        }
        if n.addresses.is_empty() {
            held.push(n);
            continue;
        }
        let mut problem = None;
        for ip in n.ips() {
            if local_ips.contains(&ip) {
                problem = Some(InputProblem::LocalAddress { ip });
            } else if let Some(by) = ip_claims.get(&ip) {
                problem = Some(InputProblem::IpClaimedTwice {
                    ip,
                    by: by.to_string(),
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
                by: by.to_string(),
            });
        }
        if let Some(p) = problem {
            err(&mut errors, &n.name, p);
            held.push(n);
            continue;
        }
        for ip in n.ips() {
            ip_claims.insert(ip, &n.name);
        }
        for c in &n.pod_cidrs {
            cidr_claims.insert(*c, &n.name);
        }
        candidates.push(n);
    }

    // 2. Node IDs. Reserve everything seen so fresh IDs never collide with the kernel.
    let mut alloc = IdAllocator::new(cfg.id_cooldown, input.allocator);
    let mut seen_ids: BTreeSet<NodeId> = BTreeSet::new();
    let mut map_ids: HashMap<IpAddr, NodeId> = HashMap::new();
    let mut inventory: HashMap<ObjectId, &KernelObject> =
        HashMap::with_capacity(input.inventory.len());
    for o in input.inventory {
        seen_ids.extend(o.node_id());
        if let KernelObject::MapEntry(e) = o
            && !local_ips.contains(&e.ip)
        {
            map_ids.insert(e.ip, e.node_id);
        }
        inventory.insert(o.id(), o);
    }
    seen_ids.extend(restored.values().filter_map(|p| p.node.node_id));
    for id in &seen_ids {
        alloc.reserve(*id);
    }
    let mut id_of: HashMap<&str, NodeId> = HashMap::new();
    let mut claimed: HashMap<NodeId, &str> = HashMap::new();
    // Which restored record an ID belongs to. An ID is a node's, not an address's: a map entry
    // whose ID the checkpoint gives to another node (its IP was recycled to a new node, or the
    // node was re-created under a new name) is not inherited, or a dead node's ID would be
    // handed out again without its cool-down, and shared with its held leftovers.
    let recorded_owner: HashMap<NodeId, &str> = restored
        .values()
        .filter_map(|p| p.node.node_id.map(|id| (id, p.node.name.as_str())))
        .collect();
    let claim_order: Vec<&Node> = candidates.iter().chain(held.iter()).copied().collect();
    // Pass 0: map IDs the record confirms (or no record contradicts); pass 1: any map ID no
    // other node's record owns; pass 2: the record's ID.
    for pass in 0..3 {
        for n in &claim_order {
            if id_of.contains_key(n.name.as_str()) {
                continue;
            }
            let record_id = restored.get(n.name.as_str()).and_then(|p| p.node.node_id);
            let from_map = n
                .ips()
                .filter_map(|ip| map_ids.get(&ip).copied())
                .filter(|id| recorded_owner.get(id).is_none_or(|owner| *owner == n.name));
            let pick = match pass {
                0 => from_map
                    .filter(|id| record_id.is_none_or(|r| r == *id))
                    .find(|id| !claimed.contains_key(id)),
                1 => from_map.into_iter().find(|id| !claimed.contains_key(id)),
                _ => record_id.filter(|id| !claimed.contains_key(id)),
            };
            if let Some(id) = pick {
                id_of.insert(&n.name, id);
                claimed.insert(id, &n.name);
            }
        }
    }

    // Capacity, fresh IDs and desired objects, in name order.
    let mut desired: HashMap<ObjectId, (KernelObject, &str)> =
        HashMap::with_capacity(input.inventory.len() + 64);
    let mut desired_order: Vec<ObjectId> = Vec::new();
    let mut programmed: Vec<Node> = Vec::with_capacity(candidates.len());
    let mut allocations = Vec::new();
    let mut map_used = 0usize;
    let mut objs = Vec::new();
    let mut problems = Vec::new();
    for n in candidates {
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
            held.push(n);
            continue;
        }
        let id = match id_of.get(n.name.as_str()) {
            Some(id) => *id,
            None => match alloc.allocate(input.now) {
                Ok(id) => {
                    allocations.push(Allocation {
                        node: n.name.clone(),
                        id,
                    });
                    id_of.insert(&n.name, id);
                    claimed.insert(id, &n.name);
                    id
                }
                Err(e) => {
                    err(&mut errors, &n.name, e.into());
                    held.push(n);
                    continue;
                }
            },
        };
        map_used += needed;
        objs.clear();
        problems.clear();
        desired_objects(n, id, cfg, &mut objs, &mut problems);
        for p in problems.drain(..) {
            err(&mut errors, &n.name, p);
        }
        for o in objs.drain(..) {
            let oid = o.id();
            desired_order.push(oid.clone());
            desired.insert(oid, (o, n.name.as_str()));
        }
        let mut rec = n.clone();
        rec.node_id = Some(id);
        programmed.push(rec);
    }

    // 3. Upserts.
    let mut upserts = Vec::new();
    for oid in &desired_order {
        let (o, node) = &desired[oid];
        match inventory.get(oid) {
            Some(have) if *have == o => {}
            have => upserts.push(Upsert {
                object: o.clone(),
                node: node.to_string(),
                update: have.is_some(),
            }),
        }
    }

    // 4. Deletes. Owners: held live nodes (current and restored record), programmed live nodes,
    // restored records of live nodes, stale records.
    let synced = input.live.synced;
    let mut index = OwnerIndex::default();
    for n in &held {
        let id = id_of.get(n.name.as_str()).copied();
        index.add_node(n, Owner::Held(&n.name), id);
        if let Some(p) = restored.get(n.name.as_str()) {
            index.add_node(&p.node, Owner::Held(&n.name), p.node.node_id.or(id));
        }
    }
    for n in &programmed {
        index.add_node(n, Owner::Current(&n.name), n.node_id);
    }
    let mut stale: Vec<&PendingDelete> = Vec::new();
    for (name, p) in &restored {
        if live_names.contains(name) {
            index.add_node(&p.node, Owner::Old(name), p.node.node_id);
        } else {
            index.add_node(&p.node, Owner::Stale(name), p.node.node_id);
            stale.push(p);
        }
    }
    // Candidates: the inventory, then record-derived objects the inventory does not show (a
    // backend treats deleting an absent object as success).
    let mut pool: Vec<&KernelObject> = input.inventory.iter().collect();
    let mut derived = Vec::new();
    for p in restored.values() {
        if let Some(id) = p.node.node_id {
            desired_objects(&p.node, id, cfg, &mut derived, &mut problems);
        }
    }
    problems.clear();
    let mut pooled: HashSet<ObjectId> = HashSet::new();
    for o in &derived {
        let oid = o.id();
        if !inventory.contains_key(&oid) && pooled.insert(oid) {
            pool.push(o);
        }
    }
    let mut deletes = Vec::new();
    let mut stale_deletes = Vec::new();
    let mut kept_ids: BTreeSet<NodeId> = BTreeSet::new();
    let mut in_pool: HashSet<ObjectId> = HashSet::new();
    for o in pool {
        let oid = o.id();
        if desired.contains_key(&oid) || !in_pool.insert(oid) {
            continue;
        }
        let local_entry = matches!(o, KernelObject::MapEntry(e) if local_ips.contains(&e.ip));
        let (reason, node) = if local_entry {
            (DeleteReason::Orphan, None)
        } else {
            match index.owner(o) {
                Some(Owner::Held(_)) => {
                    kept_ids.extend(o.node_id());
                    continue;
                }
                Some(Owner::Current(n)) => (DeleteReason::Superseded, Some(n)),
                Some(Owner::Old(n)) => (DeleteReason::ChangedWhileDown, Some(n)),
                Some(Owner::Stale(n)) => (DeleteReason::StaleNode, Some(n)),
                None => (DeleteReason::Orphan, None),
            }
        };
        let d = Delete {
            object: o.clone(),
            reason,
            node: node.map(str::to_string),
        };
        if !synced {
            kept_ids.extend(o.node_id());
        } else if reason == DeleteReason::StaleNode {
            stale_deletes.push(d);
        } else {
            deletes.push(d);
        }
    }

    // 5. Brake.
    let known: BTreeSet<&str> = restored
        .keys()
        .copied()
        .chain(live_names.iter().copied())
        .collect();
    let mut brake = None;
    let mut pending = Vec::new();
    let mut stale_attempted = BTreeMap::new();
    if !synced {
        // Nothing is known to be stale yet: carry every unseen record over as it was.
    } else if !stale.is_empty() {
        let ratio = stale.len() as f64 / known.len() as f64;
        if ratio > cfg.max_prune_ratio && !cfg.force_prune {
            for d in &stale_deletes {
                kept_ids.extend(d.object.node_id());
            }
            brake = Some(BrakeHold {
                nodes: stale.iter().map(|p| p.node.name.clone()).collect(),
                deletes: stale_deletes,
                stale_nodes: stale.len(),
                known_nodes: known.len(),
                ratio,
                max_ratio: cfg.max_prune_ratio,
            });
            pending.extend(stale.iter().map(|p| (*p).clone()));
        } else {
            deletes.extend(stale_deletes);
            stale_attempted.extend(stale.iter().map(|p| (p.node.name.clone(), (*p).clone())));
        }
    }

    // The next checkpoint and the IDs still carried by something.
    let mut cp_nodes = programmed;
    for n in &held {
        if let Some(p) = restored.get(n.name.as_str()) {
            kept_ids.extend(p.node.node_id);
            cp_nodes.push(p.node.clone());
        }
        kept_ids.extend(id_of.get(n.name.as_str()));
    }
    if !synced {
        for p in &stale {
            kept_ids.extend(p.node.node_id);
            if restored_live_list.contains(p.node.name.as_str()) {
                cp_nodes.push(p.node.clone());
            } else {
                pending.push((*p).clone());
            }
        }
    }
    for p in &pending {
        kept_ids.extend(p.node.node_id);
    }
    cp_nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let in_use: HashSet<NodeId> = cp_nodes
        .iter()
        .filter_map(|n| n.node_id)
        .chain(kept_ids.iter().copied())
        .collect();
    let mut frees = Vec::new();
    for id in seen_ids {
        if !in_use.contains(&id) && !claimed.contains_key(&id) {
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

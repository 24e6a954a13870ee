//! The reconcile planner: `(record, live view, kernel inventory, brake memory, config) -> plan`.
//!
//! Pure: no clock, no I/O. This is where the invariants of `docs/design.md` are enforced; the
//! backends only apply the plan's operations and report failures back through
//! [`Plan::checkpoint_after`]. Each step of a plan has a module of its own, in the order they run
//! (see "How a plan is made" in the design document):
//!
//! 1. [`records`]: the agent's record of remote nodes, one per name;
//! 2. [`classify`]: live nodes paired with their records, held or candidates;
//! 3. [`brake`]: which removals (gone nodes, orphans) may happen now, on the resources every node
//!    and record claims, indexed once ([`resource_index`], hashed in cache-sized parts by
//!    [`interner`]) for this step and the next;
//! 4. [`claims`] and [`assign`]: conflicts, map room and node IDs, candidate by candidate;
//! 5. desired objects ([`crate::desired`]) and the upserts they need;
//! 6. [`deletes`]: every undesired object of ours, with the reason it goes or stays;
//! 7. the next record ([`Plan::checkpoint`]) and brake memory.
//!
//! Steps of a large plan run some of their pieces on a second core ([`parallel`]).
//!
//! The steps share one vocabulary, in leaf modules beneath them all: the configuration
//! ([`config`]), the input ([`view`]), resources and who claims them ([`resource`]), the
//! planner's views of each node ([`nodes`]), the brake's memory and decision
//! ([`brake_memory`]), the problems reported ([`problem`]) and the operations planned ([`ops`]).
//! A step imports that vocabulary and the shared indexes, never another step; this module, on
//! top, runs them in order.

pub mod brake;
pub mod claims;

mod assign;
mod brake_memory;
mod claim_index;
mod classify;
pub(crate) mod config;
mod deletes;
mod interner;
mod nodes;
mod ops;
mod parallel;
pub(crate) mod problem;
mod records;
pub(crate) mod resource;
mod resource_index;
mod scope;
mod view;

use std::collections::{BTreeMap, BTreeSet};

use foldhash::{HashSet, HashSetExt};
use ipnet::IpNet;

use crate::checkpoint::{Checkpoint, PendingDelete};
use crate::desired::{desired_objects, global_objects, local_endpoint};
use crate::inventory::{Inventory, Marks};
use crate::node::{Family, Node};
use crate::objects::{KernelObject, NodeId, ObjectId, Op};

pub use brake_memory::{BrakeCount, BrakeHold, BrakeMemory, HoldKind, Removal};
pub use claim_index::ClaimIndex;
pub use config::{GlobalTags, IpsecConfig, KeyInUse, KeyTags, Pair, PlanConfig};
pub use ops::{AGENT_OWNED, Allocation, Delete, DeleteReason, ORPHANS, Upsert};
pub use problem::{InputError, InputProblem};
pub use resource::{ConflictWhy, Resource};
pub use scope::plan_scoped;
pub use view::{LiveView, MalformedNode, PlanInput};

use self::brake_memory::Brake;
use self::nodes::{HeldWhy, Live, LiveClass, Record};
use self::problem::err;
use self::view::{Elsewhere, Local};

#[derive(Clone, Debug)]
pub struct Plan {
    pub deletes: Vec<Delete>,
    pub upserts: Vec<Upsert>,
    pub allocations: Vec<Allocation>,
    pub frees: Vec<NodeId>,
    pub errors: Vec<InputError>,
    /// What the brake holds, and why; `None` when nothing is held.
    pub brake: Option<BrakeHold>,
    /// The brake's memory after this plan; the reconciler passes it to the next one.
    pub brake_memory: BrakeMemory,
    /// Removals this plan carries out (released by the brake), by node name.
    pub released_nodes: Vec<String>,
    /// The checkpoint to write once the ops have succeeded; see [`Plan::checkpoint_after`].
    pub checkpoint: Checkpoint,
    /// Stale records whose deletes are in this plan, with their previous attempt counts, so a
    /// failure can put them back as pending deletes.
    stale_attempted: BTreeMap<String, PendingDelete>,
    /// Once applied without a failure, the kernel and the record are exactly what the live
    /// nodes need, with nothing held or pending: the next change may be planned event-sized
    /// ([`plan_scoped`]).
    pub settled: bool,
    /// Once applied without a failure, the kernel is exactly what the record needs and the
    /// record what the live nodes need, with nothing held by the brake and nothing pending,
    /// except for the live nodes named here (held, or with an input error of their own). The
    /// next change may then be planned event-sized with these nodes planned again beside it
    /// ([`plan_scoped`]); `None` otherwise. A settled plan is steady (naming at most nodes
    /// still registering). At 65,000 nodes a few nodes always have something wrong; without
    /// this, each would make every event a full plan.
    pub steady: Option<Vec<String>>,
    /// For an event-sized plan: the names [`Plan::checkpoint`] covers. The rest of the record
    /// stands as it was; [`Checkpoint::splice`] puts the two together.
    pub scope: Option<Vec<String>>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.deletes.is_empty() && self.upserts.is_empty()
    }

    /// The deletes that run before the upserts, in a safe order: users before what they use
    /// (policies, states, routes, map entries), so map room is freed before it is filled; each
    /// with the node it was reached through.
    pub fn delete_ops(&self) -> Vec<(Op, Option<&str>)> {
        self.deletes_where(|last| !last)
    }

    /// The deletes that run after the upserts: the kinds [`ObjectKind::deleted_last`] names.
    ///
    /// [`ObjectKind::deleted_last`]: crate::objects::ObjectKind::deleted_last
    pub fn late_delete_ops(&self) -> Vec<(Op, Option<&str>)> {
        self.deletes_where(|last| last)
    }

    fn deletes_where(&self, last: impl Fn(bool) -> bool) -> Vec<(Op, Option<&str>)> {
        let mut deletes: Vec<&Delete> = self
            .deletes
            .iter()
            .filter(|d| last(d.object.kind().deleted_last()))
            .collect();
        deletes.sort_by_key(|d| std::cmp::Reverse(d.object.kind().rank()));
        deletes
            .into_iter()
            .map(|d| (Op::Delete(d.object.clone()), d.node.as_deref()))
            .collect()
    }

    /// The upserts, what is used before its users (map entries, nexthops, routes, states,
    /// policies), each with the node it is for. No upsert has the identity of a delete, so a
    /// delete never undoes one.
    pub fn upsert_ops(&self) -> Vec<(Op, &str)> {
        let mut upserts: Vec<&Upsert> = self.upserts.iter().collect();
        upserts.sort_by_key(|u| u.object.kind().rank());
        upserts
            .into_iter()
            .map(|u| (u.op(), u.node.as_str()))
            .collect()
    }

    /// Every operation in the order it runs: deletes, upserts, late deletes.
    pub fn ops(&self) -> Vec<Op> {
        let mut ops: Vec<Op> = self.delete_ops().into_iter().map(|(op, _)| op).collect();
        ops.extend(self.upsert_ops().into_iter().map(|(op, _)| op));
        ops.extend(self.late_delete_ops().into_iter().map(|(op, _)| op));
        ops
    }

    /// The checkpoint to write after applying the ops, given the ops that failed. A stale node
    /// with a failed delete stays a pending delete (one more attempt counted), and the IDs its
    /// objects carry are not freed, so the cleanup is retried after a restart too.
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
                    held: None,
                });
            }
        }
        cp.ids.freed.retain(|f| !still_used.contains(&f.id));
        cp
    }

    /// The plan for a list that is no view of this cluster (no local node): nothing changes,
    /// the record and the brake's memory stay as they were (invariant 15).
    fn frozen(input: &PlanInput<'_>) -> Self {
        let checkpoint = input.record.cloned().unwrap_or_else(|| Checkpoint {
            agent_version: input.config.agent_version.clone(),
            local_node: input.config.local_node.clone(),
            ids: input.allocator.clone(),
            // The window rebuilt from the kernel stays remembered.
            removals: input.brake.window.clone(),
            ..Checkpoint::default()
        });
        Plan {
            deletes: Vec::new(),
            upserts: Vec::new(),
            allocations: Vec::new(),
            frees: Vec::new(),
            errors: Vec::new(),
            brake: Some(BrakeHold::local_node_missing(&input.config.local_node)),
            brake_memory: input.brake.clone(),
            released_nodes: Vec::new(),
            checkpoint,
            stale_attempted: BTreeMap::new(),
            settled: false,
            steady: None,
            scope: None,
        }
    }
}

/// With IPsec, a family this node has pod CIDRs in but no InternalIP (no xfrm endpoint): no
/// remote pod CIDR of it is routed ([`crate::desired`]), reported once, for the local node, and
/// the same in a plan of the whole cluster or of a part (a problem per remote node made every
/// event a full plan, and said the same thing 65,000 times).
fn no_local_endpoint(cfg: &PlanConfig, local: &Local, errors: &mut Vec<InputError>) {
    if cfg.ipsec.is_none() {
        return;
    }
    for family in [Family::V4, Family::V6] {
        let has_pods = local.cidrs.iter().any(|c| Family::of_net(c) == family);
        if has_pods && local_endpoint(cfg, family).is_none() {
            err(
                errors,
                &cfg.local_node,
                InputProblem::NoLocalEndpoint { family },
            );
        }
    }
}

/// Makes the plan. Never panics on input.
///
/// Identities are hashed once into the inventory's index, which then answers "is it there" for
/// the rest of the pass; names are matched by a merge of two sorted lists, never hashed; node-ID
/// sets are bit sets. Maps use foldhash rather than SipHash (its per-process random seed still
/// keeps node data from choosing collisions). `cargo bench -p state` measures it.
pub fn plan(input: &PlanInput<'_>) -> Plan {
    plan_with(input, None)
}

/// [`plan`], of the whole cluster (`elsewhere` is `None`) or of one part of it.
pub(crate) fn plan_with(input: &PlanInput<'_>, elsewhere: Option<&Elsewhere>) -> Plan {
    let cfg = input.config;
    let synced = input.live.synced;
    let local = Local::new(cfg, input.live);
    if synced && !local.listed {
        return Plan::frozen(input);
    }
    let mut errors: Vec<InputError> = Vec::new();
    no_local_endpoint(cfg, &local, &mut errors);

    // 1-2. Records, live nodes, and who is what.
    let (mut records, sorted) = parallel::both(
        input.live.nodes.len() >= parallel::WORTH_A_THREAD,
        || records::collect(input.record, &cfg.local_node),
        || classify::sort(input.live, &cfg.local_node),
    );
    let mut live = classify::classify(sorted, &mut records, &mut errors);

    // 3. The brake: which removals may happen now.
    let index = resource_index::ResourceIndex::new(&live, &records, input.inventory, cfg);
    let brake = Brake::new(cfg, input, &records, &index, &local, elsewhere);

    // 4. Conflicts, map room and IDs, candidate by candidate.
    let known = assign::Known {
        input,
        records: &records,
        brake: &brake,
        index: &index,
        local: &local,
        elsewhere,
    };
    let admitted = assign::admit(&known, &mut live, &mut errors);

    // 5. Desired objects of programmed nodes, and the upserts they need: in two runs of nodes,
    // on two cores where there are two, the first run beside a copy of the next record's nodes
    // (which depend on nothing after admission).
    let cut = live.len() * 3 / 8;
    let ((mut cp_nodes, first), second) = parallel::both(
        live.len() >= parallel::WORTH_A_THREAD,
        || {
            let nodes = next_nodes(&live, &records);
            (nodes, wanted(input, &live, &index, 0..cut))
        },
        || wanted(input, &live, &index, cut..live.len()),
    );
    let (upserts, desired) = upserts(input, [first, second], &mut errors);

    // 6. Deletes and their reasons.
    let deleted = deletes::decide(input, &live, &records, &brake, &index, &desired, &local);
    for (object, node, user) in &deleted.in_use {
        err(
            &mut errors,
            node.as_deref().unwrap_or(ORPHANS),
            InputProblem::InUse {
                object: object.to_string(),
                user: user.clone(),
            },
        );
    }

    // 7. The next record.
    let mut kept_ids = deleted.kept_ids;
    let kept_unrecorded = deleted.kept_unrecorded;
    let mut pending = Vec::new();
    let mut stale_attempted = BTreeMap::new();
    let mut released_nodes = Vec::new();
    for r in records.iter().filter(|r| r.live.is_none()) {
        if !synced {
            // Nothing is known to be gone yet: every unseen record is carried over as it came.
            if r.listed {
                cp_nodes.push(r.node.clone());
            } else {
                pending.push(r.pending());
            }
        } else if brake.releases(r) {
            released_nodes.push(r.node.name.clone());
            stale_attempted.insert(r.node.name.clone(), r.pending());
        } else {
            pending.push(r.pending());
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
    let mut alloc = admitted.allocator;
    let mut frees = Vec::new();
    let used_elsewhere = |id| elsewhere.is_some_and(|e| e.ids.contains(id));
    for id in admitted.seen_ids.iter() {
        if !kept_ids.contains(id) && !admitted.claimed.contains(id) && !used_elsewhere(id) {
            alloc.free(id, input.now);
            frees.push(id);
        }
    }
    let (brake_hold, brake_memory) = brake.finish(deleted.held);
    let (held_nodes, orphans_held) = brake_memory.held_for_record();
    for p in &mut pending {
        p.held = held_nodes
            .get(&(p.node.name.as_str(), p.node.uid.as_str()))
            .copied();
    }
    let settled = synced
        && errors.is_empty()
        && brake_hold.is_none()
        && pending.is_empty()
        && live.iter().all(|l| match l.class {
            LiveClass::Programmed(_) => true,
            // Registering with nothing recorded and no pod CIDR: it claims nothing.
            LiveClass::Held(HeldWhy::Registering) => {
                l.record.is_none() && l.node.pod_cidrs.is_empty()
            }
            LiveClass::Held(_) | LiveClass::Candidate => false,
        });
    let steady = (synced && brake_hold.is_none() && pending.is_empty() && !kept_unrecorded)
        .then(|| unsettled(&live, &errors))
        .flatten();
    let checkpoint = Checkpoint {
        agent_version: cfg.agent_version.clone(),
        written_at: input.now,
        // The agent reads the boot clock when it writes the record.
        boot: None,
        local_node: cfg.local_node.clone(),
        nodes: cp_nodes,
        pending_deletes: pending,
        ids: alloc.state(),
        removals: brake_memory.window.clone(),
        ipsec_keys: cfg
            .ipsec
            .as_ref()
            .map(|i| i.seen.clone())
            .unwrap_or_default(),
        orphans_held,
    };
    Plan {
        deletes: deleted.deletes,
        upserts,
        allocations: admitted.allocations,
        frees,
        errors,
        brake: brake_hold,
        brake_memory,
        released_nodes,
        checkpoint,
        stale_attempted,
        settled,
        steady,
        scope: None,
    }
}

/// What step 5 found for a run of live nodes.
struct Wanted {
    upserts: Vec<Upsert>,
    slots: Vec<u32>,
    errors: Vec<InputError>,
}

/// Step 5, for the live nodes in `range`: the upserts their desired objects need, the slots of
/// those already in the kernel (which the deletes leave alone), and the nodes' input errors.
/// Runs of nodes are independent, so two runs can be found on two cores.
fn wanted(
    input: &PlanInput<'_>,
    live: &[Live<'_>],
    index: &resource_index::ResourceIndex,
    range: std::ops::Range<usize>,
) -> Wanted {
    let cfg = input.config;
    let nexthops = resource_index::IndexedNexthops {
        index,
        inventory: input.inventory,
    };
    let mut out = Wanted {
        upserts: Vec::new(),
        slots: Vec::new(),
        errors: Vec::new(),
    };
    let mut objects = Vec::new();
    let mut problems = Vec::new();
    for (i, l) in live.iter().enumerate().take(range.end).skip(range.start) {
        let LiveClass::Programmed(id) = l.class else {
            continue;
        };
        objects.clear();
        desired_objects(l.node, id, cfg, &nexthops, &mut objects, &mut problems);
        for p in problems.drain(..) {
            err(&mut out.errors, &l.node.name, p);
        }
        let blocked = Blocked::find(&objects, input.inventory, &l.node.name, &mut out.errors);
        for o in &objects {
            let oid = o.id();
            if input.inventory.foreign(&oid).is_some() || blocked.blocks(o, &objects) {
                continue;
            }
            let slot = index.slot(input.inventory, i, l.node, o);
            let have = slot.map(|s| input.inventory.at(s));
            out.slots.extend(slot.map(|s| s as u32));
            if have != Some(o) {
                out.upserts.push(Upsert {
                    update: have.is_some(),
                    object: o.clone(),
                    node: l.node.name.clone(),
                });
            }
        }
    }
    out
}

/// Step 5, put together: the runs' upserts and errors in node order, then the agent's own
/// objects; and every desired object already in the kernel, marked by slot.
fn upserts(
    input: &PlanInput<'_>,
    runs: [Wanted; 2],
    errors: &mut Vec<InputError>,
) -> (Vec<Upsert>, Marks) {
    let mut desired = Marks::for_inventory(input.inventory);
    let mut upserts = Vec::with_capacity(runs.iter().map(|r| r.upserts.len()).sum());
    for run in runs {
        upserts.extend(run.upserts);
        errors.extend(run.errors);
        for s in run.slots {
            desired.mark(s as usize);
        }
    }
    for o in global_objects(input.config) {
        let slot = input.inventory.slot(&o.id());
        if slot.map(|s| input.inventory.at(s)) != Some(&o) {
            upserts.push(Upsert {
                update: slot.is_some(),
                object: o,
                node: AGENT_OWNED.to_string(),
            });
        }
        if let Some(s) = slot {
            desired.mark(s);
        }
    }
    (upserts, desired)
}

/// The next record's live nodes: each programmed node as it is now, with its ID; each held one
/// (or candidate left waiting) as recorded, if it was.
fn next_nodes(live: &[Live<'_>], records: &[Record<'_>]) -> Vec<Node> {
    let mut nodes = Vec::with_capacity(live.len());
    for l in live {
        match l.class {
            LiveClass::Programmed(id) => {
                let mut n = l.node.clone();
                n.node_id = Some(id);
                nodes.push(n);
            }
            LiveClass::Held(_) | LiveClass::Candidate => {
                if let Some(r) = l.record {
                    nodes.push(records[r].node.clone());
                }
            }
        }
    }
    nodes
}

/// The live nodes a steady plan leaves unsettled: those held (registering, malformed, in
/// conflict, waiting for map room or an ID) and those with an input error of their own (a pod
/// CIDR with no gateway). Planned beside every change, each finds in the part what holds it and
/// what would release it: whoever it conflicts with (through the claims), and the room and IDs
/// the rest of the cluster takes (counted). `None` where an error is not one of these or not a
/// live node's (a foreign object in the way, an object a foreign one uses): only a full plan
/// looks at those again.
fn unsettled(live: &[Live<'_>], errors: &[InputError]) -> Option<Vec<String>> {
    let mut names: Vec<&str> = Vec::new();
    for l in live {
        match l.class {
            LiveClass::Programmed(_) => {}
            LiveClass::Held(_) => names.push(&l.node.name),
            LiveClass::Candidate => return None,
        }
    }
    for e in errors {
        match e.problem {
            // The local node's, of the configuration alone, which a steady plan is kept with.
            InputProblem::NoLocalEndpoint { .. } => continue,
            InputProblem::Malformed
            | InputProblem::NoGateway { .. }
            | InputProblem::Conflict { .. }
            | InputProblem::LocalResource { .. }
            | InputProblem::OverlapsLocal { .. }
            | InputProblem::CoversAddress { .. }
            | InputProblem::MapFull { .. }
            | InputProblem::Ids(_) => {}
            _ => return None,
        }
        // `live` is in name order.
        live.binary_search_by(|l| l.node.name.as_str().cmp(&e.node))
            .ok()?;
        names.push(&e.node);
    }
    names.sort_unstable();
    names.dedup();
    Some(names.into_iter().map(str::to_owned).collect())
}

/// The pod CIDR an object is keyed by (route and policy destinations), if any: a foreign route
/// at that CIDR keeps all of them from being written (invariant 6).
fn key_cidr(o: &KernelObject) -> Option<IpNet> {
    match o {
        KernelObject::Route(r) => Some(r.dst),
        KernelObject::XfrmPolicy(p) => Some(p.dst),
        KernelObject::PodCidrEntry(e) => Some(e.cidr),
        KernelObject::MapEntry(_)
        | KernelObject::Nexthop(_)
        | KernelObject::XfrmState(_)
        | KernelObject::XfrmGuard(_) => None,
    }
}

/// What foreign objects keep from being written for one node: every object keyed by a CIDR
/// whose route identity is foreign, and every object that would use a foreign one (a route
/// through a nexthop ID someone else holds would send the node's traffic their way).
struct Blocked {
    cidrs: Vec<IpNet>,
    ids: Vec<ObjectId>,
}

impl Blocked {
    /// Finds what is blocked among `objects`, reporting each foreign object once.
    fn find(
        objects: &[KernelObject],
        inventory: &Inventory,
        node: &str,
        errors: &mut Vec<InputError>,
    ) -> Self {
        let mut out = Self {
            cidrs: Vec::new(),
            ids: Vec::new(),
        };
        for o in objects {
            let id = o.id();
            if let Some(foreign) = inventory.foreign(&id) {
                err(
                    errors,
                    node,
                    InputProblem::Foreign {
                        object: o.to_string(),
                        foreign: foreign.to_string(),
                    },
                );
                out.cidrs.extend(key_cidr(o));
                out.ids.push(id);
            }
        }
        out
    }

    /// Whether `o` is not written: keyed by a blocked CIDR, using a foreign object, or a
    /// nexthop that no route of `objects` that is written would use.
    fn blocks(&self, o: &KernelObject, objects: &[KernelObject]) -> bool {
        if let KernelObject::Nexthop(_) = o {
            let id = o.id();
            return !objects.iter().any(|r| {
                r.uses().as_ref() == Some(&id)
                    && key_cidr(r).is_none_or(|c| !self.cidrs.contains(&c))
            });
        }
        key_cidr(o).is_some_and(|c| self.cidrs.contains(&c))
            || o.uses().is_some_and(|u| self.ids.contains(&u))
    }
}

#[cfg(test)]
mod tests;

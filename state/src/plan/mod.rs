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
//! 5. [`upserts`]: desired objects ([`desired`]) and the upserts they need;
//! 6. [`deletes`]: every undesired object of ours, with the reason it goes or stays;
//! 7. the next record ([`Plan::checkpoint`]) and brake memory.
//!
//! Steps of a large plan run some of their pieces on a second core ([`parallel`]).
//!
//! The steps share one vocabulary, in leaf modules beneath them all: the configuration
//! ([`config`]), the input ([`view`]), resources and who claims them ([`resource`]), the
//! planner's views of each node ([`nodes`]), the brake's memory and decision
//! ([`brake_memory`]), the problems reported ([`problem`]) and the operations planned ([`ops`]).
//! A step imports that vocabulary and the shared indexes, never another step ([`claims`] is
//! [`assign`]'s own, the two halves of step 4); this module, on top, runs them in order.

pub mod brake;
pub mod claims;
pub mod desired;

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
mod upserts;
mod view;

use std::collections::{BTreeMap, BTreeSet};

use foldhash::{HashSet, HashSetExt};

use self::desired::local_endpoint;
use crate::checkpoint::{Checkpoint, PendingDelete};
use crate::ids::{IdAllocator, IdSet};
use crate::node::{Family, Node};
use crate::objects::{NodeId, ObjectId, Op};

pub use brake_memory::{BrakeCount, BrakeHold, BrakeMemory, HoldKind, Removal};
pub use claim_index::ClaimIndex;
pub use config::{
    GlobalTags, HostAddresses, IpsecConfig, KeyInUse, KeyTags, OnLink, Pair, PlanConfig,
};
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
/// remote pod CIDR of it is routed ([`desired`]), reported once, for the local node, and
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
    let ((cp_nodes, first), second) = parallel::both(
        live.len() >= parallel::WORTH_A_THREAD,
        || {
            let nodes = next_nodes(&live, &records);
            (nodes, upserts::wanted(input, &live, &index, 0..cut))
        },
        || upserts::wanted(input, &live, &index, cut..live.len()),
    );
    let (upserts, desired) = upserts::gather(input, [first, second], &mut errors);

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
    let made = Made {
        records,
        live,
        brake,
        admitted,
        deleted,
        cp_nodes,
        upserts,
        errors,
    };
    next_record(input, elsewhere, made)
}

/// What steps 1 to 6 made, for step 7 to put into the plan and the next record.
struct Made<'a> {
    records: Vec<Record<'a>>,
    live: Vec<Live<'a>>,
    brake: Brake,
    admitted: assign::Admitted,
    deleted: deletes::Deleted,
    /// The next record's live nodes ([`next_nodes`]).
    cp_nodes: Vec<Node>,
    upserts: Vec<Upsert>,
    errors: Vec<InputError>,
}

/// Step 7: the next record (records carried over, pending deletes, the IDs freed, the brake's
/// memory) and the plan, with whether it leaves everything settled or steady.
fn next_record(input: &PlanInput<'_>, elsewhere: Option<&Elsewhere>, made: Made<'_>) -> Plan {
    let cfg = input.config;
    let synced = input.live.synced;
    let Made {
        records,
        live,
        brake,
        admitted,
        deleted,
        mut cp_nodes,
        upserts,
        errors,
    } = made;
    let Unseen {
        mut pending,
        stale_attempted,
        released_nodes,
    } = unseen(&records, synced, &brake, &mut cp_nodes);
    let mut kept_ids = deleted.kept_ids;
    for id in cp_nodes
        .iter()
        .chain(pending.iter().map(|p| &p.node))
        .filter_map(|n| n.node_id)
    {
        kept_ids.insert(id);
    }
    kept_ids.union_with(&admitted.claimed);
    let (alloc, frees) = free_ids(
        input,
        elsewhere,
        admitted.allocator,
        &admitted.seen_ids,
        &kept_ids,
    );
    cp_nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let (brake_hold, brake_memory) = brake.finish(deleted.held);
    let (held_nodes, orphans_held) = brake_memory.held_for_record();
    for p in &mut pending {
        p.held = held_nodes
            .get(&(p.node.name.as_str(), p.node.uid.as_str()))
            .copied();
    }
    let quiet = synced && brake_hold.is_none() && pending.is_empty();
    let settled = quiet && errors.is_empty() && all_settled(&live);
    let steady = (quiet && !deleted.kept_unrecorded)
        .then(|| unsettled(&live, &errors))
        .flatten();
    let checkpoint = Checkpoint {
        agent_version: cfg.agent_version.clone(),
        written_at: input.now,
        // The agent reads the boot clock when it writes the record.
        boot: None,
        local_node: cfg.local_node.clone(),
        nodes: cp_nodes.into(),
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

/// The records with no live node, as step 7 sorts them: pending deletes, and the removals the
/// brake lets through now (with their attempt counts, should a delete fail).
struct Unseen {
    pending: Vec<PendingDelete>,
    stale_attempted: BTreeMap<String, PendingDelete>,
    released_nodes: Vec<String>,
}

/// Sorts the records with no live node: before sync each is carried over as it came (a listed
/// one into `cp_nodes`); after it, a removal the brake releases goes, and any other stays a
/// pending delete.
fn unseen(records: &[Record<'_>], synced: bool, brake: &Brake, cp_nodes: &mut Vec<Node>) -> Unseen {
    let mut out = Unseen {
        pending: Vec::new(),
        stale_attempted: BTreeMap::new(),
        released_nodes: Vec::new(),
    };
    for r in records.iter().filter(|r| r.live.is_none()) {
        if !synced {
            // Nothing is known to be gone yet: every unseen record is carried over as it came.
            if r.listed {
                cp_nodes.push(r.node.clone());
            } else {
                out.pending.push(r.pending());
            }
        } else if brake.releases(r) {
            out.released_nodes.push(r.node.name.clone());
            out.stale_attempted.insert(r.node.name.clone(), r.pending());
        } else {
            out.pending.push(r.pending());
        }
    }
    out
}

/// Frees every ID seen (in the kernel or the record) that nothing keeps: no kept object, no
/// node of the next record, no programmed node (all in `kept`), nothing outside the part.
fn free_ids(
    input: &PlanInput<'_>,
    elsewhere: Option<&Elsewhere>,
    mut alloc: IdAllocator,
    seen: &IdSet,
    kept: &IdSet,
) -> (IdAllocator, Vec<NodeId>) {
    let mut frees = Vec::new();
    let used_elsewhere = |id| elsewhere.is_some_and(|e| e.ids.contains(id));
    for id in seen.iter() {
        if !kept.contains(id) && !used_elsewhere(id) {
            alloc.free(id, input.now);
            frees.push(id);
        }
    }
    (alloc, frees)
}

/// Whether every live node is programmed, or registering with nothing recorded and no pod CIDR
/// (it claims nothing).
fn all_settled(live: &[Live<'_>]) -> bool {
    live.iter().all(|l| match l.class {
        LiveClass::Programmed(_) => true,
        LiveClass::Held(HeldWhy::Registering) => l.record.is_none() && l.node.pod_cidrs.is_empty(),
        LiveClass::Held(_) | LiveClass::Candidate => false,
    })
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

#[cfg(test)]
mod tests;

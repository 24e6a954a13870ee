//! Event-sized plans: the same planner, over the part of the cluster a change touches.
//!
//! After a plan that left everything settled ([`Plan::settled`]: every live node programmed
//! under its record, nothing held, nothing pending, the kernel exactly what the record needs),
//! one node reaches another only through what both claim: an address or a pod CIDR. So the
//! part of the cluster a change to some nodes can move is those nodes and every node whose
//! record claims anything they claim, now or as recorded; everything else plans to nothing.
//! [`plan_scoped`] runs [`super::plan`]'s own steps on that part's records, live nodes and
//! kernel objects, with what the rest adds to the cluster-wide figures passed in beside it
//! ([`Elsewhere`]): the brake's ratios are still taken over every known node and object, the
//! map's room over every entry, and node IDs are still handed out, freed and inherited knowing
//! every ID in use. The property test `state/tests/scoped.rs` holds its plans to the full ones.

use std::collections::BTreeSet;

use super::claims::Resource;
use super::{Elsewhere, LiveView, Plan, PlanInput, plan_with};
use crate::checkpoint::Checkpoint;
use crate::desired::{desired_objects, global_objects};
use crate::ids::IdSet;
use crate::node::Node;
use crate::objects::{KernelObject, ObjectKind};

/// The plan for a change to the nodes named in `touched`, or `None` where only a full plan
/// will do (no record, not synced, something held or pending, the local node touched).
///
/// The caller vouches that the last plan was [`Plan::settled`] and applied without a failure,
/// that `input.inventory` is what that left and `input.record` the record it implied, and that
/// nothing but the touched nodes changed since, the configuration included. `input.live` holds
/// the touched nodes as they are now (a name missing from it is gone) and the local node: the
/// other nodes of the part are live exactly as recorded. The plan's checkpoint covers the names
/// of [`Plan::scope`]; [`Checkpoint::splice`] puts it into the record.
pub fn plan_scoped(input: &PlanInput<'_>, touched: &BTreeSet<String>) -> Option<Plan> {
    let cfg = input.config;
    let record = input.record?;
    let settled_input = input.live.synced
        && record.pending_deletes.is_empty()
        && input.brake.held.is_empty()
        && input.confirmed_hold.is_none()
        && !touched.contains(&cfg.local_node);
    if !settled_input {
        return None;
    }
    let claims = Claimed::new(claimed_by(touched, input.live, record));
    let mut part: Vec<&Node> = Vec::new();
    let mut elsewhere = Elsewhere {
        known_nodes: 0,
        objects: 0,
        map_entries: 0,
        ids: IdSet::new(),
    };
    // The record is sorted by name: the touched nodes' places in it, found once.
    let touched_at: BTreeSet<usize> = touched
        .iter()
        .filter_map(|t| record.nodes.binary_search_by(|n| n.name.cmp(t)).ok())
        .collect();
    for (at, n) in record.nodes.iter().enumerate() {
        if n.name == cfg.local_node {
            continue;
        }
        if touched_at.contains(&at) || claims.any_of(n) {
            part.push(n);
        } else {
            elsewhere.known_nodes += 1;
            // Every settled record carries its ID.
            elsewhere.ids.insert(n.node_id?);
        }
    }

    // The part's kernel objects: what its records need, found by identity. A settled kernel
    // holds nothing else of the part's: a new identity a touched node wants is either claimed
    // through a record of the part, or free.
    let mut objects: Vec<KernelObject> = global_objects(cfg);
    let mut problems = Vec::new();
    for n in &part {
        desired_objects(n, n.node_id?, cfg, &mut objects, &mut problems);
    }
    let inventory = input.inventory.part(objects.iter().map(KernelObject::id));
    elsewhere.objects = input.inventory.len() - inventory.len();
    elsewhere.map_entries =
        input.inventory.count(ObjectKind::MapEntry) - inventory.count(ObjectKind::MapEntry);

    // The part's live nodes: the touched ones as they are now, the others as recorded.
    let mut live = LiveView {
        nodes: input.live.nodes.clone(),
        malformed: input.live.malformed.clone(),
        synced: input.live.synced,
        relists: input.live.relists,
    };
    for n in part.iter().filter(|n| !touched.contains(&n.name)) {
        live.nodes.push(Node {
            node_id: None,
            ..(*n).clone()
        });
    }
    let names: Vec<String> = touched
        .iter()
        .cloned()
        .chain(
            part.iter()
                .filter(|n| !touched.contains(&n.name))
                .map(|n| n.name.clone()),
        )
        .collect();
    let sub_record = Checkpoint {
        nodes: part.into_iter().cloned().collect(),
        ..Checkpoint::default()
    };
    let sub = PlanInput {
        record: Some(&sub_record),
        live: &live,
        inventory: &inventory,
        ..*input
    };
    let mut plan = plan_with(&sub, Some(&elsewhere));
    plan.scope = Some(names);
    Some(plan)
}

/// Everything the touched nodes claim, now and as recorded: every address (mapped or not: an
/// object may use any as an endpoint) and pod CIDR, sorted.
fn claimed_by(touched: &BTreeSet<String>, live: &LiveView, record: &Checkpoint) -> Vec<Resource> {
    let mut claims = Vec::new();
    let mut add = |n: &Node| {
        claims.extend(n.ips().map(Resource::Address));
        claims.extend(n.pod_cidrs.iter().map(|c| Resource::PodCidr(*c)));
    };
    for n in live.nodes.iter().filter(|n| touched.contains(&n.name)) {
        add(n);
    }
    for name in touched {
        if let Ok(at) = record.nodes.binary_search_by(|n| n.name.as_str().cmp(name)) {
            add(&record.nodes[at]);
        }
    }
    claims.sort_unstable();
    claims.dedup();
    claims
}

/// What the touched nodes claim, sorted, with a 64-bit fingerprint of it: every record of the
/// cluster is checked against it at every event, and most share nothing with it, which the
/// fingerprint says without a search.
struct Claimed {
    sorted: Vec<Resource>,
    mask: u64,
}

impl Claimed {
    fn new(sorted: Vec<Resource>) -> Self {
        let mask = sorted.iter().fold(0, |m, r| m | fingerprint(r));
        Self { sorted, mask }
    }

    /// Whether `n` claims any of them.
    fn any_of(&self, n: &Node) -> bool {
        let has =
            |r: Resource| fingerprint(&r) & self.mask != 0 && self.sorted.binary_search(&r).is_ok();
        n.ips().any(|ip| has(Resource::Address(ip)))
            || n.pod_cidrs.iter().any(|c| has(Resource::PodCidr(*c)))
    }
}

/// One bit of 64, from the resource's address bits mixed (a Fibonacci hash's top six bits).
fn fingerprint(r: &Resource) -> u64 {
    let (bits, tag) = r.bits();
    let folded = (bits ^ (bits >> 64) ^ (u128::from(tag) << 56)) as u64;
    1 << (folded.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58)
}

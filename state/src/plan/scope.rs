//! Event-sized plans: the same planner, over the part of the cluster a change touches.
//!
//! After a plan that left everything settled ([`Plan::settled`]: every live node programmed
//! under its record, nothing held, nothing pending, the kernel exactly what the record needs),
//! one node reaches another only through what both claim: an address or a pod CIDR. So the
//! part of the cluster a change to some nodes can move is those nodes and every node whose
//! record claims anything they claim, now or as recorded; everything else plans to nothing.
//! A plan that left a few nodes unsettled (held, or with an input error) but everything else
//! so is [`Plan::steady`]: planned again beside every change, those nodes take part in the
//! same way (what holds them, and what a change may release them with, is in the part), and
//! the kernel is still exactly what the record needs.
//! [`plan_scoped`] runs [`super::plan`]'s own steps on that part's records, live nodes and
//! kernel objects, with what the rest adds to the cluster-wide figures passed in beside it
//! ([`Elsewhere`]): the brake's ratios are still taken over every known node and object, the
//! map's room over every entry, and node IDs are still handed out, freed and inherited knowing
//! every ID in use. The property test `state/tests/scoped.rs` holds its plans to the full ones.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::claim_index::ClaimIndex;
use super::desired::{desired_objects, global_objects};
use super::resource::{Resource, resources_of};
use super::view::{Elsewhere, LiveView, PlanInput};
use super::{Plan, plan_with};
use crate::checkpoint::Checkpoint;
use crate::inventory::Inventory;
use crate::node::Node;
use crate::objects::{KernelObject, ObjectKind};

/// The plan for a change to the nodes named in `touched`, or `None` where only a full plan
/// will do (no record, not synced, something held or pending, the local node touched, a record
/// without an ID or sharing one).
///
/// `index` is the [`ClaimIndex`] of `input.record`: it finds the records of the part without a
/// walk over the whole record, and counts the rest.
///
/// The caller vouches that the last plan was [`Plan::steady`] and applied without a failure,
/// that `touched` includes the nodes it left unsettled, that `input.inventory` is what that
/// plan left and `input.record` the record it implied, and that nothing but the touched nodes
/// changed since, the configuration included. `input.live` holds the touched nodes as they are
/// now (a name missing from it is gone) and the local node: the other nodes of the part are
/// live exactly as recorded. The plan's checkpoint covers the names
/// of [`Plan::scope`]; [`Checkpoint::splice`] puts it into the record.
pub fn plan_scoped(
    input: &PlanInput<'_>,
    index: &ClaimIndex,
    touched: &BTreeSet<String>,
) -> Option<Plan> {
    let record = input.record?;
    if !steady_input(input, record, index, touched) {
        return None;
    }
    let local = record.nodes.named(&input.config.local_node);
    let part = part_of(input.live, record, index, touched, &input.config.local_node);

    // The rest of the cluster, by count: every record has an ID and no two the same.
    let mut ids = index.ids().clone();
    for n in part.iter().copied().chain(local) {
        ids.remove(n.node_id?);
    }
    let inventory = part_inventory(input, &part)?;
    let elsewhere = Elsewhere {
        known_nodes: record.nodes.len() - local.len() - part.len(),
        objects: input.inventory.len() - inventory.len(),
        map_entries: input.inventory.count(ObjectKind::MapEntry)
            - inventory.count(ObjectKind::MapEntry),
        ids,
    };

    // The part's live nodes: the touched ones as they are now, the others as recorded.
    let mut live = LiveView {
        nodes: input.live.nodes.clone(),
        malformed: input.live.malformed.clone(),
        synced: input.live.synced,
        relists: input.live.relists,
    };
    for n in part.iter().filter(|n| !touched.contains(&n.name)) {
        live.nodes.push(Arc::new(Node {
            node_id: None,
            ..(*n).clone()
        }));
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

/// Whether the input allows an event-sized plan at all (see [`plan_scoped`]).
fn steady_input(
    input: &PlanInput<'_>,
    record: &Checkpoint,
    index: &ClaimIndex,
    touched: &BTreeSet<String>,
) -> bool {
    input.live.synced
        && record.pending_deletes.is_empty()
        && input.brake.held.is_empty()
        && input.brake.orphans_held.is_none()
        && input.brake.done.is_empty()
        && input.confirmed_hold.is_none()
        && !touched.contains(&input.config.local_node)
        && index.counts(record)
        && index.ids_are_distinct()
}

/// The part's records, the local node's left out.
fn part_of<'r>(
    live: &LiveView,
    record: &'r Checkpoint,
    index: &ClaimIndex,
    touched: &BTreeSet<String>,
    local: &str,
) -> Vec<&'r Node> {
    let claimed = claimed_by(touched, live, record);
    let nodes = &record.nodes;
    // The part, in the record's order (by name, then place among the name's records): the
    // touched nodes' records, and every record the index names as a claimant of what they
    // claim that does claim some of it.
    let mut at: BTreeSet<(&'r str, usize)> = BTreeSet::new();
    let mut take = |name: &str, keep: &dyn Fn(&Node) -> bool| {
        let of_name = nodes.named(name).iter().enumerate();
        at.extend(
            of_name
                .filter(|(_, n)| keep(n))
                .map(|(i, n)| (n.name.as_str(), i)),
        );
    };
    for t in touched {
        take(t, &|_| true);
    }
    for r in &claimed {
        for name in index.claimants(r) {
            take(name, &|n| claims_any(n, &claimed));
        }
    }
    // And every record whose pod CIDR covers an address the touched nodes have, or had, or
    // with an address a pod CIDR of theirs covers: the node of such a CIDR is held over it
    // (`InputProblem::CoversAddress`), whoever changed.
    let (ips, cidrs) = addresses_and_cidrs(touched, live, record);
    for ip in &ips {
        for name in index.covering(*ip) {
            take(name, &|n| n.pod_cidrs.iter().any(|c| c.contains(ip)));
        }
    }
    for c in &cidrs {
        for name in index.covered(c) {
            take(name, &|n| n.ips().any(|ip| c.contains(&ip)));
        }
    }
    at.into_iter()
        .filter(|(name, _)| *name != local)
        .map(|(name, i)| &nodes.named(name)[i])
        .collect()
}

/// The part's kernel objects: what its records need, found by identity (their nexthops at the
/// IDs the kernel has them at). A steady kernel holds nothing else of the part's: a new
/// identity a touched node wants (a readdressed node's nexthop at the other ID of its pair) is
/// either claimed through a record of the part, or free; and what is foreign, or used by
/// something foreign, the part knows in full. `None` for a record without an ID.
fn part_inventory(input: &PlanInput<'_>, part: &[&Node]) -> Option<Inventory> {
    let mut objects: Vec<KernelObject> = global_objects(input.config);
    let mut problems = Vec::new();
    for n in part {
        desired_objects(
            n,
            n.node_id?,
            input.config,
            input.inventory,
            &mut objects,
            &mut problems,
        );
    }
    Some(input.inventory.part(objects.iter().map(KernelObject::id)))
}

/// The touched nodes, as the live view has them and as the record does.
fn touched_nodes<'a>(
    touched: &'a BTreeSet<String>,
    live: &'a LiveView,
    record: &'a Checkpoint,
) -> impl Iterator<Item = &'a Node> {
    let live = live
        .nodes
        .iter()
        .map(|n| &**n)
        .filter(|n| touched.contains(&n.name));
    let recorded = touched.iter().flat_map(|t| record.nodes.named(t));
    live.chain(recorded)
}

/// Everything the touched nodes claim, now and as recorded, sorted.
fn claimed_by(touched: &BTreeSet<String>, live: &LiveView, record: &Checkpoint) -> Vec<Resource> {
    let mut claims: Vec<Resource> = touched_nodes(touched, live, record)
        .flat_map(resources_of)
        .collect();
    claims.sort_unstable();
    claims.dedup();
    claims
}

/// The addresses and pod CIDRs of the touched nodes, now and as recorded.
fn addresses_and_cidrs(
    touched: &BTreeSet<String>,
    live: &LiveView,
    record: &Checkpoint,
) -> (Vec<IpAddr>, Vec<IpNet>) {
    let (mut ips, mut cidrs) = (Vec::new(), Vec::new());
    for n in touched_nodes(touched, live, record) {
        ips.extend(n.ips());
        cidrs.extend(n.pod_cidrs.iter().copied());
    }
    (ips, cidrs)
}

/// Whether `n` claims any of `claimed` (sorted).
fn claims_any(n: &Node, claimed: &[Resource]) -> bool {
    resources_of(n).any(|r| claimed.binary_search(&r).is_ok())
}

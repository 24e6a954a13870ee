//! What the invariant checker knows after each step, and the invariants it holds the agent to.
//!
//! The rules, and which wins when they meet, are the precedence table of `docs/design.md`; the
//! oracle judges from the outside, with what a user can see: the kernel, the checkpoint through
//! `node-agent state show`, the list the agent was shown, and the exit status.
//!
//! Its checks, by the names docs/design.md's invariant table gives them:
//!
//! * **foreign**: foreign routes, nexthops and routes through our nexthops never change;
//! * **policy**: nothing the address policy refuses is mapped or routed;
//! * **no-local**: a list without the local node changes nothing, and the run exits 3;
//! * **kept**: no object of a live, clean, unchanged node is deleted, not even by a killed or
//!   cut run ([`violations`]);
//! * **unsynced**: a run whose source never completed a list deletes or changes nothing of
//!   ours, in the kernel or the record ([`unsynced_lost`]);
//! * **held**: a listed node that is malformed or has no addresses keeps the map entries and
//!   routes its record lists, even through a killed run ([`held_lost`]);
//! * **programmed**: after a run that finished, every clean node has all its objects under one
//!   ID of its own (nodes waiting for an ID at the edge of the ID space excepted);
//! * **brake**: no removal past `--max-prune-ratio`, counting the window, unless forced
//!   ([`brake_passed`]);
//! * **confirmed**: a hold an operator confirmed releases its own removals and nothing else
//!   past the brake (the brake's check, with the confirmed nodes and orphans left out). Looser
//!   than the agent on two counts: the other removals are weighed without the confirmed ones
//!   (the agent counts both), and a held name excuses one recorded node of that name;
//! * **differential**: at rest, each clean node's objects and recorded ID are what a fresh agent
//!   programs from the same record, list and foreign objects ([`node_difference`]);
//! * **converged**: at a history's end, two forced runs leave exactly what the mended cluster
//!   needs, the second writing nothing, no nexthop astray, no pending delete;
//! * **exact** (crash torture): after every restart, nothing leaked, nothing missing, no ID of
//!   an unchanged node changed ([`exactness`], [`id_changes`]).
//!
//! An oracle of some size has a module of its own (`held`, `unsynced`, `brake` with the
//! confirmed check, `exact` with the differential's comparison of one node); `snapshot` and
//! `record` are what the checker reads of the kernel and of the record; [`violations`] holds
//! the short checks and calls the rest.

mod brake;
mod exact;
mod held;
mod record;
mod snapshot;
#[cfg(test)]
mod tests;
mod unsynced;

use std::collections::{BTreeMap, BTreeSet};

use crate::agent::{TestNode, node_routes};

use super::model::slot_cidr4;
use brake::brake_passed;
pub use brake::removals;
pub use exact::{exactness, id_changes, node_difference, wanted_routes};
pub use held::held;
use held::held_lost;
use record::is_nodes_entry;
pub use record::{Recorded, clean, is_valid, record};
pub use snapshot::{FOREIGN_TABLE, Snapshot, nexthop_id};
use unsynced::unsynced_lost;

/// A hold an operator confirmed (`node-agent prune confirm`): its nodes and orphan objects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Confirmed {
    pub nodes: Vec<String>,
    pub orphans: usize,
}

/// What one step saw and did, for judging it.
pub struct StepFacts<'a> {
    pub list: &'a [TestNode],
    /// The list before this step, and its clean nodes.
    pub previous_clean: &'a [TestNode],
    pub record_before: Option<&'a [Recorded]>,
    /// The record after a run that did not finish (a kill, a cut, an unsynced source), where
    /// it is judged; `None` after one that finished, or where there is none.
    pub record_after: Option<&'a [Recorded]>,
    /// The step lost or corrupted the checkpoint before the agent ran: the agent saw no record.
    pub record_lost: bool,
    pub before: &'a Snapshot,
    /// The kernel when the step's list reached the agent: `before`, or later for a daemon that
    /// first came to rest on the last step's list.
    pub shown: &'a Snapshot,
    /// The nodes that daemon programmed at rest on the last step's list (its clean nodes); none
    /// otherwise.
    pub rested: &'a [TestNode],
    pub after: &'a Snapshot,
    /// The run's exit status; `None` for a daemon that was killed.
    pub exit: Option<i32>,
    pub forced: bool,
    /// The hold an operator confirmed during the run.
    pub confirmed: Option<&'a Confirmed>,
    /// The step's list reached a daemon as watch events, planned one by one.
    pub event_sized: bool,
    /// The list lacks the local node.
    pub no_local: bool,
    /// The step's list reached the agent: not so for a daemon ended (killed, cut) while it
    /// rested on the last step's list, before it was shown this one.
    pub reached: bool,
    /// The run's source never completed a list (the list is what it would have shown).
    pub unsynced: bool,
    /// Pod CIDR slots with a foreign route.
    pub foreign_slots: &'a [usize],
    /// Removals done by earlier steps within the brake's window: nodes, objects.
    pub window: (usize, usize),
    pub max_ratio: f64,
    /// Routes go through nexthop objects (else they carry their gateways, and a foreign
    /// nexthop at a node's nexthop ID is in nobody's way).
    pub nexthops: bool,
    /// Nodes the run reported waiting for a node ID: every ID in use or cooling.
    pub waiting: &'a BTreeSet<String>,
}

impl<'a> StepFacts<'a> {
    /// The record the agent started the step with.
    pub(super) fn agent_record(&self) -> Option<&'a [Recorded]> {
        self.record_before.filter(|_| !self.record_lost)
    }
}

/// The invariants one step broke, in words; empty when it broke none.
pub fn violations(f: &StepFacts<'_>) -> Vec<String> {
    let mut v = Vec::new();
    // Nothing foreign changes.
    if f.before.foreign_routes() != f.after.foreign_routes() {
        v.push(format!(
            "foreign routes changed:\n  before {:?}\n  after  {:?}",
            f.before.foreign_routes(),
            f.after.foreign_routes()
        ));
    }
    if f.before.foreign_nexthops() != f.after.foreign_nexthops() {
        v.push(format!(
            "foreign nexthops changed:\n  before {:?}\n  after  {:?}",
            f.before.foreign_nexthops(),
            f.after.foreign_nexthops()
        ));
    }
    if f.before.elsewhere != f.after.elsewhere {
        v.push(format!(
            "foreign routes through our nexthops (table {FOREIGN_TABLE}) changed:\n  before {:?}\n  after  {:?}",
            f.before.elsewhere, f.after.elsewhere
        ));
    }
    // Nothing the address policy refuses is mapped or routed, whatever the list said.
    for (ip, id) in &f.after.map {
        if ip
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| state::address_policy::judge_ip(ip.to_canonical()).is_err())
        {
            v.push(format!(
                "{ip} -> {id} is mapped though the address policy refuses it"
            ));
        }
    }
    for dest in f.after.our_routes().keys() {
        // `ip` names a default route `default`.
        if *dest == "default"
            || dest
                .parse::<ipnet::IpNet>()
                .is_ok_and(|d| state::address_policy::judge_net(d).is_err())
        {
            v.push(format!(
                "our route {dest} goes where the address policy refuses"
            ));
        }
    }
    // A list without the local node changes nothing.
    // Judged once the list reached the agent: a daemon ended while it rested on the last step's
    // list (seed 179631000000000, history 18) did that list's work and never saw this one.
    if f.no_local
        && f.reached
        && (f.shown.map != f.after.map || f.shown.our_routes() != f.after.our_routes())
    {
        v.push("a list without the local node changed the kernel".into());
    }
    if f.no_local && f.exit.is_some_and(|c| c != 3) {
        v.push(format!(
            "a list without the local node exited {:?}, not 3",
            f.exit
        ));
    }
    if let Some(code) = f.exit
        && !matches!(code, 0 | 3)
    {
        v.push(format!("the run exited {code}"));
    }
    let clean_now = clean(f.list, f.record_before, f.rested);
    // No object of a live, clean, unchanged node is ever deleted, not even by a killed agent.
    for n in &clean_now {
        if !f.previous_clean.contains(n) {
            continue;
        }
        for ip in &n.ips {
            if let Some(id) = f.before.map.get(ip)
                && is_nodes_entry(f.record_before, n, *id)
                && f.after.map.get(ip) != Some(id)
            {
                v.push(format!(
                    "{}'s map entry {ip} -> {id} became {:?}",
                    n.name,
                    f.after.map.get(ip)
                ));
            }
        }
        let id = n.ips.first().and_then(|ip| f.before.map.get(ip)).copied();
        // Only the routes the node needs: one of a family it has no InternalIP in (only an
        // ExternalIP) is a leftover that must go.
        for (c, _) in node_routes(n).filter(|(_, gw)| gw.is_some()) {
            // A route whose nexthop someone else took over goes: it would send their way.
            let taken = id.is_some_and(|id| f.before.nexthop_taken(id, c.contains(':')));
            if f.before.our_routes().contains_key(c)
                && !f.after.our_routes().contains_key(c)
                && !taken
            {
                v.push(format!("{}'s route {c} was deleted", n.name));
            }
        }
    }
    v.extend(held_lost(f));
    v.extend(unsynced_lost(f));
    // After a run that finished, every clean node has all its objects, under one ID of its own.
    if f.exit.is_some() && !f.no_local {
        let mut owner: BTreeMap<u16, &str> = BTreeMap::new();
        for n in &clean_now {
            let ids: BTreeSet<Option<&u16>> = n.ips.iter().map(|ip| f.after.map.get(ip)).collect();
            if ids.contains(&None) {
                if !f.waiting.contains(&n.name) {
                    v.push(format!("{} lacks a map entry: {ids:?}", n.name));
                }
                continue;
            }
            if ids.len() > 1 {
                v.push(format!("{} has several IDs: {ids:?}", n.name));
            }
            for id in ids.into_iter().flatten() {
                if let Some(other) = owner.insert(*id, &n.name)
                    && other != n.name
                {
                    v.push(format!("{} and {other} share node ID {id}", n.name));
                }
            }
            let routes = f.after.our_routes();
            let id = n.ips.first().and_then(|ip| f.after.map.get(ip)).copied();
            for (c, gw) in node_routes(n) {
                let foreign = f.foreign_slots.iter().any(|s| slot_cidr4(*s) == c);
                let v6 = c.contains(':');
                let Some(gw) = gw else {
                    continue;
                };
                if foreign {
                    if routes.contains_key(c) {
                        v.push(format!("our route {c} sits where a foreign one should"));
                    }
                } else if f.nexthops && id.is_some_and(|id| f.after.nexthop_taken(id, v6)) {
                    if routes.contains_key(c) {
                        v.push(format!(
                            "our route {c} is written though a foreign nexthop holds {}'s ID",
                            n.name
                        ));
                    }
                } else if routes.get(c) != Some(&gw) {
                    v.push(format!(
                        "{}'s route {c} via {gw} is missing (found {:?})",
                        n.name,
                        routes.get(c)
                    ));
                }
            }
        }
    }
    v.extend(brake_passed(f));
    v
}

//! The **held** oracle (invariant 8).

use std::collections::BTreeSet;

use super::StepFacts;
use super::record::{Recorded, is_valid, same_node};
use crate::agent::{TestNode, local_node};

/// What held nodes lost (invariant 8): a listed node that is malformed or has no addresses keeps
/// the map entries and routes its record lists, as the kernel held them when the list reached
/// the agent, whatever the run did (a kill included). Left aside: what the local node claims
/// now (it keeps its own), routes whose nexthop ID something foreign took, nodes a resting
/// daemon programmed anew before the list, and runs without the record (lost) or forced.
pub(super) fn held_lost(f: &StepFacts<'_>) -> Vec<String> {
    let mut v = Vec::new();
    let local = local_node();
    let local_nets: Vec<ipnet::IpNet> = local.cidrs.iter().filter_map(|c| c.parse().ok()).collect();
    let the_locals = |c: &str| {
        c.parse::<ipnet::IpNet>().is_ok_and(|c| {
            local_nets
                .iter()
                .any(|l| l.contains(&c.network()) || c.contains(&l.network()))
        })
    };
    for (n, rec, id) in held(f) {
        for ip in rec.ips.iter().filter(|ip| !local.ips.contains(ip)) {
            if f.shown.map.get(ip) == Some(&id) && f.after.map.get(ip) != Some(&id) {
                v.push(format!(
                    "held node {}'s map entry {ip} -> {id} became {:?}",
                    n.name,
                    f.after.map.get(ip)
                ));
            }
        }
        for c in rec.cidrs.iter().filter(|c| !the_locals(c)) {
            let taken = f.shown.nexthop_taken(id, c.contains(':'));
            if f.shown.our_routes().contains_key(c.as_str())
                && !f.after.our_routes().contains_key(c.as_str())
                && !taken
            {
                v.push(format!("held node {}'s route {c} was deleted", n.name));
            }
        }
    }
    v
}

/// The held nodes [`held_lost`] judges, with their records and IDs: listed (the first item of
/// their name), malformed or without addresses, recorded under their UID with an ID and no
/// pending delete, not programmed anew by a resting daemon nor passed through another version
/// on the way to this list ([`passed_through`]); none without the record or in a forced run or a
/// list without the local node, nor where an event-sized daemon was killed.
pub fn held<'a>(f: &StepFacts<'a>) -> Vec<(&'a TestNode, &'a Recorded, u16)> {
    let Some(record) = f.agent_record() else {
        return Vec::new();
    };
    // A daemon killed in an event-sized step may have come to rest on the last list first (and
    // programmed there nodes that were valid, not only clean ones), which the facts do not show.
    if f.forced || f.no_local || (f.event_sized && f.exit.is_none()) {
        return Vec::new();
    }
    let local = local_node();
    let mut seen = BTreeSet::new();
    f.list
        .iter()
        // Of a name listed twice, the first item stands.
        .filter(|n| seen.insert(n.name.as_str()))
        .filter(|n| !is_valid(n) && n.name != local.name)
        .filter(|n| !f.rested.iter().any(|r| r.name == n.name))
        .filter_map(|n| {
            let rec = record.iter().find(|r| same_node(r, n))?;
            match (rec.id, rec.attempts) {
                (Some(id), 0) if !passed_through(f, rec) => Some((n, rec, id)),
                _ => None,
            }
        })
        .collect()
}

/// Whether a daemon shown this step's list as watch events may have programmed `rec`'s node
/// as the last list had it, other than recorded: the events that lead to this list pass
/// through that version (the last list's local node missing, say, so that its rest did
/// nothing, and the local node's return reached the daemon first).
fn passed_through(f: &StepFacts<'_>, rec: &Recorded) -> bool {
    let set = |v: &[String]| v.iter().cloned().collect::<BTreeSet<String>>();
    f.event_sized
        && f.previous_clean.iter().any(|p| {
            p.name == rec.name && (set(&p.ips) != set(&rec.ips) || set(&p.cidrs) != set(&rec.cidrs))
        })
}

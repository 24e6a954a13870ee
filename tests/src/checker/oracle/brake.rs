//! The **brake** and **confirmed** oracles (invariants 9 and 16): what a step removed, as the
//! brake counts it, against `--max-prune-ratio`.

use std::collections::BTreeSet;

use super::StepFacts;
use super::record::same_node;
use crate::agent::local_node;

/// What a step removed, as the brake counts it: nodes (known, no longer listed, whose entries
/// went) and orphan objects (objects gone whose address, CIDR or gateway nobody listed claims).
pub fn removals(f: &StepFacts<'_>) -> (usize, usize) {
    let r = removed(f);
    (r.named.len() + r.unnamed, r.objects)
}

/// What a step removed: recorded nodes by name, nodes only the map told of, orphan objects.
struct Removed<'a> {
    named: Vec<&'a str>,
    unnamed: usize,
    objects: usize,
}

fn removed<'a>(f: &StepFacts<'a>) -> Removed<'a> {
    let unnamed = unrecorded_ids(f)
        .1
        .iter()
        .filter(|id| !f.after.map.values().any(|v| v == *id))
        .count();
    let mut named = Vec::new();
    for r in f.agent_record().unwrap_or_default() {
        if r.attempts > 0 || f.list.iter().any(|n| same_node(r, n)) {
            continue;
        }
        let Some(id) = r.id else { continue };
        let had = r.ips.iter().any(|ip| f.before.map.get(ip) == Some(&id));
        let has = r.ips.iter().any(|ip| f.after.map.get(ip) == Some(&id));
        if had && !has {
            named.push(r.name.as_str());
        }
    }
    // Swept objects are judged only where no checkpoint was there at all: after one the step
    // lost, the agent tells a listed node's leftovers from orphans by IDs and nexthops this
    // count does not model, and the node count above covers what the loss could hide. What a
    // daemon that came to rest on the last list first programmed there is its nodes', not
    // orphans.
    let mut objects = 0;
    if f.record_before.is_none_or(<[_]>::is_empty) {
        let claimed: BTreeSet<&str> = f
            .list
            .iter()
            .chain(f.rested)
            .flat_map(|n| n.ips.iter().chain(&n.cidrs))
            .map(String::as_str)
            .collect();
        let after_routes = f.after.our_routes();
        objects += f
            .before
            .map
            .keys()
            .filter(|ip| !f.after.map.contains_key(*ip) && !claimed.contains(ip.as_str()))
            .count();
        // A route through a listed node's address is that node's (one to a pod CIDR it no
        // longer has is superseded, not swept), as a nexthop to it is.
        objects += f
            .before
            .our_routes()
            .iter()
            .filter(|(d, gw)| {
                !after_routes.contains_key(*d) && !claimed.contains(*d) && !claimed.contains(*gw)
            })
            .count();
        let after_nexthops = f.after.our_nexthops();
        objects += f
            .before
            .our_nexthops()
            .iter()
            .filter(|(id, gw)| !after_nexthops.contains_key(*id) && !claimed.contains(**gw))
            .count();
    }
    Removed {
        named,
        unnamed,
        objects,
    }
}

/// The nodes the brake knows of only by the IDs the map carries before the step, as it counts
/// them: known ones beyond the record's, and those of them whose going is a node removal. An ID
/// on an entry that a listed node claims is that node's; an ID only on entries nobody listed
/// claims is a node only the kernel still tells of, if no record carries it (the checkpoint
/// that knew it was lost). Without a record, every ID the map carries is a known node.
fn unrecorded_ids(f: &StepFacts<'_>) -> (usize, BTreeSet<u16>) {
    let record = f.agent_record().unwrap_or_default();
    let claimed: BTreeSet<&str> = f
        .list
        .iter()
        .flat_map(|n| n.ips.iter())
        .map(String::as_str)
        .collect();
    let mut accounted: BTreeSet<u16> = record.iter().filter_map(|r| r.id).collect();
    accounted.extend(
        f.before
            .map
            .iter()
            .filter(|(ip, _)| claimed.contains(ip.as_str()))
            .map(|(_, id)| *id),
    );
    let unaccounted: BTreeSet<u16> = f
        .before
        .map
        .iter()
        .filter(|(ip, id)| !claimed.contains(ip.as_str()) && !accounted.contains(*id))
        .map(|(_, id)| *id)
        .collect();
    let known = match record.is_empty() {
        true => f.before.map.values().collect::<BTreeSet<_>>().len(),
        false => unaccounted.len(),
    };
    (known, unaccounted)
}

fn ratio(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// The **brake** and **confirmed** oracles: no removal past `--max-prune-ratio`, counting the
/// window, unless forced or confirmed by an operator (invariants 9 and 16).
pub(super) fn brake_passed(f: &StepFacts<'_>) -> Vec<String> {
    let mut v = Vec::new();
    // No deletion beyond the brake without --force-prune, judged from when the step's list
    // reached the agent: what a daemon did at its start it did to the last step's list, and
    // the nodes it programmed then are known nodes when the list comes.
    if !f.forced {
        let f = &StepFacts {
            before: f.shown,
            ..*f
        };
        let removed = removed(f);
        let record = f.agent_record().unwrap_or_default();
        // What an operator confirmed goes past the brake (invariant 16); nothing else may.
        let (nodes, objects) = match f.confirmed {
            None => (removed.named.len() + removed.unnamed, removed.objects),
            Some(c) => {
                // The hold names each node once per record (a name can be held twice, under two
                // UIDs): each recorded node removed takes one entry of its name, and what is
                // left covers as many nodes only the map told of (the hold knew them from a
                // record the step's facts do not show, as a daemon resting first writes).
                let mut left: Vec<&str> = c.nodes.iter().map(String::as_str).collect();
                let mut beyond = 0;
                for name in &removed.named {
                    match left.iter().position(|n| n == name) {
                        Some(at) => {
                            left.swap_remove(at);
                        }
                        None => beyond += 1,
                    }
                }
                // A node only the map told of is, to the agent without its record, orphan
                // objects: a hold of orphans covers them.
                let unnamed = match c.orphans {
                    0 => removed.unnamed.saturating_sub(left.len()),
                    _ => 0,
                };
                (
                    beyond + unnamed,
                    if c.orphans > 0 { 0 } else { removed.objects },
                )
            }
        };
        // Planned one event at a time, a node the list adds joins the record before the next
        // event's plan counts it (a rolling replacement passes the brake by design): each is
        // known by the time a removal after it is weighed.
        let joined = match f.event_sized {
            true => f
                .list
                .iter()
                .filter(|n| n.name != local_node().name && !record.iter().any(|r| same_node(r, n)))
                .count(),
            false => 0,
        };
        let known =
            record.iter().filter(|r| r.attempts == 0).count() + unrecorded_ids(f).0 + joined;
        let (wn, wo) = f.window;
        let node_ratio = ratio(nodes + wn, known + wn);
        if nodes > 0 && node_ratio > f.max_ratio {
            v.push(format!(
                "removed {nodes} known nodes ({wn} more within the window) of {known}: {:.0}% is past the brake",
                node_ratio * 100.0
            ));
        }
        let object_ratio = ratio(objects + wo, f.before.objects() + wo);
        if objects > 0 && object_ratio > f.max_ratio {
            v.push(format!(
                "swept {objects} orphan objects ({wo} more within the window) of {}: {:.0}% is past the brake",
                f.before.objects(),
                object_ratio * 100.0
            ));
        }
    }
    v
}

//! Crash torture's **exact** oracle, and the **differential** oracle's comparison of one node.

use std::collections::{BTreeMap, BTreeSet};

use state::node::Family;
use state::objects::NexthopId;

use super::Snapshot;
use crate::agent::{TestNode, local_node, node_routes};
use crate::checker::model::slot_cidr4;

/// What the kernel holds against what the listed nodes need (the cluster has no conflicts):
/// objects of ours nobody needs (leaked), and objects needed but absent (missing).
pub fn exactness(list: &[TestNode], after: &Snapshot, nexthops: bool) -> (usize, usize) {
    let remote: Vec<&TestNode> = list
        .iter()
        .filter(|n| n.name != local_node().name)
        .collect();
    let want_ips: BTreeSet<&str> = remote
        .iter()
        .flat_map(|n| n.ips.iter().map(String::as_str))
        .collect();
    let want_routes = wanted_routes(&remote, after, &[], nexthops);
    let routes = after.our_routes();
    let leaked = after
        .map
        .keys()
        .filter(|ip| !want_ips.contains(ip.as_str()))
        .count()
        + routes
            .iter()
            .filter(|(d, g)| want_routes.get(*d) != Some(g))
            .count()
        + after.astray_nexthops().len();
    let missing = want_ips
        .iter()
        .filter(|ip| !after.map.contains_key(**ip))
        .count()
        + want_routes
            .iter()
            .filter(|(d, g)| routes.get(*d) != Some(g))
            .count();
    (leaked, missing)
}

/// The routes `remote` nodes need (`destination -> gateway`), but for CIDRs in a foreign slot
/// and families whose nexthop ID a foreign nexthop holds.
pub fn wanted_routes<'a>(
    remote: &[&'a TestNode],
    after: &Snapshot,
    foreign_slots: &[usize],
    nexthops: bool,
) -> BTreeMap<&'a str, &'a str> {
    let mut want = BTreeMap::new();
    for n in remote {
        let id = n.ips.first().and_then(|ip| after.map.get(ip)).copied();
        for (c, gw) in node_routes(n) {
            let v6 = c.contains(':');
            if foreign_slots.iter().any(|s| slot_cidr4(*s) == c)
                || (nexthops && id.is_some_and(|id| after.nexthop_taken(id, v6)))
            {
                continue;
            }
            if let Some(gw) = gw {
                want.insert(c, gw);
            }
        }
    }
    want
}

/// How many listed nodes, unchanged since they were last seen, carry another ID than then;
/// `seen` remembers each node and its ID for the next call.
pub fn id_changes(
    list: &[TestNode],
    after: &Snapshot,
    seen: &mut BTreeMap<String, (TestNode, u16)>,
) -> usize {
    let mut changed = 0;
    let mut now = BTreeMap::new();
    for n in list.iter().filter(|n| n.name != local_node().name) {
        let Some(id) = n.ips.first().and_then(|ip| after.map.get(ip)) else {
            continue;
        };
        if let Some((before, old)) = seen.get(&n.name)
            && before == n
            && old != id
        {
            changed += 1;
        }
        now.insert(n.name.clone(), (n.clone(), *id));
    }
    *seen = now;
    changed
}

/// Where node `n`'s objects in `a` and in `b` differ: its map entries, its routes (gateway,
/// and the node and family of the nexthop they go through) and the nexthops of ours to its
/// addresses; empty when they are the same. Which ID of a node's nexthop pair is in use is
/// history (a readdressed node moves to the other one, make before break), not a difference.
pub fn node_difference(n: &TestNode, a: &Snapshot, b: &Snapshot) -> Vec<String> {
    let pair = |id: &u32| {
        NexthopId(*id)
            .decode()
            .map(|(node, family)| (node.get(), family))
    };
    let mut d = Vec::new();
    for ip in &n.ips {
        if a.map.get(ip) != b.map.get(ip) {
            d.push(format!(
                "map entry {ip}: {:?} here, {:?} fresh",
                a.map.get(ip),
                b.map.get(ip)
            ));
        }
    }
    let (ra, rb) = (a.our_routes(), b.our_routes());
    for c in &n.cidrs {
        let x = (ra.get(c.as_str()), a.nhids.get(c).map(pair));
        let y = (rb.get(c.as_str()), b.nhids.get(c).map(pair));
        if x != y {
            d.push(format!(
                "route {c} (gateway, nexthop's node and family): {x:?} here, {y:?} fresh"
            ));
        }
    }
    // The node's nexthops in each kernel: ours toward one of its addresses that carry one of its
    // routes, or no route of ours at all (a leftover). One that carries only other destinations'
    // routes is theirs: a held node's, kept from when the address (and even the ID) was its
    // own. A nexthop only a foreign route uses is kept for it, whoever it was for: history,
    // which a fresh kernel (where the foreign route could not be planted before the nexthop)
    // does not have. Each kernel leaves out its own such nexthops.
    let to_node = |s: &Snapshot| -> BTreeSet<(Option<(u16, Family)>, String)> {
        let carried = |id: &u32| -> Vec<&str> {
            s.nhids
                .iter()
                .filter(|(_, via)| *via == id)
                .map(|(dst, _)| dst.as_str())
                .collect()
        };
        let kept = |id: &u32| s.elsewhere.values().any(|u| u == id) && carried(id).is_empty();
        let its = |id: &u32| {
            let dsts = carried(id);
            dsts.is_empty() || dsts.iter().any(|d| n.cidrs.iter().any(|c| c == d))
        };
        s.our_nexthops()
            .into_iter()
            .filter(|(id, gw)| n.ips.iter().any(|ip| ip == gw) && its(id) && !kept(id))
            .map(|(id, gw)| (pair(&id), gw.to_owned()))
            .collect()
    };
    if to_node(a) != to_node(b) {
        d.push(format!(
            "nexthops (node and family, gateway): {:?} here, {:?} fresh",
            to_node(a),
            to_node(b)
        ));
    }
    // Its xfrm states and policies, under the ID each side gave it (the caller holds the two
    // IDs equal).
    let xfrm = |s: &'_ Snapshot| {
        let id = n.ips.first().and_then(|ip| s.map.get(ip));
        id.and_then(|id| s.xfrm.get(id))
            .cloned()
            .unwrap_or_default()
    };
    if xfrm(a) != xfrm(b) {
        d.push(format!(
            "xfrm states and policies: {:?} here, {:?} fresh",
            xfrm(a),
            xfrm(b)
        ));
    }
    d
}

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
//! * **unsynced**: a run whose source never completed a list deletes nothing of ours, and
//!   its record keeps every node ([`unsynced_lost`]);
//! * **held**: a listed node that is malformed or has no addresses keeps the map entries and
//!   routes its record lists, even through a killed run ([`held_lost`]);
//! * **programmed**: after a run that finished, every clean node has all its objects under one
//!   ID of its own (nodes waiting for an ID at the edge of the ID space excepted);
//! * **brake**: no removal past `--max-prune-ratio`, counting the window, unless forced;
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

use std::collections::{BTreeMap, BTreeSet};

use state::node::Family;
use state::objects::{KernelObject, NexthopId, NodeId};

use crate::agent::{AgentEnv, TestNode, local_node, node_routes};

use super::model::slot_cidr4;

/// What the kernel holds: our map entries, every route of the main table, every nexthop, and
/// the routes of table 100 (where the checker plants foreign routes through our nexthops).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Address -> node ID.
    pub map: BTreeMap<String, u16>,
    /// Destination -> (gateway, protocol).
    pub routes: BTreeMap<String, (String, String)>,
    /// ID -> (gateway, protocol).
    pub nexthops: BTreeMap<u32, (String, String)>,
    /// Routes of the main table through a nexthop: destination -> nexthop ID.
    pub nhids: BTreeMap<String, u32>,
    /// Table 100's routes through a nexthop (all foreign): destination -> nexthop ID.
    pub elsewhere: BTreeMap<String, u32>,
    /// Our xfrm states and policies by the node ID their mark carries, each as a line naming
    /// what the kernel keys and holds (endpoints, SPI on the wire, key tag, selector).
    pub xfrm: BTreeMap<u16, BTreeSet<String>>,
}

/// Our xfrm objects in this namespace, read with the agent's own parser, by node ID; none on a
/// kernel without xfrm netlink (where only the profiles without IPsec run, and the IPsec
/// profile's convergence check would miss the objects it requires).
fn xfrm() -> BTreeMap<u16, BTreeSet<String>> {
    use node_agent::backends::xfrm::{KeyBook, XfrmBackend};
    let dumped = crate::runtime().block_on(async {
        let x = XfrmBackend::new(KeyBook::default()).ok()?;
        let states = x.dump_states().await.ok()?;
        let policies = x.dump_policies().await.ok()?;
        Some((states, policies.policies))
    });
    let Some((states, policies)) = dumped else {
        return BTreeMap::new();
    };
    let mut out: BTreeMap<u16, BTreeSet<String>> = BTreeMap::new();
    let objects = (states.into_iter().map(KernelObject::XfrmState))
        .chain(policies.into_iter().map(KernelObject::XfrmPolicy));
    for o in objects {
        if let Some(id) = o.node_id() {
            out.entry(id.get()).or_default().insert(o.to_string());
        }
    }
    out
}

/// The table the checker plants foreign routes through our nexthops in.
pub const FOREIGN_TABLE: &str = "100";

/// The first ID of node `id`'s nexthop of a family, as the agent numbers them.
pub fn nexthop_id(id: u16, v6: bool) -> u32 {
    let family = if v6 { Family::V6 } else { Family::V4 };
    NexthopId::of(NodeId::new(id).expect("a remote node's ID"), family).0
}

fn ours(protocol: &str) -> bool {
    protocol == "201" || protocol == "node-agent"
}

impl Snapshot {
    pub fn take(env: &AgentEnv) -> Self {
        let pin = node_agent::datapath::node_ids_pin(&env.bpffs);
        let map = if pin.exists() {
            env.map()
        } else {
            BTreeMap::new()
        };
        Self {
            map,
            routes: env.all_routes(),
            nexthops: env.nexthops(),
            nhids: env.routes_through_nexthops("main"),
            elsewhere: env.routes_through_nexthops(FOREIGN_TABLE),
            xfrm: xfrm(),
        }
    }

    /// The same kernel with the foreign objects as they are now: planting them is someone
    /// else's change, not the agent's.
    pub fn with_foreign_of(self, env: &AgentEnv) -> Self {
        Self {
            routes: env.all_routes(),
            nexthops: env.nexthops(),
            elsewhere: env.routes_through_nexthops(FOREIGN_TABLE),
            ..self
        }
    }

    /// Our nexthops: ID -> gateway.
    pub fn our_nexthops(&self) -> BTreeMap<u32, &str> {
        self.nexthops
            .iter()
            .filter(|(_, (_, p))| ours(p))
            .map(|(id, (g, _))| (*id, g.as_str()))
            .collect()
    }

    pub fn foreign_nexthops(&self) -> BTreeMap<&u32, &(String, String)> {
        self.nexthops
            .iter()
            .filter(|(_, (_, p))| !ours(p))
            .collect()
    }

    /// Whether foreign nexthops keep node `id`'s routes of a family from being written: they
    /// hold both IDs of the node's pair (with one free or ours, the agent uses that one).
    pub fn nexthop_taken(&self, id: u16, v6: bool) -> bool {
        let family = if v6 { Family::V6 } else { Family::V4 };
        let node = NodeId::new(id).expect("a remote node's ID");
        [false, true].into_iter().all(|second| {
            self.nexthops
                .get(&NexthopId::of_pair(node, family, second).0)
                .is_some_and(|(_, p)| !ours(p))
        })
    }

    /// Our nexthops that no route uses, or that routes of ours use though the map gives their
    /// gateway another node ID than the nexthop's. (A nexthop only a foreign route uses is
    /// kept whoever it was for.)
    pub fn astray_nexthops(&self) -> Vec<u32> {
        let ours: BTreeSet<u32> = self
            .nhids
            .iter()
            .filter(|(d, _)| self.our_routes().contains_key(d.as_str()))
            .map(|(_, id)| *id)
            .collect();
        let theirs: BTreeSet<u32> = self.elsewhere.values().copied().collect();
        self.our_nexthops()
            .into_iter()
            .filter(|(id, gw)| {
                let node = NexthopId(*id).decode().map(|(n, _)| n.get());
                match (ours.contains(id), theirs.contains(id)) {
                    (false, false) => true,
                    (true, _) => self.map.get(*gw).copied() != node,
                    (false, true) => false,
                }
            })
            .map(|(id, _)| id)
            .collect()
    }

    pub fn our_routes(&self) -> BTreeMap<&str, &str> {
        self.routes
            .iter()
            .filter(|(_, (_, p))| ours(p))
            .map(|(d, (g, _))| (d.as_str(), g.as_str()))
            .collect()
    }

    pub fn foreign_routes(&self) -> BTreeMap<&String, &(String, String)> {
        self.routes.iter().filter(|(_, (_, p))| !ours(p)).collect()
    }

    /// How many objects of ours there are.
    pub fn objects(&self) -> usize {
        self.map.len() + self.our_routes().len() + self.our_nexthops().len()
    }
}

/// One node of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recorded {
    pub name: String,
    pub uid: String,
    pub ips: Vec<String>,
    pub cidrs: Vec<String>,
    pub id: Option<u16>,
    /// Cleanups tried and failed (a pending delete); 0 otherwise.
    pub attempts: u64,
}

impl Recorded {
    fn resources(&self) -> impl Iterator<Item = &String> {
        self.ips.iter().chain(&self.cidrs)
    }
}

/// The checkpoint as `node-agent state show --output json` prints it; `None` when there is none
/// (or it does not decode).
pub fn record(env: &AgentEnv) -> Option<Vec<Recorded>> {
    let (code, out, _) = env.cli(&["state", "show", "--output", "json"]);
    if code != 0 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    let node = |n: &serde_json::Value, attempts: u64| Recorded {
        name: n["name"].as_str().unwrap_or_default().to_owned(),
        uid: n["uid"].as_str().unwrap_or_default().to_owned(),
        ips: n["addresses"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x["ip"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default(),
        cidrs: n["pod_cidrs"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default(),
        id: n["node_id"].as_u64().map(|i| i as u16),
        attempts,
    };
    let mut out: Vec<Recorded> = v["nodes"].as_array()?.iter().map(|n| node(n, 0)).collect();
    out.extend(
        v["pending_deletes"]
            .as_array()?
            .iter()
            .map(|p| node(&p["node"], p["attempts"].as_u64().unwrap_or(0))),
    );
    Some(out)
}

/// Whether the agent takes `n` as it is: addresses that parse, and every address and pod CIDR
/// past the address policy (a node it refuses is malformed, and keeps what it had).
pub fn is_valid(n: &TestNode) -> bool {
    use state::address_policy::{judge_ip, judge_net};
    !n.ips.is_empty()
        && n.ips.iter().all(|ip| {
            ip.parse::<std::net::IpAddr>()
                .is_ok_and(|ip| judge_ip(ip.to_canonical()).is_ok())
        })
        && n.cidrs.iter().all(|c| {
            c.parse::<ipnet::IpNet>()
                .is_ok_and(|c| c.trunc() == c && judge_net(c).is_ok())
        })
}

fn same_node(r: &Recorded, n: &TestNode) -> bool {
    r.name == n.name && r.uid == n.uid()
}

/// The nodes of `list` that nothing may hold back: valid, with addresses, claiming nothing that
/// another listed node (the local node included, held nodes by their record), or a recorded
/// node that is no longer listed, claims. Whatever the brake, the incumbency rules or a restart
/// do, these must be programmed. `rested` are the nodes a daemon programmed before it was shown
/// `list` (the last step's clean nodes, for a daemon that came to rest on the last list first):
/// they are in its record by then, and one no longer listed claims what it had, as a recorded
/// one does.
pub fn clean<'a>(
    list: &'a [TestNode],
    record: Option<&'a [Recorded]>,
    rested: &'a [TestNode],
) -> Vec<&'a TestNode> {
    let record = record.unwrap_or_default();
    let mut claims: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    let mut claim = |r: &'a str, who: &'a str| {
        claims.entry(r).or_default().insert(who);
    };
    for n in list {
        for r in n.ips.iter().chain(&n.cidrs) {
            claim(r, &n.name);
        }
        // A held node keeps its own record's claims: the record of its name and UID, not of
        // another node that had the name (one replaced under it, or another cluster's).
        if !is_valid(n)
            && let Some(rec) = record.iter().find(|r| same_node(r, n))
        {
            for r in rec.resources() {
                claim(r, &n.name);
            }
        }
    }
    for rec in record {
        if !list.iter().any(|n| same_node(rec, n)) {
            for r in rec.resources() {
                claim(r, "(a recorded node no longer listed)");
            }
        }
    }
    for n in rested {
        if !list.iter().any(|l| l.name == n.name && l.uid() == n.uid()) {
            for r in n.ips.iter().chain(&n.cidrs) {
                claim(r, "(a node programmed before the list, no longer listed)");
            }
        }
    }
    let local = local_node();
    list.iter()
        .filter(|n| n.name != local.name && is_valid(n))
        .filter(|n| {
            n.ips
                .iter()
                .chain(&n.cidrs)
                .all(|r| claims.get(r.as_str()).is_none_or(|who| who.len() == 1))
        })
        .collect()
}

/// Whether a map entry carrying `id` at one of `n`'s addresses is `n`'s own. A node's ID is the
/// one its record gives it; a node without a record (one a killed agent programmed but never
/// recorded) owns an entry unless another recorded node's ID is on it. An entry that is not the
/// node's is a leftover at an address the node took over (a recycled IP whose previous owner was
/// never cleaned up because the agent was killed first), and the agent rightly rewrites it under
/// the node's own ID (invariant 5: an ID belongs to a node, not to an address).
fn is_nodes_entry(record: Option<&[Recorded]>, n: &TestNode, id: u16) -> bool {
    let record = record.unwrap_or_default();
    match record.iter().find(|r| same_node(r, n)).and_then(|r| r.id) {
        Some(own) => own == id,
        None => !record.iter().any(|r| r.id == Some(id) && !same_node(r, n)),
    }
}

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

/// What a run whose source never completed a list deleted or changed (invariant 1): every
/// object of ours in the kernel before it (map entries, routes, nexthops, xfrm objects) is there
/// after it as it was, and every recorded node's row is as it was (the record may gain nothing
/// either: with no list there is nothing to add).
fn unsynced_lost(f: &StepFacts<'_>) -> Vec<String> {
    if !f.unsynced {
        return Vec::new();
    }
    let mut v = Vec::new();
    let mut changed = |what: &str, lost: Vec<String>| {
        if !lost.is_empty() {
            v.push(format!(
                "before any full list, {what} went or changed: {}",
                lost.join(", ")
            ));
        }
    };
    fn lost<K: Ord + std::fmt::Debug, V: PartialEq + std::fmt::Debug>(
        before: &BTreeMap<K, V>,
        after: &BTreeMap<K, V>,
    ) -> Vec<String> {
        (before.iter())
            .filter(|(k, v)| after.get(*k) != Some(*v))
            .map(|(k, v)| format!("{k:?} -> {v:?}"))
            .collect()
    }
    let (before, after) = (f.before, f.after);
    changed("map entries", lost(&before.map, &after.map));
    changed("routes", lost(&before.our_routes(), &after.our_routes()));
    changed(
        "nexthops",
        lost(&before.our_nexthops(), &after.our_nexthops()),
    );
    changed("xfrm objects", lost(&before.xfrm, &after.xfrm));
    let rows = |r: Option<&[Recorded]>| -> BTreeSet<String> {
        r.unwrap_or_default()
            .iter()
            .map(|r| format!("{r:?}"))
            .collect()
    };
    let (was, is) = (rows(f.record_before), rows(f.record_after));
    changed(
        "recorded nodes",
        was.symmetric_difference(&is).cloned().collect(),
    );
    v
}

/// What held nodes lost (invariant 8): a listed node that is malformed or has no addresses keeps
/// the map entries and routes its record lists, as the kernel held them when the list reached
/// the agent, whatever the run did (a kill included). Left aside: what the local node claims
/// now (it keeps its own), routes whose nexthop ID something foreign took, nodes a resting
/// daemon programmed anew before the list, and runs without the record (lost) or forced.
fn held_lost(f: &StepFacts<'_>) -> Vec<String> {
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

impl<'a> StepFacts<'a> {
    /// The record the agent started the step with.
    fn agent_record(&self) -> Option<&'a [Recorded]> {
        self.record_before.filter(|_| !self.record_lost)
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
    if f.no_local && (f.shown.map != f.after.map || f.shown.our_routes() != f.after.our_routes()) {
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
                (
                    beyond + removed.unnamed.saturating_sub(left.len()),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Objects a restarted daemon recorded at rest are not orphans when the step's list moves
    /// their node. Seed 1795920953637136484 (history 78 of seed 1795920953637136406,
    /// event-sized, brake on): n006 was killed half-programmed before any checkpoint; the next
    /// step's daemon finished it at rest on the last list, then saw it readdressed and removed
    /// its old map entry and route as a changed node's. With no checkpoint before the step, the
    /// oracle had counted the two as orphans swept past the brake. A real orphan beside them
    /// still counts.
    #[test]
    fn a_node_recorded_at_rest_leaves_no_orphans_behind() {
        let node = |ip: &str, cidr: &str| TestNode {
            name: "n006".into(),
            ips: vec![ip.into()],
            cidrs: vec![cidr.into()],
            uid: Some("n006-1".into()),
            ..TestNode::default()
        };
        let before = Snapshot {
            map: BTreeMap::from([("10.88.7.13".to_owned(), 1)]),
            routes: BTreeMap::from([("10.130.10.0/24".to_owned(), toward("10.88.7.13"))]),
            ..Snapshot::default()
        };
        let after = Snapshot {
            map: BTreeMap::from([("10.88.7.18".to_owned(), 1)]),
            routes: BTreeMap::from([("10.130.12.0/24".to_owned(), toward("10.88.7.18"))]),
            ..Snapshot::default()
        };
        let list = [node("10.88.7.18", "10.130.12.0/24")];
        let rested = [node("10.88.7.13", "10.130.10.0/24")];
        let waiting = BTreeSet::new();
        let facts = |rested| StepFacts {
            rested,
            event_sized: true,
            ..step(&list, &before, &after, &waiting)
        };
        assert_eq!(removals(&facts(&rested)).1, 0);
        // Without a record at all, the two are orphans.
        assert_eq!(removals(&facts(&[])).1, 2);
        // A real orphan beside the rested node is still counted.
        let mut before = before.clone();
        before.map.insert("10.88.9.9".to_owned(), 7);
        let with_orphan = StepFacts {
            before: &before,
            shown: &before,
            ..facts(&rested)
        };
        assert_eq!(removals(&with_orphan).1, 1);
    }

    /// A full-list step of `list` that finished, from `before` to `after`, with no record and
    /// nothing else going on: each test sets what it needs.
    fn step<'a>(
        list: &'a [TestNode],
        before: &'a Snapshot,
        after: &'a Snapshot,
        waiting: &'a BTreeSet<String>,
    ) -> StepFacts<'a> {
        StepFacts {
            list,
            previous_clean: &[],
            record_before: None,
            record_after: None,
            record_lost: false,
            before,
            shown: before,
            rested: &[],
            after,
            exit: Some(0),
            forced: false,
            confirmed: None,
            event_sized: false,
            no_local: false,
            unsynced: false,
            foreign_slots: &[],
            window: (0, 0),
            max_ratio: 0.5,
            nexthops: false,
            waiting,
        }
    }

    /// A route or nexthop of ours (the agent's protocol) toward `gw`, as a snapshot holds it.
    fn toward(gw: &str) -> (String, String) {
        (gw.to_owned(), "201".to_owned())
    }

    /// Adds to `s` a route of ours to `dst` through our nexthop `nhid` toward `gw`.
    fn route_via(s: &mut Snapshot, dst: &str, gw: &str, nhid: u32) {
        s.routes.insert(dst.to_owned(), toward(gw));
        s.nexthops.insert(nhid, toward(gw));
        s.nhids.insert(dst.to_owned(), nhid);
    }

    /// A node's nexthops are those that carry its routes, or none. Seed 1795920953634136549
    /// (history 143 of seed 1795920953634136406): after a lost checkpoint, a node with no
    /// addresses (held while it registers) kept its route and its nexthop toward an address
    /// n001 holds now; a fresh agent, with no record of the held node, has neither. The held
    /// node's nexthop is not n001's, even under n001's own ID.
    #[test]
    fn a_nodes_nexthops_are_those_that_carry_its_routes() {
        let n = TestNode {
            name: "n001".into(),
            ips: vec!["10.88.7.10".into()],
            cidrs: vec!["10.130.10.0/24".into()],
            ..TestNode::default()
        };
        let mut fresh = Snapshot {
            map: BTreeMap::from([("10.88.7.10".to_owned(), 4)]),
            ..Snapshot::default()
        };
        route_via(
            &mut fresh,
            "10.130.10.0/24",
            "10.88.7.10",
            nexthop_id(4, false),
        );
        let mut here = fresh.clone();
        route_via(
            &mut here,
            "10.130.7.0/24",
            "10.88.7.10",
            nexthop_id(3, false),
        );
        assert_eq!(node_difference(&n, &here, &fresh), Vec::<String>::new());
        // Its own nexthop missing is a difference.
        let mut lacking = fresh.clone();
        lacking.nexthops.remove(&nexthop_id(4, false));
        assert_eq!(node_difference(&n, &here, &lacking).len(), 1);
        // Another destination's route through a nexthop under the node's own ID (a held node's,
        // from when the ID was its own, after a lost checkpoint: seed 1795920953632136446) is
        // that destination's node's.
        let mut shared = fresh.clone();
        shared.nexthops.remove(&nexthop_id(4, false));
        shared.nhids.remove("10.130.10.0/24");
        shared.routes.remove("10.130.10.0/24");
        let mut held = shared.clone();
        route_via(
            &mut held,
            "10.130.13.0/24",
            "10.88.7.10",
            nexthop_id(4, false),
        );
        assert_eq!(node_difference(&n, &held, &shared), Vec::<String>::new());
        // A leftover toward its address under another ID, carrying nothing, is one too.
        let mut leftover = fresh.clone();
        leftover
            .nexthops
            .insert(nexthop_id(3, false), toward("10.88.7.10"));
        assert_eq!(node_difference(&n, &leftover, &fresh).len(), 1);
    }

    /// A node a restarted daemon programmed on the last list, then saw removed, claims what it
    /// had. Seed 1795920953633136419 (history 13 of seed 1795920953633136406, event-sized): a
    /// daemon killed while readdressing n007 to 10.88.7.18 was started again on that list and
    /// finished it; the next list gave 10.88.7.18 to n004 and dropped every other node, the
    /// brake held the wipe, and n007 kept its address. The agent held n004 back, rightly; the
    /// oracle, which knew only the record from before the restart, had called n004 clean.
    #[test]
    fn a_node_programmed_before_the_list_claims_what_it_had() {
        let node = |name: &str, ip: &str, cidr: &str| TestNode {
            name: name.into(),
            ips: vec![ip.into()],
            cidrs: vec![cidr.into()],
            ..TestNode::default()
        };
        let list = [node("n004", "10.88.7.18", "10.130.7.0/24")];
        let rested = [node("n007", "10.88.7.18", "10.130.6.0/24")];
        assert!(clean(&list, None, &rested).is_empty());
        assert_eq!(clean(&list, None, &[]).len(), 1);
        // Still listed, it claims only what the list gives it.
        let both = [list[0].clone(), node("n007", "10.88.7.19", "10.130.6.0/24")];
        assert_eq!(clean(&both, None, &rested).len(), 2);
    }

    /// Each kernel is judged by its own foreign routes. Seed 1795920953631136453 (history 47 of
    /// seed 1795920953631136406): a node readdressed while a foreign route used its IPv4
    /// nexthop; the agent kept that nexthop for its user and gave the node its other IPv4 ID,
    /// while a fresh kernel (no foreign route) holds the node's nexthop at the first ID. The
    /// agent's kernel is right; the oracle had left out every nexthop at an ID a foreign route
    /// used in either kernel, so the fresh kernel's live one too.
    #[test]
    fn each_kernel_is_judged_by_its_own_foreign_routes() {
        let n = TestNode {
            name: "n004".into(),
            ips: vec!["10.88.7.18".into(), "fd00:88::7:12".into()],
            cidrs: vec!["10.130.5.0/24".into(), "fd00:130:5::/64".into()],
            ..TestNode::default()
        };
        let (v4, v4_other, v6) = (nexthop_id(1, false), 201_500_001, nexthop_id(1, true));
        assert_eq!(
            NexthopId(v4_other).decode().map(|(id, f)| (id.get(), f)),
            Some((1, Family::V4))
        );
        let routes = BTreeMap::from([
            ("10.130.5.0/24".to_owned(), toward("10.88.7.18")),
            ("fd00:130:5::/64".to_owned(), toward("fd00:88::7:12")),
        ]);
        let map = BTreeMap::from([
            ("10.88.7.18".to_owned(), 1),
            ("fd00:88::7:12".to_owned(), 1),
        ]);
        let here = Snapshot {
            map: map.clone(),
            routes: routes.clone(),
            nexthops: BTreeMap::from([
                (v4, toward("10.88.7.20")),
                (v4_other, toward("10.88.7.18")),
                (v6, toward("fd00:88::7:12")),
            ]),
            nhids: BTreeMap::from([
                ("10.130.5.0/24".to_owned(), v4_other),
                ("fd00:130:5::/64".to_owned(), v6),
            ]),
            elsewhere: BTreeMap::from([("10.130.1.0/24".to_owned(), v4)]),
            ..Snapshot::default()
        };
        let fresh = Snapshot {
            map,
            routes,
            nexthops: BTreeMap::from([(v4, toward("10.88.7.18")), (v6, toward("fd00:88::7:12"))]),
            nhids: BTreeMap::from([
                ("10.130.5.0/24".to_owned(), v4),
                ("fd00:130:5::/64".to_owned(), v6),
            ]),
            ..Snapshot::default()
        };
        assert_eq!(node_difference(&n, &here, &fresh), Vec::<String>::new());
        // Without its IPv4 nexthop, the fresh kernel differs.
        let mut lacking = fresh.clone();
        lacking.nexthops.remove(&v4);
        assert_eq!(node_difference(&n, &here, &lacking).len(), 1);
        // A live nexthop a foreign route uses too (the step before the readdress) is compared:
        // the fresh kernel, where no foreign route could use it, has it alike.
        let mut shared = fresh.clone();
        shared.elsewhere = BTreeMap::from([("10.130.1.0/24".to_owned(), v4)]);
        assert_eq!(node_difference(&n, &shared, &fresh), Vec::<String>::new());
        assert_eq!(node_difference(&n, &shared, &lacking).len(), 1);
    }

    /// A held node keeps what its record lists (invariant 8): a node listed without addresses
    /// whose entry and route went is a violation; the same with the record lost, or for a node
    /// a resting daemon programmed anew, is not judged.
    #[test]
    fn a_held_node_keeps_what_its_record_lists() {
        let held = TestNode {
            name: "n003".into(),
            ..TestNode::default()
        };
        let rec = Recorded {
            name: "n003".into(),
            uid: held.uid(),
            ips: vec!["10.88.7.13".into()],
            cidrs: vec!["10.130.3.0/24".into()],
            id: Some(3),
            attempts: 0,
        };
        let had = Snapshot {
            map: BTreeMap::from([("10.88.7.13".to_owned(), 3)]),
            routes: BTreeMap::from([("10.130.3.0/24".to_owned(), toward("10.88.7.13"))]),
            ..Snapshot::default()
        };
        let gone = Snapshot::default();
        let list = [held.clone()];
        let record = [rec];
        let waiting = BTreeSet::new();
        let facts = |after: &'static str| StepFacts {
            record_before: Some(&record),
            ..step(
                &list,
                &had,
                if after == "had" { &had } else { &gone },
                &waiting,
            )
        };
        assert!(held_lost(&facts("had")).is_empty());
        assert_eq!(
            held_lost(&facts("gone")).len(),
            2,
            "{:?}",
            held_lost(&facts("gone"))
        );
        let lost = StepFacts {
            record_lost: true,
            ..facts("gone")
        };
        assert!(held_lost(&lost).is_empty());
        let rested = [held.clone()];
        let anew = StepFacts {
            rested: &rested,
            ..facts("gone")
        };
        assert!(held_lost(&anew).is_empty());
        // Seed 179598179593651, history 57: event-sized, the last list (without the local node)
        // readdressed it; the events of this one pass through that version before it loses its
        // addresses, and the daemon rightly programs it there first.
        let readdressed = [TestNode {
            ips: vec!["10.88.7.18".into()],
            cidrs: vec!["10.130.11.0/24".into()],
            ..held.clone()
        }];
        let through = StepFacts {
            previous_clean: &readdressed,
            event_sized: true,
            ..facts("gone")
        };
        assert!(held_lost(&through).is_empty());
        // Listed last time as recorded, it has nothing to pass through.
        let as_recorded = [TestNode {
            ips: vec!["10.88.7.13".into()],
            cidrs: vec!["10.130.3.0/24".into()],
            ..held
        }];
        let same = StepFacts {
            previous_clean: &as_recorded,
            event_sized: true,
            ..facts("gone")
        };
        assert_eq!(held_lost(&same).len(), 2);
    }

    /// Before a first full list, each kind of object of ours that goes or changes (and a
    /// recorded node the record forgets) is a violation; objects added, and a run that did
    /// sync, are not.
    #[test]
    fn an_unsynced_run_deletes_nothing_of_ours_and_forgets_no_node() {
        let mut had = Snapshot {
            map: BTreeMap::from([("10.88.7.13".to_owned(), 3)]),
            routes: BTreeMap::from([("10.130.3.0/24".to_owned(), toward("10.88.7.13"))]),
            nexthops: BTreeMap::from([(nexthop_id(3, false), toward("10.88.7.13"))]),
            ..Snapshot::default()
        };
        had.xfrm
            .insert(3, BTreeSet::from(["policy out 10.130.3.0/24".to_owned()]));
        let rec = Recorded {
            name: "n003".into(),
            uid: "uid-n003".into(),
            ips: vec!["10.88.7.13".into()],
            cidrs: vec!["10.130.3.0/24".into()],
            id: Some(3),
            attempts: 0,
        };
        let record = [rec];
        let waiting = BTreeSet::new();
        let judge = |after: &Snapshot, record_after: Option<&[Recorded]>, unsynced: bool| {
            unsynced_lost(&StepFacts {
                record_before: Some(&record),
                record_after,
                exit: None,
                unsynced,
                ..step(&[], &had, after, &waiting)
            })
        };
        assert!(judge(&had, Some(&record), true).is_empty());
        let mut more = had.clone();
        more.map.insert("10.88.7.14".into(), 4);
        assert!(
            judge(&more, Some(&record), true).is_empty(),
            "adds are not deletes"
        );
        let without = |what: &str| {
            let mut s = had.clone();
            match what {
                "map" => s.map.clear(),
                "route" => s.routes.clear(),
                "nexthop" => s.nexthops.clear(),
                _ => s.xfrm.clear(),
            }
            s
        };
        let mut walked = Vec::new();
        for what in ["map", "route", "nexthop", "xfrm"] {
            let broke = judge(&without(what), Some(&record), true);
            assert_eq!(broke.len(), 1, "{what}: {broke:?}");
            assert!(judge(&without(what), Some(&record), false).is_empty());
            walked.push(what);
        }
        let mut rewritten = had.clone();
        rewritten.map.insert("10.88.7.13".into(), 9);
        assert_eq!(
            judge(&rewritten, Some(&record), true).len(),
            1,
            "an ID rewritten"
        );
        assert_eq!(judge(&had, Some(&[]), true).len(), 1, "a forgotten node");
        assert_eq!(judge(&had, None, true).len(), 1, "a lost record");
        println!(
            "unsynced oracle: each of {} gone, and the record's node",
            walked.join(" ")
        );
    }

    /// Past the brake, a confirmed hold's own nodes may go and nothing else: four of five
    /// known nodes removed breaks the brake unless the confirmation covers enough of them.
    #[test]
    fn a_confirmation_releases_its_own_removals_and_no_others() {
        let names = ["a", "b", "c", "d", "e"];
        let ip = |i: usize| format!("10.88.7.{}", i + 1);
        let record: Vec<Recorded> = (names.iter().enumerate())
            .map(|(i, n)| Recorded {
                name: (*n).into(),
                uid: format!("uid-{n}"),
                ips: vec![ip(i)],
                cidrs: vec![format!("10.130.{i}.0/24")],
                id: Some(i as u16 + 1),
                attempts: 0,
            })
            .collect();
        let before = Snapshot {
            map: (0..5).map(|i| (ip(i), i as u16 + 1)).collect(),
            ..Snapshot::default()
        };
        let after = Snapshot {
            map: BTreeMap::from([(ip(0), 1)]),
            ..Snapshot::default()
        };
        let list = [TestNode {
            name: "a".into(),
            ips: vec![ip(0)],
            cidrs: vec!["10.130.0.0/24".into()],
            ..TestNode::default()
        }];
        let waiting = BTreeSet::new();
        let brake = |confirmed: Option<&Confirmed>| {
            violations(&StepFacts {
                record_before: Some(&record),
                confirmed,
                ..step(&list, &before, &after, &waiting)
            })
            .into_iter()
            .filter(|v| v.contains("past the brake"))
            .count()
        };
        let hold = |nodes: &[&str]| Confirmed {
            nodes: nodes.iter().map(|n| (*n).to_owned()).collect(),
            orphans: 0,
        };
        assert_eq!(brake(None), 1, "4 of 5 removed without a confirmation");
        assert_eq!(brake(Some(&hold(&["b", "c", "d", "e"]))), 0);
        assert_eq!(brake(Some(&hold(&["b", "c"]))), 0, "2 of 5 more: within");
        assert_eq!(brake(Some(&hold(&["b"]))), 1, "3 of 5 beyond the hold");
        assert_eq!(brake(Some(&hold(&["x", "y"]))), 1, "another hold's nodes");
        // Seed 7, history 1, step 23: a hold of nodes the step's record does not show (a
        // resting daemon programmed them) covers as many nodes only the map tells of.
        let unrecorded = Snapshot {
            map: (0..5)
                .map(|i| (ip(i), i as u16 + 1))
                .chain([("10.88.9.1".into(), 21), ("10.88.9.2".into(), 22)])
                .collect(),
            ..Snapshot::default()
        };
        let with_two_more = |hold: &Confirmed| {
            violations(&StepFacts {
                record_before: Some(&record),
                confirmed: Some(hold),
                ..step(&list, &unrecorded, &after, &waiting)
            })
            .into_iter()
            .filter(|v| v.contains("past the brake"))
            .count()
        };
        assert_eq!(
            with_two_more(&hold(&["b", "c", "x", "y"])),
            0,
            "2 of 7 beyond"
        );
        assert_eq!(
            with_two_more(&hold(&["b", "c"])),
            1,
            "4 of 7 beyond the hold"
        );
    }
}

//! The agent's record as a user reads it (`node-agent state show`), and which listed nodes are
//! clean: valid, claiming nothing another claims.

use std::collections::{BTreeMap, BTreeSet};

use crate::agent::{AgentEnv, TestNode, local_node};

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

pub(super) fn same_node(r: &Recorded, n: &TestNode) -> bool {
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
pub(super) fn is_nodes_entry(record: Option<&[Recorded]>, n: &TestNode, id: u16) -> bool {
    let record = record.unwrap_or_default();
    match record.iter().find(|r| same_node(r, n)).and_then(|r| r.id) {
        Some(own) => own == id,
        None => !record.iter().any(|r| r.id == Some(id) && !same_node(r, n)),
    }
}

//! What the checker reads of the kernel: our map entries, routes, nexthops and xfrm objects, and
//! the foreign objects beside them.

use std::collections::{BTreeMap, BTreeSet};

use state::node::Family;
use state::objects::{KernelObject, NexthopId, NodeId};

use crate::agent::AgentEnv;

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

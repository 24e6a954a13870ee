//! The xfrm floor of the IPsec benchmark: iproute2 writing, with `ip -batch` (one request at a
//! time, in one process), the states and policies the agent writes for a cluster under a
//! per-sender key: the planner's own objects ([`state::plan::desired_objects`]), written as the
//! agent's messages ask ([`node_agent_tests::ip_xfrm`]); in a kernel that holds the cluster's
//! routes, as the agent's does. That matters: every IPv6 policy the kernel adds or deletes makes
//! it walk the whole IPv6 routing table (the xfrm change bumps the IPv6 route generation, and
//! the FIB's serial numbers are updated route by route), so an IPv6 policy costs time in
//! proportion to the IPv6 routes there are. Measured in the guest: 270 µs per policy without
//! routes at 5,000 and 20,000 nodes; with the routes, 1.1 ms at 5,000 and 3.4 ms at 20,000
//! (IPv4 policies: 240 µs either way).
//!
//! Two figures: the cold start's (every node's objects into an empty SAD and SPD), and an
//! event's (a few more nodes' objects added to the full ones, readdressed, and deleted again, per
//! node), since what one write costs depends on what the kernel already holds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use node_agent_tests::agent::TestNode;
use node_agent_tests::{ip, ip_batch, ip_xfrm};
use state::node::{Node, RawNode};
use state::objects::{KernelObject, KeyTag, NodeId, SpiLayout};
use state::plan::desired::desired_objects;
use state::plan::{GlobalTags, IpsecConfig, KeyInUse, PlanConfig};

/// The link the cluster's routes go through while the floor runs (the benchmark's own).
const ROUTE_DEV: &str = "gw0";
/// The nodes an event's figure is measured over.
const EVENT_NODES: u32 = 50;

/// What the floor measured.
pub struct XfrmFloor {
    /// States and policies of the cold start.
    pub objects: usize,
    /// Adding them.
    pub add: Duration,
    /// One event's share at full size: the mean of a node added, a node readdressed (the lines
    /// the agent's backend writes for it, [`ip_xfrm::changes`]) and a node removed, each timed
    /// beside every other node's objects.
    pub event: Duration,
    /// Each kind's share per node (add, readdress, remove) and its `ip -batch` lines per node.
    pub kinds: [(&'static str, Duration, f64); 3],
}

impl XfrmFloor {
    /// Microseconds per object of the cold start.
    pub fn per_object_us(&self) -> f64 {
        self.add.as_secs_f64() * 1e6 / self.objects.max(1) as f64
    }

    /// Writes what the agent on `local` writes toward `nodes` under key `key` (`hex`, a global
    /// key in the per-sender layout), times it, times an event's share, and removes it all.
    pub fn measure(local: &TestNode, nodes: &[TestNode], key: u8, hex: &str) -> Self {
        let objects = Objects::new(local, key);
        let cluster = objects.of(nodes, 0);
        let routes = routes(nodes);
        ip_batch(&[], &routes);
        let t = Instant::now();
        ip_batch(&[], &ip_xfrm::adds(&cluster, hex));
        let add = t.elapsed();
        let (event, kinds) = Self::events(local, nodes, key, hex);
        ip(&["xfrm", "policy", "flush"]);
        ip(&["xfrm", "state", "flush"]);
        ip_batch(&[], &routes.replace("route add", "route del"));
        Self {
            objects: cluster.len(),
            add,
            event,
            kinds,
        }
    }

    /// An event's share: [`EVENT_NODES`] more nodes' states and policies added beside what the
    /// kernel holds, readdressed, and removed, each kind timed per node; their routes are there
    /// meanwhile. Works beside the floor's own objects of `nodes` or beside the agent's, which
    /// they never touch (other addresses, CIDRs and IDs).
    pub fn events(
        local: &TestNode,
        nodes: &[TestNode],
        key: u8,
        hex: &str,
    ) -> (Duration, [(&'static str, Duration, f64); 3]) {
        let objects = Objects::new(local, key);
        let n = u32::try_from(nodes.len()).unwrap();
        let named = |k: u32, i: u32| TestNode::wide(&format!("floor-event-{k}"), i);
        let extra: Vec<TestNode> = (0..EVENT_NODES).map(|k| named(k, 5 * n + k)).collect();
        // The same nodes under the same IDs, with new addresses and pod CIDRs.
        let moved: Vec<TestNode> = (0..EVENT_NODES).map(|k| named(k, 6 * n + k)).collect();
        // IDs past the cluster's and past those the benchmark's events add.
        let first_id = nodes.len() + 100;
        let (added, readdressed) = (objects.of(&extra, first_id), objects.of(&moved, first_id));
        let routes = routes(&[extra, moved].concat());
        ip_batch(&[], &routes);
        let timed = |batch: &str| {
            let t = Instant::now();
            ip_batch(&[], batch);
            t.elapsed()
        };
        // What starting `ip` costs (tens of milliseconds in an emulated guest) is no kernel
        // work: the least of three empty batches is taken off each batch below.
        let start = (0..3).map(|_| timed("")).min().unwrap_or_default();
        let batches = [
            ("add", ip_xfrm::adds(&added, hex)),
            ("readdress", ip_xfrm::changes(&added, &readdressed, hex)),
            ("remove", ip_xfrm::deletes(&readdressed)),
        ];
        let kinds = batches.map(|(kind, batch)| {
            let took = timed(&batch).saturating_sub(start) / EVENT_NODES;
            let lines = batch.lines().count() as f64 / f64::from(EVENT_NODES);
            (kind, took, lines)
        });
        ip_batch(&[], &routes.replace("route add", "route del"));
        let event = kinds.iter().map(|(_, took, _)| *took).sum::<Duration>() / 3;
        (event, kinds)
    }
}

/// The planner's xfrm objects for nodes, as the agent on `local` plans them under one key.
struct Objects(PlanConfig);

impl Objects {
    fn new(local: &TestNode, key: u8) -> Self {
        Self(PlanConfig {
            local_addresses: local.ips.iter().map(|a| a.parse().unwrap()).collect(),
            local_pod_cidrs: local.cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            ipsec: Some(IpsecConfig {
                send_spi: key,
                keys: vec![KeyInUse {
                    spi: key,
                    tag: KeyTag::default(),
                    layout: SpiLayout::PerSender,
                }],
                seen: Vec::new(),
                tags: Arc::new(GlobalTags),
            }),
            ..PlanConfig::default()
        })
    }

    /// The states and policies of `nodes` under IDs from `first_id + 1`, in the order the agent
    /// writes them: states, then the policies that select them.
    fn of(&self, nodes: &[TestNode], first_id: usize) -> Vec<KernelObject> {
        let mut out = Vec::new();
        for (i, t) in nodes.iter().enumerate() {
            let id = NodeId::new(u16::try_from((first_id + i) % 65_535 + 1).unwrap()).unwrap();
            desired_objects(
                &node(t),
                id,
                &self.0,
                &state::inventory::Inventory::new(),
                &mut out,
                &mut Vec::new(),
            );
        }
        out.retain(|o| ip_xfrm::delete(o).is_some());
        out.sort_by_key(|o| o.kind().rank());
        out
    }
}

/// A route through the benchmark's link to each pod CIDR of `nodes`.
fn routes(nodes: &[TestNode]) -> String {
    nodes
        .iter()
        .flat_map(|n| n.cidrs.iter())
        .map(|c| format!("route add {c} dev {ROUTE_DEV}\n"))
        .collect()
}

/// `t` as the planner sees a node.
fn node(t: &TestNode) -> Node {
    Node::from_raw(RawNode {
        name: t.name.clone(),
        uid: t.uid(),
        addresses: t.addresses().map(|(k, a)| (k.into(), a.into())).collect(),
        pod_cidrs: t.cidrs.clone(),
        boot_id: String::new(),
    })
    .expect("a valid test node")
}

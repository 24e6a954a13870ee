//! A cluster of N remote nodes, each with an IPv4 and an IPv6 InternalIP and two pod CIDRs, and
//! an agent converged on it: what the planner benchmark (`benches/plan.rs`) and the per-event
//! test (`tests/per_event.rs`) both start from, so that the figures the one prints and the
//! counts the other asserts are of the same cluster.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

use state::checkpoint::Checkpoint;
use state::inventory::Inventory;
use state::node::{AddressKind, Node, NodeAddress, RawNode};
use state::plan::{BrakeMemory, LiveView, PlanConfig, PlanInput, plan};

/// When the cluster is planned.
pub const NOW: Duration = Duration::from_secs(1_750_000_000);

/// Node `i`, with the addresses and pod CIDRs of `slot` (a readdressed node keeps its `i` and
/// takes another slot).
pub fn node(i: usize, slot: usize) -> Node {
    let v4 = Ipv4Addr::new(10, (slot >> 16) as u8 | 0x80, (slot >> 8) as u8, slot as u8);
    let v6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, (slot >> 16) as u16, slot as u16);
    Node {
        name: format!("ip-10-0-{}-{}.eu-west-1.compute.internal", i / 256, i % 256),
        uid: format!("{:08x}-1b2c-4d3e-8f40-{:012x}", i, i * 7919).into(),
        addresses: vec![
            NodeAddress {
                kind: AddressKind::InternalIP,
                ip: IpAddr::V4(v4),
            },
            NodeAddress {
                kind: AddressKind::InternalIP,
                ip: IpAddr::V6(v6),
            },
        ]
        .into(),
        pod_cidrs: vec![
            // A /26 each in 10.0.0.0/9: room for 131,072 slots.
            ipnet::Ipv4Net::new(Ipv4Addr::from(0x0a00_0000 + ((slot as u32) << 6)), 26)
                .unwrap()
                .into(),
            format!("fd01:{:x}:{:x}::/64", slot >> 16, slot & 0xffff)
                .parse()
                .unwrap(),
        ]
        .into(),
        boot_id: format!("{:08x}-aaaa-bbbb-cccc-{:012x}", i * 31, i).into(),
        node_id: None,
    }
}

/// The local node, outside every remote node's addresses.
pub fn local() -> Node {
    Node::from_raw(RawNode {
        name: "local".into(),
        uid: "uid-local".into(),
        addresses: vec![("InternalIP".into(), "192.168.0.1".into())],
        pod_cidrs: vec!["10.250.0.0/24".into()],
        boot_id: String::new(),
    })
    .expect("a valid node")
}

/// `nodes` and the local node, in name order, as the agent's views come (its live state is a
/// map by name).
pub fn view(mut nodes: Vec<Node>) -> LiveView {
    nodes.push(local());
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    LiveView {
        nodes: nodes.into_iter().map(Arc::new).collect(),
        malformed: Vec::new(),
        synced: true,
        relists: 1,
    }
}

pub fn config() -> PlanConfig {
    PlanConfig {
        local_node: "local".into(),
        local_addresses: vec!["192.168.0.1".parse().unwrap()],
        agent_version: "bench".into(),
        // The agent's default for a new map: a dual-stack cluster of 65,536 nodes.
        map_capacity: 131_072,
        // No ID cool-down: at 65,000 nodes only 535 never-used IDs remain and the churn's new
        // nodes would be held for want of one (the ID space's edge, benchmarked on its own).
        id_cooldown: Duration::ZERO,
        ..PlanConfig::default()
    }
}

/// The record and the kernel an agent leaves once it has converged on `live`, starting from
/// `record` and `inventory`: plans applied until one plans nothing (new nodes that found no
/// free ID get the IDs the plan before freed).
pub fn converge(
    mut record: Option<Checkpoint>,
    mut inventory: Inventory,
    live: &LiveView,
    config: &PlanConfig,
    now: Duration,
) -> (Checkpoint, Inventory) {
    let brake = BrakeMemory::default();
    for _ in 0..4 {
        let p = plan(&PlanInput {
            record: record.as_ref(),
            live,
            inventory: &inventory,
            allocator: &record.as_ref().map(|r| r.ids.clone()).unwrap_or_default(),
            brake: &brake,
            confirmed_hold: None,
            now,
            config,
        });
        let done = p.ops().is_empty() && record.is_some();
        for op in p.ops() {
            inventory.apply(&op);
        }
        record = Some(p.checkpoint);
        if done {
            return (record.unwrap(), inventory);
        }
    }
    panic!("the cluster did not converge in 4 plans");
}

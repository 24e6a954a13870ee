//! `cargo bench -p state`: planner and checkpoint figures for a 5,000-node cluster.
//!
//! Scenario: 5,000 remote nodes, each with an IPv4 and an IPv6 InternalIP and two pod CIDRs,
//! converged (20,000 map entries and routes in the inventory, IPsec off); then 10% churn while
//! the agent was down: 250 nodes deleted, 250 readdressed, 250 added (half on recycled IPs).
//! Prints `bench: <name> <value> <unit>` lines, with the targets next to them (not asserted).

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use state::checkpoint::{Checkpoint, CheckpointStore, decode, encode};
use state::inventory::Inventory;
use state::node::RawNode;
use state::node::{AddressKind, Node, NodeAddress};
use state::plan::{BrakeMemory, LiveView, PlanConfig, PlanInput, plan};

const NODES: usize = 5_000;

fn node(i: usize, slot: usize) -> Node {
    let v4 = Ipv4Addr::new(10, (slot >> 16) as u8 | 0x80, (slot >> 8) as u8, slot as u8);
    let v6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, (slot >> 16) as u16, slot as u16);
    Node {
        name: format!("ip-10-0-{}-{}.eu-west-1.compute.internal", i / 256, i % 256),
        uid: format!("{:08x}-1b2c-4d3e-8f40-{:012x}", i, i * 7919),
        addresses: vec![
            NodeAddress {
                kind: AddressKind::InternalIP,
                ip: IpAddr::V4(v4),
            },
            NodeAddress {
                kind: AddressKind::InternalIP,
                ip: IpAddr::V6(v6),
            },
        ],
        pod_cidrs: vec![
            format!("10.{}.{}.0/24", 64 + (slot >> 8), slot & 0xff)
                .parse()
                .unwrap(),
            format!("fd01:0:{:x}::/64", slot).parse().unwrap(),
        ],
        boot_id: format!("{:08x}-aaaa-bbbb-cccc-{:012x}", i * 31, i),
        node_id: None,
    }
}

/// The local node, outside every remote node's addresses.
fn local() -> Node {
    Node::from_raw(RawNode {
        name: "local".into(),
        uid: "uid-local".into(),
        addresses: vec![("InternalIP".into(), "192.168.0.1".into())],
        pod_cidrs: vec!["10.250.0.0/24".into()],
        boot_id: String::new(),
    })
    .expect("a valid node")
}

/// Median of `runs` timings of `f`.
fn time<T>(runs: usize, mut f: impl FnMut() -> T) -> Duration {
    let mut v: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            black_box(f());
            t.elapsed()
        })
        .collect();
    v.sort();
    v[runs / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    let cfg = PlanConfig {
        local_node: "local".into(),
        local_addresses: vec!["192.168.0.1".parse().unwrap()],
        agent_version: "bench".into(),
        ..PlanConfig::default()
    };
    let now = Duration::from_secs(1_750_000_000);
    // Converge once on the original cluster.
    let before: Vec<Node> = (0..NODES).map(|i| node(i, i)).collect();
    let with_local = |mut nodes: Vec<Node>| {
        nodes.push(local());
        LiveView {
            nodes,
            malformed: Vec::new(),
            synced: true,
            relists: 1,
        }
    };
    let brake = BrakeMemory::default();
    let first = plan(&PlanInput {
        record: None,
        live: &with_local(before.clone()),
        inventory: &Inventory::new(),
        allocator: &Default::default(),
        brake: &brake,
        confirmed_hold: None,
        now,
        config: &cfg,
    });
    let inventory: Inventory = first.ops().iter().map(|op| op.object().clone()).collect();
    let restored = first.checkpoint.clone();

    // Churn while down: 0..250 deleted, 250..500 readdressed, 250 new (125 on deleted IPs).
    let mut live: Vec<Node> = before[500..].to_vec();
    live.extend((250..500).map(|i| node(i, NODES + i)));
    live.extend((0..250).map(|k| {
        node(
            NODES + 1000 + k,
            if k % 2 == 0 { k } else { NODES + 2000 + k },
        )
    }));
    let live = with_local(live);
    let input = PlanInput {
        record: Some(&restored),
        live: &live,
        inventory: &inventory,
        allocator: &restored.ids,
        brake: &brake,
        confirmed_hold: None,
        now: now + Duration::from_secs(600),
        config: &cfg,
    };
    let p = plan(&input);
    let plan_time = time(21, || plan(&input));

    let cp: Checkpoint = p.checkpoint.clone();
    let bytes = encode(&cp).unwrap();
    let enc = time(51, || encode(&cp).unwrap());
    let dec = time(51, || decode(&bytes).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let store = CheckpointStore::open(dir.path().join("state")).unwrap();
    let write = time(11, || store.write(&cp).unwrap());
    let json = serde_json::to_vec(&cp).unwrap();
    let jenc = time(21, || serde_json::to_vec(&cp).unwrap());
    let jdec = time(21, || serde_json::from_slice::<Checkpoint>(&json).unwrap());

    let codec = enc + dec;
    let jcodec = jenc + jdec;
    println!("bench: inventory_objects {} objects", inventory.len());
    println!(
        "bench: plan_ops {} ops ({} deletes, {} upserts, {} allocations)",
        p.ops().len(),
        p.deletes.len(),
        p.upserts.len(),
        p.allocations.len()
    );
    println!("bench: plan_time {:.3} ms (target < 20 ms)", ms(plan_time));
    println!("bench: checkpoint_encode {:.3} ms", ms(enc));
    println!("bench: checkpoint_decode {:.3} ms", ms(dec));
    println!(
        "bench: checkpoint_encode_decode {:.3} ms (target < 5 ms)",
        ms(codec)
    );
    println!("bench: checkpoint_write_fsync {:.3} ms", ms(write));
    println!(
        "bench: checkpoint_size {} bytes (target < 1048576 bytes)",
        bytes.len()
    );
    println!("bench: json_encode {:.3} ms", ms(jenc));
    println!("bench: json_decode {:.3} ms", ms(jdec));
    println!("bench: json_encode_decode {:.3} ms", ms(jcodec));
    println!("bench: json_size {} bytes", json.len());
    println!(
        "bench: speedup_vs_json {:.1} x (target >= 5 x)",
        jcodec.as_secs_f64() / codec.as_secs_f64()
    );
    println!(
        "bench: size_ratio_vs_json {:.1} x (target >= 3 x)",
        json.len() as f64 / bytes.len() as f64
    );
}

//! `cargo bench -p state`: planner and checkpoint figures at 5,000 and 65,000 nodes
//! (`NODE_AGENT_BENCH_SIZES=5000,65000` by default).
//!
//! Scenario at N nodes: N remote nodes, each with an IPv4 and an IPv6 InternalIP and two pod
//! CIDRs, converged (4N map entries and routes in the inventory, IPsec off); then 10% churn while
//! the agent was down: N/20 nodes deleted, N/20 readdressed, N/20 added (half on recycled IPs).
//! Prints `bench: <name>_<N> <value> <unit>` lines, with the targets next to them (not
//! asserted), and how each figure scales from the smallest size to the largest.

use std::collections::BTreeSet;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use state::checkpoint::{Checkpoint, CheckpointStore, NodeRecords, decode, encode};
use state::inventory::Inventory;
use state::node::Node;
use state::plan::{BrakeMemory, ClaimIndex, LiveView, PlanInput, plan, plan_scoped};

#[path = "../tests/common/cluster.rs"]
mod cluster;
use cluster::node as bench_node;

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

/// The figures of one size, for the scaling lines.
struct Figures {
    nodes: usize,
    plan_churn: Duration,
    plan_unchanged: Duration,
    codec: Duration,
    json_codec: Duration,
    size: usize,
}

fn main() {
    let sizes: Vec<usize> = std::env::var("NODE_AGENT_BENCH_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![5_000, 65_000]);
    let figures: Vec<Figures> = sizes.iter().map(|&n| run(n)).collect();
    if let (Some(a), Some(b)) = (figures.first(), figures.last())
        && b.nodes > a.nodes
    {
        let nodes = b.nodes as f64 / a.nodes as f64;
        let grow = |x: Duration, y: Duration| y.as_secs_f64() / x.as_secs_f64();
        println!(
            "bench: scaling {} -> {} nodes ({nodes:.1}x): plan_churn {:.1}x, plan_unchanged {:.1}x, checkpoint_encode_decode {:.1}x, json {:.1}x, checkpoint_size {:.1}x",
            a.nodes,
            b.nodes,
            grow(a.plan_churn, b.plan_churn),
            grow(a.plan_unchanged, b.plan_unchanged),
            grow(a.codec, b.codec),
            grow(a.json_codec, b.json_codec),
            b.size as f64 / a.size as f64
        );
    }
}

/// What the daemon pays after each event that adds or removes a node, to put the event plan's
/// record into the whole one: the median of `runs` turns of a node in the middle of the record
/// replaced by a new one, and back, halved.
fn splice_event(settled: &Checkpoint, runs: usize) -> Duration {
    let mut record = settled.clone();
    let header = Checkpoint {
        nodes: NodeRecords::new(),
        pending_deletes: Vec::new(),
        ..settled.clone()
    };
    let gone = record
        .nodes
        .iter()
        .nth(record.nodes.len() / 2)
        .expect("a record")
        .clone();
    let new = Node {
        name: format!("{}-new", gone.name),
        ..gone.clone()
    };
    let part = |n: &Node| Checkpoint {
        nodes: [n.clone()].into(),
        ..header.clone()
    };
    let turn = time(runs, || {
        record.splice(std::slice::from_ref(&gone.name), part(&new));
        record.splice(std::slice::from_ref(&new.name), part(&gone));
    });
    assert!(
        record.same_content(settled),
        "the turns put the record back"
    );
    turn / 2
}

fn run(nodes: usize) -> Figures {
    let cfg = cluster::config();
    let now = cluster::NOW;
    // Converge once on the original cluster.
    let before: Vec<Node> = (0..nodes).map(|i| bench_node(i, i)).collect();
    let brake = BrakeMemory::default();
    let (restored, inventory) = cluster::converge(
        None,
        Inventory::new(),
        &cluster::view(before.clone()),
        &cfg,
        now,
    );

    // Churn while down: the first 5% deleted, the next 5% readdressed, 5% new (half of them on
    // deleted IPs).
    let five = nodes / 20;
    let mut live: Vec<Node> = before[2 * five..].to_vec();
    live.extend((five..2 * five).map(|i| bench_node(i, nodes + i)));
    live.extend((0..five).map(|k| {
        bench_node(
            nodes + 2 * five + k,
            if k % 2 == 0 { k } else { nodes + 2 * five + k },
        )
    }));
    let live = cluster::view(live);
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
    let runs = if nodes > 20_000 { 5 } else { 21 };
    let plan_time = time(runs, || plan(&input));
    // A resync's cost: a full plan with nothing to do, once the churn has settled.
    let mut churned = inventory.clone();
    for op in p.ops() {
        churned.apply(&op);
    }
    let (settled, settled_inventory) =
        cluster::converge(Some(p.checkpoint.clone()), churned, &live, &cfg, input.now);
    let unchanged = PlanInput {
        record: Some(&settled),
        inventory: &settled_inventory,
        allocator: &settled.ids,
        ..input
    };
    assert!(
        plan(&unchanged).ops().is_empty(),
        "a settled cluster plans no work"
    );
    let plan_unchanged = time(runs, || plan(&unchanged));
    // What an event-sized plan finds its part with, built once after each full plan.
    let index = ClaimIndex::of(&settled);
    let index_build = time(runs, || ClaimIndex::of(&settled));
    // One event on the settled cluster, planned event-sized as the daemon does: what the planner
    // adds to an event's latency.
    // `unsettled` is a node the last plan left held, planned beside the change as the daemon
    // does.
    let event = |name: String, changed: Option<Node>, unsettled: Option<&Node>| {
        let mut touched: BTreeSet<String> = [name].into();
        touched.extend(unsettled.map(|n| n.name.clone()));
        let live = cluster::view(changed.into_iter().chain(unsettled.cloned()).collect());
        let input = PlanInput {
            live: &live,
            ..unchanged
        };
        let p = plan_scoped(&input, &index, &touched)
            .expect("a steady cluster plans events event-sized");
        assert!(!p.ops().is_empty(), "the event changes something");
        assert_eq!(p.errors.len(), usize::from(unsettled.is_some()));
        time(runs * 4, || plan_scoped(&input, &index, &touched))
    };
    let readdressed = bench_node(2 * five + 7, 3 * nodes + 7);
    let plan_event_readdress = event(readdressed.name.clone(), Some(readdressed), None);
    let added = bench_node(4 * nodes, 4 * nodes);
    let plan_event_add = event(added.name.clone(), Some(added.clone()), None);
    let plan_event_remove = event(bench_node(2 * five + 9, 0).name, None, None);
    // A node that claims another's addresses stays held: the cluster is steady, not settled,
    // and events are still planned event-sized, with the held node beside them.
    let held = Node {
        name: "claims-another-nodes-addresses".into(),
        ..bench_node(4 * nodes + 1, 2 * five + 11)
    };
    let mut with_held = unchanged.live.nodes.clone();
    with_held.push(Arc::new(held.clone()));
    let held_plan = plan(&PlanInput {
        live: &LiveView {
            nodes: with_held,
            ..unchanged.live.clone()
        },
        ..unchanged
    });
    assert!(held_plan.ops().is_empty(), "a held node gets nothing");
    assert_eq!(held_plan.steady, Some(vec![held.name.clone()]));
    let plan_event_add_beside_held = event(added.name.clone(), Some(added), Some(&held));

    let splice_event = splice_event(&settled, runs * 4);

    let cp: Checkpoint = p.checkpoint.clone();
    let bytes = encode(&cp).unwrap();
    let runs = if nodes > 20_000 { 7 } else { 51 };
    let enc = time(runs, || encode(&cp).unwrap());
    let dec = time(runs, || decode(&bytes).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let store = CheckpointStore::open(dir.path().join("state")).unwrap();
    let write = time(11, || store.write(&cp).unwrap());
    let json = serde_json::to_vec(&cp).unwrap();
    let jenc = time(runs, || serde_json::to_vec(&cp).unwrap());
    let jdec = time(runs, || {
        serde_json::from_slice::<Checkpoint>(&json).unwrap()
    });

    let codec = enc + dec;
    let jcodec = jenc + jdec;
    // The two codecs timed in turns, a round trip of each per pair, and the ratio taken per
    // pair: this machine's speed drifts by tens of percent within a run, and timing one codec
    // after the other would put the drift into the ratio.
    let mut paired: Vec<f64> = (0..runs)
        .map(|_| {
            let ours = time(1, || decode(&encode(&cp).unwrap()).unwrap());
            let theirs = time(1, || {
                serde_json::from_slice::<Checkpoint>(&serde_json::to_vec(&cp).unwrap()).unwrap()
            });
            theirs.as_secs_f64() / ours.as_secs_f64()
        })
        .collect();
    paired.sort_by(f64::total_cmp);
    let speedup = paired[runs / 2];
    let out = |name: &str, value: String, unit: &str| {
        println!("bench: {name}_{nodes} {value} {unit}");
    };
    let plan_target = if nodes > 20_000 { 120 } else { 10 };
    out("inventory_objects", inventory.len().to_string(), "objects");
    out(
        "plan_ops",
        p.ops().len().to_string(),
        &format!(
            "ops ({} deletes, {} upserts, {} allocations; {} nodes wait for an ID the plan frees)",
            p.deletes.len(),
            p.upserts.len(),
            p.allocations.len(),
            p.errors.len()
        ),
    );
    out(
        "plan_churn",
        format!("{:.3}", ms(plan_time)),
        &format!("ms (target < {plan_target} ms)"),
    );
    out(
        "plan_unchanged",
        format!("{:.3}", ms(plan_unchanged)),
        &format!("ms (target < {plan_target} ms)"),
    );
    for (kind, t) in [
        ("add", plan_event_add),
        ("remove", plan_event_remove),
        ("readdress", plan_event_readdress),
        ("add_beside_a_held_node", plan_event_add_beside_held),
    ] {
        out(
            &format!("plan_event_{kind}"),
            format!("{:.3}", ms(t)),
            "ms (one node, planned event-sized)",
        );
    }
    out(
        "checkpoint_splice_event",
        format!("{:.3}", ms(splice_event)),
        "ms (an event's record put into the whole one: a node gone, another new)",
    );
    out(
        "claim_index_build",
        format!("{:.3}", ms(index_build)),
        "ms (after each full plan, off the event path)",
    );
    out("checkpoint_encode", format!("{:.3}", ms(enc)), "ms");
    out("checkpoint_decode", format!("{:.3}", ms(dec)), "ms");
    out(
        "checkpoint_encode_decode",
        format!("{:.3}", ms(codec)),
        "ms",
    );
    out("checkpoint_write_fsync", format!("{:.3}", ms(write)), "ms");
    out("checkpoint_size", bytes.len().to_string(), "bytes");
    out("json_encode", format!("{:.3}", ms(jenc)), "ms");
    out("json_decode", format!("{:.3}", ms(jdec)), "ms");
    out("json_encode_decode", format!("{:.3}", ms(jcodec)), "ms");
    out("json_size", json.len().to_string(), "bytes");
    out(
        "speedup_vs_json",
        format!("{speedup:.1}"),
        &format!(
            "x (target >= 5 x; median of {runs} paired round trips, {:.1}-{:.1} x; {:.1} x from the medians above)",
            paired[0],
            paired[runs - 1],
            jcodec.as_secs_f64() / codec.as_secs_f64()
        ),
    );
    out(
        "size_ratio_vs_json",
        format!("{:.1}", json.len() as f64 / bytes.len() as f64),
        "x (target >= 3 x)",
    );
    Figures {
        nodes,
        plan_churn: plan_time,
        plan_unchanged,
        codec,
        json_codec: jcodec,
        size: bytes.len(),
    }
}

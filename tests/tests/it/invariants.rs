//! The end-to-end invariant checker (`node_agent_tests::checker`): random, seeded histories of
//! the real binary, every invariant checked after every step. CI runs a fixed budget;
//! `NODE_AGENT_CHECK_STEPS` runs more, `NODE_AGENT_CHECK_SEED` replays a seed.

use std::time::Duration;

use node_agent_tests::agent::{
    AgentEnv, TestNode, cluster, is_exact, k8s_node, local_node, metric, scrape_metrics,
};
use node_agent_tests::apiserver::ApiServer;
use node_agent_tests::checker::model::{Profile, Rng};
use node_agent_tests::checker::{Budget, check, seed_from_env, steps_from_env};
use node_agent_tests::{require_sandbox, sandbox, skip_without_esp, test_name};

#[test]
fn random_histories_keep_every_invariant() {
    require_sandbox!();
    check("invariants", Budget::from_env(150, 25, Profile::INVARIANTS));
}

/// The same histories with IPsec in every one, in either SPI layout (the VM tier: the host
/// kernels of the development machines have no ESP).
#[test]
fn random_histories_with_ipsec_keep_every_invariant() {
    require_sandbox!();
    if !sandbox(|_| crate::agent::kernel_has_esp()) {
        skip_without_esp(test_name!(), "this kernel has no ESP support");
        return;
    }
    check("invariants-ipsec", Budget::from_env(12, 6, Profile::IPSEC));
}

/// Crash torture on the same harness: a cluster of about eighty nodes, a tenth churned each
/// round (adds, deletes, readdressing, recycled IPs), the daemon killed with SIGKILL at a random
/// moment (during the apply, just after it, during the checkpoint write), then a restart that
/// must converge exactly: nothing leaked, nothing missing, unchanged nodes' IDs unchanged. CI
/// runs 50 rounds; `NODE_AGENT_CHECK_STEPS` (two steps a round) runs more.
#[test]
fn killed_mid_reconcile_the_agent_always_converges_exactly() {
    require_sandbox!();
    check("torture", Budget::from_env(101, 101, Profile::TORTURE));
}

/// Event-sized reconciles against full ones, end to end: the daemon watches the API-server
/// stand-in while nodes are added, deleted, readdressed and made to collide one or a few at a
/// time. After each change has been reconciled, the next periodic resync (a dump and a full
/// plan) must find nothing to write; at the end a `--once` run from the record the daemon
/// wrote must find nothing either. So the kernel and the record the event-sized plans left are
/// what full plans would have left. `NODE_AGENT_CHECK_STEPS` runs more rounds (12 by default).
#[test]
fn event_sized_reconciles_leave_what_a_full_reconcile_would() {
    require_sandbox!();
    let rounds = steps_from_env(12) as u32;
    let seed = seed_from_env();
    println!("event-sized: seed {seed} ({rounds} rounds; NODE_AGENT_CHECK_SEED replays it)");
    sandbox(|sb| {
        let mut rng = Rng::new(seed);
        let mut nodes: Vec<TestNode> = cluster(40);
        let server = ApiServer::start().expect("starting the API server stand-in");
        server.apply(k8s_node(&local_node()));
        for n in &nodes {
            server.apply(k8s_node(n));
        }
        let mut env = AgentEnv::new(&sb.bpffs);
        let dir = env.state_dir.parent().unwrap().to_owned();
        env.kubeconfig = Some(server.kubeconfig(&dir).unwrap());
        let metrics = || scrape_metrics(METRICS);
        let reconciles = || metric(&metrics(), "node_agent_reconcile_duration_seconds_count");
        let (code, _, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        let mut child = env.spawn(&[
            "--metrics-addr",
            METRICS,
            "--resync-interval",
            "1s",
            "--debounce",
            "0s",
        ]);
        // The daemon's own first reconcile (the one-shot run before it already made the kernel
        // exact): a change before its list would reach it in the list, not as an event.
        env.wait("the first reconcile", TIMEOUT, || {
            reconciles().is_some_and(|n| n >= 1.0) && is_exact(&env, &nodes)
        });
        let mut next = 100;
        let mut conflicted = None;
        for round in 0..rounds {
            let changed = change(&mut rng, &server, &mut nodes, &mut next, &mut conflicted);
            // The change's reconciles: until the last one planned from the server's newest
            // version (its events may arrive a few milliseconds apart).
            let version = server.resource_version() as f64;
            env.wait("the change's reconcile", TIMEOUT, || {
                metric(&metrics(), "node_agent_source_revision").is_some_and(|v| v >= version)
            });
            let writes = operations(&metrics());
            let settled = reconciles().unwrap_or(0.0);
            env.wait("a resync", TIMEOUT, || {
                reconciles().is_some_and(|n| n >= settled + 1.0)
            });
            assert_eq!(
                operations(&metrics()),
                writes,
                "round {round} ({changed}): a full resync after the event-sized reconcile wrote to the kernel; log:\n{}",
                std::fs::read_to_string(env.log()).unwrap_or_default()
            );
        }
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        assert!(child.wait().unwrap().success());
        let log = std::fs::read_to_string(env.log()).unwrap_or_default();
        let event_sized = log.matches("event_sized=true").count();
        println!("event-sized: {event_sized} event-sized reconciles over {rounds} rounds");
        // A round that mends a conflict plans in full (the conflict stood): most of the others
        // are event-sized.
        assert!(
            event_sized * 4 >= rounds as usize,
            "only {event_sized} of {rounds} changes were planned event-sized:\n{log}"
        );
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(
            report["kernel_writes"], 0,
            "a full run from the daemon's record found work: {report}"
        );
    });
}

const TIMEOUT: Duration = Duration::from_secs(60);
const METRICS: &str = "127.0.0.1:9967";

/// Every kernel operation the agent has applied, from its metrics.
fn operations(text: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("node_agent_plan_operations_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One or two changes through the API: a node added, deleted, readdressed (new addresses and
/// pod CIDRs), or taking another node's pod CIDR (a conflict the incumbent wins, mended by
/// readdressing the newcomer the round after). Says what.
fn change(
    rng: &mut Rng,
    server: &ApiServer,
    nodes: &mut Vec<TestNode>,
    next: &mut u32,
    conflicted: &mut Option<String>,
) -> String {
    if let Some(name) = conflicted.take() {
        let i = nodes.iter().position(|n| n.name == name).unwrap();
        return readdress(server, nodes, i, next);
    }
    let mut what = Vec::new();
    for _ in 0..1 + rng.below(2) {
        let pick = rng.below(nodes.len());
        match rng.below(5) {
            0 | 1 => {
                *next += 1;
                let n = TestNode::dual(&format!("node-{next:04}"), *next);
                server.apply(k8s_node(&n));
                what.push(format!("added {}", n.name));
                nodes.push(n);
            }
            2 if conflicted.is_none() => {
                let n = nodes.remove(pick);
                server.delete(&n.name);
                what.push(format!("deleted {}", n.name));
            }
            3 => what.push(readdress(server, nodes, pick, next)),
            _ => {
                let other = rng.below(nodes.len());
                if other == pick || conflicted.is_some() {
                    continue;
                }
                let mut n = nodes[pick].clone();
                n.cidrs[0] = nodes[other].cidrs[0].clone();
                server.apply(k8s_node(&n));
                what.push(format!("{} took {}'s pod CIDR", n.name, nodes[other].name));
                *conflicted = Some(n.name.clone());
                nodes[pick] = n;
            }
        }
    }
    what.join(", ")
}

fn readdress(server: &ApiServer, nodes: &mut [TestNode], i: usize, next: &mut u32) -> String {
    *next += 1;
    let mut n = TestNode::dual(&nodes[i].name, *next);
    n.uid = nodes[i].uid.clone();
    server.apply(k8s_node(&n));
    nodes[i] = n;
    format!("readdressed {}", nodes[i].name)
}

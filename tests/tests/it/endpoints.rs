//! The running binary's `/metrics`, `/healthz` and `/readyz`, checked against what the kernel
//! shows. Each test in its own sandbox (so `127.0.0.1:9965` is the sandbox's own loopback).

use std::time::Duration;

use node_agent_tests::agent::cluster;
use node_agent_tests::agent::{AgentEnv, TestNode, http_get, metric};
use node_agent_tests::require_sandbox;
use node_agent_tests::sandbox;

const ADDR: &str = "127.0.0.1:9965";
const TIMEOUT: Duration = Duration::from_secs(90);

fn get(path: &str) -> (u16, String) {
    http_get(ADDR, path).unwrap_or((0, String::new()))
}

#[test]
fn metrics_match_the_kernel_and_readiness_follows_sync_and_the_brake() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        // No nodes file yet: alive, not ready, and it says why.
        let mut child = env.spawn(&["--metrics-addr", ADDR, "--prune-confirm-delay", "1h"]);
        env.wait("the endpoints", TIMEOUT, || get("/healthz").0 == 200);
        let (code, body) = get("/readyz");
        assert_eq!(code, 503);
        assert!(body.contains("not synced"), "{body}");
        let metrics = get("/metrics").1;
        assert_eq!(
            metric(&metrics, "node_agent_source_synced"),
            Some(0.0),
            "{metrics}"
        );

        let nodes = cluster(5);
        env.write_nodes(&nodes);
        env.wait("readiness", TIMEOUT, || get("/readyz").0 == 200);
        let metrics = get("/metrics").1;
        let kernel_map = env.map().len() as f64;
        let kernel_routes = env.routes().len() as f64;
        assert_eq!(kernel_map, 10.0);
        let m = |s: &str| metric(&metrics, s).unwrap_or_else(|| panic!("{s} missing:\n{metrics}"));
        assert_eq!(
            m("node_agent_kernel_objects{kind=\"map_entry\"}"),
            kernel_map
        );
        assert_eq!(
            m("node_agent_kernel_objects{kind=\"route\"}"),
            kernel_routes
        );
        assert_eq!(m("node_agent_nodes{state=\"live\"}"), 5.0);
        assert_eq!(m("node_agent_nodes{state=\"pending_delete\"}"), 0.0);
        assert_eq!(m("node_agent_source_synced"), 1.0);
        assert_eq!(m("node_agent_brake_held"), 0.0);
        assert_eq!(
            m("node_agent_plan_operations_total{kind=\"route\",op=\"upsert\",result=\"ok\"}"),
            kernel_routes
        );
        assert_eq!(
            m("node_agent_node_map_fill_ratio"),
            kernel_map / f64::from(node_agent_common::DEFAULT_NODE_MAP_MAX)
        );
        assert!(m("node_agent_checkpoint_writes_total{result=\"ok\"}") >= 1.0);
        assert!(m("node_agent_source_relists_total") >= 1.0);
        assert!(m("node_agent_reconcile_duration_seconds_count") >= 1.0);

        // 4 of 5 nodes gone at once: the brake holds, readiness says so, nothing is deleted.
        env.write_nodes(&nodes[..1]);
        env.wait("the brake", TIMEOUT, || {
            get("/readyz").1.contains("brake held")
        });
        assert_eq!(get("/readyz").0, 503);
        let metrics = get("/metrics").1;
        assert_eq!(
            metric(&metrics, "node_agent_brake_held"),
            Some(1.0),
            "{metrics}"
        );
        assert_eq!(env.map().len() as f64, kernel_map);
        assert_eq!(get("/healthz").0, 200);

        // A malformed node is counted.
        let mut bad = nodes[..1].to_vec();
        let mut b = TestNode::v4("bad", 77);
        b.ips = vec!["not-an-ip".into()];
        bad.push(b);
        bad.extend_from_slice(&nodes[1..]);
        env.write_nodes(&bad);
        env.wait("the input error metric", TIMEOUT, || {
            metric(&get("/metrics").1, "node_agent_node_input_errors") == Some(1.0)
        });
        assert_eq!(get("/readyz").0, 200, "{}", get("/readyz").1);
        assert_eq!(get("/nope").0, 404);
        child.kill().unwrap();
        child.wait().unwrap();
    });
}

#[test]
fn with_every_node_id_taken_a_new_node_is_held_counted_and_named_in_readiness() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(3);
        env.write_nodes(&nodes);
        // This test's ID space holds 3 IDs (a test-only setting; the benchmark uses 65,535).
        let _daemon = env.spawn(&["--metrics-addr", ADDR, "--max-node-id", "3"]);
        env.wait("readiness", TIMEOUT, || get("/readyz").0 == 200);
        let mut more = nodes.clone();
        more.push(TestNode::dual("node-0004", 4));
        env.write_nodes(&more);
        env.wait("the exhaustion metric", TIMEOUT, || {
            metric(&get("/metrics").1, "node_agent_node_ids_exhausted") == Some(1.0)
        });
        let (code, body) = get("/readyz");
        assert_eq!(code, 200, "the programmed nodes are right: {body}");
        assert!(
            body.contains("no node ID free") && body.contains("node-0004"),
            "{body}"
        );
        assert!(
            !env.map().contains_key(&more[3].ips[0]),
            "held, not programmed"
        );
        assert_eq!(env.map().len(), 6, "the three others keep theirs");
        let log = std::fs::read_to_string(env.log()).unwrap();
        assert!(
            log.contains("node-0004") && log.contains("cooling down"),
            "{log}"
        );
        // A node goes: its ID cools down, and the newcomer still waits for it.
        env.write_nodes(&more[1..]);
        std::thread::sleep(Duration::from_secs(2));
        assert!(
            !env.map().contains_key(&more[3].ips[0]),
            "the freed ID is cooling down"
        );
    });
}

#[test]
fn a_missing_pod_interface_is_waited_for_named_in_readiness_and_attached_when_it_appears() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        env.write_nodes(&cluster(2));
        let _daemon = env.spawn(&["--metrics-addr", ADDR, "--pod-iface", "cni7"]);
        env.wait("readiness", TIMEOUT, || get("/readyz").0 == 200);
        let body = get("/readyz").1;
        assert!(
            body.contains("pod interface cni7 has no classifier: no such interface"),
            "{body}"
        );
        node_agent_tests::ip(&["link", "add", "cni7", "type", "bridge"]);
        env.wait(
            "the classifier on the new bridge",
            Duration::from_secs(5),
            || node_agent_tests::attached("cni7", aya::programs::TcAttachType::Ingress) == 1,
        );
        let waited = std::panic::catch_unwind(|| {
            node_agent_tests::agent::wait_for(
                "readiness without the detail",
                Duration::from_secs(5),
                || get("/readyz").1.trim() == "ready",
            )
        });
        assert!(waited.is_ok(), "{}", get("/readyz").1);
    });
}

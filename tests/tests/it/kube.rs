//! End to end through the Kubernetes API: the real `node-agent` binary watching the in-process
//! API-server stand-in (`node_agent_tests::apiserver`) through a kubeconfig, in a sandbox.
//!
//! The stand-in is started on the sandbox thread, so it listens on the sandbox's own loopback,
//! where the agent (spawned from the same thread) reaches it.

use std::time::Duration;

use node_agent::source::kube::MAX_BACKOFF;
use node_agent_tests::agent::cluster;
use node_agent_tests::agent::{
    AgentEnv, TestNode, http_get, k8s_node, local_node, metric, scrape_metrics,
};
use node_agent_tests::agent::{assert_exact, is_exact};
use node_agent_tests::apiserver::{ApiServer, Kind};
use node_agent_tests::require_sandbox;
use node_agent_tests::sandbox;

const TIMEOUT: Duration = Duration::from_secs(90);
/// Room for a slow guest on top of a wait the agent's backoff sets.
const SLACK: Duration = Duration::from_secs(30);
const METRICS: &str = "127.0.0.1:9965";

/// The server, holding the local node and `remote`, and an agent environment pointed at it.
fn setup(sb: &node_agent_tests::Sandbox, remote: &[TestNode]) -> (ApiServer, AgentEnv) {
    let server = ApiServer::start().expect("starting the API server stand-in");
    server.apply(k8s_node(&local_node()));
    for n in remote {
        server.apply(k8s_node(n));
    }
    let mut env = AgentEnv::new(&sb.bpffs);
    let dir = env.state_dir.parent().unwrap().to_owned();
    env.kubeconfig = Some(server.kubeconfig(&dir).unwrap());
    (server, env)
}

fn readyz() -> (u16, String) {
    http_get(METRICS, "/readyz").unwrap_or((0, String::new()))
}

#[test]
fn forbidden_then_allowed_nothing_is_pruned_before_the_first_full_list() {
    require_sandbox!();
    sandbox(|sb| {
        let nodes = cluster(10);
        let (server, env) = setup(sb, &nodes);
        let (code, _, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_exact(&env, &nodes);

        // While the agent is down, three nodes go, and RBAC breaks.
        for n in &nodes[..3] {
            server.delete(&n.name);
        }
        server.set_forbidden(true);
        let mut child = env.spawn(&["--metrics-addr", METRICS]);
        env.wait("reported source errors", TIMEOUT, || {
            metric(&scrape_metrics(METRICS), "node_agent_source_errors_total")
                .is_some_and(|v| v >= 2.0)
        });
        let (code, body) = readyz();
        assert_eq!(code, 503);
        assert!(body.contains("not synced"), "{body}");
        assert_exact(&env, &nodes); // 403 reads as "unknown", never as "no nodes"
        let log = std::fs::read_to_string(env.log()).unwrap();
        assert!(
            log.contains("forbidden (403)") && log.contains("`list` and `watch` on `nodes`"),
            "names the missing permission:\n{log}"
        );

        server.set_forbidden(false);
        env.wait("the prune after the first full list", TIMEOUT, || {
            is_exact(&env, &nodes[3..])
        });
        assert_exact(&env, &nodes[3..]);
        env.wait("readiness", TIMEOUT, || readyz().0 == 200);
        child.kill().unwrap();
        child.wait().unwrap();
    });
}

#[test]
fn a_node_deleted_while_the_watch_is_broken_is_pruned_after_the_410_relist() {
    require_sandbox!();
    sandbox(|sb| {
        let nodes = cluster(10);
        let (server, env) = setup(sb, &nodes);
        let mut child = env.spawn(&["--metrics-addr", METRICS]);
        env.wait("readiness", TIMEOUT, || readyz().0 == 200);
        assert_exact(&env, &nodes);
        let lists = server.requests().list;

        // The watch breaks and cannot come back (RBAC flaps) while a node is deleted and the
        // history is compacted: the resumed watch gets 410 and the agent must relist.
        server.set_forbidden(true);
        server.drop_watches();
        server.delete(&nodes[4].name);
        server.compact();
        std::thread::sleep(Duration::from_millis(300));
        assert_exact(&env, &nodes);
        server.set_forbidden(false);

        let mut left = nodes.clone();
        left.remove(4);
        env.wait("the prune after the relist", TIMEOUT, || {
            is_exact(&env, &left)
        });
        assert_exact(&env, &left);
        assert!(server.requests().list > lists, "the agent relisted");
        child.kill().unwrap();
        child.wait().unwrap();
    });
}

#[test]
fn a_dropped_watch_resumes_and_prunes_nothing_extra() {
    require_sandbox!();
    sandbox(|sb| {
        let nodes = cluster(6);
        let (server, env) = setup(sb, &nodes);
        let mut child = env.spawn(&["--metrics-addr", METRICS]);
        env.wait("readiness", TIMEOUT, || readyz().0 == 200);
        let lists = server.requests().list;
        for _ in 0..3 {
            server.drop_watches();
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut more = nodes.clone();
        more.push(TestNode::dual("node-0077", 77));
        server.apply(k8s_node(&more[6]));
        env.wait("the node added after the reconnects", TIMEOUT, || {
            is_exact(&env, &more)
        });
        assert_exact(&env, &more);
        assert_eq!(
            server.requests().list,
            lists,
            "resumed from its resourceVersion, no relist"
        );
        child.kill().unwrap();
        child.wait().unwrap();
    });
}

#[test]
fn restart_with_churn_through_the_api() {
    require_sandbox!();
    sandbox(|sb| {
        let before = cluster(10);
        let (server, env) = setup(sb, &before);
        let (code, _, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_exact(&env, &before);
        let map_before = env.map();

        // While the agent is down: deleted, readdressed, deleted with its IP recycled, renamed,
        // added.
        let mut after = before.clone();
        server.delete("node-0001");
        after.retain(|n| n.name != "node-0001");
        let readdressed = TestNode::dual("node-0002", 102);
        server.apply(k8s_node(&readdressed));
        *after.iter_mut().find(|n| n.name == "node-0002").unwrap() = readdressed;
        server.delete("node-0003");
        after.retain(|n| n.name != "node-0003");
        let mut recycled = TestNode::dual("node-0103", 103);
        recycled.ips = before[2].ips.clone();
        server.apply(k8s_node(&recycled));
        after.push(recycled);
        server.delete("node-0004");
        let renamed = TestNode {
            name: "node-0004-renamed".into(),
            ..before[3].clone()
        };
        server.apply(k8s_node(&renamed));
        *after.iter_mut().find(|n| n.name == "node-0004").unwrap() = renamed;
        let added = TestNode::dual("node-0111", 111);
        server.apply(k8s_node(&added));
        after.push(added);

        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_exact(&env, &after);
        assert_eq!(report["live_nodes"], after.len() + 1);
        let map_after = env.map();
        for ip in &before[4].ips {
            assert_eq!(
                map_after[ip], map_before[ip],
                "an untouched node keeps its ID"
            );
        }
        let (_, report, _) = env.once(&[]);
        assert_eq!(report["kernel_writes"], 0, "{report}");
    });
}

/// After sync, readiness follows the API server both ways: not ready while it refuses the agent
/// or cannot be reached, ready again once it serves. Nothing in the cluster changes, so no event
/// comes: readiness comes back by the agent's own probe, which it retries on its backoff, so it
/// comes within one backoff period ([`MAX_BACKOFF`] at most) of the recovery however fast the
/// machine is. (A probe that failed just before the recovery was not retried, and the agent
/// stayed not ready until the next node event: a flake in the 6.12 guest.)
#[test]
fn readiness_follows_the_api_server_after_sync() {
    require_sandbox!();
    sandbox(|sb| {
        let nodes = cluster(4);
        let (server, env) = setup(sb, &nodes);
        let _child = env.spawn(&["--metrics-addr", METRICS]);
        env.wait("readiness", TIMEOUT, || readyz().0 == 200);
        type Set = fn(&ApiServer, bool);
        let cases: [(&str, Set, &str); 3] = [
            ("forbidden", ApiServer::set_forbidden, "forbidden (403)"),
            ("revoked", ApiServer::set_revoked, "unauthorized (401)"),
            (
                "unreachable",
                ApiServer::set_unreachable,
                "node source failing",
            ),
        ];
        for (what, set, says) in cases {
            set(&server, true);
            server.drop_watches();
            env.wait(&format!("not ready while {what}"), TIMEOUT, || {
                let (code, body) = readyz();
                code == 503 && body.contains(says) && body.contains("node source failing")
            });
            assert_eq!(
                metric(&scrape_metrics(METRICS), "node_agent_source_failing"),
                Some(1.0),
                "{what}"
            );
            assert_exact(&env, &nodes);
            let before = server.requests();
            let began = std::time::Instant::now();
            set(&server, false);
            env.wait(
                &format!("ready again after {what}, by a probe within a backoff period"),
                MAX_BACKOFF + SLACK,
                || readyz().0 == 200,
            );
            let after = server.requests();
            node_agent_tests::report(&format!(
                "readiness after {what}: ready {:.1} s after the recovery, {} probe(s)",
                began.elapsed().as_secs_f64(),
                after.probe - before.probe
            ));
            assert!(
                after.probe > before.probe,
                "no node event came: only a probe can have made the agent ready"
            );
            assert_eq!(
                metric(&scrape_metrics(METRICS), "node_agent_source_failing"),
                Some(0.0)
            );
        }
    });
}

/// The race of the test above, made on purpose: the resumed watch is refused once and the first
/// two probes too, so the watch comes back (quietly) while the agent still fails. Its probes go on,
/// one per backoff period, and the third makes it ready; no node event ever comes.
#[test]
fn a_watch_that_resumes_quietly_after_a_failed_probe_is_ready_by_the_next_probe() {
    require_sandbox!();
    sandbox(|sb| {
        let nodes = cluster(2);
        let (server, env) = setup(sb, &nodes);
        let _child = env.spawn(&["--metrics-addr", METRICS]);
        env.wait("readiness", TIMEOUT, || readyz().0 == 200);
        let errors =
            || metric(&scrape_metrics(METRICS), "node_agent_source_errors_total").unwrap_or(0.0);
        let errors_before = errors();
        let before = server.requests();
        const FAILED_PROBES: u64 = 2;
        server.forbid_next(Kind::Watch, 1);
        server.forbid_next(Kind::Probe, FAILED_PROBES);
        server.drop_watches();
        // Three backoff periods: the watch's failure and each failed probe's (1, 2 and 4 s).
        let began = std::time::Instant::now();
        env.wait(
            "the failure, the refused probes, and readiness by the next probe",
            Duration::from_secs(1 + 2 + 4) + SLACK,
            || {
                errors() > errors_before
                    && server.requests().probe > before.probe + FAILED_PROBES
                    && readyz().0 == 200
            },
        );
        let after = server.requests();
        node_agent_tests::report(&format!(
            "quiet resumption: ready {:.1} s after the watch failed, by probe {} ({FAILED_PROBES} refused)",
            began.elapsed().as_secs_f64(),
            after.probe - before.probe
        ));
        assert_eq!(
            after.probe - before.probe,
            FAILED_PROBES + 1,
            "no probe once ready"
        );
        assert_eq!(
            after.list - after.probe,
            before.list - before.probe,
            "no relist: the watch resumed"
        );
        assert_eq!(errors(), errors_before + 1.0, "one failure, of the watch");
        assert_exact(&env, &nodes);
    });
}

/// Lists that succeed and watches that never start (every one `410 Expired`, as behind a
/// caching proxy that keeps no history) are retried with growing waits too: each good list
/// reset the backoff, and the agent listed the whole cluster about every second.
#[test]
fn lists_that_succeed_before_watches_that_fail_do_not_reset_the_backoff() {
    require_sandbox!();
    sandbox(|sb| {
        let nodes = cluster(2);
        let (server, env) = setup(sb, &nodes);
        let _child = env.spawn(&["--metrics-addr", METRICS]);
        env.wait("readiness", TIMEOUT, || readyz().0 == 200);
        server.set_expiring(true);
        server.drop_watches();
        let start = server.requests().list;
        let began = std::time::Instant::now();
        std::thread::sleep(Duration::from_secs(30));
        let lists = server.requests().list - start;
        node_agent_tests::report(&format!(
            "bench: expiring_watch_lists {lists} lists in {:.1} s",
            began.elapsed().as_secs_f64()
        ));
        // Waits of 1, 2, 4, 8 and 16 s (each from its upper half) fit at most 6 relists, each
        // with a probe list: 12. Reset by each list, the waits stayed near 1 s: 30 and more.
        assert!(
            lists <= 14,
            "{lists} lists in 30 s: the backoff does not grow"
        );
        assert!(lists >= 2, "the agent keeps trying ({lists})");
        server.set_expiring(false);
    });
}

#[test]
fn a_failing_api_server_is_retried_with_growing_waits() {
    require_sandbox!();
    sandbox(|sb| {
        let nodes = cluster(2);
        let (server, env) = setup(sb, &nodes);
        let _child = env.spawn(&["--metrics-addr", METRICS]);
        env.wait("readiness", TIMEOUT, || readyz().0 == 200);
        server.set_failing(true);
        server.drop_watches();
        let total = |r: node_agent_tests::apiserver::Requests| r.list + r.watch + r.get;
        let start = total(server.requests());
        let began = std::time::Instant::now();
        std::thread::sleep(Duration::from_secs(30));
        let attempts = total(server.requests()) - start;
        // Waits of 1, 2, 4, 8 and 16 s, each drawn from its upper half, fit at most 6 attempts
        // in 30 s, each followed by one probe; a backoff that never grew (the watcher's own,
        // reset by every list attempt, about every 1 to 1.5 s) made 20 or more.
        node_agent_tests::report(&format!(
            "bench: failing_api_server_requests {attempts} requests in {:.1} s",
            began.elapsed().as_secs_f64()
        ));
        assert!(
            attempts <= 14,
            "{attempts} requests in 30 s: the backoff does not grow"
        );
        assert!(attempts >= 2, "the agent keeps trying ({attempts})");
        assert_eq!(readyz().0, 503);
        server.set_failing(false);
        env.wait("ready again", Duration::from_secs(120), || {
            readyz().0 == 200
        });
    });
}

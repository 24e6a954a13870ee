//! What the daemon costs while it waits, in each state where it can do nothing.

use std::time::Duration;

use node_agent_tests::agent::{AgentEnv, TestNode};
use node_agent_tests::{ip, sandbox};

use super::{bench, cpu_over, enabled};

const NODES: u32 = 5000;

/// What the daemon costs while it waits, in each state where it can do nothing (5,000 nodes):
/// the brake held, the API server failing, the state directory full, the node-ID map full.
/// Each should be near idle: the daemon waits for a list, a retry time or a change, never on a
/// tight timer.
#[test]
fn bench_daemon_cpu_while_waiting() {
    if !enabled(node_agent_tests::test_name!()) {
        return;
    }
    let secs: u64 = std::env::var("NODE_AGENT_BENCH_IDLE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let nodes: Vec<TestNode> = (1..=NODES)
        .map(|i| TestNode::dual(&format!("node-{i:05}"), i))
        .collect();
    let ready = |env: &AgentEnv| {
        env.wait(
            "the daemon's first reconcile",
            Duration::from_secs(180),
            || {
                node_agent_tests::agent::http_get("127.0.0.1:9965", "/readyz").is_some()
                    && env.checkpoint().exists()
            },
        )
    };
    let daemon = [
        "--metrics-addr",
        "127.0.0.1:9965",
        "--prune-confirm-delay",
        "10s",
    ];
    // The brake holds: nine tenths of the nodes vanish from the list.
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        env.write_nodes(&nodes);
        let child = env.spawn(&daemon);
        ready(&env);
        env.write_nodes(&nodes[..NODES as usize / 10]);
        env.wait("the hold", Duration::from_secs(60), || {
            env.state_dir.join("hold.json").exists()
        });
        // Past the confirm delay, where the old daemon re-planned every 250 ms.
        std::thread::sleep(Duration::from_secs(12));
        bench(
            &format!("daemon_cpu_brake_held_over_{secs}s"),
            cpu_over(child.id(), secs),
            "% of one core (5000 nodes, a wipe held past its confirm delay)",
        );
    });
    // The API server fails every request.
    sandbox(|sb| {
        let server = node_agent_tests::apiserver::ApiServer::start().unwrap();
        server.apply(node_agent_tests::agent::k8s_node(
            &node_agent_tests::agent::local_node(),
        ));
        for n in &nodes {
            server.apply(node_agent_tests::agent::k8s_node(n));
        }
        let mut env = AgentEnv::new(&sb.bpffs);
        env.kubeconfig = Some(server.kubeconfig(env.state_dir.parent().unwrap()).unwrap());
        let child = env.spawn(&daemon);
        ready(&env);
        server.set_failing(true);
        server.drop_watches();
        std::thread::sleep(Duration::from_secs(5));
        let requests = server.requests();
        bench(
            &format!("daemon_cpu_api_failing_over_{secs}s"),
            cpu_over(child.id(), secs),
            "% of one core (5000 nodes, every request answered 500)",
        );
        let after = server.requests();
        bench(
            &format!("daemon_api_requests_while_failing_over_{secs}s"),
            (after.list + after.watch + after.get - requests.list - requests.watch - requests.get)
                as f64,
            "requests",
        );
    });
    // The state directory is full (and stays so).
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        std::fs::create_dir_all(&env.state_dir).unwrap();
        ip(&["link", "set", "lo", "up"]);
        node_agent_tests::run(std::process::Command::new("mount").args([
            "-t",
            "tmpfs",
            "-o",
            "size=2m,mode=0700",
            "tmpfs",
            env.state_dir.to_str().unwrap(),
        ]));
        env.write_nodes(&nodes);
        let child = env.spawn(&daemon);
        ready(&env);
        let _ = std::process::Command::new("dd")
            .args([
                "if=/dev/zero",
                &format!("of={}", env.state_dir.join("filler").display()),
                "bs=64k",
            ])
            .output();
        env.write_nodes(&nodes[..NODES as usize - 10]);
        std::thread::sleep(Duration::from_secs(5));
        bench(
            &format!("daemon_cpu_state_dir_full_over_{secs}s"),
            cpu_over(child.id(), secs),
            "% of one core (5000 nodes, every checkpoint write fails)",
        );
    });
    // The node-ID map is full: a tenth of the nodes do not fit.
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        env.write_nodes(&nodes);
        let cap = (2 * NODES * 9 / 10).to_string();
        let child = env.spawn(&[&daemon[..], &["--node-map-max", &cap]].concat());
        ready(&env);
        std::thread::sleep(Duration::from_secs(5));
        bench(
            &format!("daemon_cpu_map_full_over_{secs}s"),
            cpu_over(child.id(), secs),
            "% of one core (5000 nodes, 500 of them held: no room in the map)",
        );
    });
}

//! End to end: the rollback of docs/install.md ("Rolling back"), to the previous release (main as
//! of 4815775, the last before nexthop objects).
//!
//! CI runs the current binary through the documented first step and holds what it leaves to what
//! the previous release itself writes for the same cluster, recorded below from its binary: the
//! previous release deletes a removed node's routes in exactly that shape, so a kernel in that
//! shape is one it cleans up. With `NODE_AGENT_PREVIOUS_RELEASE` naming that release's binary
//! (built from `git worktree add DIR 4815775`: `cargo xtask build-ebpf --release && cargo build
//! -p node-agent` there), the test runs the rest for real: the previous binary takes over, a node
//! is removed and it must clean that node up, then the current one rolls forward.

use std::process::Command;

use node_agent_tests::agent::{AgentEnv, assert_exact, cluster};
use node_agent_tests::{ip, report, require_sandbox, sandbox};

/// `ip -j route show proto 201` (IPv4, then IPv6) after the previous release's `run --once` on
/// `cluster(3)`, from scratch: each route with its own gateway, in the main table. Recorded with
/// `NODE_AGENT_RECORD_PREVIOUS=1` and the previous binary.
const PREVIOUS_ROUTES: &str = include_str!("../../fixtures/previous-release-routes.json");

/// The map pins install.md's third step removes.
const MAP_PINS: [&str; 2] = ["node_ids", "pod_cidrs"];

/// The routes of protocol 201, both families, as `ip -j` prints them (the fields the kernel
/// keeps: destination, gateway, device, protocol, scope, flags, metric).
fn routes_json() -> serde_json::Value {
    let mut all = Vec::new();
    for family in ["-4", "-6"] {
        let o = ip(&[family, "-j", "route", "show", "proto", "201"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        all.extend(v.as_array().unwrap().iter().cloned().map(|mut r| {
            // Preferences and expiry are the kernel's, not the writer's.
            if let Some(o) = r.as_object_mut() {
                o.remove("expires");
                o.remove("pref");
            }
            r
        }));
    }
    serde_json::Value::Array(all)
}

/// `node-agent run --once` of this environment, with the binary at `bin`.
fn once_with(env: &AgentEnv, bin: &str, extra: &[&str]) -> (i32, String) {
    let c = env.command(&["--once", "--sync-timeout", "90s"]);
    let out = Command::new(bin)
        .args(c.get_args())
        .args(extra)
        .envs(c.get_envs().filter_map(|(k, v)| Some((k, v?))))
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The node-ID map's capacity as its pin has it, read as install.md says: with bpftool.
fn map_capacity(env: &AgentEnv) -> u64 {
    let pin = node_agent::datapath::node_ids_pin(&env.bpffs);
    let out = Command::new("bpftool")
        .args(["-j", "map", "show", "pinned"])
        .arg(&pin)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["max_entries"].as_u64().expect("max_entries")
}

#[test]
fn the_documented_rollback_leaves_what_the_previous_release_cleans_up() {
    require_sandbox!();
    let previous = std::env::var("NODE_AGENT_PREVIOUS_RELEASE").ok();
    if std::env::var_os("NODE_AGENT_RECORD_PREVIOUS").is_some() {
        let bin = previous.expect("NODE_AGENT_RECORD_PREVIOUS needs NODE_AGENT_PREVIOUS_RELEASE");
        sandbox(|sb| {
            let env = AgentEnv::new(&sb.bpffs);
            env.write_nodes(&cluster(3));
            let (code, err) = once_with(&env, &bin, &[]);
            assert_eq!(code, 0, "{err}");
            println!("{}", serde_json::to_string_pretty(&routes_json()).unwrap());
        });
        return;
    }
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(3);
        env.write_nodes(&nodes);
        // The current release, as it runs before the rollback: routes through nexthops.
        let (code, _, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert!(!env.routes_through_nexthops("main").is_empty());
        // Step 1: the old route shape, on the current release.
        let (code, _, err) = env.once(&["--route-nexthops", "false"]);
        assert_eq!(code, 0, "{err}");
        assert_exact(&env, &nodes);
        assert!(
            env.nexthops().values().all(|(_, proto)| proto != "201"),
            "a nexthop of ours is left"
        );
        let recorded: serde_json::Value = serde_json::from_str(PREVIOUS_ROUTES).unwrap();
        assert_eq!(
            routes_json(),
            recorded,
            "the routes are not in the shape the previous release writes"
        );
        let Some(bin) = previous else {
            report(
                "rollback: step 1 leaves the previous release's own route shape (recorded from 4815775); \
                 NODE_AGENT_PREVIOUS_RELEASE not set, so its binary did not run",
            );
            return;
        };
        // Step 3: the maps' pins go (the previous release takes at most 65,535 entries; this
        // one's maps hold two entries per node ID), then the previous release takes over (step
        // 2, the brake, has nothing held here).
        assert!(
            map_capacity(&env) > 65_535,
            "the step is needed: {}",
            map_capacity(&env)
        );
        for pin in MAP_PINS {
            std::fs::remove_file(env.bpffs.join("node-agent").join(pin)).unwrap();
        }
        let (code, err) = once_with(&env, &bin, &[]);
        assert_eq!(code, 0, "previous release taking over: {err}");
        assert_exact(&env, &nodes);
        // A node removed under the previous release: it cleans that node up.
        env.write_nodes(&nodes[..2]);
        let (code, err) = once_with(&env, &bin, &["--max-prune-ratio", "1"]);
        assert_eq!(code, 0, "previous release pruning: {err}");
        assert_exact(&env, &nodes[..2]);
        // Rolling forward again.
        let (code, _, err) = env.once(&[]);
        assert_eq!(code, 0, "rolling forward: {err}");
        assert_exact(&env, &nodes[..2]);
        assert!(!env.routes_through_nexthops("main").is_empty());
        report(
            "rollback: current -> step 1 -> previous release (4815775) took over, cleaned up a removed node -> rolled forward",
        );
    });
}

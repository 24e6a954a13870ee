//! End to end, one test per rule of `docs/design.md` that the planner's unit tests prove against
//! a model: here the real binary, the real kernel, through the CLI only.

use std::collections::BTreeMap;
use std::time::Duration;

use node_agent_tests::agent::{
    AgentEnv, TestNode, assert_exact, cluster, faketime_lib, wall_clock_moved,
};
use node_agent_tests::require_sandbox;
use node_agent_tests::{ip, sandbox, skip};

/// Generous: the same tests run under QEMU's TCG emulation in the VM tier.
const TIMEOUT: Duration = Duration::from_secs(90);

/// Node ID of each node's first address.
fn ids(env: &AgentEnv, nodes: &[TestNode]) -> BTreeMap<String, u16> {
    let map = env.map();
    nodes
        .iter()
        .filter_map(|n| map.get(&n.ips[0]).map(|id| (n.name.clone(), *id)))
        .collect()
}

fn errors_of(report: &serde_json::Value) -> Vec<(String, String)> {
    report["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["node"].as_str().unwrap().to_owned(),
                e["error"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[test]
fn a_foreign_route_at_a_remote_pod_cidr_is_reported_and_never_replaced() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(4);
        // Someone else routes node-0002's IPv4 pod CIDR already, and the local node's pod CIDR
        // has its own route; a remote node also claims the local pod CIDR.
        ip(&[
            "route",
            "add",
            "10.100.2.0/24",
            "via",
            "10.88.1.200",
            "proto",
            "static",
        ]);
        ip(&["route", "add", "10.99.0.0/24", "dev", "gw0"]);
        let before = env.all_routes();
        let mut thief = TestNode::v4("thief", 40);
        thief.cidrs = vec!["10.99.0.0/24".into()];
        let mut all = nodes.clone();
        all.push(thief);
        env.write_nodes(&all);
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        let errors = errors_of(&report);
        assert!(
            errors.iter().any(|(n, e)| n == "node-0002"
                && e.contains("10.100.2.0/24")
                && e.contains("proto static")),
            "{errors:?}"
        );
        assert!(
            errors
                .iter()
                .any(|(n, e)| n == "thief" && e.contains("local node")),
            "{errors:?}"
        );
        let after = env.all_routes();
        assert_eq!(
            after["10.100.2.0/24"],
            ("10.88.1.200".into(), "static".into())
        );
        assert_eq!(after["10.99.0.0/24"], before["10.99.0.0/24"]);
        assert!(env.map().contains_key("10.88.1.3"), "node-0002 is mapped");
        assert!(
            env.routes().contains_key("fd00:244:3::/64"),
            "and its IPv6 route is ours"
        );
        // `node-agent plan` shows the conflicts too.
        let (_, table, _) = env.cli(&[
            "plan",
            "--node-name",
            "local",
            "--nodes-file",
            env.nodes_file.to_str().unwrap(),
        ]);
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("conflict") && l.contains("node-0002")),
            "{table}"
        );
        // node-0002 goes away: its objects go, the foreign route stays.
        all.retain(|n| n.name != "node-0002");
        env.write_nodes(&all);
        assert_eq!(env.once(&[]).0, 0);
        assert_eq!(
            env.all_routes()["10.100.2.0/24"],
            ("10.88.1.200".into(), "static".into())
        );
        assert!(!env.map().contains_key("10.88.1.3"));
    });
}

/// The routes at exactly `dst`, as `ip route` prints them.
fn routes_at(dst: &str) -> Vec<String> {
    let out = ip(&["route", "show", "exact", dst]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().to_owned())
        .collect()
}

/// Routes of other types in our table are someone else's too. A blackhole at a remote pod CIDR
/// is reported by name and left alone, never replaced; one prepended before ours at the same
/// destination and metric is never taken by a replace of ours (an IPv4 replace takes the first
/// route it finds there): when that node moves, its route is reported and goes from under the
/// blackhole, which stays.
#[test]
fn a_blackhole_in_our_table_is_someone_elses() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let mut nodes = cluster(3);
        ip(&["route", "add", "blackhole", "10.100.2.0/24"]);
        env.write_nodes(&nodes);
        // Routes with their gateway inline: a readdress replaces the route itself.
        let inline = ["--route-nexthops", "false"];
        let (code, report, err) = env.once(&inline);
        assert_eq!(code, 0, "{err}");
        let errors = errors_of(&report);
        assert!(
            errors
                .iter()
                .any(|(n, e)| n == "node-0002" && e.contains("blackhole 10.100.2.0/24")),
            "{errors:?}"
        );
        assert_eq!(routes_at("10.100.2.0/24"), ["blackhole 10.100.2.0/24"]);
        let ours = routes_at("10.100.3.0/24");
        assert!(
            matches!(&ours[..], [r] if r.contains("via 10.88.1.4") && r.contains("proto 201")),
            "{ours:?}"
        );

        ip(&["route", "prepend", "blackhole", "10.100.3.0/24"]);
        nodes[2].ips[0] = "10.88.1.40".into();
        env.write_nodes(&nodes);
        let (_, report, _) = env.once(&inline);
        let errors = errors_of(&report);
        assert!(
            errors
                .iter()
                .any(|(n, e)| n == "node-0003" && e.contains("blackhole 10.100.3.0/24")),
            "{errors:?}"
        );
        let at = routes_at("10.100.3.0/24");
        assert!(at.contains(&"blackhole 10.100.3.0/24".to_owned()), "{at:?}");
        assert!(!at.iter().any(|r| r.contains("10.88.1.40")), "{at:?}");
        assert_eq!(routes_at("10.100.2.0/24"), ["blackhole 10.100.2.0/24"]);
    });
}

#[test]
fn a_malformed_node_keeps_its_objects_across_a_restart() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(4);
        env.write_nodes(&nodes);
        assert_eq!(env.once(&[]).0, 0);
        let ids_before = ids(&env, &nodes);
        let mut broken = nodes.clone();
        broken[1].ips = vec!["not-an-ip".into()];
        env.write_nodes(&broken);
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_exact(&env, &nodes);
        assert!(
            errors_of(&report).iter().any(|(n, _)| n == "node-0002"),
            "{report}"
        );
        env.write_nodes(&nodes);
        let (code, report, _) = env.once(&[]);
        assert_eq!((code, &report["kernel_writes"]), (0, &serde_json::json!(0)));
        assert_eq!(ids(&env, &nodes), ids_before);
    });
}

#[test]
fn a_list_without_the_local_node_changes_nothing() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(4);
        env.write_nodes(&nodes);
        assert_eq!(env.once(&[]).0, 0);
        // Another cluster's list (or a filtered one): new nodes, none of ours, no local node.
        let other: Vec<TestNode> = (50..60)
            .map(|i| TestNode::v4(&format!("other-{i}"), i))
            .collect();
        env.write_list(&other);
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 3, "{err}");
        assert_eq!(report["brake"]["kind"], "no_local_node", "{report}");
        assert_eq!(report["kernel_writes"], 0, "{report}");
        assert_exact(&env, &nodes);
        // Even --force-prune changes nothing on such a list.
        let (code, _, _) = env.once(&["--force-prune"]);
        assert_eq!(code, 3);
        assert_exact(&env, &nodes);
    });
}

#[test]
fn the_incumbent_keeps_its_address_and_id_against_a_newcomer() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(5);
        env.write_nodes(&nodes);
        assert_eq!(env.once(&[]).0, 0);
        let before = ids(&env, &nodes);
        // A newcomer whose name sorts first claims node-0005's IPv4 address.
        let mut newcomer = TestNode::v4("aaa-newcomer", 90);
        newcomer.ips = vec![nodes[4].ips[0].clone()];
        let mut all = vec![newcomer];
        all.extend(nodes.iter().cloned());
        env.write_nodes(&all);
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(ids(&env, &nodes), before, "nobody's ID changed");
        assert_exact(&env, &nodes);
        let errors = errors_of(&report);
        assert!(
            errors.iter().any(|(n, e)| n == "aaa-newcomer"
                && e.contains("node-0005")
                && e.contains("record")),
            "{errors:?}"
        );
    });
}

#[test]
fn drift_in_the_map_is_rewritten_not_adopted() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(3);
        env.write_nodes(&nodes);
        let _daemon = env.spawn(&["--resync-interval", "300ms"]);
        env.wait("all routes", TIMEOUT, || env.routes().len() == 6);
        let id = env.map()["10.88.1.3"];
        // Someone rewrites node-0002's entry with another ID.
        let pin = node_agent::datapath::node_ids_pin(&env.bpffs);
        let mut map = node_agent::datapath::maps::NodeMap::open(&pin).unwrap();
        map.upsert(
            "10.88.1.3".parse().unwrap(),
            node_agent_common::NodeValue {
                id: 999,
                spi: 0,
                flags: 0,
            },
        )
        .unwrap();
        env.wait("the recorded ID back", TIMEOUT, || {
            env.map()["10.88.1.3"] == id
        });
    });
}

/// Three remote nodes programmed (with `--max-node-id 3`, the whole ID space), the third's ID,
/// and a newcomer that will ask for it.
fn three_programmed(env: &AgentEnv) -> (Vec<TestNode>, u16, TestNode) {
    let nodes = cluster(3);
    env.write_nodes(&nodes);
    assert_eq!(env.once(&[]).0, 0);
    let freed = env.map()[&nodes[2].ips[0]];
    (nodes, freed, TestNode::dual("node-0100", 100))
}

#[test]
fn the_cooldown_of_a_freed_id_survives_a_lost_checkpoint() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let (nodes, freed, newcomer) = three_programmed(&env);
        env.write_nodes(&nodes[..2]);
        assert_eq!(env.once(&[]).0, 0);
        std::fs::remove_file(env.checkpoint()).unwrap();
        // Only IDs 1..=3 exist in this test's ID space: the only free one is cooling down.
        env.write_nodes(&[nodes[0].clone(), nodes[1].clone(), newcomer.clone()]);
        let (code, report, err) = env.once(&["--max-node-id", "3"]);
        assert_eq!(code, 0, "{err}");
        assert!(
            !env.map().contains_key(&newcomer.ips[0]),
            "ID {freed} was freed moments ago: {report}"
        );
        assert!(
            errors_of(&report)
                .iter()
                .any(|(n, e)| n == "node-0100" && e.contains("cooling")),
            "{report}"
        );
        // With the ID space open, the newcomer gets a fresh ID, not the cooling one.
        let (code, _, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_ne!(env.map()[&newcomer.ips[0]], freed);
    });
}

/// At the edge of the ID space, a freed ID that has cooled the floor (not the cool-down) goes to
/// the newcomer that waits for one, with a warning; before the floor the newcomer is held with an
/// error that says when.
#[test]
fn at_the_edge_an_id_cooled_past_the_floor_is_reused_early() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let (nodes, freed, newcomer) = three_programmed(&env);
        env.write_nodes(&[nodes[0].clone(), nodes[1].clone(), newcomer.clone()]);
        let edge = ["--max-node-id", "3", "--id-reuse-floor", "2s"];
        let (code, report, err) = env.once(&edge);
        assert_eq!(code, 0, "{err}");
        assert!(!env.map().contains_key(&newcomer.ips[0]), "{report}");
        assert!(
            errors_of(&report)
                .iter()
                .any(|(n, e)| n == "node-0100" && e.contains("once it has cooled 2s")),
            "{report}"
        );
        // Past the floor the ID comes back. Each run is a fresh process whose plan reads the
        // clock when it starts, so runs repeat until one starts past the floor (a loaded machine
        // only takes more of them); the floor is 2 s, so 30 s without it is a failure.
        let held_at = std::time::Instant::now();
        let mut runs = Vec::new();
        let got = loop {
            std::thread::sleep(Duration::from_millis(500));
            let (code, report, err) = env.once(&edge);
            assert_eq!(code, 0, "{err}");
            let got = env.map().get(&newcomer.ips[0]).copied();
            runs.push(format!("{report}\n{err}"));
            if got.is_some() || held_at.elapsed() > Duration::from_secs(30) {
                break got;
            }
        };
        let last = runs.last().unwrap();
        assert_eq!(got, Some(freed), "after {} runs: {last}", runs.len());
        assert!(last.contains("before its cool-down has passed"), "{last}");
        println!(
            "id edge: the newcomer got the freed ID {:.1} s after it was held, at run {}",
            held_at.elapsed().as_secs_f64(),
            runs.len()
        );
    });
}

#[test]
fn a_near_total_wipe_waits_for_the_operator() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(10);
        env.write_nodes(&nodes);
        let _daemon = env.spawn(&["--prune-confirm-delay", "1s", "--relist-interval", "300ms"]);
        env.wait("all routes", TIMEOUT, || env.routes().len() == 20);
        env.write_nodes(&[]);
        let hold = env.state_dir.join("hold.json");
        env.wait("the published hold", TIMEOUT, || hold.exists());
        // Relists well past the confirm delay do not release a wipe.
        std::thread::sleep(Duration::from_secs(3));
        assert_eq!(env.routes().len(), 20);
        let (code, status, err) = env.cli(&["prune", "status", "--output", "json"]);
        assert_eq!(code, 0, "{err}");
        let status: serde_json::Value = serde_json::from_str(&status).unwrap();
        assert_eq!(status["kind"], "wipe", "{status}");
        let id = status["id"].as_str().unwrap().to_owned();
        let (code, _, err) = env.cli(&["prune", "confirm", "0123456789ab"]);
        assert_ne!(code, 0);
        assert!(err.contains(&id), "names the hold it does hold: {err}");
        let (code, out, err) = env.cli(&["prune", "confirm", &id]);
        assert_eq!(code, 0, "{out}{err}");
        env.wait("the confirmed wipe", TIMEOUT, || env.routes().is_empty());
        env.wait("the hold withdrawn", TIMEOUT, || !hold.exists());
        assert!(env.map().is_empty());
    });
}

#[test]
fn a_full_map_never_displaces_a_programmed_node() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(2);
        env.write_nodes(&nodes);
        let fixed = ["--node-map-max", "4", "--node-map-grow", "false"];
        assert_eq!(env.once(&fixed).0, 0);
        let before = ids(&env, &nodes);
        let mut all = vec![TestNode::dual("aaa-new", 50)];
        all.extend(nodes.iter().cloned());
        env.write_nodes(&all);
        let (code, report, err) = env.once(&fixed);
        assert_eq!(code, 0, "{err}");
        assert_exact(&env, &nodes);
        assert_eq!(ids(&env, &nodes), before);
        assert!(
            errors_of(&report)
                .iter()
                .any(|(n, e)| n == "aaa-new" && e.contains("map full")),
            "{report}"
        );
    });
}

#[test]
fn a_map_that_fills_grows_online_and_a_smaller_request_never_shrinks_it() {
    use node_agent::datapath::{node_ids_pin, pins::MapLayout};
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let capacity = || {
            MapLayout::of_pin(&node_ids_pin(&env.bpffs))
                .unwrap()
                .unwrap()
                .max_entries
        };
        let mut nodes = cluster(2);
        env.write_nodes(&nodes);
        // Four entries would fill a map of four: it doubles before they are written.
        let (code, report, err) = env.once(&["--node-map-max", "4"]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(capacity(), 8, "{report}");
        assert!(err.contains("node-ID map grown online"), "{err}");
        nodes.push(TestNode::dual("node-new", 50));
        env.write_nodes(&nodes);
        let (code, report, err) = env.once(&["--node-map-max", "4"]);
        assert_eq!(code, 0, "{err}");
        assert!(errors_of(&report).is_empty(), "{report}");
        assert_exact(&env, &nodes);
        assert_eq!(
            capacity(),
            8,
            "six of eight entries is under three quarters"
        );
        // The flag's smaller size never shrinks the grown map, and a restart writes nothing.
        let (code, report, err) = env.once(&["--node-map-max", "4"]);
        assert_eq!((code, &report["kernel_writes"]), (0, &0.into()), "{err}");
        assert_eq!(capacity(), 8);
    });
}

#[test]
fn removals_split_over_runs_are_counted_together() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(10);
        env.write_nodes(&nodes);
        assert_eq!(env.once(&[]).0, 0);
        env.write_nodes(&nodes[4..]);
        assert_eq!(env.once(&[]).0, 0, "four of ten is fine");
        // The checkpoint remembers them for the window, and `state show` says so.
        let (code, shown, err) = env.cli(&["state", "show", "--output", "json"]);
        assert_eq!(code, 0, "{err}");
        let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
        assert_eq!(shown["recent_removals"][0]["nodes"], 4, "{shown}");
        env.write_nodes(&nodes[6..]);
        let (code, report, _) = env.once(&[]);
        assert_eq!(code, 3, "six of ten within the window: {report}");
        assert_exact(&env, &nodes[4..]);
        // The checkpoint is lost, and with it the window; so is the freed-ID record (which
        // stands in for the window where nothing better is left). The kernel's record of
        // recent removals still counts the four.
        std::fs::remove_file(env.checkpoint()).unwrap();
        std::fs::remove_file(node_agent::datapath::records::freed_ids::pin(&sb.bpffs)).unwrap();
        let (code, report, _) = env.once(&[]);
        assert_eq!(code, 3, "still six of ten within the window: {report}");
        assert_eq!(report["brake"]["removed_nodes"], 6, "{report}");
        assert_exact(&env, &nodes[4..]);
        assert_eq!(env.once(&["--force-prune"]).0, 0);
        assert_exact(&env, &nodes[6..]);
    });
}

/// A wall clock stepped forward past the window between two runs on one boot (an NTP step,
/// `date -s`; here libfaketime in front of the agent, the host's clock untouched) empties no
/// window: the agent's clock continues from the record by the boot clock, so the first run's
/// four removals still count with the second run's two.
#[test]
fn a_wall_clock_step_forward_keeps_the_window() {
    require_sandbox!();
    let lib = match faketime_lib() {
        Ok(lib) => lib,
        Err(why) => return skip(node_agent_tests::test_name!(), &why),
    };
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(10);
        env.write_nodes(&nodes);
        assert_eq!(env.once(&[]).0, 0);
        env.write_nodes(&nodes[4..]);
        assert_eq!(env.once(&[]).0, 0, "four of ten is fine");
        env.write_nodes(&nodes[6..]);
        let two_hours_on = wall_clock_moved(&lib, "+2h");
        let (code, report, err) = env.once_with_env(&two_hours_on, &[]);
        assert_eq!(code, 3, "six of ten within the window: {report}\n{err}");
        assert_eq!(report["brake"]["removed_nodes"], 6, "{report}");
        assert_exact(&env, &nodes[4..]);
        assert_eq!(env.once(&["--force-prune"]).0, 0);
        assert_exact(&env, &nodes[6..]);
    });
}

/// A removal the brake holds stays held when the checkpoint is lost meanwhile: the run after
/// the loss counts the held nodes by the IDs their map entries carry, and so does every run
/// after it, whose new checkpoint no longer names them. Counted as objects only, they would
/// pass here: the cluster's own nodes are dual-stack with pod CIDRs (six objects each), the
/// held ones have one address and no pod CIDR (one map entry each).
#[test]
fn a_held_removal_stays_held_after_the_checkpoint_is_lost() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(4);
        let other: Vec<TestNode> = (50..56)
            .map(|i| TestNode {
                cidrs: Vec::new(),
                ..TestNode::v4(&format!("other-{i}"), i)
            })
            .collect();
        env.write_nodes(&[nodes.clone(), other.clone()].concat());
        assert_eq!(env.once(&[]).0, 0);
        // The six are gone from the list: six of ten, held.
        env.write_nodes(&nodes);
        let (code, report, _) = env.once(&[]);
        assert_eq!(code, 3, "{report}");
        let (code, report, _) = env.once(&[]);
        assert_eq!(code, 3, "{report}");
        let mut bytes = std::fs::read(env.checkpoint()).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x5a;
        std::fs::write(env.checkpoint(), bytes).unwrap();
        for run in ["the run after the loss", "the run after that"] {
            let (code, report, _) = env.once(&[]);
            assert_eq!(code, 3, "{run}: {report}");
            assert_eq!(report["brake"]["removed_nodes"], 6, "{run}: {report}");
            assert_exact(&env, &[nodes.clone(), other.clone()].concat());
        }
        assert_eq!(env.once(&["--force-prune"]).0, 0);
        assert_exact(&env, &nodes);
    });
}

/// A restart is no confirmation: every one-shot run is a restart, and the nodes that joined
/// while a wipe was held (9 held of 20 known, 45%, would pass the ratio) dilute nothing. Only
/// the operator releases it.
#[test]
fn a_hold_survives_restarts_while_newcomers_dilute_its_ratio() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(10);
        env.write_nodes(&nodes);
        assert_eq!(env.once(&[]).0, 0);
        env.write_nodes(&nodes[..1]);
        let (code, report, _) = env.once(&[]);
        assert_eq!(code, 3, "{report}");
        assert_eq!(report["brake"]["kind"], "wipe", "{report}");
        let newcomers: Vec<TestNode> = (100..110)
            .map(|i| TestNode::dual(&format!("new-{i}"), i))
            .collect();
        let live = [nodes[..1].to_vec(), newcomers].concat();
        env.write_nodes(&live);
        for run in ["the run the newcomers join in", "the run after it"] {
            let (code, report, _) = env.once(&[]);
            assert_eq!(code, 3, "{run}: {report}");
            assert_eq!(report["brake"]["kind"], "wipe", "{run}: {report}");
            assert_exact(&env, &[nodes.clone(), live[1..].to_vec()].concat());
        }
        assert_eq!(env.once(&["--force-prune"]).0, 0);
        assert_exact(&env, &live);
    });
}

#[test]
fn another_cluster_with_more_nodes_or_the_same_names_is_held() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(4);
        env.write_nodes(&nodes);
        assert_eq!(env.once(&[]).0, 0);
        // Many more nodes, none of them ours.
        let other: Vec<TestNode> = (50..70)
            .map(|i| TestNode::dual(&format!("other-{i}"), i))
            .collect();
        env.write_nodes(&other);
        let (code, report, _) = env.once(&[]);
        assert_eq!(code, 3, "{report}");
        let map = env.map();
        assert!(
            nodes
                .iter()
                .all(|n| n.ips.iter().all(|ip| map.contains_key(ip)))
        );
        // The same names, with other UIDs, addresses and pod CIDRs.
        let impostors: Vec<TestNode> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| TestNode {
                name: n.name.clone(),
                uid: Some(format!("other-uid-{i}")),
                ..TestNode::dual("x", 80 + i as u32)
            })
            .collect();
        env.write_nodes(&impostors);
        let (code, report, _) = env.once(&[]);
        assert_eq!(code, 3, "{report}");
        let map = env.map();
        assert!(
            nodes
                .iter()
                .all(|n| n.ips.iter().all(|ip| map.contains_key(ip)))
        );
    });
}

#[test]
fn orphans_without_a_checkpoint_are_held_when_most_would_go() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(6);
        env.write_nodes(&nodes);
        assert_eq!(env.once(&[]).0, 0);
        std::fs::remove_file(env.checkpoint()).unwrap();
        env.write_nodes(&nodes[..1]);
        let (code, report, _) = env.once(&[]);
        assert_eq!(code, 3, "{report}");
        assert!(report["brake"]["orphans"].as_u64().unwrap() > 0, "{report}");
        assert_exact(&env, &nodes);
        // The operator says go.
        assert_eq!(env.once(&["--force-prune"]).0, 0);
        assert_exact(&env, &nodes[..1]);
    });
}

/// An address on an interface that is down is not the host's: kube-proxy's IPVS mode keeps every
/// Service's ClusterIP and externalIPs (which may be nodes' addresses) on `kube-ipvs0`, which is
/// never up. A node at such an address is not held as the local node's; it gets its map entry,
/// and the kernel, which takes the address as local, refuses a nexthop through it.
#[test]
fn an_address_on_an_interface_that_is_down_is_not_the_hosts() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let node = TestNode::v4("node-0001", 1);
        // Down, as kube-ipvs0 is (a veth: not every test kernel has the dummy driver).
        ip(&[
            "link",
            "add",
            "kube-ipvs0",
            "type",
            "veth",
            "peer",
            "name",
            "ipvs-peer",
        ]);
        ip(&[
            "addr",
            "add",
            &format!("{}/32", node.ips[0]),
            "dev",
            "kube-ipvs0",
        ]);
        env.write_nodes(std::slice::from_ref(&node));
        let (_, report, err) = env.once(&[]);
        let errors = errors_of(&report);
        assert!(
            !errors
                .iter()
                .any(|(_, e)| e.contains("belongs to the local node")),
            "{errors:?}\n{err}"
        );
        assert!(env.map().contains_key(&node.ips[0]), "{report}\n{err}");
    });
}

/// What the host holds is the local node's, whatever the local node's record lists (the address
/// policy): a remote node on a secondary address of the host, or one whose pod CIDR lies on the
/// host's own link (IPv4's connected route is `scope link`, IPv6's has no gateway), is reported
/// and gets no map entry, nexthop or route; the host keeps its gateway. A remote node on the
/// host's link is how nodes are, and is programmed.
#[test]
fn what_the_host_holds_is_never_mapped_or_routed_to_a_node() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        ip(&["addr", "add", "10.88.0.2/16", "dev", "gw0"]);
        ip(&[
            "route",
            "add",
            "default",
            "via",
            "10.88.255.254",
            "dev",
            "gw0",
        ]);
        let secondary = TestNode {
            name: "secondary".into(),
            ips: vec!["10.88.0.2".into()],
            cidrs: vec!["10.101.1.0/24".into()],
            ..TestNode::default()
        };
        let mut on_link = TestNode::v4("on-link", 20);
        on_link.cidrs = vec!["10.88.128.0/17".into()];
        let on_link6 = TestNode {
            name: "on-link6".into(),
            ips: vec!["10.88.1.22".into(), "fd00:88::122".into()],
            cidrs: vec!["fd00:88:0:0:8000::/65".into()],
            ..TestNode::default()
        };
        let normal = TestNode::dual("node-0001", 1);
        let nodes = [secondary, on_link.clone(), on_link6.clone(), normal.clone()];
        env.write_nodes(&nodes);
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        let errors = errors_of(&report);
        for e in &errors {
            println!("{}: {}", e.0, e.1);
        }
        let said =
            |node: &str, what: &str| errors.iter().any(|(n, e)| n == node && e.contains(what));
        assert!(
            said("secondary", "address 10.88.0.2 belongs to the local node"),
            "{errors:?}"
        );
        assert!(
            said("on-link", "the host's on-link prefix 10.88.0.0/16 on gw0"),
            "{errors:?}"
        );
        assert!(
            said("on-link6", "the host's on-link prefix fd00:88::/64 on gw0"),
            "{errors:?}"
        );
        assert_eq!(errors.len(), 3, "{errors:?}");
        let map = env.map();
        let mapped: Vec<&str> = map.keys().map(String::as_str).collect();
        assert_eq!(mapped, ["10.88.1.2", "fd00:88::101"], "node-0001's alone");
        let routes = env.routes();
        let routed: Vec<&str> = routes.keys().map(String::as_str).collect();
        assert_eq!(
            routed,
            ["10.100.1.0/24", "fd00:244:2::/64"],
            "node-0001's alone"
        );
        for (id, (gateway, _)) in env.nexthops() {
            assert!(
                ["10.88.1.2", "fd00:88::101"].contains(&gateway.as_str()),
                "nexthop {id} via {gateway}"
            );
        }
        // The host's gateway is still on its link, not behind a node.
        let out = ip(&["route", "get", "10.88.255.254"]);
        let how = String::from_utf8_lossy(&out.stdout);
        assert!(how.contains("dev gw0") && !how.contains("via"), "{how}");
        // A second pass changes nothing: the held nodes stay held, the run stays clean.
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(report["kernel_writes"], 0, "{report}");
        assert_eq!(errors_of(&report).len(), 3, "{report}");
    });
}

//! End to end: the real `node-agent` binary, driven by a NodeList file, in a sandbox (own
//! network and mount namespaces, private bpffs) per test.

use std::collections::BTreeMap;
use std::time::Duration;

use node_agent_tests::agent::assert_exact;
use node_agent_tests::agent::cluster;
use node_agent_tests::agent::{AgentEnv, TestNode, local_node};
use node_agent_tests::require_sandbox;
use node_agent_tests::{ip, sandbox};

/// Generous: the same tests run under QEMU's TCG emulation in the VM tier.
const TIMEOUT: Duration = Duration::from_secs(90);
/// How long a daemon may take to sync 2,000 nodes from a file and write its first routes. In the
/// VM tier (a debug build under emulation) the sync alone has taken over 20 s, and one run went
/// past [`TIMEOUT`] before its first route; the wait only bounds a hang.
const FIRST_WRITES_OF_A_LARGE_CLUSTER: Duration = Duration::from_secs(300);

fn ids_of(env: &AgentEnv, nodes: &[TestNode]) -> BTreeMap<String, u16> {
    let map = env.map();
    nodes
        .iter()
        .map(|n| (n.name.clone(), map[&n.ips[0]]))
        .collect()
}

#[test]
fn restart_with_churn_leaves_exactly_the_live_nodes() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let before = cluster(10);
        env.write_nodes(&before);
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(report["live_nodes"], 11);
        assert_exact(&env, &before);
        let ids_before = ids_of(&env, &before);

        // While the agent is down:
        let mut after = before.clone();
        after.retain(|n| n.name != "node-0001"); // deleted
        let changed = after.iter_mut().find(|n| n.name == "node-0002").unwrap();
        *changed = TestNode::dual("node-0002", 102); // new IPs and pod CIDRs
        let recycled_ip = before[2].ips.clone();
        after.retain(|n| n.name != "node-0003"); // deleted, and its IPs go to a new node
        let mut newcomer = TestNode::dual("node-0103", 103);
        newcomer.ips = recycled_ip;
        after.push(newcomer);
        let renamed = after.iter_mut().find(|n| n.name == "node-0004").unwrap();
        renamed.name = "node-0004-renamed".into(); // renamed, same IPs
        after.push(TestNode::dual("node-0111", 111)); // added
        env.write_nodes(&after);

        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert!(report["brake"].is_null(), "{report}");
        assert_exact(&env, &after);
        let pruned: Vec<String> = serde_json::from_value(report["pruned"].clone()).unwrap();
        assert!(pruned.contains(&"node-0001".to_string()), "{report}");
        // Survivors keep their IDs, the changed node included.
        let ids_after = ids_of(&env, &after);
        for name in ["node-0002", "node-0005", "node-0006", "node-0010"] {
            assert_eq!(ids_after[name], ids_before[name], "{name} changed ID");
        }
        // The recycled IP does not keep pointing at the dead node's ID.
        assert_ne!(
            ids_after["node-0103"], ids_before["node-0003"],
            "recycled IP kept a dead node's ID"
        );
        let ids: std::collections::BTreeSet<u16> = ids_after.values().copied().collect();
        assert_eq!(ids.len(), after.len(), "IDs are unique: {ids_after:?}");

        // An unchanged restart writes nothing.
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(report["kernel_writes"], 0, "{report}");
        assert_exact(&env, &after);
        // The report says what the run cost in memory: the agent's own peak, for sizing limits.
        let peak = report["peak_rss_kib"].as_u64().unwrap_or(0);
        assert!(
            (1024..1024 * 1024).contains(&peak),
            "peak RSS {peak} KiB: {report}"
        );
    });
}

#[test]
fn sigterm_writes_the_final_checkpoint() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(3);
        env.write_nodes(&nodes);
        // Coalescing holds every write after the first for an hour: only SIGTERM can write.
        let mut child = env.spawn(&["--checkpoint-interval", "1h"]);
        env.wait("the first checkpoint", TIMEOUT, || {
            env.checkpoint().exists()
        });
        let first = std::fs::read(env.checkpoint()).unwrap();
        let mut more = nodes.clone();
        more.push(TestNode::dual("node-0042", 42));
        env.write_nodes(&more);
        env.wait("the new node's route", TIMEOUT, || {
            env.routes().contains_key("10.100.42.0/24")
        });
        assert_eq!(
            std::fs::read(env.checkpoint()).unwrap(),
            first,
            "written before SIGTERM"
        );
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        assert!(status.success(), "exit status {status}");
        let out = std::process::Command::new(node_agent_tests::agent_bin())
            .args(["state", "show", "--output", "json", "--state-dir"])
            .arg(&env.state_dir)
            .output()
            .unwrap();
        let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let names: Vec<&str> = shown["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["name"].as_str().unwrap())
            .collect();
        assert!(names.contains(&"node-0042"), "{names:?}");
        assert!(
            !names.contains(&"local"),
            "the local node is never checkpointed"
        );
        // The datapath stays attached after the agent has gone.
        assert_eq!(
            node_agent_tests::attached("gw0", aya::programs::TcAttachType::Ingress),
            1
        );
    });
}

#[test]
fn kill_9_mid_reconcile_then_restart_converges_exactly() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let big = cluster(2000);
        env.write_nodes(&big);
        let mut child = env.spawn(&[]);
        // Kill it once it has started writing, before it can have finished.
        env.wait("the first routes", FIRST_WRITES_OF_A_LARGE_CLUSTER, || {
            !env.routes().is_empty() || child.try_wait().unwrap().is_some()
        });
        child.kill().unwrap();
        child.wait().unwrap();
        let partial = env.routes().len();
        node_agent_tests::report(&format!("kill -9 after {partial} of {} routes", 4000));

        // Meanwhile a quarter of the nodes went away.
        let after: Vec<TestNode> = big
            .iter()
            .filter(|n| !n.name.ends_with(['1', '3']))
            .cloned()
            .collect();
        env.write_nodes(&after);
        let (code, report, err) = env.once(&["--force-prune"]);
        assert_eq!(code, 0, "{err}");
        assert!(
            report["failed_ops"].as_array().unwrap().is_empty(),
            "{report}"
        );
        assert_exact(&env, &after);
        let (_, report, _) = env.once(&[]);
        assert_eq!(report["kernel_writes"], 0, "{report}");
    });
}

#[test]
fn corrupt_checkpoint_is_moved_aside_and_the_agent_converges() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(4);
        env.write_nodes(&nodes);
        assert_eq!(env.once(&[]).0, 0);
        std::fs::write(env.checkpoint(), b"NAGCKPT\0 this is not a checkpoint").unwrap();
        let fewer = &nodes[..2];
        env.write_nodes(fewer);
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert!(err.contains("moved aside"), "{err}");
        let aside: Vec<_> = std::fs::read_dir(&env.state_dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("nodes.ckpt.corrupt-")
            })
            .collect();
        assert_eq!(aside.len(), 1, "the corrupt file is kept aside");
        // Without the checkpoint, the orphan sweep removes the two dropped nodes' objects.
        assert_exact(&env, fewer);
        assert_eq!(report["restored_nodes"], 0);
    });
}

#[test]
fn lost_checkpoint_orphans_are_swept_and_foreign_objects_stay() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(4);
        env.write_nodes(&nodes);
        assert_eq!(env.once(&[]).0, 0);
        ip(&[
            "route",
            "add",
            "10.55.0.0/24",
            "via",
            "10.88.0.9",
            "proto",
            "static",
        ]);
        ip(&[
            "-6",
            "route",
            "add",
            "fd00:55::/64",
            "via",
            "fd00:88::9",
            "proto",
            "static",
        ]);
        std::fs::remove_file(env.checkpoint()).unwrap();
        env.write_nodes(&nodes[1..]);
        let (code, _, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_exact(&env, &nodes[1..]);
        let v4 = String::from_utf8(ip(&["route", "show", "proto", "static"]).stdout).unwrap();
        assert!(v4.contains("10.55.0.0/24"), "{v4}");
        let v6 = String::from_utf8(ip(&["-6", "route", "show", "proto", "static"]).stdout).unwrap();
        assert!(v6.contains("fd00:55::/64"), "{v6}");
    });
}

#[test]
fn a_second_instance_is_refused() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        env.write_nodes(&cluster(2));
        let mut first = env.spawn(&[]);
        env.wait("the first instance to be ready", TIMEOUT, || {
            env.checkpoint().exists()
        });
        let out = env.command(&["--once"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("already running") && err.contains(&first.id().to_string()),
            "names the holder's PID: {err}"
        );
        first.kill().unwrap();
        first.wait().unwrap();
    });
}

#[test]
fn the_brake_holds_and_force_prune_releases_it() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(10);
        env.write_nodes(&nodes);
        assert_eq!(env.once(&[]).0, 0);
        env.write_nodes(&nodes[..2]); // 8 of 10 gone at once: looks like a partial list
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 3, "brake held exits 3: {err}");
        assert_eq!(report["brake"]["stale_nodes"], 8, "{report}");
        assert!(err.contains("8 stale nodes"), "{err}");
        assert_exact(&env, &nodes); // nothing deleted
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 3, "still held without confirmation: {err} {report}");
        let (code, report, err) = env.once(&["--force-prune"]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(report["pruned_nodes"], 8, "{report}");
        assert_exact(&env, &nodes[..2]);
    });
}

#[test]
fn the_daemon_deletes_held_nodes_after_a_confirming_relist() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(10);
        env.write_nodes(&nodes);
        let mut child = env.spawn(&["--prune-confirm-delay", "1s", "--relist-interval", "300ms"]);
        env.wait("all routes", TIMEOUT, || env.routes().len() == 20);
        env.write_nodes(&nodes[..2]);
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(env.routes().len(), 20, "deleted before the confirm delay");
        env.wait("the confirmed prune", TIMEOUT, || env.routes().len() == 4);
        assert_exact(&env, &nodes[..2]);
        child.kill().unwrap();
        child.wait().unwrap();
    });
}

#[test]
fn bad_nodes_are_reported_and_the_rest_are_programmed() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let good = cluster(3);
        let mut all = good.clone();
        let mut bad_ip = TestNode::v4("bad-ip", 50);
        bad_ip.ips = vec!["10.88.300.1".into()];
        let mut bad_cidr = TestNode::v4("bad-cidr", 51);
        bad_cidr.cidrs = vec!["10.1.2.3/33".into()];
        let mut dup = TestNode::v4("zz-duplicate-ip", 52);
        dup.ips = good[0].ips[..1].to_vec();
        all.extend([bad_ip, bad_cidr, dup]);
        env.write_nodes(&all);
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        let errors = report["errors"].as_array().unwrap();
        let named: Vec<&str> = errors.iter().map(|e| e["node"].as_str().unwrap()).collect();
        for n in ["bad-ip", "bad-cidr", "zz-duplicate-ip"] {
            assert!(named.contains(&n), "{n} not reported: {report}");
        }
        assert_exact(&env, &good);
    });
}

/// Whether this kernel can create an ESP state, asked through `ip`, independently of the agent.
pub(crate) fn kernel_has_esp() -> bool {
    let ok = std::process::Command::new("ip")
        .args([
            "xfrm",
            "state",
            "add",
            "src",
            "192.0.2.1",
            "dst",
            "192.0.2.2",
            "proto",
            "esp",
            "spi",
            "0x4e41",
            "mode",
            "tunnel",
            "aead",
            "rfc4106(gcm(aes))",
            "0x0102030405060708090a0b0c0d0e0f1011121314",
            "128",
        ])
        .output()
        .unwrap()
        .status
        .success();
    if ok {
        ip(&["xfrm", "state", "flush"]);
    }
    ok
}

/// The xfrm objects of ours in the kernel: (kind, remote endpoint or CIDR, node ID in the mark).
fn xfrm_objects() -> Vec<(String, String, u16)> {
    use node_agent::backends::xfrm::{KeyBook, XfrmBackend};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let x = XfrmBackend::new(KeyBook::default()).unwrap();
        let mut out = Vec::new();
        for s in x.dump_states().await.unwrap() {
            let (kind, remote) = match s.dir {
                state::objects::XfrmDir::Out => ("state-out", s.dst),
                state::objects::XfrmDir::In => ("state-in", s.src),
            };
            out.push((kind.to_owned(), remote.to_string(), s.node_id.get()));
        }
        for p in x.dump_policies().await.unwrap().policies {
            out.push((
                format!("policy-out via {}", p.tmpl_dst),
                p.dst.to_string(),
                p.node_id.get(),
            ));
        }
        out.sort();
        out
    })
}

/// What the kernel must hold with IPsec for `nodes`, the node IDs taken from the map: both
/// states per remote address, a policy per pod CIDR; every mark carries the map's ID.
fn expected_xfrm(env: &AgentEnv, nodes: &[TestNode]) -> Vec<(String, String, u16)> {
    let map = env.map();
    let mut out = Vec::new();
    for n in nodes {
        let id = map[&n.ips[0]];
        // A state only where pod traffic uses it: OUT in the families of the node's pod
        // CIDRs, IN in those of the local node's (IPv4 only).
        let has_cidr_of =
            |cidrs: &[String], ip: &str| cidrs.iter().any(|c| c.contains(':') == ip.contains(':'));
        for ip in &n.ips {
            assert_eq!(map[ip], id, "{} maps to one ID", n.name);
            if has_cidr_of(&n.cidrs, ip) {
                out.push(("state-out".to_owned(), ip.clone(), id));
            }
            if has_cidr_of(&local_node().cidrs, ip) {
                out.push(("state-in".to_owned(), ip.clone(), id));
            }
        }
        for c in &n.cidrs {
            let gw = n
                .ips
                .iter()
                .find(|i| i.contains(':') == c.contains(':'))
                .unwrap();
            out.push((format!("policy-out via {gw}"), c.clone(), id));
        }
    }
    out.sort();
    out
}

#[test]
fn ipsec_restart_with_churn_or_a_clear_error_without_esp() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let key = env.state_dir.with_file_name("ipsec.key");
        std::fs::write(
            &key,
            "3 rfc4106(gcm(aes)) 0x0102030405060708090a0b0c0d0e0f1011121314 128\n",
        )
        .unwrap();
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let key_arg = key.to_str().unwrap();
        let nodes = cluster(6);
        env.write_nodes(&nodes);
        // The bridge pod traffic enters through: IPsec refuses to start without one.
        ip(&["link", "add", "cni0", "type", "bridge"]);
        let ipsec = ["--ipsec-key-file", key_arg, "--pod-iface", "cni0"];

        if !kernel_has_esp() {
            let out = env
                .command(&["--once", ipsec[0], ipsec[1], ipsec[2], ipsec[3]])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{err}");
            assert!(
                err.contains("this kernel has no ESP support (CONFIG_INET_ESP)"),
                "{err}"
            );
            assert!(
                !err.contains("0102030405060708"),
                "key material in the error: {err}"
            );
            assert!(!env.checkpoint().exists(), "nothing was done");
            node_agent_tests::skip_without_esp(
                "ipsec_restart_with_churn (the churn half)",
                "this kernel has no ESP support; the VM tier runs it",
            );
            return;
        }

        let (code, _, err) = env.once(&ipsec);
        assert_eq!(code, 0, "{err}");
        assert_exact(&env, &nodes);
        assert_eq!(xfrm_objects(), expected_xfrm(&env, &nodes));
        let ids_before = ids_of(&env, &nodes);

        let mut after: Vec<TestNode> = nodes
            .iter()
            .filter(|n| n.name != "node-0001")
            .cloned()
            .collect();
        *after.iter_mut().find(|n| n.name == "node-0002").unwrap() =
            TestNode::dual("node-0002", 102);
        after.push(TestNode::dual("node-0111", 111));
        env.write_nodes(&after);
        let (code, report, err) = env.once(&ipsec);
        assert_eq!(code, 0, "{err}");
        assert!(
            report["failed_ops"].as_array().unwrap().is_empty(),
            "{report}"
        );
        assert_exact(&env, &after);
        assert_eq!(
            xfrm_objects(),
            expected_xfrm(&env, &after),
            "states and policies of exactly the live nodes"
        );
        assert_eq!(ids_of(&env, &after)["node-0002"], ids_before["node-0002"]);
        let (_, report, _) = env.once(&ipsec);
        assert_eq!(report["kernel_writes"], 0, "{report}");

        // IPsec turned off: every state, policy, guard and mark of ours goes (left, they went
        // on encrypting toward peers that no longer decrypt, and the marks on steering pod
        // traffic into them); the routes and map entries stay.
        assert!(xfrm_guards() > 0 && pod_cidr_marks(&sb.bpffs) > 0);
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{report}\n{err}");
        assert_eq!(xfrm_objects(), Vec::new());
        assert_eq!(xfrm_guards(), 0, "the guards go too");
        assert_eq!(pod_cidr_marks(&sb.bpffs), 0, "and the marks");
        assert_exact(&env, &after);
        assert_eq!(env.once(&[]).1["kernel_writes"], 0);
    });
}

/// Our xfrm guards in the namespace.
fn xfrm_guards() -> usize {
    use node_agent::backends::xfrm::{KeyBook, XfrmBackend};
    node_agent_tests::runtime().block_on(async {
        let x = XfrmBackend::new(KeyBook::default()).unwrap();
        x.dump_policies().await.unwrap().guards.len()
    })
}

/// The entries of the pod-CIDR map, which mark pod traffic for IPsec.
fn pod_cidr_marks(bpffs: &std::path::Path) -> usize {
    let pin = node_agent::datapath::pod_cidrs_pin(bpffs);
    node_agent::datapath::maps::PodCidrMap::open(&pin)
        .map_or(0, |m| m.dump().unwrap().entries.len())
}

#[test]
fn a_map_an_earlier_release_created_keeps_its_capacity_grows_on_request_and_new_maps_hold_more_than_65535()
 {
    use node_agent::datapath::{node_ids_pin, pins::MapLayout};
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(3);
        env.write_nodes(&nodes);
        let capacity = || {
            MapLayout::of_pin(&node_ids_pin(&env.bpffs))
                .unwrap()
                .unwrap()
                .max_entries
        };
        // The previous release's default was 16384 entries.
        let (code, _, err) = env.once(&["--node-map-max", "16384"]);
        assert_eq!(code, 0, "{err}");
        // Without the flag, the existing map is kept as it is.
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(report["kernel_writes"], 0, "{report}");
        assert_eq!(capacity(), 16384);
        assert_exact(&env, &nodes);
        // A larger size is grown to online, keeping every entry; a smaller one keeps the map.
        let (code, report, err) = env.once(&["--node-map-max", "262144"]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(report["kernel_writes"], 0, "{report}");
        assert_eq!(capacity(), 262144);
        assert_exact(&env, &nodes);
        let (code, _, err) = env.once(&["--node-map-max", "1024"]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(capacity(), 262144);
    });
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        env.write_nodes(&cluster(2));
        let (code, _, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        let layout = MapLayout::of_pin(&node_ids_pin(&env.bpffs))
            .unwrap()
            .unwrap();
        assert_eq!(
            layout.max_entries,
            node_agent_common::DEFAULT_NODE_MAP_MAX,
            "a new map holds a dual-stack cluster of 65,536 nodes"
        );
        assert!(layout.max_entries > 65_535);
    });
}

/// Make before break on the real kernel: a node readdressed while the agent was down keeps its
/// pod CIDRs, and its routes move to a new nexthop at the other ID of its pair (`2015…` for
/// IPv4, `2017…` for IPv6) before the old one goes, rather than the old one being replaced
/// under them (which makes the kernel walk every IPv4 route). The next readdress moves them
/// back to the first IDs; the other node is not touched.
#[test]
fn a_readdressed_nodes_routes_move_to_a_new_nexthop_at_the_other_id_of_its_pair() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let mut nodes = cluster(2);
        env.write_nodes(&nodes);
        let (code, _, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        let id = u32::from(ids_of(&env, &nodes)[&nodes[0].name]);
        let first = |v6: bool| if v6 { 201_600_000 } else { 201_400_000 } + id;
        let through = |env: &AgentEnv| env.routes_through_nexthops("main");
        let before = through(&env);
        for (readdress, offset) in [(20, 100_000), (30, 0)] {
            nodes[0].ips = TestNode::dual("moved", readdress).ips;
            env.write_nodes(&nodes);
            let (code, report, err) = env.once(&[]);
            assert_eq!(code, 0, "{err}");
            assert_exact(&env, &nodes);
            // Two map entries out and two in, two nexthops made, two routes moved onto them
            // and the two old nexthops deleted.
            assert_eq!(report["kernel_writes"], 10, "{report}");
            for (dst, nhid) in through(&env) {
                if nodes[0].cidrs.contains(&dst) {
                    assert_eq!(nhid, first(dst.contains(':')) + offset, "{dst}");
                } else {
                    assert_eq!(nhid, before[&dst], "the other node's {dst} stays");
                }
            }
            let ours: Vec<u32> = env
                .nexthops()
                .into_iter()
                .filter(|(_, (_, proto))| proto == "201")
                .map(|(nh, _)| nh)
                .collect();
            assert_eq!(ours.len(), 4, "one nexthop per node and family: {ours:?}");
            assert_eq!(env.once(&[]).1["kernel_writes"], 0, "settled");
        }
    });
}

#[test]
fn routes_with_their_own_gateway_move_to_nexthops_in_place_and_back() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(3);
        env.write_nodes(&nodes);
        let ours = |env: &AgentEnv| {
            env.nexthops()
                .into_iter()
                .filter(|(_, (_, proto))| proto == "201")
                .count()
        };
        // As the releases before nexthops wrote them.
        let (code, _, err) = env.once(&["--route-nexthops", "false"]);
        assert_eq!(code, 0, "{err}");
        assert_exact(&env, &nodes);
        assert!(env.routes_through_nexthops("main").is_empty());
        let routes = env.routes();
        // Upgraded: a nexthop per node and family, then each route replaced in place.
        let (code, report, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(
            report["kernel_writes"], 12,
            "6 nexthops, 6 replaces: {report}"
        );
        assert!(
            !err.contains("deleted route"),
            "no route was deleted: {err}"
        );
        assert_eq!(
            env.routes(),
            routes,
            "the same routes, via the same gateways"
        );
        assert_eq!(ours(&env), 6);
        let ids = ids_of(&env, &nodes);
        for (dst, nhid) in env.routes_through_nexthops("main") {
            let node = nodes.iter().find(|n| n.cidrs.contains(&dst)).unwrap();
            let base = if dst.contains(':') {
                201_600_000
            } else {
                201_400_000
            };
            assert_eq!(nhid, base + u32::from(ids[&node.name]), "{dst}");
        }
        assert_eq!(env.once(&[]).1["kernel_writes"], 0);
        // And back: the routes carry their gateways again before the nexthops go.
        let (code, _, err) = env.once(&["--route-nexthops", "false"]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(env.routes(), routes);
        assert!(env.routes_through_nexthops("main").is_empty());
        assert_eq!(ours(&env), 0);
    });
}

/// A second agent with a state directory of its own, on the node's bpffs (an operator's debug
/// `run --once` without `--datapath-iface`, with `--force-prune` and a list that would prune):
/// refused at start, naming the pin directory and the daemon's PID, before it touches the
/// kernel. The daemon's classifiers stay attached and its routes and map entries stay. A dry
/// run beside the daemon still plans (it only reads), and once the daemon is gone the lock went
/// with it: the next agent starts.
#[test]
fn a_second_agent_with_another_state_dir_is_refused_and_changes_nothing() {
    use aya::programs::TcAttachType;
    use node_agent_tests::attached;
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(3);
        env.write_nodes(&nodes);
        let mut daemon = env.spawn(&[]);
        env.wait("the daemon's routes and checkpoint", TIMEOUT, || {
            env.checkpoint().exists() && node_agent_tests::agent::is_exact(&env, &nodes)
        });
        let before = (
            env.routes(),
            env.map(),
            attached("gw0", TcAttachType::Ingress),
            attached("gw0", TcAttachType::Egress),
        );
        assert!(
            before.2 > 0 && before.3 > 0,
            "the daemon attached: {before:?}"
        );
        let base = sb.bpffs.parent().unwrap();
        let other_nodes = base.join("debug-nodes.yaml");
        std::fs::write(
            &other_nodes,
            node_agent_tests::agent::node_list(&[local_node()]),
        )
        .unwrap();
        let second = |extra: &[&str]| {
            let out = std::process::Command::new(node_agent_tests::agent_bin())
                .args(["run", "--node-name", "local", "--nodes-file"])
                .arg(&other_nodes)
                .arg("--state-dir")
                .arg(base.join("debug-state"))
                .arg("--bpffs")
                .arg(&sb.bpffs)
                .args(["--sync-timeout", "30s"])
                .args(extra)
                .output()
                .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        };
        let (code, err) = second(&["--once", "--force-prune"]);
        assert_ne!(code, Some(0), "{err}");
        assert!(
            err.contains("already running")
                && err.contains("pin directory")
                && err.contains(&daemon.id().to_string()),
            "names the pin directory and the daemon's PID: {err}"
        );
        let after = (
            env.routes(),
            env.map(),
            attached("gw0", TcAttachType::Ingress),
            attached("gw0", TcAttachType::Egress),
        );
        assert_eq!(before, after, "the daemon's objects changed");
        node_agent_tests::report(&format!(
            "second agent: refused ({}); {} routes, {} map entries, {}+{} classifiers kept",
            err.lines().last().unwrap_or("").trim(),
            after.0.len(),
            after.1.len(),
            after.2,
            after.3
        ));
        let (code, err) = second(&["--dry-run"]);
        assert!(
            matches!(code, Some(0) | Some(3)),
            "a dry run only reads: {err}"
        );
        assert!(!err.contains("already running"), "{err}");
        assert_eq!(env.routes(), before.0);
        daemon.kill().unwrap();
        daemon.wait().unwrap();
        // The lock died with the daemon: a restart (here a one-shot run) is not refused.
        let (code, _, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        assert_exact(&env, &nodes);
    });
}

/// What a hostile neighbour (or a mistake) can leave at a path the agent writes or creates.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Hostile {
    SymlinkToFile,
    SymlinkToDir,
    Dangling,
    Fifo,
    /// A directory where a file is expected.
    Directory,
    /// A regular file where a directory is expected.
    File,
    /// A second name of a file elsewhere.
    HardLink,
    /// A shared directory: mode 0777.
    WorldWritable,
    /// A shared directory like `/tmp`: mode 1777.
    Sticky,
    /// Someone else's directory (uid 65534).
    Foreign,
}

/// What the agent must do about it.
#[derive(Debug)]
enum Expect {
    /// Exit non-zero, the error naming the path and saying this.
    Refused(&'static str),
    /// Go on, the file moved aside (never opened through the link), saying so by name.
    SetAside,
    /// Go on, what was there removed (the link, not its target).
    Removed,
}

/// One path the agent writes or creates: its name, where it is, whether it is a directory.
struct Written {
    name: &'static str,
    path: std::path::PathBuf,
    dir: bool,
}

/// Every path the agent writes or creates at start, from the code: the state directory
/// (`CheckpointStore::open`), its lock, the checkpoint (replaced by rename, read back at start)
/// and the checkpoint's temporary file (a leftover is removed); in bpffs the pin directory
/// (`lock_pin_dir`) and the link directory (`Datapath::open`). Each x each hostile kind that
/// applies: the agent refuses naming the path (or, for the checkpoint, moves it aside by name;
/// for the temporary file, removes it), and no symlink's target is touched or created. Not
/// here: `hold.json` and `prune-confirm` (written only by a daemon with a hold and by
/// `prune confirm`, both through `input::replace`-style create-new-and-rename, and read through
/// the gate without following links: the input gate's table walks them).
#[test]
fn every_path_the_agent_writes_refuses_what_is_not_its_own() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        env.write_nodes(&cluster(2));
        let base = sb.bpffs.parent().unwrap().to_owned();
        let victim = base.join("victim");
        let victim_dir = base.join("victim-dir");
        let nothing = base.join("nothing-here");
        std::fs::create_dir(&victim_dir).unwrap();
        std::fs::set_permissions(&victim_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let pin_dir = node_agent::datapath::pin_dir(&sb.bpffs);
        let mut covered = Vec::new();
        let mut skipped = Vec::new();
        let mut n = 0;
        let dir_kinds = [
            Hostile::SymlinkToDir,
            Hostile::Dangling,
            Hostile::Fifo,
            Hostile::File,
            Hostile::WorldWritable,
            Hostile::Sticky,
            Hostile::Foreign,
        ];
        let file_kinds = [
            Hostile::SymlinkToFile,
            Hostile::Dangling,
            Hostile::Fifo,
            Hostile::Directory,
            Hostile::HardLink,
        ];
        // The bpffs directories first, while the pin directory is not there yet.
        for which in [
            "pin directory",
            "link directory",
            "state directory",
            "lock",
            "checkpoint",
            "temporary checkpoint",
        ] {
            let kinds: &[Hostile] = if which.ends_with("directory") {
                &dir_kinds
            } else {
                &file_kinds
            };
            for &kind in kinds {
                n += 1;
                let state = base.join(format!("case-{n}")).join("state");
                let w = match which {
                    "pin directory" => Written {
                        name: which,
                        path: pin_dir.clone(),
                        dir: true,
                    },
                    "link directory" => Written {
                        name: which,
                        path: pin_dir.join("links"),
                        dir: true,
                    },
                    "state directory" => Written {
                        name: which,
                        path: state.clone(),
                        dir: true,
                    },
                    "lock" => Written {
                        name: which,
                        path: state.join("lock"),
                        dir: false,
                    },
                    "checkpoint" => Written {
                        name: which,
                        path: state.join("nodes.ckpt"),
                        dir: false,
                    },
                    _ => Written {
                        name: which,
                        path: state.join(".nodes.ckpt.tmp"),
                        dir: false,
                    },
                };
                std::fs::create_dir_all(state.parent().unwrap()).unwrap();
                if which == "link directory" {
                    std::fs::create_dir_all(&pin_dir).unwrap();
                    std::fs::set_permissions(&pin_dir, std::fs::Permissions::from_mode(0o700))
                        .unwrap();
                }
                if !w.dir {
                    std::fs::create_dir_all(&state).unwrap();
                    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700))
                        .unwrap();
                }
                std::fs::write(&victim, "precious\n").unwrap();
                let expect = match plant(kind, &w, &victim, &victim_dir, &nothing) {
                    Ok(e) => e,
                    Err(why) => {
                        skipped.push(format!("{kind:?} at the {}: {why}", w.name));
                        continue;
                    }
                };
                let expect = match (w.name, expect) {
                    ("checkpoint", Expect::Refused(_)) => Expect::SetAside,
                    ("temporary checkpoint", Expect::Refused(_)) if kind != Hostile::Directory => {
                        Expect::Removed
                    }
                    ("temporary checkpoint", Expect::Refused(_)) => {
                        Expect::Refused("removing leftover temp checkpoint")
                    }
                    (_, e) => e,
                };
                let case_env = AgentEnv {
                    bpffs: env.bpffs.clone(),
                    state_dir: state.clone(),
                    nodes_file: env.nodes_file.clone(),
                    kubeconfig: None,
                    flags: Vec::new(),
                };
                let out = case_env
                    .command(&["--once", "--sync-timeout", "30s"])
                    .output()
                    .unwrap();
                let err = String::from_utf8_lossy(&out.stderr).into_owned();
                let shown = w.path.display().to_string();
                let what = format!("{kind:?} at the {} {shown}", w.name);
                match &expect {
                    Expect::Refused(says) => {
                        assert_ne!(out.status.code(), Some(0), "{what}: not refused\n{err}");
                        assert!(
                            err.contains(&shown) && err.contains(says),
                            "{what}: the error does not name the path and say {says:?}:\n{err}"
                        );
                    }
                    Expect::SetAside => {
                        assert_eq!(out.status.code(), Some(0), "{what}:\n{err}");
                        assert!(
                            err.contains("moved aside") && err.contains(&shown),
                            "{what}: not moved aside by name:\n{err}"
                        );
                        assert!(
                            std::fs::symlink_metadata(&w.path)
                                .is_ok_and(|m| m.file_type().is_file()),
                            "{what}: the agent's own checkpoint is in place"
                        );
                    }
                    Expect::Removed => {
                        assert_eq!(out.status.code(), Some(0), "{what}:\n{err}");
                        assert!(
                            std::fs::symlink_metadata(&w.path).is_err(),
                            "{what}: still there"
                        );
                    }
                }
                // No target was written, created or chmodded.
                assert_eq!(
                    std::fs::read_to_string(&victim).unwrap(),
                    "precious\n",
                    "{what}"
                );
                assert!(
                    !nothing.exists(),
                    "{what}: a dangling link's target was created"
                );
                let vd = std::fs::metadata(&victim_dir).unwrap();
                assert_eq!(
                    vd.mode() & 0o7777,
                    0o755,
                    "{what}: the linked directory was chmodded"
                );
                assert_eq!(
                    std::fs::read_dir(&victim_dir).unwrap().count(),
                    0,
                    "{what}: written in the linked directory"
                );
                if let (true, Expect::Refused(_)) = (w.dir, &expect)
                    && matches!(
                        kind,
                        Hostile::WorldWritable | Hostile::Sticky | Hostile::Foreign
                    )
                {
                    let m = std::fs::metadata(&w.path).unwrap();
                    assert_ne!(
                        m.mode() & 0o777,
                        0o700,
                        "{what}: a refused directory was chmodded"
                    );
                    assert!(
                        m.mode() & 0o777 != 0o700
                            && std::fs::read_dir(&w.path).unwrap().count() == 0,
                        "{what}: written in"
                    );
                }
                covered.push(format!("{kind:?}@{}", w.name));
                // Undo the plant (a directory the case left, the link), so the next case starts
                // from the agent's own layout.
                let m = std::fs::symlink_metadata(&w.path);
                match m {
                    Ok(m) if m.is_dir() => {
                        let _ = std::fs::remove_dir_all(&w.path);
                    }
                    Ok(_) => std::fs::remove_file(&w.path).unwrap(),
                    Err(_) => {}
                }
                let _ = std::fs::remove_file(&victim);
            }
        }
        for s in &skipped {
            node_agent_tests::report(&format!("written paths: skipped {s}"));
        }
        node_agent_tests::report(&format!(
            "written paths: {} cases refused, set aside or removed, no link followed ({} skipped): {}",
            covered.len(),
            skipped.len(),
            covered.join(", ")
        ));
        assert!(covered.len() >= 30, "too few cases ran: {}", covered.len());
    });
}

/// Puts `kind` at `w`'s path; what the agent must do about it (refusals say what they found).
fn plant(
    kind: Hostile,
    w: &Written,
    victim: &std::path::Path,
    victim_dir: &std::path::Path,
    nothing: &std::path::Path,
) -> Result<Expect, String> {
    use std::os::unix::fs::PermissionsExt;
    let p = &w.path;
    let mkdir = |mode| {
        std::fs::create_dir(p).map_err(|e| format!("mkdir: {e}"))?;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("chmod: {e}"))
    };
    Ok(match kind {
        Hostile::SymlinkToFile => {
            std::os::unix::fs::symlink(victim, p).unwrap();
            Expect::Refused("is a symbolic link")
        }
        Hostile::SymlinkToDir => {
            std::os::unix::fs::symlink(victim_dir, p).map_err(|e| format!("symlink: {e}"))?;
            Expect::Refused("is a symbolic link")
        }
        Hostile::Dangling => {
            std::os::unix::fs::symlink(nothing, p).map_err(|e| format!("symlink: {e}"))?;
            Expect::Refused("is a symbolic link")
        }
        Hostile::Fifo => {
            let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: a valid NUL-terminated path.
            if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
                return Err(format!("mkfifo: {}", std::io::Error::last_os_error()));
            }
            Expect::Refused(if w.dir {
                "is not a directory"
            } else {
                "is a FIFO"
            })
        }
        Hostile::Directory => {
            mkdir(0o700)?;
            Expect::Refused("is a directory")
        }
        Hostile::File => {
            std::fs::write(p, "x").map_err(|e| format!("creating a file: {e}"))?;
            Expect::Refused("is not a directory")
        }
        Hostile::HardLink => {
            if w.name != "lock" {
                return Err("only the lock is written in place".into());
            }
            std::fs::hard_link(victim, p).unwrap();
            Expect::Refused("hard links")
        }
        Hostile::WorldWritable => {
            mkdir(0o777)?;
            Expect::Refused("world-writable")
        }
        Hostile::Sticky => {
            mkdir(0o1777)?;
            Expect::Refused("world-writable")
        }
        Hostile::Foreign => {
            mkdir(0o755)?;
            std::os::unix::fs::chown(p, Some(65534), Some(65534))
                .map_err(|e| format!("chown: {e}"))?;
            Expect::Refused("owned by uid 65534")
        }
    })
}

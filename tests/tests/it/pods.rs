//! Kernel tier (host and VM): pods made by the reference CNI plugins on four nodes, each with its
//! own agent (`node_agent_tests::cluster`), keep talking across nodes while one node's maps grow
//! online, its agent is restarted, killed with SIGKILL, rolled back to the previous release's
//! route shape and upgraded again, and down while another node goes away. Only the gone node's
//! pod stops answering; its routes leave the restarted node.
//!
//! Without IPsec: the host kernels of the development machines have no ESP, and the IPsec tests
//! (`ipsec.rs`) cover the same moves with encryption in the VM tier.

use std::time::Duration;

use node_agent_tests::agent::{TestNode, wait_for};
use node_agent_tests::cluster::{
    self, Cluster, LongPing, PingRun, SimNode, Timeline, answers, ping, tcp_transfer,
};
use node_agent_tests::report;

/// Waits until `n`'s agent, just started, has finished its first reconcile.
fn reconciled(n: &SimNode) {
    let count = || n.metric("node_agent_reconcile_duration_seconds_count");
    wait_for("a reconcile", Duration::from_secs(60), || {
        count().is_some_and(|c| c > 0.0)
    });
}

/// Waits until `from`'s pod reaches `to`'s pod over both families.
fn reaches(from: &SimNode, to: &SimNode) {
    wait_for(
        &format!("{}'s pod reaching {}'s", from.name, to.name),
        Duration::from_secs(60),
        || answers(&from.pod_ns(), &to.pod4()) && answers(&from.pod_ns(), &to.pod6()),
    );
}

fn routes_toward(n: &SimNode, gone: &SimNode) -> Vec<String> {
    let mut routes: Vec<String> = Vec::new();
    for family in ["-4", "-6"] {
        routes.extend(
            n.ip(&[family, "route", "show"])
                .lines()
                .filter(|l| {
                    l.contains(&format!("10.244.{}.", gone.index))
                        || l.contains(&format!("fd00:244:{}:", gone.index))
                })
                .map(str::to_owned),
        );
    }
    routes
}

/// `n`'s routes of ours (protocol 201, both families): how many go through a nexthop object,
/// how many have their own gateway.
fn route_shapes(n: &SimNode) -> (usize, usize) {
    let mut shapes = (0, 0);
    for family in ["-4", "-6"] {
        for l in n.ip(&[family, "route", "show", "proto", "201"]).lines() {
            if l.contains(" nhid ") {
                shapes.0 += 1;
            } else if l.contains(" via ") {
                shapes.1 += 1;
            }
        }
    }
    shapes
}

fn lost(what: &str, run: &PingRun) {
    report(&format!(
        "pods: {what}: {} of {} pings answered, lost {:?}{}",
        run.received,
        run.sent,
        run.lost,
        if run.in_flight {
            " (and one in flight when stopped)"
        } else {
            ""
        }
    ));
}

#[test]
fn pods_on_other_nodes_keep_talking_across_a_map_growth_a_restart_a_kill_an_upgrade_and_a_node_removed_while_down()
 {
    cluster::with_cluster(
        node_agent_tests::test_name!(),
        |_| true,
        |c: &mut Cluster| {
            let nodes: Vec<SimNode> = (1..=4)
                .map(|i| c.add_node(&format!("node-{i}"), i))
                .collect();
            let [one, two, three, four] = [&nodes[0], &nodes[1], &nodes[2], &nodes[3]];
            let listed: Vec<TestNode> = nodes.iter().map(SimNode::test_node).collect();
            // node-1's maps hold 6 entries: its two peers' 4 addresses fit, and node-4's joining
            // grows them online, under the traffic.
            let small = ["--node-map-max", "6"];
            let flags = |n: &SimNode| if n.index == 1 { &small[..] } else { &[][..] };
            c.write_nodes(&listed[..3]);
            let mut agents: Vec<_> = nodes[..3]
                .iter()
                .map(|n| c.start_agent(n, flags(n)))
                .collect();
            for to in [two, three] {
                reaches(one, to);
                reaches(to, one);
            }

            // Traffic both ways through node-1. A ping's sequence number k left at +0.1k s.
            let t = Timeline::start();
            t.mark("node-1 -> node-2 and node-3 -> node-1 start");
            let mut runs = vec![
                (
                    "node-1 -> node-2",
                    LongPing::start(&one.pod_ns(), &two.pod4(), "0.1"),
                ),
                (
                    "node-3 -> node-1",
                    LongPing::start(&three.pod_ns(), &one.pod6(), "0.1"),
                ),
            ];

            // Growth: node-4 joins.
            let grown = || one.log_grep(&["maps grown online"]).lines().count();
            assert_eq!(grown(), 0, "node-1's maps had room for two peers");
            c.write_nodes(&listed);
            agents.push(c.start_agent(four, &[]));
            t.mark("node-4 joins");
            reaches(one, four);
            reaches(four, one);
            assert_eq!(
                grown(),
                1,
                "node-4 grew node-1's maps: {}",
                one.log_tail(20)
            );
            t.mark("node-1 -> node-4 starts");
            runs.push((
                "node-1 -> node-4",
                LongPing::start(&one.pod_ns(), &four.pod4(), "0.1"),
            ));

            // A restart (SIGTERM), a crash (SIGKILL), then docs/install.md's first rollback step
            // and the upgrade back: routes with their own gateways, the shape the previous
            // release (4815775) writes (`rollback.rs` holds it to that release's recorded
            // routes), then this release again, which replaces each route in place by one
            // through its node's nexthop.
            let rollback = [&small[..], &["--route-nexthops", "false"]].concat();
            let steps: [(&str, libc::c_int, &[&str], usize); 4] = [
                ("restarted", libc::SIGTERM, &small, 3),
                ("killed", libc::SIGKILL, &small, 3),
                ("rolled back", libc::SIGTERM, &rollback, 0),
                ("upgraded", libc::SIGTERM, &small, 3),
            ];
            for (what, signal, flags, peers_through_nexthops) in steps {
                let shapes = (2 * peers_through_nexthops, 6 - 2 * peers_through_nexthops);
                // SAFETY: kill on a child we own.
                unsafe { libc::kill(agents[0].id() as i32, signal) };
                agents[0].wait().unwrap();
                t.mark(&format!("node-1 {what}: its agent stopped"));
                agents[0] = c.start_agent(one, flags);
                reconciled(one);
                t.mark(&format!("node-1 {what}: its agent reconciled"));
                wait_for(
                    &format!("node-1 {what}: (through nexthops, own gateway) = {shapes:?}"),
                    Duration::from_secs(60),
                    || route_shapes(one) == shapes,
                );
                report(&format!(
                    "pods: node-1 {what}: {} routes through nexthops, {} with their own gateway",
                    shapes.0, shapes.1
                ));
                std::thread::sleep(Duration::from_secs(1));
            }

            // node-1's agent down while node-4 goes: its agent stops, its pod is deleted, it
            // leaves the list; the other agents clean up as they see it.
            agents[0].kill().unwrap();
            agents[0].wait().unwrap();
            agents[3].kill().unwrap();
            agents[3].wait().unwrap();
            c.write_nodes(&listed[..3]);
            t.mark("node-1's and node-4's agents down, node-4 leaves the list");
            wait_for(
                "node-2 and node-3 forgetting node-4",
                Duration::from_secs(60),
                || routes_toward(two, four).is_empty() && routes_toward(three, four).is_empty(),
            );
            assert!(
                !routes_toward(one, four).is_empty(),
                "node-1's agent is down: its routes toward node-4 are still there"
            );
            agents[0] = c.start_agent(one, &small);
            t.mark("node-1's agent started");
            wait_for(
                "node-1's restarted agent removing node-4's routes",
                Duration::from_secs(60),
                || routes_toward(one, four).is_empty(),
            );
            t.mark("node-1 has no route toward node-4");
            // node-4's pod is still there, but no longer reached from node-1; the other runs
            // go on meanwhile.
            assert_eq!(
                ping(&one.pod_ns(), &four.pod4(), 2),
                (2, 0),
                "node-4 is gone"
            );

            let [to_two, to_one, to_four]: [(&str, PingRun); 3] = runs
                .into_iter()
                .map(|(what, run)| (what, run.stop()))
                .collect::<Vec<_>>()
                .try_into()
                .expect("three runs");
            for (what, run) in [&to_two, &to_one] {
                lost(what, run);
                assert!(run.sent > 20, "{what}: the pings ran through every step");
                assert!(
                    run.lost.is_empty(),
                    "{what}: pods on live nodes lost pings {:?}, when:\n{t}node-1's log:\n{}",
                    run.lost,
                    one.log_tail(120)
                );
            }
            lost(to_four.0, &to_four.1);
            assert!(
                to_four.1.received > 0,
                "node-4's pod answered until it went"
            );
            assert!(!to_four.1.lost.is_empty(), "and not after");

            let mib = 1 << 20;
            assert_eq!(
                tcp_transfer(&one.pod_ns(), &three.pod_ns(), &three.pod4(), mib),
                mib,
                "1 MiB over TCP from node-1's pod to node-3's after it all"
            );
            for to in [two, three] {
                assert_eq!(ping(&one.pod_ns(), &to.pod6(), 2), (2, 2));
            }
        },
    );
}

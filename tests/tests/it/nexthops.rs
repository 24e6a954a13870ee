//! Kernel tier: the nexthop backend, and routes through its nexthops, against the real kernel.
//!
//! Each test runs in its own network namespace.

use std::collections::{HashMap, HashSet};

use ipnet::IpNet;
use node_agent::backends::Backend;
use node_agent::backends::nexthops::NexthopBackend;
use node_agent::backends::nexthops::{apply_nexthops, users_of};
use node_agent::backends::routes::{DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE, RouteBackend};
use node_agent::backends::users_watch::UsersWatch;
use node_agent::kernel::{OpError, RoutesSinceDump};
use node_agent_tests::{ip, ip_batch, require_sandbox, runtime, sandbox};
use state::inventory::Inventory;
use state::node::Family;
use state::objects::{KernelObject, Nexthop, NexthopId, NodeId, ObjectId, Op, Route, Via};

use node_agent_tests::fixture::all_ok;

use crate::backends::{link_with_gateways, sorted};

fn nh(node: u16, gw: &str) -> KernelObject {
    KernelObject::Nexthop(Nexthop {
        node_id: NodeId::new(node).unwrap(),
        gateway: gw.parse().unwrap(),
        second: false,
    })
}

fn nh_id(node: u16, family: Family) -> NexthopId {
    NexthopId::of(NodeId::new(node).unwrap(), family)
}

fn route(dst: &str, node: u16) -> KernelObject {
    let dst: IpNet = dst.parse().unwrap();
    KernelObject::Route(Route {
        dst,
        via: Via::Nexthop(nh_id(node, Family::of_net(&dst))),
        metric: Route::default_metric(&dst),
    })
}

fn ops(f: fn(KernelObject) -> Op, objs: &[KernelObject]) -> Vec<Op> {
    objs.iter().cloned().map(f).collect()
}

/// `ip` with the words of `line`.
fn ip_line(line: &str) -> std::process::Output {
    ip(&line.split_whitespace().collect::<Vec<_>>())
}

fn shown(args: &[&str]) -> String {
    String::from_utf8(ip(args).stdout).unwrap()
}

async fn open() -> NexthopBackend {
    NexthopBackend::open(DEFAULT_ROUTE_PROTOCOL)
        .await
        .unwrap()
        .expect("this kernel has nexthop objects (5.3 and later)")
}

#[test]
fn routes_go_through_our_nexthops_and_a_readdress_rewrites_one_nexthop() {
    require_sandbox!();
    sandbox(|_| {
        link_with_gateways();
        runtime().block_on(async {
            let mut n = open().await;
            let mut r = RouteBackend::new(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
            let hops = vec![nh(1, "10.88.0.2"), nh(1, "fd00:88::2"), nh(2, "10.88.0.3")];
            let routes = vec![
                route("10.244.1.0/24", 1),
                route("10.244.101.0/24", 1),
                route("fd00:244:1::/64", 1),
                route("10.244.2.0/24", 2),
            ];
            all_ok(n.apply(&ops(Op::Create, &hops)).await);
            all_ok(r.apply(&ops(Op::Create, &routes)).await);
            assert_eq!(sorted(n.dump().await.unwrap()), sorted(hops.clone()));
            assert_eq!(sorted(r.dump().await.unwrap()), sorted(routes.clone()));
            let listed = shown(&["nexthop", "show", "id", "201400001"]);
            assert!(
                listed.contains("via 10.88.0.2 dev gw0") && listed.contains("proto 201"),
                "{listed}"
            );
            let v4 = shown(&["route", "show", "proto", "201"]);
            assert!(
                v4.contains("10.244.1.0/24 nhid 201400001 via 10.88.0.2"),
                "{v4}"
            );

            // Node 1 readdressed: one nexthop replaced, its routes follow untouched.
            let moved = nh(1, "10.88.0.9");
            all_ok(n.apply(&[Op::Replace(moved.clone())]).await);
            let got = shown(&["route", "get", "10.244.101.7"]);
            assert!(got.contains("via 10.88.0.9"), "{got}");
            assert_eq!(sorted(r.dump().await.unwrap()), sorted(routes.clone()));

            // Routes first, then nexthops: nothing of ours is left.
            all_ok(r.apply(&ops(Op::Delete, &routes)).await);
            let now = vec![moved, hops[1].clone(), hops[2].clone()];
            all_ok(n.apply(&ops(Op::Delete, &now)).await);
            assert!(n.dump().await.unwrap().is_empty() && r.dump().await.unwrap().is_empty());
            // Deleting what is already gone is not an error.
            all_ok(n.apply(&ops(Op::Delete, &now)).await);
        });
    });
}

#[test]
fn foreign_nexthops_and_routes_through_ours_are_reported_and_never_touched() {
    require_sandbox!();
    sandbox(|_| {
        link_with_gateways();
        // In our range but not ours; outside our range; ours with a foreign user.
        ip_line("nexthop add id 201400003 via 10.88.0.5 dev gw0 proto static");
        ip_line("nexthop add id 7 via 10.88.0.6 dev gw0 proto 201");
        runtime().block_on(async {
            let mut n = open().await;
            let mut r = RouteBackend::new(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
            all_ok(
                n.apply(&[
                    Op::Create(nh(1, "10.88.0.2")),
                    Op::Create(nh(2, "10.88.0.4")),
                    Op::Create(nh(4, "10.88.0.8")),
                ])
                .await,
            );
            // A group of someone else's holds our node 2's nexthop.
            ip_line("nexthop add id 900 group 201400002 proto static");
            ip_line("route add 192.168.7.0/24 nhid 201400001 table 100 proto static");
            // Our protocol in our table, but with a TOS: not a route we write, so someone's.
            ip_line("route add 192.168.8.0/24 tos 0x10 nhid 201400004 proto 201");

            let mut inv = Inventory::new();
            n.dump_into(&mut inv).await.unwrap();
            r.dump_into(&mut inv).await.unwrap();
            let taken = ObjectId::Nexthop {
                id: nh_id(3, Family::V4),
            };
            let foreign = inv
                .foreign(&taken)
                .expect("the foreign nexthop is reported");
            assert!(
                foreign.contains("201400003") && foreign.contains("static"),
                "{foreign}"
            );
            assert_eq!(
                sorted(inv.objects().cloned().collect()),
                vec![nh(1, "10.88.0.2"), nh(2, "10.88.0.4"), nh(4, "10.88.0.8")]
            );
            let tos = inv
                .foreign_user(&ObjectId::Nexthop {
                    id: nh_id(4, Family::V4),
                })
                .expect("the route with a TOS through ours is a foreign user");
            assert!(tos.contains("192.168.8.0/24"), "{tos}");
            let group = inv
                .foreign_user(&ObjectId::Nexthop {
                    id: nh_id(2, Family::V4),
                })
                .expect("the group holding ours is reported");
            assert!(group.contains("group") && group.contains("900"), "{group}");
            let user = inv
                .foreign_user(&ObjectId::Nexthop {
                    id: nh_id(1, Family::V4),
                })
                .expect("the route through ours is reported");
            assert!(
                user.contains("192.168.7.0/24") && user.contains("table 100"),
                "{user}"
            );

            // Read back before routes go through them: ours, someone else's, nothing.
            let now = n
                .still_ours(&[
                    nh_id(1, Family::V4),
                    nh_id(3, Family::V4),
                    nh_id(9, Family::V4),
                ])
                .await;
            assert!(now[0].is_ok(), "{now:?}");
            assert!(
                matches!(&now[1], Err(e) if e.to_string().contains("not ours")),
                "{now:?}"
            );
            assert!(matches!(now[2], Err(OpError::NexthopMissing)), "{now:?}");

            // An exclusive create never takes the foreign nexthop's ID, and a delete of one
            // of ours that someone replaced since the dump leaves theirs alone.
            let results = n.apply(&[Op::Create(nh(3, "10.88.0.7"))]).await;
            assert!(
                matches!(results[0], Err(OpError::Occupied { .. })),
                "{results:?}"
            );
            let results = n.apply(&[Op::Delete(nh(3, "10.88.0.5"))]).await;
            let e = results[0]
                .as_ref()
                .expect_err("a foreign nexthop was deleted");
            assert!(e.to_string().contains("not ours"), "{e}");
        });
        let all = shown(&["nexthop", "show"]);
        assert!(
            all.contains("id 201400003 via 10.88.0.5") && all.contains("id 7 via 10.88.0.6"),
            "{all}"
        );
        let t100 = shown(&["route", "show", "table", "100"]);
        assert!(t100.contains("192.168.7.0/24 nhid 201400001"), "{t100}");
    });
}

#[test]
fn a_nexthop_gateway_on_no_connected_prefix_is_unreachable_and_the_others_go_in() {
    require_sandbox!();
    sandbox(|_| {
        link_with_gateways();
        // A gateway only reachable through another gateway is no nexthop of a connected link.
        ip_line("route add 198.51.100.0/24 via 10.88.0.254");
        runtime().block_on(async {
            let mut n = open().await;
            let results = n
                .apply(&ops(
                    Op::Create,
                    &[
                        nh(9, "192.0.2.99"),
                        nh(8, "198.51.100.8"),
                        nh(1, "10.88.0.2"),
                    ],
                ))
                .await;
            for (r, gw) in results[..2].iter().zip(["192.0.2.99", "198.51.100.8"]) {
                match r {
                    Err(e @ OpError::GatewayUnreachable { gateway, .. }) => {
                        assert_eq!(gateway.to_string(), gw);
                        assert!(e.to_string().contains("nexthop 20140000"), "{e}");
                    }
                    other => panic!("expected an unreachable gateway, got {other:?}"),
                }
            }
            results[2].as_ref().expect("the reachable one goes in");
            assert_eq!(n.dump().await.unwrap(), vec![nh(1, "10.88.0.2")]);
        });
    });
}

#[test]
fn a_nexthop_a_route_or_a_group_goes_through_is_never_deleted() {
    require_sandbox!();
    sandbox(|_| {
        link_with_gateways();
        runtime().block_on(async {
            let mut n = open().await;
            let mut r = RouteBackend::new(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
            let hops = [nh(1, "10.88.0.2"), nh(2, "10.88.0.3"), nh(3, "10.88.0.4")];
            all_ok(n.apply(&ops(Op::Create, &hops)).await);
            // The agent reads the kernel (as every full reconcile does)...
            let mut w = UsersWatch::open(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
            w.reading();
            // ...and since: someone's route through node 1's nexthop, and someone's group
            // holding node 2's.
            ip_line("route add 192.168.7.0/24 nhid 201400001 table 100 proto static");
            ip_line("nexthop add id 900 group 201400002 proto static");
            let results =
                apply_nexthops(&mut n, Some(&mut r), Some(&mut w), &ops(Op::Delete, &hops)).await;
            match &results[..] {
                [
                    Err(OpError::InUse { user: route, .. }),
                    Err(OpError::InUse { user: group, .. }),
                    Ok(()),
                ] => {
                    assert!(route.contains("192.168.7.0/24"), "{route}");
                    assert!(group.contains("group") && group.contains("900"), "{group}");
                }
                other => panic!("{other:?}"),
            }
        });
        let all = shown(&["nexthop", "show"]);
        assert!(
            all.contains("id 201400001 ") && all.contains("id 201400002 "),
            "the used nexthops stay: {all}"
        );
        assert!(!all.contains("id 201400003 "), "the unused one goes: {all}");
        let t100 = shown(&["route", "show", "table", "100"]);
        assert!(t100.contains("192.168.7.0/24 nhid 201400001"), "{t100}");
    });
}

/// After a dump, the watch tells where in our table someone else changed a route: a replace
/// from the agent's view stays trusted at every other destination, whatever others do in other
/// tables or with our own routes, and nowhere once announcements were lost.
#[test]
fn the_watch_tells_where_in_our_table_someone_else_changed_a_route_since_the_dump() {
    require_sandbox!();
    sandbox(|_| {
        link_with_gateways();
        let mut w = UsersWatch::open(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
        let ours: IpNet = "10.1.1.0/24".parse().unwrap();
        let theirs: IpNet = "10.1.2.0/24".parse().unwrap();
        let theirs6: IpNet = "fd00:2::/64".parse().unwrap();
        assert!(
            w.since_dump(&[ours]) == RoutesSinceDump::Unknown,
            "nothing is known before a dump"
        );
        w.dumping();
        let ours6: IpNet = "fd00:1::/64".parse().unwrap();
        let multipath: IpNet = "10.1.3.0/24".parse().unwrap();
        for line in [
            // Ours: with its own gateway, and through a nexthop, made, replaced and deleted.
            "route add 10.1.1.0/24 via 10.88.0.2 proto 201",
            "nexthop add id 201600001 via fd00:88::2 dev gw0 proto 201",
            "route add fd00:1::/64 nhid 201600001 proto 201",
            "nexthop add id 201700001 via fd00:88::3 dev gw0 proto 201",
            "route replace fd00:1::/64 nhid 201700001 proto 201",
            "route del fd00:1::/64 proto 201",
            // Someone else's: in another table, at other destinations, and our protocol in a
            // shape the dump does not take as ours.
            "route add 10.1.1.0/24 via 10.88.0.2 table 100 proto static",
            "route add 10.1.2.0/24 via 10.88.0.3 proto static",
            "route add fd00:2::/64 via fd00:88::3 proto static",
            "route add 10.1.3.0/24 proto 201 nexthop via 10.88.0.2 nexthop via 10.88.0.3",
            "route add blackhole 10.1.4.0/24 proto 201",
        ] {
            let out = ip_line(line);
            assert!(out.status.success(), "{line}: {out:?}");
        }
        assert!(
            w.since_dump(&[ours, ours6]) == RoutesSinceDump::Untouched,
            "ours, and another table's"
        );
        assert!(w.since_dump(&[ours, theirs]) == RoutesSinceDump::Touched);
        assert!(w.since_dump(&[theirs6]) == RoutesSinceDump::Touched);
        let blackhole: IpNet = "10.1.4.0/24".parse().unwrap();
        assert!(
            w.since_dump(&[blackhole]) == RoutesSinceDump::Touched,
            "our protocol, but a blackhole"
        );
        assert!(
            w.since_dump(&[multipath]) == RoutesSinceDump::Touched,
            "our protocol, two hops"
        );
        w.dumping();
        assert!(
            w.since_dump(&[ours, theirs, theirs6, multipath]) == RoutesSinceDump::Untouched,
            "a dump reads them"
        );
        assert!(
            ip_line("route del 10.1.2.0/24 proto static")
                .status
                .success()
        );
        assert!(
            w.since_dump(&[theirs]) == RoutesSinceDump::Touched,
            "a delete touches too"
        );
        // More announcements than the socket holds between two looks: nothing is trusted.
        w.dumping();
        let lines: String = (0..20_000u32)
            .map(|k| {
                format!(
                    "route add 10.200.{}.{}/32 via 10.88.0.2 proto 201\n",
                    k >> 8,
                    k & 0xff
                )
            })
            .collect();
        ip_batch(&[], &lines);
        assert!(
            w.since_dump(&[ours]) == RoutesSinceDump::Unknown,
            "announcements were lost"
        );
        w.dumping();
        assert!(w.since_dump(&[ours]) == RoutesSinceDump::Untouched);
    });
}

#[test]
fn routes_and_groups_are_read_before_a_nexthop_delete_only_when_something_not_ours_changed() {
    require_sandbox!();
    sandbox(|_| {
        link_with_gateways();
        runtime().block_on(async {
            let mut n = open().await;
            let mut r = RouteBackend::new(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
            let mut w = UsersWatch::open(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
            let hops = [nh(1, "10.88.0.2"), nh(2, "10.88.0.3")];
            all_ok(n.apply(&ops(Op::Create, &hops)).await);
            let both: HashSet<ObjectId> = hops.iter().map(KernelObject::id).collect();
            let one = |i: u16| ObjectId::Nexthop {
                id: nh_id(i, Family::V4),
            };
            // Nothing read yet: everything is read, and our own route through 1 is found.
            all_ok(r.apply(&[Op::Create(route("10.1.1.0/24", 1))]).await);
            let users = users_of(&mut n, Some(&mut r), Some(&mut w), &both)
                .await
                .unwrap();
            assert!(users[&one(1)].contains("10.1.1.0/24"), "{users:?}");
            // Only our own routes and plain nexthops changed since: what the read found stands
            // and nothing is read (the plan deletes our routes before their nexthop).
            all_ok(r.apply(&[Op::Create(route("10.1.2.0/24", 2))]).await);
            all_ok(r.apply(&[Op::Delete(route("10.1.1.0/24", 1))]).await);
            ip_line("nexthop add id 800 via 10.88.0.9 dev gw0");
            let unread = users_of(&mut n, Some(&mut r), Some(&mut w), &both).await;
            assert_eq!(unread.unwrap(), HashMap::new());
            // A route with our protocol in another table is not one of ours.
            ip_line("route add 192.168.8.0/24 nhid 201400001 table 100 proto 201");
            let users = users_of(&mut n, Some(&mut r), Some(&mut w), &both)
                .await
                .unwrap();
            assert!(users[&one(1)].contains("192.168.8.0/24"), "{users:?}");
            assert!(
                users[&one(2)].contains("10.1.2.0/24"),
                "read in full: {users:?}"
            );
            let unread = users_of(&mut n, Some(&mut r), Some(&mut w), &both).await;
            assert_eq!(unread.unwrap(), HashMap::new());
            // A group is read, whoever made it.
            ip_line("nexthop add id 900 group 201400002 proto 201");
            let users = users_of(&mut n, Some(&mut r), Some(&mut w), &both)
                .await
                .unwrap();
            assert!(users.contains_key(&one(2)), "{users:?}");
            // And so is anyone's route in our table.
            ip_line("route add 192.168.9.0/24 nhid 201400002 proto static");
            let users = users_of(&mut n, Some(&mut r), Some(&mut w), &both)
                .await
                .unwrap();
            assert!(
                users.contains_key(&one(1)) && users.contains_key(&one(2)),
                "{users:?}"
            );
        });
    });
}

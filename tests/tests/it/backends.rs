//! Kernel tier: the node-ID map and routes backends against the real kernel.
//!
//! Each test runs in its own network and mount namespace with a private bpffs.

use std::net::IpAddr;
use std::path::Path;
use std::process::Command;

use ipnet::IpNet;
use node_agent::backends::Backend;
use node_agent::backends::map::MapBackend;
use node_agent::backends::netlink::batch::{BATCH, Batcher};
use node_agent::backends::nexthops::fibmatch;
use node_agent::backends::nexthops::message::NexthopMessage;
use node_agent::backends::routes::{DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE, RouteBackend};
use node_agent::datapath::maps::NodeMap;
use node_agent::datapath::{Datapath, DatapathConfig, node_ids_pin};
use node_agent::kernel::OpError;
use node_agent_common::NodeValue;
use node_agent_tests::fixture::{all_ok, deletes, upserts};
use node_agent_tests::require_sandbox;
use node_agent_tests::runtime;
use node_agent_tests::{ip, report, run, sandbox};
use state::objects::{KernelObject, MapEntry, NodeId, Op, Route, Via};

fn route(dst: &str, gw: &str) -> KernelObject {
    let dst = dst.parse::<IpNet>().unwrap();
    KernelObject::Route(Route {
        dst,
        via: Via::Gateway(gw.parse::<IpAddr>().unwrap()),
        metric: Route::default_metric(&dst),
    })
}

fn entry(ip: &str, id: u16) -> KernelObject {
    KernelObject::MapEntry(MapEntry {
        ip: ip.parse().unwrap(),
        node_id: NodeId::new(id).unwrap(),
        spi: 0,
    })
}

pub(crate) fn sorted(mut v: Vec<KernelObject>) -> Vec<KernelObject> {
    v.sort();
    v
}

/// A veth pair with both ends up, so gateways in 10.88.0.0/16 and fd00:88::/64 are on-link.
pub(crate) fn link_with_gateways() {
    ip(&["link", "add", "gw0", "type", "veth", "peer", "name", "gw1"]);
    // No IPv6 link-local addresses: the kernel adds them, and their routes, a moment after the
    // link comes up (after duplicate address detection), so they would land in the middle of a
    // test that watches the routing table for changes that are not ours.
    for link in ["gw0", "gw1"] {
        ip(&["link", "set", link, "addrgenmode", "none"]);
    }
    ip(&["addr", "add", "10.88.0.1/16", "dev", "gw0"]);
    ip(&["addr", "add", "fd00:88::1/64", "dev", "gw0", "nodad"]);
    ip(&["link", "set", "gw0", "up"]);
    ip(&["link", "set", "gw1", "up"]);
}

fn ip_routes(args: &[&str]) -> String {
    String::from_utf8(ip(args).stdout).unwrap()
}

#[test]
fn routes_round_trip_ipv4_and_ipv6_with_our_protocol() {
    require_sandbox!();
    sandbox(|_| {
        link_with_gateways();
        runtime().block_on(async {
            let mut b = RouteBackend::new(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
            let ours = vec![
                route("10.244.1.0/24", "10.88.0.2"),
                route("10.244.2.0/24", "10.88.0.3"),
                route("fd00:244:1::/64", "fd00:88::2"),
            ];
            all_ok(b.apply(&upserts(&ours)).await);
            assert_eq!(sorted(b.dump().await.unwrap()), sorted(ours.clone()));
            let shown = ip_routes(&["route", "show", "proto", "201"]);
            assert!(shown.contains("10.244.1.0/24 via 10.88.0.2"), "{shown}");

            // A changed gateway is a replace, in place.
            let moved = route("10.244.2.0/24", "10.88.0.9");
            all_ok(b.apply(&upserts(std::slice::from_ref(&moved))).await);
            let dump = sorted(b.dump().await.unwrap());
            assert!(
                dump.contains(&moved) && !dump.contains(&ours[1]),
                "{dump:?}"
            );

            let now = vec![ours[0].clone(), moved, ours[2].clone()];
            all_ok(b.apply(&deletes(&now)).await);
            assert!(b.dump().await.unwrap().is_empty());
            // Deleting what is already gone is not an error.
            all_ok(b.apply(&deletes(&now)).await);
        });
    });
}

#[test]
fn foreign_routes_are_never_listed_nor_deleted() {
    require_sandbox!();
    sandbox(|_| {
        link_with_gateways();
        ip(&[
            "route",
            "add",
            "10.55.0.0/24",
            "via",
            "10.88.0.5",
            "proto",
            "static",
        ]);
        ip(&[
            "-6",
            "route",
            "add",
            "fd00:55::/64",
            "via",
            "fd00:88::5",
            "proto",
            "static",
        ]);
        // Same destination as one of ours would be, but in another table.
        ip(&[
            "route",
            "add",
            "10.244.1.0/24",
            "via",
            "10.88.0.2",
            "proto",
            "201",
            "table",
            "7",
        ]);
        runtime().block_on(async {
            let mut b = RouteBackend::new(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
            assert!(
                b.dump().await.unwrap().is_empty(),
                "foreign routes listed as ours"
            );
            let ours = vec![route("10.244.1.0/24", "10.88.0.2")];
            all_ok(b.apply(&upserts(&ours)).await);
            assert_eq!(b.dump().await.unwrap(), ours);
            all_ok(b.apply(&deletes(&ours)).await);
            // A delete of an identity we do not hold must not touch a foreign route either.
            all_ok(
                b.apply(&deletes(&[route("10.55.0.0/24", "10.88.0.5")]))
                    .await,
            );
        });
        let v4 = ip_routes(&["route", "show"]);
        assert!(v4.contains("10.55.0.0/24 via 10.88.0.5"), "{v4}");
        let v6 = ip_routes(&["-6", "route", "show"]);
        assert!(v6.contains("fd00:55::/64 via fd00:88::5"), "{v6}");
        let t7 = ip_routes(&["route", "show", "table", "7"]);
        assert!(t7.contains("10.244.1.0/24"), "{t7}");
    });
}

#[test]
fn unreachable_gateway_is_reported_with_the_kernel_error() {
    require_sandbox!();
    sandbox(|_| {
        link_with_gateways();
        runtime().block_on(async {
            let mut b = RouteBackend::new(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
            let results = b
                .apply(&upserts(&[
                    route("10.244.9.0/24", "192.0.2.99"),
                    route("10.244.1.0/24", "10.88.0.2"),
                ]))
                .await;
            match &results[0] {
                Err(e @ OpError::GatewayUnreachable { gateway, .. }) => {
                    assert_eq!(gateway.to_string(), "192.0.2.99");
                    let msg = e.to_string();
                    assert!(
                        msg.contains("192.0.2.99") && msg.contains("10.244.9.0/24"),
                        "{msg}"
                    );
                }
                other => panic!("expected an unreachable gateway, got {other:?}"),
            }
            results[1]
                .as_ref()
                .expect("the other route is still programmed");
            assert_eq!(
                b.dump().await.unwrap(),
                vec![route("10.244.1.0/24", "10.88.0.2")]
            );
        });
    });
}

#[test]
fn routes_in_a_custom_table_and_protocol() {
    require_sandbox!();
    sandbox(|_| {
        link_with_gateways();
        runtime().block_on(async {
            let mut b = RouteBackend::new(77, 1000).unwrap();
            let ours = vec![
                route("10.244.1.0/24", "10.88.0.2"),
                route("fd00:244:1::/64", "fd00:88::2"),
            ];
            all_ok(b.apply(&upserts(&ours)).await);
            assert_eq!(sorted(b.dump().await.unwrap()), sorted(ours.clone()));
            let shown = ip_routes(&["route", "show", "table", "1000"]);
            assert!(shown.contains("proto 77"), "{shown}");
            // The default protocol/table sees none of them.
            let mut other = RouteBackend::new(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
            assert!(other.dump().await.unwrap().is_empty());
            all_ok(b.apply(&deletes(&ours)).await);
            assert!(b.dump().await.unwrap().is_empty());
        });
    });
}

fn load_map(bpffs: &Path, capacity: u32) -> (Datapath, MapBackend) {
    let mut config = DatapathConfig::new(bpffs);
    config.node_map_max = capacity;
    let dp = Datapath::load(&config).unwrap();
    let backend = MapBackend::open(&node_ids_pin(bpffs), capacity).unwrap();
    (dp, backend)
}

#[test]
fn map_entries_round_trip_ipv4_and_ipv6() {
    require_sandbox!();
    sandbox(|sb| {
        let (_dp, mut b) = load_map(&sb.bpffs, 1024);
        runtime().block_on(async {
            let ours = vec![
                entry("10.0.0.1", 1),
                entry("10.0.0.2", 2),
                entry("fd00::1", 1),
            ];
            all_ok(b.apply(&upserts(&ours)).await);
            assert_eq!(sorted(b.dump().await.unwrap()), sorted(ours.clone()));
            let moved = entry("10.0.0.2", 9);
            all_ok(b.apply(&upserts(std::slice::from_ref(&moved))).await);
            assert!(b.dump().await.unwrap().contains(&moved));
            all_ok(b.apply(&deletes(&ours)).await);
            assert!(b.dump().await.unwrap().is_empty());
        });
    });
}

#[test]
fn full_map_is_a_typed_error_naming_the_flag() {
    require_sandbox!();
    sandbox(|sb| {
        let (_dp, mut b) = load_map(&sb.bpffs, 4);
        runtime().block_on(async {
            let five: Vec<_> = (1..=5).map(|i| entry(&format!("10.0.0.{i}"), i)).collect();
            let results = b.apply(&upserts(&five)).await;
            assert!(results[..4].iter().all(Result::is_ok), "{results:?}");
            let err = results[4].as_ref().unwrap_err();
            assert!(
                matches!(err, OpError::MapFull { capacity: 4, .. }),
                "{err:?}"
            );
            assert_eq!(
                err.to_string(),
                "node-ID map full at 4 entries; raise --node-map-max"
            );
            assert_eq!(
                b.dump().await.unwrap().len(),
                4,
                "the first four are programmed"
            );
        });
    });
}

#[test]
fn invalid_entries_are_reported_and_purged_and_a_second_map_is_untouched() {
    require_sandbox!();
    sandbox(|sb| {
        let (_dp, mut b) = load_map(&sb.bpffs, 1024);
        // A second map with the same layout: not ours, whatever it holds.
        let other = sb.bpffs.join("other_map");
        run(Command::new("bpftool")
            .args(["map", "create"])
            .arg(&other)
            .args([
                "type",
                "hash",
                "key",
                "20",
                "value",
                "4",
                "entries",
                "16",
                "name",
                "other_map",
            ]));
        let mut second = NodeMap::open(&other).unwrap();
        second
            .upsert(
                "10.0.0.1".parse().unwrap(),
                NodeValue {
                    id: 5,
                    spi: 0,
                    flags: 0,
                },
            )
            .unwrap();
        // ID 0 is the local node: never written by the agent.
        let mut raw = NodeMap::open(&node_ids_pin(&sb.bpffs)).unwrap();
        raw.upsert(
            "10.0.0.7".parse().unwrap(),
            NodeValue {
                id: 0,
                spi: 0,
                flags: 0,
            },
        )
        .unwrap();
        runtime().block_on(async {
            all_ok(b.apply(&upserts(&[entry("10.0.0.1", 1)])).await);
            assert_eq!(b.dump().await.unwrap(), vec![entry("10.0.0.1", 1)]);
            assert_eq!(b.invalid().len(), 1, "the ID-0 entry is reported");
            assert_eq!(b.purge_invalid().unwrap(), 1);
            all_ok(b.apply(&deletes(&[entry("10.0.0.1", 1)])).await);
            b.dump().await.unwrap();
            assert!(b.invalid().is_empty());
        });
        assert!(
            NodeMap::open(&node_ids_pin(&sb.bpffs))
                .unwrap()
                .dump()
                .unwrap()
                .entries
                .is_empty()
        );
        let kept = second.dump().unwrap();
        assert_eq!(kept.entries.len(), 1, "the second map was touched");
    });
}

/// Requests go many to a system call: across more than two batches, each request gets its own
/// answer (the refusals in the middle fail those requests alone, the rest go in). A batch's
/// answers, all of them replies, fit the receive buffer a machine with the kernel's default
/// `net.core.rmem_max` gives. With a receive buffer too small for a batch's answers, the kernel
/// drops some: then no request whose answer is missing passes for done.
#[test]
fn batched_requests_get_their_own_answers_and_lost_answers_never_pass_for_success() {
    require_sandbox!();
    sandbox(|_sb| {
        runtime().block_on(async {
            link_with_gateways();
            let n = 2 * BATCH + 88;
            let dst = |i: usize| format!("10.201.{}.{}/32", i / 250, i % 250);
            let planted = [BATCH - 1, BATCH, n - 1];
            for i in planted {
                ip(&["route", "add", &dst(i), "via", "10.88.0.3", "proto", "static"]);
            }
            let creates: Vec<Op> = (0..n).map(|i| Op::Create(route(&dst(i), "10.88.0.2"))).collect();
            let mut routes = RouteBackend::new(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
            let results = routes.apply(&creates).await;
            let calls = routes.batches_sent();
            assert!(calls >= n.div_ceil(BATCH) as u64 && calls < n as u64, "{n} creates in {calls} calls");
            assert_eq!(results.len(), n);
            for (i, r) in results.iter().enumerate() {
                match planted.contains(&i) {
                    true => assert!(matches!(r, Err(OpError::Occupied { .. })), "{i}: {r:?}"),
                    false => assert!(r.is_ok(), "{i}: {r:?}"),
                }
            }
            assert_eq!(routes.dump().await.unwrap().len(), n - planted.len());

            // Route lookups, a reply each, with the receive buffer the kernel's default
            // `rmem_max` allows (212,992 bytes, doubled by the kernel).
            let gateway = |i: usize| IpAddr::from([10, 88, 1 + (i / 250) as u8, (i % 250) as u8 + 1]);
            let lookups = (0..BATCH).map(|i| (fibmatch(gateway(i)), 0)).collect();
            let mut small = Batcher::with_receive_buffer(libc::NETLINK_ROUTE as isize, 212_992)
                .unwrap()
                .first_batch(BATCH);
            let answers = small.exchange(lookups).await;
            assert_eq!(answers.len(), BATCH);
            assert_eq!(small.batches_sent(), 1, "a full batch in one call");
            for (i, a) in answers.iter().enumerate() {
                assert!(matches!(a, Ok(m) if m.len() == 1), "lookup {i}: {a:?}");
            }

            // Deleting nexthops that are not there: every request is refused, and with room
            // for only a few answers, the kernel drops the rest.
            let mut batcher = Batcher::with_receive_buffer(libc::NETLINK_ROUTE as isize, 1).unwrap();
            let deletes = (0..BATCH as u32)
                .map(|i| (NexthopMessage::del(201_400_000 + i), 0))
                .collect();
            let answers = batcher.exchange(deletes).await;
            assert_eq!(answers.len(), BATCH);
            let lost = answers
                .iter()
                .filter(|a| matches!(a, Err(e) if e.to_string().contains("answers lost")))
                .count();
            assert!(answers.iter().all(Result::is_err), "silence passed for success");
            assert!(lost > 0, "the buffer held every answer: the test proves nothing");
            let refused = answers
                .iter()
                .filter(|a| matches!(a, Err(e) if e.errno() == Some(libc::ENOENT)))
                .count();
            assert_eq!(refused + lost, BATCH);
            report(&format!(
                "batched requests: {n} creates in {calls} sendmsgs (at least {} at {BATCH} a call), {} refusals where planted; {BATCH} lookups in one call all answered in a default-sized buffer; {refused} of {BATCH} refusals read and {lost} lost with a tiny buffer",
                n.div_ceil(BATCH),
                planted.len()
            ));
        })
    });
}

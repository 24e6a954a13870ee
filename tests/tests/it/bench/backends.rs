//! The backends against their floors: the objects of 5,000 remote nodes (10,000 map entries,
//! 5,000 routes via distinct gateways) applied into a fresh namespace and removed again, next to
//! the floor measured on the same work in the same run: `ip -batch` for routes, a plain loop of
//! `bpf(2)` calls on the map's fd for map entries. (xfrm policies: `tests/tests/it/xfrm.rs`.)

use std::time::Instant;

use node_agent::backends::Backend;
use node_agent::backends::map::MapBackend;
use node_agent::backends::routes::{DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE, RouteBackend};
use node_agent::datapath::{Datapath, DatapathConfig, node_ids_pin};
use node_agent_common::{NodeKey, NodeValue};
use node_agent_tests::runtime;
use node_agent_tests::{ip, ip_batch, sandbox};
use state::objects::{KernelObject, MapEntry, NodeId, Op, Route, Via};

use super::{bench, elem, enabled, ms, obj_get};

const NODES: u32 = 5000;

/// Gateway `i` in 10.200.0.0/16 and its pod CIDR in 10.x.y.0/24.
fn gateway(i: u32) -> String {
    format!("10.200.{}.{}", i / 250, i % 250 + 1)
}
fn cidr(i: u32) -> String {
    format!("10.{}.{}.0/24", 100 + i / 250, i % 250)
}

#[test]
fn bench_backends_against_their_floors() {
    if !enabled(node_agent_tests::test_name!()) {
        return;
    }
    sandbox(|sb| {
        ip(&["link", "add", "gw0", "type", "veth", "peer", "name", "gw1"]);
        ip(&["addr", "add", "10.200.0.0/16", "dev", "gw0"]);
        ip(&["link", "set", "gw0", "up"]);
        ip(&["link", "set", "gw1", "up"]);
        let mut config = DatapathConfig::new(&sb.bpffs);
        config.node_map_max = 16384;
        let _dp = Datapath::load(&config).unwrap();

        // Map entries: two addresses per node.
        let entries: Vec<(NodeKey, NodeValue, KernelObject)> = (0..NODES * 2)
            .map(|i| {
                let ip: std::net::IpAddr = if i % 2 == 0 {
                    gateway(i / 2).parse().unwrap()
                } else {
                    format!("fd00:200::{:x}", i / 2 + 1).parse().unwrap()
                };
                let id = (i / 2 + 1) as u16;
                let obj = KernelObject::MapEntry(MapEntry {
                    ip,
                    node_id: NodeId::new(id).unwrap(),
                    spi: 0,
                });
                (
                    node_agent::datapath::maps::encode_key(ip),
                    NodeValue {
                        id,
                        spi: 0,
                        flags: 0,
                    },
                    obj,
                )
            })
            .collect();
        let fd = obj_get(&node_ids_pin(&sb.bpffs));
        let t = Instant::now();
        for (k, v, _) in &entries {
            elem(&fd, 2, k, Some(v));
        }
        let floor_add = t.elapsed();
        let t = Instant::now();
        for (k, _, _) in &entries {
            elem(&fd, 3, k, None);
        }
        let floor_del = t.elapsed();

        let routes: Vec<KernelObject> = (0..NODES)
            .map(|i| {
                let dst = cidr(i).parse().unwrap();
                KernelObject::Route(Route {
                    dst,
                    via: Via::Gateway(gateway(i).parse().unwrap()),
                    metric: Route::default_metric(&dst),
                })
            })
            .collect();
        let (mut add, mut del) = (String::new(), String::new());
        for i in 0..NODES {
            add.push_str(&format!(
                "route add {} via {} proto 201\n",
                cidr(i),
                gateway(i)
            ));
            del.push_str(&format!(
                "route del {} via {} proto 201\n",
                cidr(i),
                gateway(i)
            ));
        }
        let t = Instant::now();
        ip_batch(&[], &add);
        let floor_route_add = t.elapsed();
        let t = Instant::now();
        let out = ip(&["-4", "route", "show", "proto", "201"]);
        let floor_route_dump = t.elapsed();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).lines().count(),
            NODES as usize
        );
        let t = Instant::now();
        ip_batch(&[], &del);
        let floor_route_del = t.elapsed();

        runtime().block_on(async {
            let mut map = MapBackend::open(&node_ids_pin(&sb.bpffs), 16384).unwrap();
            let ups: Vec<Op> = entries
                .iter()
                .map(|(_, _, o)| Op::Replace(o.clone()))
                .collect();
            let dels: Vec<Op> = entries
                .iter()
                .map(|(_, _, o)| Op::Delete(o.clone()))
                .collect();
            let t = Instant::now();
            assert!(map.apply(&ups).await.iter().all(Result::is_ok));
            let add = t.elapsed();
            let t = Instant::now();
            assert_eq!(map.dump().await.unwrap().len(), entries.len());
            let dump = t.elapsed();
            let t = Instant::now();
            assert!(map.apply(&dels).await.iter().all(Result::is_ok));
            let del = t.elapsed();
            bench("map_add_10000", ms(add), "ms");
            bench("map_add_floor_bpf_syscalls", ms(floor_add), "ms");
            bench(
                "map_add_ratio",
                add.as_secs_f64() / floor_add.as_secs_f64(),
                "x (target <= 1.5)",
            );
            bench("map_delete_10000", ms(del), "ms");
            bench("map_delete_floor_bpf_syscalls", ms(floor_del), "ms");
            bench(
                "map_delete_ratio",
                del.as_secs_f64() / floor_del.as_secs_f64(),
                "x (target <= 1.5)",
            );
            bench("map_dump_10000", ms(dump), "ms");

            let mut r = RouteBackend::new(DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE).unwrap();
            let ups: Vec<Op> = routes.iter().cloned().map(Op::Replace).collect();
            let dels: Vec<Op> = routes.iter().cloned().map(Op::Delete).collect();
            let t = Instant::now();
            assert!(r.apply(&ups).await.iter().all(Result::is_ok));
            let add = t.elapsed();
            let t = Instant::now();
            assert_eq!(r.dump().await.unwrap().len(), routes.len());
            let dump = t.elapsed();
            let t = Instant::now();
            assert!(r.apply(&dels).await.iter().all(Result::is_ok));
            let del = t.elapsed();
            bench("route_add_5000", ms(add), "ms");
            bench("route_add_floor_ip_batch", ms(floor_route_add), "ms");
            bench(
                "route_add_ratio",
                add.as_secs_f64() / floor_route_add.as_secs_f64(),
                "x (target <= 1.5)",
            );
            bench("route_delete_5000", ms(del), "ms");
            bench("route_delete_floor_ip_batch", ms(floor_route_del), "ms");
            bench(
                "route_delete_ratio",
                del.as_secs_f64() / floor_route_del.as_secs_f64(),
                "x (target <= 1.5)",
            );
            bench("route_dump_5000", ms(dump), "ms");
            bench("route_dump_floor_ip_route_show", ms(floor_route_dump), "ms");
        });
    });
}

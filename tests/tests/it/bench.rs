//! Benchmarks (run by `cargo xtask bench`, with `NODE_AGENT_BENCH=1`): they print figures as
//! `bench: <name> <value> <unit>` lines and assert nothing about time.
//!
//! - Backends: the objects of 5,000 remote nodes (10,000 map entries, 5,000 routes via distinct
//!   gateways) applied into a fresh namespace and removed again, next to the floor measured on
//!   the same work in the same run: `ip -batch` for routes, a plain loop of `bpf(2)` calls on the
//!   map's fd for map entries. (xfrm policies: `tests/tests/it/xfrm.rs`.)
//! - The agent: a 5,000-node NodeList, cold start to ready, restart with 10% churn, unchanged
//!   restart, peak RSS, and CPU over an idle minute.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use node_agent::backends::Backend;
use node_agent::backends::map::MapBackend;
use node_agent::backends::routes::{DEFAULT_ROUTE_PROTOCOL, MAIN_TABLE, RouteBackend};
use node_agent::datapath::{Datapath, DatapathConfig, node_ids_pin};
use node_agent_common::{NodeKey, NodeValue};
use node_agent_tests::agent::{AgentEnv, TestNode};
use node_agent_tests::runtime;
use node_agent_tests::{can_sandbox, ip, ip_batch, report, sandbox, skip};
use state::objects::{KernelObject, MapEntry, NodeId, Op, Route};

const NODES: u32 = 5000;

fn enabled(name: &str) -> bool {
    if std::env::var("NODE_AGENT_BENCH").as_deref() != Ok("1") {
        report(&format!(
            "SKIPPED {name}: a benchmark; `cargo xtask bench` runs it"
        ));
        return false;
    }
    if let Err(why) = can_sandbox() {
        skip(name, &why);
        return false;
    }
    true
}

fn bench(name: &str, value: f64, unit: &str) {
    report(&format!("bench: {name} {value:.1} {unit}"));
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Gateway `i` in 10.200.0.0/16 and its pod CIDR in 10.x.y.0/24.
fn gateway(i: u32) -> String {
    format!("10.200.{}.{}", i / 250, i % 250 + 1)
}
fn cidr(i: u32) -> String {
    format!("10.{}.{}.0/24", 100 + i / 250, i % 250)
}

/// `bpf(BPF_OBJ_GET)`: an fd for a pinned object, without any library in between.
fn obj_get(path: &Path) -> OwnedFd {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut attr = [0u64; 16];
    attr[0] = c.as_ptr() as u64;
    // SAFETY: attr is a zeroed bpf_attr with `pathname` set to a live C string.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            7, /* BPF_OBJ_GET */
            attr.as_mut_ptr(),
            128,
        )
    };
    assert!(
        fd >= 0,
        "BPF_OBJ_GET {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    // SAFETY: the kernel just returned this fd to us.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

/// `bpf(cmd)` on one element of a map: update (2) or delete (3).
fn elem(fd: &OwnedFd, cmd: i64, key: &NodeKey, value: Option<&NodeValue>) {
    let mut attr = [0u64; 16];
    attr[0] = fd.as_raw_fd() as u64;
    attr[1] = key as *const NodeKey as u64;
    attr[2] = value.map_or(0, |v| v as *const NodeValue as u64);
    // SAFETY: attr is a bpf_attr for a map element op; key and value outlive the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), 128) };
    assert_eq!(rc, 0, "bpf({cmd}): {}", std::io::Error::last_os_error());
}

#[test]
fn bench_backends_against_their_floors() {
    if !enabled("bench_backends_against_their_floors") {
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
                    node_agent::node_map::encode_key(ip),
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
                    gateway: gateway(i).parse().unwrap(),
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

/// Runs the agent once to completion: wall time, exit code, peak RSS (KiB), report.
fn timed_once(env: &AgentEnv, extra: &[&str]) -> (Duration, i32, i64, serde_json::Value) {
    let mut args = vec!["--once", "--output", "json", "--sync-timeout", "120s"];
    args.extend_from_slice(extra);
    let t = Instant::now();
    #[expect(
        clippy::zombie_processes,
        reason = "reaped by wait4 below, which also gives its rusage"
    )]
    let child = env
        .command(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let mut status = 0;
    // SAFETY: rusage is a plain out-parameter; wait4 reaps our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let mut stdout = child.stdout.unwrap();
    let mut out = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut out).unwrap();
    unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    let report = serde_json::from_str(&out).unwrap_or(serde_json::Value::Null);
    (
        t.elapsed(),
        libc::WEXITSTATUS(status),
        usage.ru_maxrss,
        report,
    )
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the comm.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[test]
fn bench_agent_restarts_at_5000_nodes() {
    if !enabled("bench_agent_restarts_at_5000_nodes") {
        return;
    }
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes: Vec<TestNode> = (1..=NODES)
            .map(|i| TestNode::dual(&format!("node-{i:05}"), i))
            .collect();
        env.write_nodes(&nodes);
        let (cold, code, rss_cold, rep) = timed_once(&env, &[]);
        assert_eq!(code, 0, "{rep}");
        bench("agent_cold_start_to_converged", ms(cold), "ms");
        bench(
            "agent_cold_start_kernel_writes",
            rep["kernel_writes"].as_f64().unwrap_or(-1.0),
            "writes",
        );

        // 10% churn while down: 250 deleted, 250 readdressed, 250 added... in all 500 nodes
        // changed of 5000 (10%).
        let mut churned: Vec<TestNode> = nodes
            .iter()
            .filter(|n| !n.name.ends_with("0") || n.name.ends_with("00"))
            .cloned()
            .collect();
        for (k, n) in churned.iter_mut().enumerate().filter(|(k, _)| k % 20 == 1) {
            *n = TestNode::dual(&n.name, NODES + 1 + k as u32);
        }
        let removed = nodes.len() - churned.len();
        churned.extend(
            (0..removed as u32).map(|k| TestNode::dual(&format!("new-{k:05}"), 2 * NODES + k)),
        );
        env.write_nodes(&churned);
        let (churn, code, rss_churn, rep) = timed_once(&env, &[]);
        assert_eq!(code, 0, "{rep}");
        bench(
            "agent_restart_with_10pct_churn_to_converged",
            ms(churn),
            "ms (target < 2000)",
        );
        bench(
            "agent_restart_churn_kernel_writes",
            rep["kernel_writes"].as_f64().unwrap_or(-1.0),
            "writes",
        );
        let (same, code, rss_same, rep) = timed_once(&env, &[]);
        assert_eq!(code, 0, "{rep}");
        bench(
            "agent_unchanged_restart_to_converged",
            ms(same),
            "ms (target < 1000)",
        );
        bench(
            "agent_unchanged_restart_kernel_writes",
            rep["kernel_writes"].as_f64().unwrap_or(-1.0),
            "writes (target 0)",
        );
        bench(
            "agent_peak_rss",
            rss_cold.max(rss_churn).max(rss_same) as f64 / 1024.0,
            "MiB (target < 64)",
        );

        // Idle: a daemon that has converged, watched for a while.
        let idle: u64 = std::env::var("NODE_AGENT_BENCH_IDLE_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(60);
        let mut child = env.spawn(&["--metrics-addr", "127.0.0.1:9965"]);
        env.wait(
            "the daemon's first reconcile",
            Duration::from_secs(120),
            || {
                node_agent_tests::agent::http_get("127.0.0.1:9965", "/readyz")
                    .is_some_and(|(c, _)| c == 200)
            },
        );
        let before = cpu_ticks(child.id());
        std::thread::sleep(Duration::from_secs(idle));
        let after = cpu_ticks(child.id());
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        bench(
            &format!("agent_idle_cpu_over_{idle}s"),
            (after - before) as f64 / hz / idle as f64 * 100.0,
            "% of one core",
        );
        let rss = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
        let hwm = rss
            .lines()
            .find(|l| l.starts_with("VmHWM"))
            .unwrap_or("VmHWM: ? kB")
            .to_owned();
        report(&format!(
            "bench: agent_daemon_{}",
            hwm.split_whitespace().collect::<Vec<_>>().join(" ")
        ));
        child.kill().unwrap();
        child.wait().unwrap();
    });
}

/// CPU of a daemon with nothing it can do, `secs` seconds of it, in percent of one core.
fn cpu_over(pid: u32, secs: u64) -> f64 {
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(secs));
    let after = cpu_ticks(pid);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (after - before) as f64 / hz / secs as f64 * 100.0
}

/// What the daemon costs while it waits, in each state where it can do nothing (5,000 nodes):
/// the brake held, the API server failing, the state directory full, the node-ID map full.
/// Each should be near idle: the daemon waits for a list, a retry time or a change, never on a
/// tight timer.
#[test]
fn bench_daemon_cpu_while_waiting() {
    if !enabled("bench_daemon_cpu_while_waiting") {
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

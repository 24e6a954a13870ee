//! End to end: faults outside the agent (a full or vanished state directory, a NodeList that
//! does not parse, drift made by hand) and what the agent does about them.

use std::time::{Duration, Instant};

use node_agent_tests::agent::{AgentEnv, assert_exact, cluster, http_get, metric, scrape_metrics};
use node_agent_tests::{ip, require_sandbox, run, sandbox};

/// Generous: the same tests run under QEMU's TCG emulation in the VM tier.
const TIMEOUT: Duration = Duration::from_secs(90);
const METRICS: &str = "127.0.0.1:9965";

/// Mounts a tmpfs of `kib` KiB on the environment's state directory (the sandbox's mount
/// namespace: gone with the test).
fn small_tmpfs(env: &AgentEnv, kib: u32) {
    std::fs::create_dir_all(&env.state_dir).unwrap();
    run(std::process::Command::new("mount").args([
        "-t",
        "tmpfs",
        "-o",
        &format!("size={kib}k,mode=0700"),
        "tmpfs",
        env.state_dir.to_str().unwrap(),
    ]));
}

/// Fills the file system holding `dir` to the last byte.
fn fill(dir: &std::path::Path) -> std::path::PathBuf {
    let filler = dir.join("filler");
    let _ = std::process::Command::new("dd")
        .args(["if=/dev/zero", &format!("of={}", filler.display()), "bs=4k"])
        .output();
    filler
}

/// CPU seconds a process has used so far (user + system), from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz
}

#[test]
fn a_full_state_dir_backs_off_keeps_programming_and_recovers() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        small_tmpfs(&env, 64);
        let nodes = cluster(4);
        env.write_nodes(&nodes);
        let child = env.spawn(&["--metrics-addr", METRICS]);
        env.wait("the first checkpoint", TIMEOUT, || {
            env.checkpoint().exists()
        });
        let filler = fill(&env.state_dir);
        // The node list changes while no checkpoint can be written.
        let more = cluster(6);
        env.write_nodes(&more);
        env.wait("the new nodes programmed", TIMEOUT, || {
            env.routes().len() == 12
        });
        env.wait("a failed write counted", TIMEOUT, || {
            metric(
                &scrape_metrics(METRICS),
                "node_agent_checkpoint_writes_total{result=\"error\"}",
            )
            .is_some_and(|v| v >= 1.0)
        });
        let (code, body) = http_get(METRICS, "/readyz").unwrap();
        assert_eq!(code, 200, "the datapath is right: {body}");
        assert!(
            body.contains("checkpoint failing") && body.contains("No space left"),
            "{body}"
        );
        // Waiting costs nothing: a few seconds see a few attempts, no busy loop.
        let cpu = cpu_seconds(child.id());
        let before = metric(
            &scrape_metrics(METRICS),
            "node_agent_checkpoint_writes_total{result=\"error\"}",
        )
        .unwrap();
        std::thread::sleep(Duration::from_secs(6));
        let attempts = metric(
            &scrape_metrics(METRICS),
            "node_agent_checkpoint_writes_total{result=\"error\"}",
        )
        .unwrap()
            - before;
        let used = cpu_seconds(child.id()) - cpu;
        node_agent_tests::report(&format!(
            "bench: cpu_while_state_dir_full {:.2} % of a core ({attempts} write attempts in 6 s)",
            used / 6.0 * 100.0
        ));
        assert!(attempts <= 4.0, "{attempts} attempts in 6 s");
        assert!(
            metric(
                &scrape_metrics(METRICS),
                "node_agent_checkpoint_stale_seconds"
            )
            .is_some_and(|s| s > 0.0)
        );
        let log = std::fs::read_to_string(env.log()).unwrap();
        let failures = log.matches("checkpoint write failed").count();
        assert!(failures < 10, "{failures} lines: logged once per attempt");
        // Space comes back: the next attempt writes, without a restart.
        std::fs::remove_file(filler).unwrap();
        env.wait(
            "the checkpoint written again",
            Duration::from_secs(60),
            || {
                let cp = env.cli(&["state", "show", "--output", "json"]).1;
                cp.matches("\"name\"").count() == 6
            },
        );
        env.wait("no complaint left", TIMEOUT, || {
            http_get(METRICS, "/readyz").is_some_and(|(c, b)| c == 200 && b.trim() == "ready")
        });
        assert_eq!(
            metric(
                &scrape_metrics(METRICS),
                "node_agent_checkpoint_stale_seconds"
            ),
            Some(0.0)
        );
    });
}

#[test]
fn sigterm_with_a_full_state_dir_says_so_and_exits_non_zero() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        small_tmpfs(&env, 64);
        env.write_nodes(&cluster(2));
        let mut child = env.spawn(&[]);
        env.wait("the first checkpoint", TIMEOUT, || {
            env.checkpoint().exists()
        });
        fill(&env.state_dir);
        env.write_nodes(&cluster(3));
        env.wait("the new node programmed", TIMEOUT, || {
            env.routes().len() == 6
        });
        let began = Instant::now();
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        assert!(began.elapsed() < Duration::from_secs(10));
        assert_eq!(status.code(), Some(1));
        let log = std::fs::read_to_string(env.log()).unwrap();
        assert!(log.contains("final checkpoint write failed"), "{log}");
    });
}

#[test]
fn a_full_state_dir_at_start_is_one_clear_error() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        small_tmpfs(&env, 16);
        fill(&env.state_dir);
        env.write_nodes(&cluster(1));
        let out = env.command(&["--once"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("node-agent: ") && last.contains("lock") && last.contains("No space"),
            "{err}"
        );
        assert_eq!(
            last.matches("No space left on device").count(),
            1,
            "each cause once: {last}"
        );
    });
}

#[test]
fn a_nodes_file_that_does_not_parse_ends_a_one_shot_run_at_once() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        std::fs::write(
            &env.nodes_file,
            "apiVersion: v1\nitems:\n- metadata: {name: [\n",
        )
        .unwrap();
        for cmd in [&["run", "--once"][..], &["plan"][..]] {
            let began = Instant::now();
            let mut c = env.command(&[]);
            // `command` starts with `run`; rebuild it for `plan`.
            let args: Vec<String> = c
                .get_args()
                .skip(1)
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            c = std::process::Command::new(node_agent_tests::agent_bin());
            c.args(cmd).args(&args).env("NODE_AGENT_LOG", "info");
            let out = c.output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_ne!(out.status.code(), Some(0), "{err}");
            assert!(began.elapsed() < Duration::from_secs(20), "{cmd:?} waited");
            let path = env.nodes_file.display().to_string();
            assert!(
                err.contains(&format!("{path}:3:")),
                "{cmd:?}: file, line, column: {err}"
            );
        }
    });
}

/// Every wait of a one-shot run before its first plan ends at `--sync-timeout`, whatever it
/// waits on, with status 1 and what it waited for; nothing is written. Walked: a nodes file that
/// never appears, one that is fresh and lists fewer nodes than nothing (its first read waits
/// for the settle period, here longer than the timeout), for `run --once` and `plan`. A
/// kubeconfig whose token file is a FIFO nobody writes ends sooner: the input gate refuses it
/// before the Kubernetes client is built (a slow network mount is what the deadline still
/// bounds there), with status 1 and the field and file it refused.
#[test]
fn every_wait_of_a_one_shot_run_ends_at_the_sync_timeout() {
    require_sandbox!();
    sandbox(|sb| {
        let mut env = AgentEnv::new(&sb.bpffs);
        let dir = env.state_dir.parent().unwrap().to_owned();
        let fifo = dir.join("token");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: \"https://127.0.0.1:1\"}}}}]\n\
                 users: [{{name: u, user: {{tokenFile: {}}}}}]\n\
                 contexts: [{{name: x, context: {{cluster: c, user: u}}}}]\ncurrent-context: x\n",
                fifo.display()
            ),
        )
        .unwrap();
        let mut covered = 0;
        let mut phases = Vec::new();
        for (case, fresh_file, kube) in [
            ("no nodes file", false, false),
            ("a fresh file settling", true, false),
            ("a token file that blocks", false, true),
        ] {
            let _ = std::fs::remove_file(&env.nodes_file);
            if fresh_file {
                env.write_nodes(&cluster(2));
            }
            env.kubeconfig = kube.then(|| kubeconfig.clone());
            for cmd in [&["run", "--once"][..], &["plan"][..]] {
                let mut c = std::process::Command::new(node_agent_tests::agent_bin());
                let args: Vec<String> = env
                    .command(&["--sync-timeout", "10s", "--nodes-file-settle", "10m"])
                    .get_args()
                    .skip(1)
                    .map(|a| a.to_string_lossy().into_owned())
                    .collect();
                c.args(cmd).args(&args).env("NODE_AGENT_LOG", "warn");
                c.stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped());
                let mut child = c.spawn().unwrap();
                // A bound far past the timeout, so that a run that never ends fails the test
                // instead of hanging it.
                let began = Instant::now();
                while child.try_wait().unwrap().is_none() {
                    if began.elapsed() > Duration::from_secs(120) {
                        let _ = child.kill();
                        panic!("{case}, {cmd:?}: still running after 120 s");
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                let out = child.wait_with_output().unwrap();
                let err = String::from_utf8_lossy(&out.stderr);
                assert_eq!(out.status.code(), Some(1), "{case}, {cmd:?}: {err}");
                if kube {
                    // The input gate refuses the FIFO before the client could block on it.
                    assert!(
                        err.contains("user \"u\" tokenFile") && err.contains("is a FIFO"),
                        "{case}, {cmd:?}: {err}"
                    );
                    assert!(
                        began.elapsed() < Duration::from_secs(10),
                        "{case}, {cmd:?} waited"
                    );
                    phases.push("none: refused by the input gate");
                    covered += 1;
                    continue;
                }
                // What it names depends on how far the run got: on a slow guest the deadline
                // can fall while the datapath still loads. Every phase is a wait it may end.
                let phase = [
                    "the node source's first full list",
                    "the kernel's objects",
                    "the lock and checkpoint",
                    "the node source (a Kubernetes client",
                ]
                .into_iter()
                .find(|p| {
                    err.contains(&format!(
                        "gave up after 10s (--sync-timeout) waiting for {p}"
                    ))
                })
                .unwrap_or_else(|| panic!("{case}, {cmd:?}: {err}"));
                phases.push(phase);
                assert!(
                    !env.state_dir.join("nodes.ckpt").exists(),
                    "{case}, {cmd:?}: a checkpoint was written"
                );
                covered += 1;
            }
        }
        node_agent_tests::report(&format!(
            "sync timeout: {covered} waits (3 sources x run --once, plan) ended (at the deadline, or refused at once), waiting for: {phases:?}"
        ));
    });
}

#[test]
fn drift_in_routes_and_the_map_is_repaired_and_counted() {
    require_sandbox!();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        let nodes = cluster(4);
        env.write_nodes(&nodes);
        let _child = env.spawn(&["--metrics-addr", METRICS, "--resync-interval", "1s"]);
        env.wait("all routes", TIMEOUT, || env.routes().len() == 8);
        // A route of ours deleted, another moved to another gateway, an entry deleted, another
        // rewritten; and a foreign route nobody must touch.
        ip(&["route", "del", "10.100.1.0/24", "proto", "201"]);
        ip(&[
            "route",
            "replace",
            "10.100.2.0/24",
            "via",
            "10.88.1.250",
            "proto",
            "201",
        ]);
        ip(&[
            "route",
            "add",
            "10.77.0.0/24",
            "via",
            "10.88.1.251",
            "proto",
            "static",
        ]);
        let pin = node_agent::datapath::node_ids_pin(&env.bpffs);
        let mut map = node_agent::datapath::maps::NodeMap::open(&pin).unwrap();
        map.remove("10.88.1.4".parse().unwrap()).unwrap();
        map.upsert(
            "10.88.1.5".parse().unwrap(),
            node_agent_common::NodeValue {
                id: 999,
                spi: 0,
                flags: 0,
            },
        )
        .unwrap();
        env.wait("the repairs", TIMEOUT, || {
            let m = scrape_metrics(METRICS);
            metric(&m, "node_agent_drift_repaired_total{kind=\"route\"}") == Some(2.0)
                && metric(&m, "node_agent_drift_repaired_total{kind=\"map_entry\"}") == Some(2.0)
        });
        assert_exact(&env, &nodes);
        assert_eq!(
            env.all_routes()["10.77.0.0/24"],
            ("10.88.1.251".into(), "static".into())
        );
        let log = std::fs::read_to_string(env.log()).unwrap();
        assert_eq!(log.matches("repaired drift").count(), 4, "{log}");
        assert!(
            log.contains("route 10.100.2.0/24 via 10.88.1.250"),
            "what was found"
        );
    });
}

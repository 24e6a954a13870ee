//! The container image, built for real by `cargo xtask image` and run from its own filesystem.
//!
//! `podman run` needs an OCI runtime that these machines refuse (`setrlimit`), so the test does
//! what the runtime would: `podman create` + `podman mount` give the image's root filesystem, and
//! its binaries run under `chroot` there, inside a sandbox (private network and mount namespace,
//! private bpffs) with the mounts the DaemonSet gives the pod: `/proc`, `/sys`, the bpffs at
//! `/sys/fs/bpf`, the state directory at `/run/node-agent`. The agent then does the demo's
//! restart scenario, and the image's `bpftool` and `ip` read what it programmed.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use node_agent_tests::agent::{AgentEnv, Daemon, assert_exact, cluster, is_exact};
use node_agent_tests::fixture::workspace_root;
use node_agent_tests::{report, require_sandbox, run, sandbox, skip, which};

/// The tag the test builds; `cargo xtask image`'s default tag stays the user's.
const TAG: &str = "localhost/node-agent:test";
/// Small: the slim base, the agent, bpftool and ip. A compiler or a toolchain stage (LLVM alone
/// is over 100 MB) cannot hide under it.
const MAX_SIZE_MB: f64 = 150.0;
const TIMEOUT: Duration = Duration::from_secs(60);

/// A container created from the image, its root filesystem mounted; removed when dropped.
struct Mounted {
    name: String,
    rootfs: PathBuf,
}

impl Mounted {
    fn new(image: &str) -> Self {
        let name = format!("node-agent-image-test-{}", std::process::id());
        // A leftover of an earlier run that was killed before its clean-up.
        let _ = Command::new("podman")
            .args(["rm", "--force", &name])
            .output();
        run(Command::new("podman").args(["create", "--name", &name, image]));
        let out = run(Command::new("podman").args(["mount", &name]));
        let rootfs = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        assert!(rootfs.join("usr").is_dir(), "{}", rootfs.display());
        Self { name, rootfs }
    }

    /// `chroot ROOTFS PROGRAM ARGS...`: a binary of the image, run in the image's filesystem.
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut c = Command::new("chroot");
        c.arg(&self.rootfs).arg(program).args(args);
        c
    }

    fn output(&self, program: &str, args: &[&str]) -> String {
        String::from_utf8_lossy(&run(&mut self.command(program, args)).stdout).into_owned()
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("podman").args(["umount", &self.name]).output();
        let _ = Command::new("podman")
            .args(["rm", "--force", &self.name])
            .output();
    }
}

#[test]
fn the_image_builds_and_its_binaries_run_the_restart_scenario() {
    let name = node_agent_tests::test_name!();
    require_sandbox!();
    if which("podman").is_none() {
        skip(name, "needs podman (`cargo xtask test` installs it)");
        return;
    }
    let start = Instant::now();

    // The build, as users run it.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(workspace_root())
        .args(["xtask", "image", "--tag", TAG])
        .stdin(Stdio::null())
        .output()
        .expect("starting cargo xtask image");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "cargo xtask image failed: {}\n{}{log}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    for line in log.lines().filter(|l| {
        l.starts_with("xtask: image: ")
            && (l.contains(" built: ") || l.contains("base ") || l.contains("stand-in"))
    }) {
        report(line);
    }
    let build = start.elapsed().as_secs_f64();
    report(&format!("bench: image_build {build:.1} s"));

    let size = run(Command::new("podman").args(["image", "inspect", "--format", "{{.Size}}", TAG]));
    let size_mb = String::from_utf8_lossy(&size.stdout)
        .trim()
        .parse::<f64>()
        .expect("podman's image size")
        / 1e6;
    report(&format!("bench: image_size {size_mb:.1} MB"));
    assert!(
        size_mb < MAX_SIZE_MB,
        "the image is {size_mb:.1} MB, over {MAX_SIZE_MB} MB"
    );

    let image = Mounted::new(TAG);
    let rootfs = image.rootfs.clone();
    // Exactly the binary xtask built, and no toolchain beside it.
    let shipped = std::fs::read(rootfs.join("usr/local/bin/node-agent")).unwrap();
    let built = std::fs::read(workspace_root().join("target/release/node-agent")).unwrap();
    assert!(
        shipped == built,
        "the image's node-agent is not target/release/node-agent"
    );
    for tool in ["cc", "gcc", "clang", "rustc", "cargo", "ld"] {
        assert!(
            !rootfs.join("usr/bin").join(tool).exists(),
            "a compiler in the image: /usr/bin/{tool}"
        );
    }
    assert!(
        std::fs::read_dir(rootfs.join("usr/lib"))
            .unwrap()
            .all(|e| !e.unwrap().file_name().to_string_lossy().starts_with("llvm")),
        "LLVM in the image"
    );

    let version = image.output("/usr/local/bin/node-agent", &["--version"]);
    assert_eq!(
        version.trim(),
        format!("node-agent {}", env!("CARGO_PKG_VERSION"))
    );
    let bpftool = image.output("bpftool", &["version"]);
    assert!(bpftool.starts_with("bpftool v"), "{bpftool}");
    report(&format!(
        "{name}: the image's `node-agent --version`: {}; `bpftool version`: {}",
        version.trim(),
        bpftool.lines().next().unwrap_or_default()
    ));

    sandbox(|sb| restart_scenario(&image, &sb.bpffs));
    drop(image);
    report(&format!(
        "bench: image_test {:.1} s",
        start.elapsed().as_secs_f64()
    ));
}

/// The demo's scenario with the image's binaries: the agent programs four remote nodes, stops;
/// two of them are deleted while it is down; on restart it removes exactly what they left behind.
fn restart_scenario(image: &Mounted, bpffs: &Path) {
    let rootfs = &image.rootfs;
    let mut env = AgentEnv::new(bpffs);
    let base = bpffs.parent().unwrap().to_owned();
    let input = base.join("input");
    std::fs::create_dir_all(&input).unwrap();
    std::fs::create_dir_all(&env.state_dir).unwrap();
    env.nodes_file = input.join("nodes.yaml");
    // The pod's mounts, in the sandbox's mount namespace only. sysfs mounted here shows the
    // sandbox's network namespace, as the pod's shows the host's.
    let sh = |cmd: String| run(Command::new("sh").args(["-c", &cmd]));
    let r = rootfs.display();
    sh(format!("mount -t proc proc {r}/proc"));
    sh(format!("mount -t sysfs sysfs {r}/sys"));
    sh(format!("mount --bind {} {r}/sys/fs/bpf", bpffs.display()));
    sh(format!(
        "mkdir -p {r}/run/node-agent {r}/etc/node-agent/input && mount --bind {} \
         {r}/run/node-agent && mount --bind {} {r}/etc/node-agent/input",
        env.state_dir.display(),
        input.display()
    ));
    let agent = |args: &[&str]| {
        let mut c = image.command("/usr/local/bin/node-agent", args);
        c.args([
            "--nodes-file",
            "/etc/node-agent/input/nodes.yaml",
            "--node-name",
            "local",
            "--state-dir",
            "/run/node-agent",
            "--bpffs",
            "/sys/fs/bpf",
        ])
        .env("NODE_AGENT_LOG", "info");
        c
    };

    // 1. The agent runs and programs four remote nodes.
    let nodes = cluster(4);
    env.write_nodes(&nodes);
    let log = std::fs::File::create(env.log()).unwrap();
    let mut daemon = Daemon(
        agent(&[
            "run",
            "--datapath-iface",
            "gw0",
            "--nodes-file-poll",
            "50ms",
            "--nodes-file-settle",
            "200ms",
        ])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap(),
    );
    env.wait("the four nodes programmed", TIMEOUT, || {
        env.checkpoint().exists() && is_exact(&env, &nodes)
    });
    assert_exact(&env, &nodes);

    // The image's bpftool and ip read it; `proto node-agent` resolves through the image's
    // /etc/iproute2/rt_protos.d.
    let dump = image.output(
        "bpftool",
        &[
            "-j",
            "map",
            "dump",
            "pinned",
            "/sys/fs/bpf/node-agent/node_ids",
        ],
    );
    let entries: serde_json::Value = serde_json::from_str(&dump).unwrap();
    assert_eq!(
        entries.as_array().map(Vec::len),
        Some(2 * nodes.len()),
        "{dump}"
    );
    let v4 = image.output("ip", &["route", "show", "proto", "node-agent"]);
    let v6 = image.output("ip", &["-6", "route", "show", "proto", "node-agent"]);
    assert_eq!(
        v4.lines().count() + v6.lines().count(),
        2 * nodes.len(),
        "{v4}{v6}"
    );

    // 2. It stops; two nodes are deleted while it is down.
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    let status = daemon.wait().unwrap();
    assert!(status.success(), "the agent on SIGTERM: {status}");
    let left = &nodes[..2];
    env.write_nodes(left);

    // 3. On restart it synthesizes the deletes the watch never delivered.
    let out = agent(&[
        "run",
        "--once",
        "--output",
        "json",
        "--datapath-iface",
        "gw0",
    ])
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", out.status);
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no JSON report ({e}): {stderr}"));
    let pruned: Vec<String> = serde_json::from_value(summary["pruned"].clone()).unwrap();
    assert_eq!(pruned.len(), 2, "{summary}");
    for gone in &nodes[2..] {
        assert!(
            pruned.contains(&gone.name),
            "{} not pruned: {summary}",
            gone.name
        );
    }
    assert_exact(&env, left);
    let v4 = image.output("ip", &["route", "show", "proto", "node-agent"]);
    assert_eq!(v4.lines().count(), left.len(), "{v4}");
    report(&format!(
        "the image's agent programmed {} nodes, stopped, and on restart pruned {}",
        nodes.len(),
        pruned.join(" and ")
    ));
}

//! `cargo xtask demo`: the agent's main job, start to finish, in a sandbox.
//!
//! The task moves itself into fresh network and mount namespaces before anything else, so the
//! agent, `ip` and `bpftool` it runs can only ever see the sandbox: the host's routes and bpffs
//! are out of reach, and everything vanishes when the task exits.

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::cmd::{self, root, step};
use crate::{build_ebpf, setup};

/// The nodes that go away while the agent is down, in the second act.
const GONE: [&str; 2] = ["worker-b", "worker-d"];

pub fn run() -> anyhow::Result<()> {
    if !cmd::is_root() {
        bail!(
            "the demo needs root (network and mount namespaces, bpffs): run `sudo cargo xtask demo`"
        );
    }
    setup::run()?;
    build_ebpf::run(&build_ebpf::Args { release: true })?;
    step("demo: cargo build -p node-agent");
    cmd::run(
        Command::new("cargo")
            .current_dir(root())
            .args(["build", "-p", "node-agent"]),
    )?;
    let agent = root().join("target/debug/node-agent");

    let dir = std::env::temp_dir().join(format!("node-agent-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let result = in_sandbox(&dir, &agent);
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    step("demo: sandbox torn down; the host's network namespace was never touched");
    Ok(())
}

fn in_sandbox(dir: &Path, agent: &Path) -> anyhow::Result<()> {
    step("demo: 1. a sandbox network namespace and a private bpffs");
    // SAFETY: the task is single-threaded here; unshare moves only this process.
    if unsafe { libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWNS) } != 0 {
        bail!("unshare: {}", std::io::Error::last_os_error());
    }
    sh(&["mount", "--make-rprivate", "/"])?;
    let bpffs = dir.join("bpffs");
    std::fs::create_dir_all(&bpffs)?;
    sh(&["mount", "-t", "bpf", "bpf", bpffs.to_str().unwrap()])?;
    // The node's uplink: one end of a veth pair holds the node's addresses, so the other nodes'
    // addresses are on-link gateways.
    for line in [
        "link set lo up",
        "link add eth0 type veth peer name eth0-peer",
        "addr add 192.168.50.1/24 dev eth0",
        "addr add fd00:50::1/64 dev eth0 nodad",
        "link set eth0 up",
        "link set eth0-peer up",
    ] {
        sh(&["ip"]
            .into_iter()
            .chain(line.split(' '))
            .collect::<Vec<_>>())?;
    }

    let nodes = dir.join("nodes.yaml");
    std::fs::copy(root().join("examples/nodes.yaml"), &nodes)?;
    let state = dir.join("state");
    let args = |extra: &[&str]| -> Command {
        let mut c = Command::new(agent);
        c.arg("run")
            .arg("--nodes-file")
            .arg(&nodes)
            .args(["--node-name", "demo-local", "--datapath-iface", "eth0"])
            .arg("--state-dir")
            .arg(&state)
            .arg("--bpffs")
            .arg(&bpffs)
            .args(extra);
        c
    };

    step("demo: 2. the agent runs on examples/nodes.yaml (1 local + 4 remote nodes)");
    let mut daemon = args(&["--nodes-file-poll", "200ms"])
        .spawn()
        .context("starting node-agent")?;
    wait_for(&state.join("nodes.ckpt"), &mut daemon)?;

    step("demo: 3. what it programmed");
    show(&[
        "bpftool",
        "map",
        "dump",
        "pinned",
        &format!("{}/node-agent/node_ids", bpffs.display()),
    ])?;
    show_programmed(agent, &bpffs)?;

    step(&format!(
        "demo: 4. the agent stops; while it is down, {} are deleted",
        GONE.join(" and ")
    ));
    terminate(daemon)?;
    let text = std::fs::read_to_string(&nodes)?;
    std::fs::write(&nodes, drop_nodes(&text, &GONE))?;

    step("demo: 5. on restart it synthesizes the deletes the watch never delivered");
    show(&[
        agent.to_str().unwrap(),
        "plan",
        "--nodes-file",
        nodes.to_str().unwrap(),
        "--node-name",
        "demo-local",
        "--state-dir",
        state.to_str().unwrap(),
        "--bpffs",
        bpffs.to_str().unwrap(),
    ])?;
    let out = args(&["--once"])
        .output()
        .context("running node-agent --once")?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        bail!(
            "node-agent --once failed: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for line in String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.contains("deleted"))
    {
        println!("{line}");
    }
    step("demo: the clean result");
    show_programmed(agent, &bpffs)?;
    show(&[
        agent.to_str().unwrap(),
        "state",
        "show",
        "--state-dir",
        state.to_str().unwrap(),
    ])?;
    step("demo: 6. tearing the sandbox down");
    Ok(())
}

/// The NodeList without the items named in `gone`: items are the blocks that start with `- `.
fn drop_nodes(text: &str, gone: &[&str]) -> String {
    let mut blocks: Vec<String> = vec![String::new()];
    for line in text.lines() {
        if line.starts_with("- ") {
            blocks.push(String::new());
        }
        let last = blocks.last_mut().expect("one block at least");
        last.push_str(line);
        last.push('\n');
    }
    blocks
        .into_iter()
        .filter(|b| !gone.iter().any(|g| b.contains(&format!("{{name: {g},"))))
        .collect()
}

/// The node-ID map, our nexthops and routes, as an operator would look at them.
fn show_programmed(agent: &Path, bpffs: &Path) -> anyhow::Result<()> {
    show(&[
        agent.to_str().unwrap(),
        "map",
        "dump",
        "--bpffs",
        bpffs.to_str().unwrap(),
    ])?;
    show(&["ip", "nexthop", "list", "protocol", "201"])?;
    show(&["ip", "route", "show", "proto", "201"])?;
    show(&["ip", "-6", "route", "show", "proto", "201"])
}

fn sh(args: &[&str]) -> anyhow::Result<()> {
    cmd::run(Command::new(args[0]).args(&args[1..]))
}

/// Runs and prints a command the way a reader would type it: the agent by its name (it is on the
/// `PATH` of a node's pod), the sandbox's directories under `/tmp`.
fn show(args: &[&str]) -> anyhow::Result<()> {
    let shown: Vec<&str> = args
        .iter()
        .enumerate()
        .map(|(i, a)| match (i, Path::new(a).file_name()) {
            (0, Some(name)) => name.to_str().unwrap_or(a),
            _ => a,
        })
        .collect();
    println!(
        "$ {}",
        shown
            .join(" ")
            .replace(&format!("{}/", std::env::temp_dir().display()), "/tmp/")
    );
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args[0]))?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn wait_for(path: &Path, daemon: &mut Child) -> anyhow::Result<()> {
    let start = Instant::now();
    while !path.exists() {
        if let Some(status) = daemon.try_wait()? {
            bail!("node-agent exited early: {status}");
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("node-agent was not ready after 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn terminate(mut daemon: Child) -> anyhow::Result<()> {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    let status = daemon.wait()?;
    if !status.success() {
        bail!("node-agent exited with {status} on SIGTERM");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropping_nodes_keeps_the_others_intact() {
        let text = std::fs::read_to_string(root().join("examples/nodes.yaml")).unwrap();
        let left = drop_nodes(&text, &GONE);
        assert!(
            !left.contains("worker-b") && !left.contains("worker-d"),
            "{left}"
        );
        for kept in ["demo-local", "worker-a", "worker-c", "192.168.50.13"] {
            assert!(left.contains(kept), "{kept} lost:\n{left}");
        }
        assert_eq!(left.matches("- apiVersion: v1").count(), 3);
    }
}

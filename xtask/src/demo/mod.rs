//! `cargo xtask demo`: the agent's job, start to finish, on a small cluster in a sandbox.
//!
//! The task moves itself into fresh network and mount namespaces before anything else and
//! mounts a private tmpfs on `/run/netns`, so the namespaces it names, the agents, `ip` and
//! `bpftool` it runs can only ever see the sandbox: the host's routes, bpffs and named
//! namespaces are out of reach, and whatever a crash would leave vanishes when the task exits.
//!
//! The sandbox's own namespace is the switch: a bridge `wire`. Every node of
//! `examples/nodes.yaml` is a network namespace named after it with `eth0` on the wire (its
//! InternalIPs), a private bpffs and state directory, and its own agent. Every node has a pod: a
//! namespace whose interfaces the reference CNI plugins (`bridge`, `host-local`, `loopback`,
//! Debian's `containernetworking-plugins`) create from the node's pod CIDR, as a kubelet would.
//! Pods on different nodes reach each other only through the routes the agents program.

mod cluster;
mod sandbox;
mod story;
mod traffic;
mod transcript;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

use self::sandbox::{Sandbox, quiet, shown_path};
pub use self::transcript::{OnNode, PARTS, Transcript};
use crate::cmd::{self, root, step};
use crate::{build_ebpf, setup};

/// What the demo runs besides the toolchain: the reference CNI plugins and `ping`.
const PACKAGES: &[&str] = &["containernetworking-plugins", "iputils-ping"];

/// Runs the demo. Each of `scripts` also runs on the local node once its agent has programmed
/// the cluster, as in the agent's pod ([`Sandbox::on_node`]); what they print is kept in the
/// transcript, not printed.
pub fn run(scripts: &[OnNode]) -> anyhow::Result<Transcript> {
    if !cmd::is_root() {
        bail!(
            "the demo needs root (network and mount namespaces, bpffs): run `sudo cargo xtask demo`"
        );
    }
    setup::run()?;
    crate::apt::ensure("demo packages", PACKAGES, "")?;
    build_ebpf::run(&build_ebpf::Args { release: true })?;
    step("demo: cargo build -p node-agent");
    cmd::run(
        Command::new("cargo")
            .current_dir(root())
            .args(["build", "-p", "node-agent"]),
    )?;
    let agent = target_dir().join("debug/node-agent");

    sweep_dead_demos();
    let dir = std::env::temp_dir().join(format!("{DIR_PREFIX}{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let start = Instant::now();
    let result = in_sandbox(&dir, &agent, scripts);
    let _ = std::fs::remove_dir_all(&dir);
    let transcript = result?;
    step(&format!(
        "demo: done in {:.1} s (after the build); the host's network namespace was never touched",
        start.elapsed().as_secs_f64()
    ));
    Ok(transcript)
}

/// The demo's directory is this and its PID.
const DIR_PREFIX: &str = "node-agent-demo-";

/// Removes the directories of demos whose process is gone. A demo removes its own, but one that
/// was interrupted (Ctrl-C, kill -9, a crash) cannot; its namespaces and mounts went with it.
fn sweep_dead_demos() {
    let tmp = std::env::temp_dir();
    for entry in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(DIR_PREFIX)
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            match std::fs::remove_dir_all(entry.path()) {
                Ok(()) => step(&format!(
                    "demo: removed {} (left by an interrupted demo)",
                    shown_path(&entry.path())
                )),
                Err(e) => step(&format!(
                    "demo: cannot remove {} (left by an interrupted demo): {e}",
                    shown_path(&entry.path())
                )),
            }
        }
    }
}

/// Cargo's target directory: `CARGO_TARGET_DIR` when set (relative to the workspace root, where
/// the build runs), else `target/`.
fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => root().join(d),
        None => root().join("target"),
    }
}

fn in_sandbox(dir: &Path, agent: &Path, scripts: &[OnNode]) -> anyhow::Result<Transcript> {
    step(
        "demo: 1. a sandbox: every node of examples/nodes.yaml is a network namespace on one wire",
    );
    let home = Home::save()?;
    // SAFETY: the task is single-threaded here; unshare moves only this process.
    if unsafe { libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWNS) } != 0 {
        bail!("unshare: {}", std::io::Error::last_os_error());
    }
    let outcome = (|| {
        quiet(&["mount", "--make-rprivate", "/"])?;
        let mut s = Sandbox::new(dir, agent)?;
        let result = s.act(scripts);
        if result.is_err() {
            s.print_logs();
        }
        let left = s.teardown();
        result?;
        left?;
        Ok(std::mem::take(&mut s.transcript))
    })();
    home.restore()?;
    outcome
}

/// The namespaces and directory the task left for the sandbox. `cargo xtask test` goes on after
/// the demo (the VM tier downloads its kernels): it must be back on the host's network and
/// mounts, or it would go on in an empty network namespace.
struct Home {
    net: std::fs::File,
    mnt: std::fs::File,
    cwd: PathBuf,
}

impl Home {
    fn save() -> anyhow::Result<Self> {
        let open = |ns: &str| {
            std::fs::File::open(format!("/proc/self/ns/{ns}"))
                .with_context(|| format!("opening this task's {ns} namespace"))
        };
        Ok(Self {
            net: open("net")?,
            mnt: open("mnt")?,
            cwd: std::env::current_dir()?,
        })
    }

    /// Back into the saved namespaces (the sandbox's threads have all ended: a task with other
    /// threads cannot change its mount namespace), checked by the namespaces' identities.
    fn restore(self) -> anyhow::Result<()> {
        use std::os::fd::AsRawFd as _;
        use std::os::unix::fs::MetadataExt as _;
        for (file, kind, name) in [
            (&self.mnt, libc::CLONE_NEWNS, "mount"),
            (&self.net, libc::CLONE_NEWNET, "network"),
        ] {
            // SAFETY: setns(2) on a namespace file we hold open.
            if unsafe { libc::setns(file.as_raw_fd(), kind) } != 0 {
                bail!(
                    "returning to the host's {name} namespace after the demo: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
        for (file, ns) in [(&self.net, "net"), (&self.mnt, "mnt")] {
            let now = std::fs::metadata(format!("/proc/self/ns/{ns}"))?.ino();
            if now != file.metadata()?.ino() {
                bail!("still outside the host's {ns} namespace after the demo");
            }
        }
        std::env::set_current_dir(&self.cwd)?;
        Ok(())
    }
}

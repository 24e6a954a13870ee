//! Building what the guest runs: the kernel-tier test binaries and the agent they start.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

use crate::cmd::{self, root, step};

/// The test payload: the workspace, shared with the guest over 9p and mounted at the same path
/// there. Everything the tests find by path then resolves as on the host: the agent next to
/// them (`target/<profile>/node-agent`, where `agent_bin()` looks) and files named through
/// `env!("CARGO_MANIFEST_DIR")`, such as `target/ebpf/node-agent.bpf.o`.
pub struct Payload {
    /// The workspace root, shared read-only and mounted at this same path in the guest.
    pub share: PathBuf,
    /// The test executables (absolute, under `share`).
    pub tests: Vec<String>,
    /// The agent binary and the tests, for `ldd`.
    pub binaries: Vec<PathBuf>,
}

/// Builds the agent and the test binaries, with `--release` when `release`.
pub fn tests(release: bool) -> anyhow::Result<Payload> {
    step("vm-test: building node-agent and the node-agent-tests binaries");
    let profile: &[&str] = if release { &["--release"] } else { &[] };
    cmd::run(
        Command::new("cargo")
            .current_dir(root())
            .args(["build", "-p", "node-agent"])
            .args(profile),
    )?;
    let exes = test_executables(profile)?;
    let first = exes
        .first()
        .context("node-agent-tests produced no test executables")?;
    let profile_dir = first
        .parent()
        .and_then(Path::parent)
        .context("test executables live in target/<profile>/deps")?;
    let agent = profile_dir.join("node-agent");
    if !agent.is_file() {
        bail!(
            "{} is missing after `cargo build -p node-agent`; the tests start it from there",
            agent.display()
        );
    }
    let share = root();
    let mut tests = Vec::new();
    for exe in &exes {
        if !exe.starts_with(&share) {
            bail!(
                "{} is outside the workspace {}, which is all the guest sees; unset \
                 CARGO_TARGET_DIR",
                exe.display(),
                share.display()
            );
        }
        tests.push(exe.to_string_lossy().into_owned());
    }
    let mut binaries = exes;
    binaries.push(agent);
    Ok(Payload {
        share,
        tests,
        binaries,
    })
}

/// The test modules that exercise the kernel: the guest runs these. The others (the API-server
/// stand-in's own tests, manifests, docs, the benchmarks) do not depend on the kernel, and TCG
/// makes every second in the guest count.
pub const KERNEL_TIER: &[&str] = &[
    "datapath::",
    "backends::",
    "nexthops::",
    "xfrm::",
    "ipsec::",
    "pods::",
    "caps::",
    "agent::",
    "rules::",
    "faults::",
    "endpoints::",
    "kube::",
    "invariants::random_histories_with_ipsec",
];
/// The one integration-test target (`tests/tests/it`).
const TEST_TARGET: &str = "it";

/// `cargo test --no-run` with JSON messages: the executables of the kernel-tier test targets.
fn test_executables(profile: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    let mut cargo = Command::new("cargo");
    cargo
        .current_dir(root())
        .args([
            "test",
            "--no-run",
            "-p",
            "node-agent-tests",
            "--message-format=json-render-diagnostics",
        ])
        .args(profile);
    eprintln!(
        "  $ cargo test --no-run -p node-agent-tests --message-format=json-render-diagnostics {}",
        profile.join(" ")
    );
    let out = cargo
        .stderr(Stdio::inherit())
        .output()
        .context("starting cargo test --no-run")?;
    if !out.status.success() {
        bail!(
            "building the node-agent-tests binaries failed: {}",
            out.status
        );
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] == "compiler-artifact"
            && msg["profile"]["test"] == true
            && msg["target"]["name"]
                .as_str()
                .is_some_and(|t| t == TEST_TARGET)
            && let Some(exe) = msg["executable"].as_str()
        {
            exes.push(PathBuf::from(exe));
        }
    }
    exes.sort();
    Ok(exes)
}

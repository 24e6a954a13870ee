//! `cargo xtask bench`: every benchmark, in release builds. Each prints `bench: <name> <value>
//! <unit>` lines; none asserts a time.

use std::process::Command;

use anyhow::bail;

use crate::cmd::{self, root, step};
use crate::{build_ebpf, setup};

pub fn run() -> anyhow::Result<()> {
    if !cmd::is_root() {
        bail!("the benchmarks use network namespaces and bpffs: run as root");
    }
    setup::run()?;
    build_ebpf::run(&build_ebpf::Args { release: true })?;
    step("bench: state (planner and checkpoint)");
    cmd::run(
        Command::new("cargo")
            .current_dir(root())
            .args(["bench", "-p", "state"]),
    )?;
    step("bench: cargo build --release -p node-agent");
    cmd::run(Command::new("cargo").current_dir(root()).args([
        "build",
        "--release",
        "-p",
        "node-agent",
    ]))?;
    step(
        "bench: backends against their floors, the agent at 5,000 and 65,000 nodes (NODE_AGENT_BENCH_SIZES), the daemon while it waits",
    );
    cmd::run(
        Command::new("cargo")
            .current_dir(root())
            .env("NODE_AGENT_BENCH", "1")
            .args([
                "test",
                "--release",
                "-p",
                "node-agent-tests",
                "--test",
                "it",
            ])
            .args(["--", "bench", "--test-threads=1", "--nocapture"]),
    )
}

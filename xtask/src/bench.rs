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
    )?;
    step(
        "bench: the agent at scale with IPsec off and on (NODE_AGENT_BENCH_IPSEC_SIZES) and xfrm states and policies by the thousand (NODE_AGENT_BENCH_XFRM_SIZES), in the VM tier: ESP is there, release builds under emulation",
    );
    cmd::run(
        Command::new(std::env::current_exe()?)
            .env("NODE_AGENT_BENCH", "1")
            .args(["vm-test", "--release", "--kernel", "6.12"])
            .args(["--memory-mib", "4096", "--timeout", "3600", "--"])
            .args(["bench_agent_at_scale_ipsec", "bench_xfrm_scaling"])
            .args(["--test-threads=1", "--nocapture"]),
    )
}

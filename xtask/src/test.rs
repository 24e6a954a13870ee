//! `cargo xtask test`: the README's test command. Sets everything up, builds the eBPF object,
//! then runs the workspace's tests, the kernel tiers included (they need root).

use std::process::Command;

use anyhow::bail;

use crate::cmd::{self, root, step};
use crate::{build_ebpf, setup};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Arguments passed to `cargo test` after `--` (a test name filter, `--nocapture`, ...).
    #[arg(last = true)]
    pub rest: Vec<String>,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    if !cmd::is_root() {
        bail!("the kernel test tier needs root (network and mount namespaces, bpffs); run as root");
    }
    setup::run()?;
    build_ebpf::run(&build_ebpf::Args { release: true })?;
    // The end-to-end tests run the real binary; `cargo test` alone only builds binaries for the
    // tests of their own package.
    step("test: cargo build -p node-agent");
    cmd::run(
        Command::new("cargo")
            .current_dir(root())
            .args(["build", "-p", "node-agent"]),
    )?;
    step("test: cargo test --workspace");
    cmd::run(
        Command::new("cargo")
            .current_dir(root())
            .args(["test", "--workspace", "--"])
            .args(&args.rest),
    )
}

//! `cargo xtask test`: the README's test command. Sets everything up, builds the eBPF object,
//! runs the workspace's tests (the kernel and end-to-end tiers included; they need root), then
//! the VM tier on both Debian kernels.

use std::process::Command;

use anyhow::bail;

use crate::cmd::{self, root, step};
use crate::{apt, build_ebpf, docs, image, setup, vm};

/// What the image and alert tests need beyond `setup`: podman to build the image and debootstrap
/// for its stand-in base (tests/tests/it/image.rs), promtool from `prometheus` to check and unit-test
/// the alert rules (tests/tests/it/deploy/alerts.rs), libfaketime from `faketime` to step one agent's
/// wall clock without the host's (tests/tests/it/rules.rs), the reference CNI plugins and `ping`
/// for the pods of the host tier (tests/tests/it/pods.rs). Not part of `setup`.
const TEST_PACKAGES: &[&str] = &[
    "podman",
    "debootstrap",
    "prometheus",
    "faketime",
    "containernetworking-plugins",
    "iputils-ping",
];

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Skip the VM tier (quick local runs; CI runs everything).
    #[arg(long)]
    pub host_only: bool,
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
    apt::ensure("test", TEST_PACKAGES, "")?;
    // The image test runs `cargo xtask image`, which packages the release agent on a base image.
    // Both are made here, so that their minutes show as steps of their own rather than inside
    // one test, and side by side: the base (where no registry is reachable, a debootstrap that
    // waits on the network, then cached) while the release build keeps the CPUs busy.
    step("test: the image's base, beside cargo build --release -p node-agent");
    let base = std::thread::spawn(image::prepare_base);
    let build = cmd::run(Command::new("cargo").current_dir(root()).args([
        "build",
        "--release",
        "-p",
        "node-agent",
    ]));
    let base = base
        .join()
        .map_err(|_| anyhow::anyhow!("preparing the image's base panicked"))?;
    build?;
    step(&format!("test: the image's base is {}", base?));
    step("test: cargo test --workspace");
    cmd::run(
        Command::new("cargo")
            .current_dir(root())
            .args(["test", "--workspace", "--"])
            .args(&args.rest),
    )?;
    // The demo, the README's first command, is a test too: its run must still print what the
    // docs show it printing.
    if args.rest.is_empty() {
        step("test: the docs' recorded outputs against a fresh demo run");
        docs::run(&docs::Args { check: true })?;
    } else {
        step("test: the docs' recorded outputs not checked (a test filter was given)");
    }
    if args.host_only {
        step("test: VM tier skipped (--host-only)");
        return Ok(());
    }
    let vm_args = vm::Args {
        kernel: vm::KernelChoice::All,
        timeout: 900,
        bzimage: false,
        release: false,
        memory_mib: 2048,
        rest: args.rest.clone(),
    };
    match vm::run(&vm_args)? {
        0 => Ok(()),
        rc => bail!("the VM tier failed (guest test status {rc})"),
    }
}

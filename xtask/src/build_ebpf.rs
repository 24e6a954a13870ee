//! `cargo xtask build-ebpf`: the eBPF crate, built by the nightly for `bpfel-unknown-none`.

use std::path::PathBuf;
use std::process::Command;

use anyhow::Context;

use crate::cmd::{self, root, step};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Build with the release profile (LTO, one codegen unit).
    #[arg(long)]
    pub release: bool,
}

/// Where the agent's build script looks for the object to embed.
pub fn object_path() -> PathBuf {
    root().join("target/ebpf/node-agent.bpf.o")
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let root = root();
    let target_dir = root.join("target/ebpf");
    let profile = if args.release { "release" } else { "dev" };
    step(&format!("build-ebpf: node-agent-ebpf ({profile})"));
    let mut cargo = Command::new("cargo");
    cargo
        .current_dir(root.join("node-agent-ebpf"))
        // The crate's rust-toolchain.toml selects the nightly; the stable one cargo-xtask runs
        // under must not leak into the child.
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTFLAGS")
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            "-Cdebuginfo=2\x1f-Clink-arg=--btf",
        )
        .args(["build", "--target-dir"])
        .arg(&target_dir);
    if args.release {
        cargo.arg("--release");
    }
    cmd::run(&mut cargo)?;
    let dir = if args.release { "release" } else { "debug" };
    let built = target_dir.join(format!("bpfel-unknown-none/{dir}/node-agent"));
    let dest = object_path();
    // Copy only on change, so the agent's build script does not rebuild it for nothing.
    let new = std::fs::read(&built).with_context(|| format!("reading {}", built.display()))?;
    if std::fs::read(&dest).ok().as_deref() != Some(new.as_slice()) {
        std::fs::write(&dest, &new).with_context(|| format!("writing {}", dest.display()))?;
    }
    step(&format!(
        "build-ebpf: {} ({} bytes)",
        dest.display(),
        new.len()
    ));
    Ok(())
}

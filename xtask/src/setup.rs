//! `cargo xtask setup`: installs or verifies the eBPF toolchain of docs/toolchain.md.
//!
//! Every check is cheap, so a second run on a ready machine takes seconds. Anything that cannot
//! be installed stops the run with the reason and the command that would fix it.

use std::process::Command;

use anyhow::{Context, bail};

use xtask::host::which;

use crate::cmd::{self, output, step};

/// Debian packages: LLVM 22 for bpf-linker, bpftool to inspect maps, iproute2 for the tests,
/// CA certificates for the Kubernetes client (it loads the system store even for a plain-http
/// API server; the VM tier copies the bundle into its guests).
const PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libpolly-22-dev",
    "bpftool",
    "iproute2",
    "ca-certificates",
];
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
const BPF_LINKER_VERSION: &str = "0.13.0";
const NIGHTLY: &str = "nightly";

pub fn run() -> anyhow::Result<()> {
    packages()?;
    nightly()?;
    bpf_linker()?;
    llvm_match()?;
    step("setup: ready");
    Ok(())
}

fn packages() -> anyhow::Result<()> {
    crate::apt::ensure(
        "packages",
        PACKAGES,
        "; the LLVM 22 packages come from bookworm-security (see docs/toolchain.md)",
    )
}

fn nightly() -> anyhow::Result<()> {
    let toolchains = output(Command::new("rustup").args(["toolchain", "list"])).unwrap_or_default();
    if !toolchains.lines().any(|l| l.starts_with(NIGHTLY)) {
        bail!(
            "the `{NIGHTLY}` toolchain is missing; the eBPF crate needs it. Fix: rustup toolchain \
             install {NIGHTLY} --profile minimal --component rust-src"
        );
    }
    let components = output(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        NIGHTLY,
    ]))
    .unwrap_or_default();
    if components.lines().any(|l| l.starts_with("rust-src")) {
        step("nightly: rust-src installed");
        return Ok(());
    }
    step("nightly: adding rust-src");
    cmd::fetch(Command::new("rustup").args([
        "component",
        "add",
        "rust-src",
        "--toolchain",
        NIGHTLY,
    ]))
    .context("adding rust-src to the nightly (needed for -Z build-std=core)")
}

fn bpf_linker_version() -> Option<String> {
    output(Command::new("bpf-linker").arg("--version"))
        .and_then(|s| s.split_whitespace().nth(1).map(str::to_owned))
}

fn bpf_linker() -> anyhow::Result<()> {
    if bpf_linker_version().as_deref() == Some(BPF_LINKER_VERSION) {
        step(&format!("bpf-linker: {BPF_LINKER_VERSION} installed"));
        return Ok(());
    }
    step(&format!(
        "bpf-linker: building {BPF_LINKER_VERSION} against LLVM 22 (about 2 minutes)"
    ));
    cmd::run(
        Command::new("cargo")
            .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION])
            .args(["--no-default-features", "--features", "llvm-22"])
            .env("LLVM_PREFIX", LLVM_PREFIX)
            .env_remove("RUSTUP_TOOLCHAIN"),
    )
    .with_context(|| {
        format!(
            "building bpf-linker; fix: LLVM_PREFIX={LLVM_PREFIX} cargo install bpf-linker \
             --version {BPF_LINKER_VERSION} --no-default-features --features llvm-22"
        )
    })
}

/// The LLVM major the nightly emits bitcode for must be the one bpf-linker links against, or
/// linking fails with an opaque bitcode error.
fn llvm_match() -> anyhow::Result<()> {
    let rustc = output(Command::new("rustc").args([&format!("+{NIGHTLY}"), "-vV"]))
        .context("running rustc +nightly -vV")?;
    let nightly_llvm = rustc
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("the nightly did not report its LLVM version")?
        .to_owned();
    let linker = which("bpf-linker").context("bpf-linker is not on PATH")?;
    let ldd = output(Command::new("ldd").arg(&linker)).unwrap_or_default();
    let linker_llvm = ldd
        .lines()
        .find_map(|l| l.trim().strip_prefix("libLLVM.so."))
        .and_then(|v| v.split('.').next())
        .map(str::to_owned)
        .or_else(|| ldd.contains("libLLVM-").then(String::new))
        .context("cannot tell which LLVM bpf-linker links against (ldd shows no libLLVM)")?;
    if nightly_llvm != linker_llvm {
        bail!(
            "LLVM mismatch: the nightly uses LLVM {nightly_llvm}, bpf-linker links LLVM \
             {linker_llvm}. Rebuild bpf-linker against LLVM {nightly_llvm}: \
             LLVM_PREFIX=/usr/lib/llvm-{nightly_llvm} cargo install bpf-linker --force \
             --no-default-features --features llvm-{nightly_llvm}"
        );
    }
    step(&format!(
        "llvm: nightly and bpf-linker both on LLVM {nightly_llvm}"
    ));
    Ok(())
}

//! The host side's Debian packages: QEMU, busybox for the guest, and the tools whose binaries
//! are copied into the guest. Nothing else is installed on the host; the kernels are only
//! downloaded and unpacked.

use std::process::Command;

use anyhow::Context;

use crate::cmd::{self, output, step};

pub const PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "cpio",
    "iproute2",
    "bpftool",
    "xz-utils",
    "zstd",
    "lz4",
];

fn installed(pkg: &str) -> bool {
    output(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
        .is_some_and(|s| s.contains("install ok installed"))
}

/// Installs whatever is missing; one dpkg-query per package when everything is there.
pub fn ensure_packages() -> anyhow::Result<()> {
    let missing: Vec<&str> = PACKAGES.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        step(&format!(
            "vm-test: host packages installed ({})",
            PACKAGES.join(", ")
        ));
        return Ok(());
    }
    step(&format!(
        "vm-test: installing host packages {}",
        missing.join(", ")
    ));
    cmd::run(Command::new("apt-get").args(["update", "-qq"])).context("apt-get update")?;
    cmd::run(
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .with_context(|| {
        format!(
            "installing the VM tier's host packages {}",
            missing.join(" ")
        )
    })
}

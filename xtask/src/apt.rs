//! Debian packages: checked with one `dpkg-query` each, installed with `apt-get` only when
//! missing, so a ready machine pays nothing.

use std::process::Command;

use anyhow::{Context, bail};

use crate::cmd::{self, output, step};

fn installed(pkg: &str) -> bool {
    output(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
        .is_some_and(|s| s.contains("install ok installed"))
}

/// Installs whichever of `packages` are missing. `what` names them in messages; `hint` is added
/// to an install failure.
pub fn ensure(what: &str, packages: &[&str], hint: &str) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        step(&format!("{what}: {} installed", packages.join(", ")));
        return Ok(());
    }
    step(&format!("{what}: installing {}", missing.join(", ")));
    if !cmd::is_root() {
        bail!(
            "installing Debian packages needs root; run: sudo apt-get update && sudo apt-get \
             install -y {}",
            missing.join(" ")
        );
    }
    cmd::fetch(Command::new("apt-get").args(["update", "-qq"])).context("apt-get update")?;
    cmd::fetch(
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .with_context(|| format!("installing {}{hint}", missing.join(" ")))
}

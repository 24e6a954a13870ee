//! Running external commands with their command line echoed, and the workspace's paths.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};

/// The workspace root (the parent of `xtask/`).
pub fn root() -> PathBuf {
    xtask::host::workspace_root()
}

/// Prints a step heading the way every task does.
pub fn step(msg: &str) {
    eprintln!("xtask: {msg}");
}

/// Runs `cmd`, echoing it, and fails with its exit status.
pub fn run(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("  $ {}", display(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("starting `{}`", display(cmd)))?;
    if !status.success() {
        bail!("`{}` failed: {status}", display(cmd));
    }
    Ok(())
}

/// Runs `cmd`, which fetches from a package registry, as [`run`] does, trying again after 2, 8
/// and 30 s: a registry or its name server that fails for a moment (it happens on CI machines)
/// must not fail the whole run. A failure that lasts is returned after the fourth attempt.
pub fn fetch(cmd: &mut Command) -> anyhow::Result<()> {
    let mut waits = [2, 8, 30].into_iter();
    loop {
        match run(cmd) {
            Ok(()) => return Ok(()),
            Err(e) => match waits.next() {
                Some(secs) => {
                    eprintln!("  ({e:#}; trying again in {secs} s)");
                    std::thread::sleep(std::time::Duration::from_secs(secs));
                }
                None => return Err(e),
            },
        }
    }
}

/// Runs `cmd` quietly and returns its stdout, or `None` if it cannot start or fails.
pub fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn display(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

pub fn is_root() -> bool {
    output(Command::new("id").arg("-u")).is_some_and(|s| s.trim() == "0")
}

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

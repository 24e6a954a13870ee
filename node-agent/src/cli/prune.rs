//! `node-agent prune status` and `node-agent prune confirm <ID>`: what a running daemon's brake
//! holds, and an operator's confirmation of it (see `agent::hold_file`).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};
use state::checkpoint::{lock_held_by, lock_holder};

use super::Output;
use crate::agent::hold_file;

#[derive(Debug, clap::Args)]
pub struct StateDirArgs {
    /// The agent's state directory.
    #[arg(long, env = "NODE_AGENT_STATE_DIR", default_value = "/run/node-agent")]
    pub state_dir: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub dir: StateDirArgs,
    #[arg(long, env = "NODE_AGENT_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

#[derive(Debug, clap::Args)]
pub struct ConfirmArgs {
    #[command(flatten)]
    pub dir: StateDirArgs,
    /// The ID of the hold to release, as `node-agent prune status` prints it. The daemon
    /// releases the hold only if it still holds exactly that set.
    pub hold: String,
}

pub fn status(args: &StatusArgs, out: &mut impl Write) -> anyhow::Result<()> {
    let dir = &args.dir.state_dir;
    let hold = hold_file::read(dir)?;
    match args.output {
        Output::Json => writeln!(out, "{}", serde_json::to_string_pretty(&hold)?)?,
        Output::Text => match hold {
            None => writeln!(out, "nothing is held")?,
            Some(h) => {
                writeln!(out, "hold {} ({}): {}", h.id, h.kind, h.message)?;
                if !h.nodes.is_empty() {
                    writeln!(out, "held nodes: {}", h.nodes.join(", "))?;
                }
                if h.orphans > 0 {
                    writeln!(out, "held orphan objects: {}", h.orphans)?;
                }
                writeln!(out, "release it: node-agent prune confirm {}", h.id)?;
            }
        },
    }
    Ok(())
}

pub fn confirm(args: &ConfirmArgs, out: &mut impl Write) -> anyhow::Result<()> {
    let dir = &args.dir.state_dir;
    let Some(pid) = lock_holder(dir)? else {
        bail!(
            "no node-agent runs on {} (nobody holds its lock); a one-shot run releases a hold \
             with --force-prune",
            dir.display()
        );
    };
    match hold_file::read(dir)? {
        None => bail!("the agent holds nothing now; nothing to confirm"),
        Some(h) if h.id != args.hold => bail!(
            "the agent holds {} now, not {}: check `node-agent prune status` again",
            h.id,
            args.hold
        ),
        Some(_) => {}
    }
    hold_file::write_confirmation(dir, &args.hold)?;
    if !lock_held_by(dir, pid) {
        // From another PID namespace (the host, for a pod's state directory) the PID names
        // some other process, which SIGUSR1 would most likely kill.
        writeln!(
            out,
            "confirmation left for the agent (pid {pid} in its lock file is not the agent as \
             this PID namespace sees it, so it is not signalled; it reads it within seconds)"
        )?;
        return Ok(());
    }
    let pid = libc::pid_t::try_from(pid).context("the PID in the lock file")?;
    // SAFETY: kill has no memory-safety preconditions; the worst outcome is an error.
    if unsafe { libc::kill(pid, libc::SIGUSR1) } != 0 {
        let e = std::io::Error::last_os_error();
        writeln!(
            out,
            "confirmation left for the agent (signalling pid {pid} failed: {e}; it reads it within seconds)"
        )?;
    } else {
        writeln!(
            out,
            "confirmation of hold {} sent to the agent (pid {pid})",
            args.hold
        )?;
    }
    Ok(())
}

//! The command line: argument definitions and one module per subcommand.

pub mod flags;
pub mod ipsec_status;
pub mod map_dump;
pub mod prune;
pub mod run;
pub mod state_show;

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

/// Programs the node-ID map, routes and xfrm state of every remote node of a Kubernetes
/// cluster, and cleans them up after restarts.
#[derive(Debug, Parser)]
#[command(name = "node-agent", version, propagate_version = true)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "NODE_AGENT_LOG_FORMAT")]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent: program every remote node's map entries, routes and xfrm state, and
    /// clean up after nodes that went away (also while the agent was down).
    Run(run::RunArgs),
    /// Print what a reconcile would do now, as a table or JSON; nothing is changed.
    Plan(run::PlanArgs),
    /// Inspect the checkpoint.
    State {
        #[command(subcommand)]
        command: StateCommand,
    },
    /// Inspect the pinned eBPF maps.
    Map {
        #[command(subcommand)]
        command: MapCommand,
    },
    /// What a running agent's brake holds, and releasing it.
    Prune {
        #[command(subcommand)]
        command: PruneCommand,
    },
    /// IPsec on this node.
    Ipsec {
        #[command(subcommand)]
        command: IpsecCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum IpsecCommand {
    /// The keys and the SPI sent with, each remote node's states and policies, the nodes
    /// missing a state, the guards, and the kernel's xfrm error counters.
    Status(ipsec_status::Args),
}

#[derive(Debug, Subcommand)]
pub enum PruneCommand {
    /// Print what the running agent's brake holds: the nodes, the orphans, the hold's ID.
    Status(prune::StatusArgs),
    /// Release a hold of the running agent (a near-total wipe only releases this way): the
    /// agent deletes the held nodes' objects if it still holds exactly that hold.
    Confirm(prune::ConfirmArgs),
}

#[derive(Debug, Subcommand)]
pub enum MapCommand {
    /// Print every entry of the pinned node-ID map, sorted by address.
    Dump(map_dump::Args),
}

#[derive(Debug, Subcommand)]
pub enum StateCommand {
    /// The checkpoint decoded: version, time written, nodes with IDs, addresses and CIDRs,
    /// and pending deletes.
    Show(state_show::Args),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// A table for people.
    Text,
    /// JSON for tools.
    Json,
}

/// The bpffs root shared by every subcommand that touches pins.
#[derive(Debug, clap::Args)]
pub struct BpffsArg {
    /// Root of the bpffs mount that holds the `node-agent/` pin directory.
    #[arg(long, default_value = "/sys/fs/bpf", env = "NODE_AGENT_BPFFS")]
    pub bpffs: PathBuf,
}

/// An error and its causes on one line, each cause once: a cause whose text the line already
/// ends with (an error that prints its source in its own message) is not repeated.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut line = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !line.ends_with(&text) && !line.contains(&format!("{text}:")) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = c.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("checking /tmp/x: {source}")]
    struct Repeats {
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("opening the state directory")]
    struct Quiet {
        #[source]
        source: std::io::Error,
    }

    #[test]
    fn each_cause_is_printed_once() {
        let io = || std::io::Error::from_raw_os_error(libc::ENOENT);
        let e = anyhow::Error::new(Repeats { source: io() });
        assert_eq!(
            error_chain(e.as_ref()),
            "checking /tmp/x: No such file or directory (os error 2)"
        );
        let e = anyhow::Error::new(Quiet { source: io() }).context("starting");
        assert_eq!(
            error_chain(e.as_ref()),
            "starting: opening the state directory: No such file or directory (os error 2)"
        );
    }
}

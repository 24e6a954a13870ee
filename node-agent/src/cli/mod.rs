//! The command line: argument definitions and one module per subcommand.

pub mod map_dump;
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

//! The `node-agent` binary: parses the command line, sets up logging, runs one subcommand.

use std::process::ExitCode;

use clap::Parser;
use node_agent::cli::{
    Cli, Command, IpsecCommand, LogFormat, MapCommand, PruneCommand, StateCommand, ipsec_status,
    map_dump, prune, run, state_show,
};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    node_agent::runtime::memory::init();
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    let mut out = std::io::stdout().lock();
    let result = match &cli.command {
        Command::Run(args) => run::run(args, &mut out),
        Command::Plan(args) => run::plan(args, &mut out),
        Command::State {
            command: StateCommand::Show(args),
        } => state_show::run(args, &mut out).map(|()| 0),
        Command::Map {
            command: MapCommand::Dump(args),
        } => map_dump::run(args, &mut out).map(|()| 0),
        Command::Prune {
            command: PruneCommand::Status(args),
        } => prune::status(args, &mut out).map(|()| 0),
        Command::Prune {
            command: PruneCommand::Confirm(args),
        } => prune::confirm(args, &mut out).map(|()| 0),
        Command::Ipsec {
            command: IpsecCommand::Status(args),
        } => ipsec_status::run(args, &mut out).map(|()| 0),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("node-agent: {}", node_agent::cli::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr, so stdout stays clean for `--output json`. aya-log records from the
/// datapath arrive through the `log` facade, bridged here.
fn init_tracing(format: LogFormat) {
    let filter =
        EnvFilter::try_from_env("NODE_AGENT_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

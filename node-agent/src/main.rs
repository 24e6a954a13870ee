//! The `node-agent` binary: parses the command line, sets up logging, runs one subcommand.

use std::process::ExitCode;

use clap::Parser;
use node_agent::cli::{Cli, Command, LogFormat, MapCommand, map_dump};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    let result = match &cli.command {
        Command::Map {
            command: MapCommand::Dump(args),
        } => map_dump::run(args, &mut std::io::stdout().lock()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("node-agent: {e:#}");
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
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

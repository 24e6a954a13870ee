//! `node-agent map dump`: the pinned node-ID map, decoded.

use std::io::Write;

use anyhow::Context;

use super::{BpffsArg, Output};
use crate::datapath::maps::NodeMap;
use crate::datapath::node_ids_pin;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub bpffs: BpffsArg,
    /// Output format.
    #[arg(long, env = "NODE_AGENT_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

pub fn run(args: &Args, out: &mut impl Write) -> anyhow::Result<()> {
    let pin = node_ids_pin(&args.bpffs.bpffs);
    let map = NodeMap::open(&pin)?;
    let dump = map.dump()?;
    for bad in &dump.undecodable {
        tracing::warn!(key = ?bad.key, value = ?bad.value, "entry with a key node-agent never writes");
    }
    match args.output {
        Output::Json => {
            serde_json::to_writer_pretty(&mut *out, &dump.entries)?;
            writeln!(out)?;
        }
        Output::Text => {
            writeln!(
                out,
                "{:<40} {:>7} {:>3} {:>5}",
                "IP", "NODE_ID", "SPI", "FLAGS"
            )?;
            for e in &dump.entries {
                writeln!(
                    out,
                    "{:<40} {:>7} {:>3} {:>5}",
                    e.ip, e.node_id, e.spi, e.flags
                )?;
            }
            writeln!(out, "{} entries in {}", dump.entries.len(), pin.display())?;
        }
    }
    out.flush().context("writing the dump")
}

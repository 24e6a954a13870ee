//! `node-agent state show`: the checkpoint, decoded, without taking the agent's lock.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use serde::Serialize;
use state::checkpoint;
use state::node::Node;

use super::Output;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The agent's state directory.
    #[arg(long, env = "NODE_AGENT_STATE_DIR", default_value = "/run/node-agent")]
    pub state_dir: PathBuf,
    #[arg(long, env = "NODE_AGENT_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

#[derive(Serialize)]
struct Shown<'a> {
    path: String,
    format_version: u32,
    agent_version: &'a str,
    written_at_unix: u64,
    local_node: &'a str,
    nodes: &'a [Node],
    pending_deletes: Vec<Pending<'a>>,
}

#[derive(Serialize)]
struct Pending<'a> {
    node: &'a Node,
    attempts: u32,
}

pub fn run(args: &Args, out: &mut impl Write) -> anyhow::Result<()> {
    let path = args.state_dir.join("nodes.ckpt");
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let cp = checkpoint::decode(&bytes).with_context(|| format!("decoding {}", path.display()))?;
    let shown = Shown {
        path: path.display().to_string(),
        format_version: checkpoint::FORMAT_VERSION,
        agent_version: &cp.agent_version,
        written_at_unix: cp.written_at.as_secs(),
        local_node: &cp.local_node,
        nodes: &cp.nodes,
        pending_deletes: cp
            .pending_deletes
            .iter()
            .map(|p| Pending {
                node: &p.node,
                attempts: p.attempts,
            })
            .collect(),
    };
    match args.output {
        Output::Json => writeln!(out, "{}", serde_json::to_string_pretty(&shown)?)?,
        Output::Text => {
            writeln!(
                out,
                "{} (format v{}, agent {}, written at {} unix, local node {})",
                shown.path,
                shown.format_version,
                shown.agent_version,
                shown.written_at_unix,
                shown.local_node
            )?;
            writeln!(
                out,
                "{:<24} {:>7} {:<40} PODCIDRS",
                "NODE", "NODE_ID", "ADDRESSES"
            )?;
            let line = |n: &Node| {
                let id = n.node_id.map_or("-".into(), |i| i.to_string());
                let addrs: Vec<String> = n.addresses.iter().map(|a| a.ip.to_string()).collect();
                let cidrs: Vec<String> = n.pod_cidrs.iter().map(|c| c.to_string()).collect();
                format!(
                    "{:<24} {:>7} {:<40} {}",
                    n.name,
                    id,
                    addrs.join(","),
                    cidrs.join(",")
                )
            };
            for n in shown.nodes {
                writeln!(out, "{}", line(n))?;
            }
            for p in &shown.pending_deletes {
                writeln!(
                    out,
                    "{}  (pending delete, {} failed attempts)",
                    line(p.node),
                    p.attempts
                )?;
            }
        }
    }
    Ok(())
}

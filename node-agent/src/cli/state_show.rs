//! `node-agent state show`: the checkpoint, decoded, without taking the agent's lock.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use serde::Serialize;
use state::checkpoint;
use state::checkpoint::NodeRecords;
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
    /// The version the file was written in.
    format_version: u32,
    agent_version: &'a str,
    written_at_unix: u64,
    /// The same time in UTC, `2026-11-23T21:52:00Z`.
    written_at: String,
    age_seconds: u64,
    local_node: &'a str,
    nodes: &'a NodeRecords,
    pending_deletes: Vec<Pending<'a>>,
    /// Removals the brake let through within its window (`--prune-confirm-delay`), oldest
    /// first: what the next removals are counted with.
    recent_removals: Vec<Recent>,
}

#[derive(Serialize)]
struct Recent {
    at_unix: u64,
    nodes: u32,
    objects: u32,
}

#[derive(Serialize)]
struct Pending<'a> {
    node: &'a Node,
    attempts: u32,
    /// Held by the brake since then (Unix seconds), if it is: a restart keeps the hold.
    held_since_unix: Option<u64>,
    /// Held as part of a near-total wipe: only an operator releases it.
    held_as_wipe: bool,
}

pub fn run(args: &Args, out: &mut impl Write) -> anyhow::Result<()> {
    let path = args.state_dir.join("nodes.ckpt");
    let bytes = state::input::read(&path, state::input::Input::Checkpoint)?;
    let cp = checkpoint::decode(&bytes).with_context(|| format!("decoding {}", path.display()))?;
    let written = cp.written_at.as_secs();
    // By the agent's clock, continued from the record as a restarted agent would.
    let now = crate::runtime::AgentClock::resume(Some(&cp))
        .now()
        .as_secs();
    let shown = Shown {
        path: path.display().to_string(),
        format_version: bytes
            .get(8..12)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u32::from_le_bytes),
        agent_version: &cp.agent_version,
        written_at_unix: written,
        written_at: utc(written),
        age_seconds: now.saturating_sub(written),
        local_node: &cp.local_node,
        nodes: &cp.nodes,
        pending_deletes: cp
            .pending_deletes
            .iter()
            .map(|p| Pending {
                node: &p.node,
                attempts: p.attempts,
                held_since_unix: p.held.map(|h| h.at.as_secs()),
                held_as_wipe: p.held.is_some_and(|h| h.wipe),
            })
            .collect(),
        recent_removals: cp
            .removals
            .iter()
            .map(|r| Recent {
                at_unix: r.at.as_secs(),
                nodes: r.nodes,
                objects: r.objects,
            })
            .collect(),
    };
    match args.output {
        Output::Json => writeln!(out, "{}", serde_json::to_string_pretty(&shown)?)?,
        Output::Text => {
            writeln!(
                out,
                "{} (format v{}, agent {}, written {} ({} ago), local node {})",
                shown.path,
                shown.format_version,
                shown.agent_version,
                shown.written_at,
                age(shown.age_seconds),
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
                let why = match p.held_since_unix {
                    Some(at) => format!(
                        "held by the brake since {}{}",
                        utc(at),
                        if p.held_as_wipe { ", a wipe" } else { "" }
                    ),
                    None => format!("{} failed attempts", p.attempts),
                };
                writeln!(out, "{}  (pending delete, {why})", line(p.node))?;
            }
        }
    }
    Ok(())
}

/// `secs` since the Unix epoch as an RFC 3339 UTC time (the civil calendar, from days since
/// 1970-01-01 by Howard Hinnant's algorithm).
fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// A duration as people say it: `42s`, `3m 12s`, `2h 5m`, `3d 4h`.
fn age(secs: u64) -> String {
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m {}s", secs / 60, secs % 60),
        3600..86_400 => format!("{}h {}m", secs / 3600, secs / 60 % 60),
        _ => format!("{}d {}h", secs / 86_400, secs / 3600 % 24),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_print_as_utc_dates_and_ages() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_795_463_520), "2026-11-23T19:52:00Z");
        assert_eq!(age(42), "42s");
        assert_eq!(age(192), "3m 12s");
        assert_eq!(age(7_500), "2h 5m");
        assert_eq!(age(273_600), "3d 4h");
    }
}

//! `node-agent ipsec status`: what IPsec looks like on this node, from the kernel and the
//! checkpoint: the keys and the SPI sent with, each remote node's states and policies, the
//! nodes missing a state, the guards, and the kernel's xfrm error counters. Operators know it
//! from `cilium-dbg encrypt status`. It reads only: nothing is locked or changed.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::Context;
use serde::Serialize;
use state::checkpoint::{self, Checkpoint};
use state::node::Family;
use state::objects::{GuardRole, NodeId, XfrmDir, XfrmGuard, XfrmState};

use super::{BpffsArg, Output};
use crate::backends::xfrm::{KeyBook, KeyFile, XfrmBackend, stats};
use crate::datapath::maps::PodCidrMap;
use crate::datapath::pod_cidrs_pin;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The agent's state directory (its checkpoint names the nodes).
    #[arg(long, env = "NODE_AGENT_STATE_DIR", default_value = "/run/node-agent")]
    pub state_dir: PathBuf,
    #[command(flatten)]
    pub bpffs: BpffsArg,
    /// The key file, to show its keys (never their material).
    #[arg(long, env = "NODE_AGENT_IPSEC_KEY_FILE")]
    pub ipsec_key_file: Option<PathBuf>,
    #[arg(long, env = "NODE_AGENT_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

#[derive(Debug, Default, Serialize)]
pub struct Status {
    /// The SPI the pod-CIDR map marks traffic with; `None` without entries.
    pub send_spi: Option<u8>,
    pub keys: Vec<KeyStatus>,
    pub guards: Vec<String>,
    pub nodes: Vec<NodeStatus>,
    /// Nodes of the checkpoint missing an OUT or IN state of the SPI sent with.
    pub nodes_missing_states: Vec<String>,
    /// The kernel's xfrm counters; empty where it keeps none.
    pub xfrm_stat: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize)]
pub struct KeyStatus {
    pub spi: u8,
    pub per_pair: bool,
    /// How its states lay out their SPI: `key` or `per-sender`.
    pub spi_layout: &'static str,
    /// The key's fingerprint (see `docs/ipsec.md`), never the key.
    pub tag: String,
    /// When this node first saw it, from the checkpoint.
    pub first_seen_unix: Option<u64>,
    /// Our states holding a key of this SPI.
    pub states: usize,
}

#[derive(Debug, Serialize)]
pub struct NodeStatus {
    pub name: String,
    pub node_id: Option<u16>,
    pub states: Vec<StateStatus>,
    pub policies: usize,
    /// The SPI layout of what this node sends toward it (its OUT states under the SPI sent
    /// with): `key` or `per-sender`; `None` without such a state.
    pub sent_layout: Option<&'static str>,
    /// What it lacks for the SPI sent with: `out ipv4`, `in ipv6`...
    pub missing: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct StateStatus {
    pub dir: &'static str,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// The SPI as the kernel and the wire have it.
    pub spi: u32,
    pub key: String,
}

pub fn run(args: &Args, out: &mut impl Write) -> anyhow::Result<()> {
    let status = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime")?
        .block_on(gather(args))?;
    match args.output {
        Output::Json => writeln!(out, "{}", serde_json::to_string_pretty(&status)?)?,
        Output::Text => print_text(&status, out)?,
    }
    out.flush().context("writing the status")
}

async fn gather(args: &Args) -> anyhow::Result<Status> {
    let x = XfrmBackend::new(KeyBook::default()).context("opening the xfrm netlink socket")?;
    let states = x.dump_states().await?;
    let policies = x.dump_policies().await?;
    let cp = read_checkpoint(&args.state_dir)?;
    let mut status = Status {
        send_spi: send_spi(&pod_cidrs_pin(&args.bpffs.bpffs))?,
        guards: policies.guards.iter().map(guard_line).collect(),
        xfrm_stat: stats::read()?.unwrap_or_default().into_iter().collect(),
        ..Status::default()
    };
    if let Some(path) = &args.ipsec_key_file {
        status.keys = key_statuses(&KeyFile::load(path)?, cp.as_ref(), &states);
    }
    let by_node = per_node(&states, &policies.policies);
    // The agent keeps guards in every family this node has an xfrm endpoint in: there, a node
    // with an address of the family should have its states where packets use them: OUT toward
    // a node with pod CIDRs of the family, IN when this node has pod CIDRs of it (which the
    // record does not keep; that the agent keeps IN states of the family for some node says so).
    let families: BTreeSet<Family> = policies.guards.iter().map(|g| g.family).collect();
    let receiving: BTreeSet<Family> = states
        .iter()
        .filter(|s| s.dir == XfrmDir::In && Some(s.spi.key()) == status.send_spi)
        .map(|s| Family::of(&s.src))
        .collect();
    for n in cp.iter().flat_map(|c| c.nodes.iter()) {
        let (st, pol) = n
            .node_id
            .and_then(|id| by_node.get(&id))
            .cloned()
            .unwrap_or_default();
        let mut missing = Vec::new();
        if let Some(spi) = status.send_spi {
            for f in families.iter().filter(|f| n.internal_ip(**f).is_some()) {
                let sends = n.pod_cidrs.iter().any(|c| Family::of_net(c) == *f);
                let wanted = [(XfrmDir::Out, sends), (XfrmDir::In, receiving.contains(f))];
                for dir in wanted.into_iter().filter(|w| w.1).map(|w| w.0) {
                    let has = st
                        .iter()
                        .any(|s| s.spi.key() == spi && s.dir == dir && Family::of(&s.src) == *f);
                    if !has {
                        missing.push(format!("{} {}", dir_name(dir), family_name(*f)));
                    }
                }
            }
        }
        if !missing.is_empty() {
            status.nodes_missing_states.push(n.name.clone());
        }
        status.nodes.push(NodeStatus {
            name: n.name.clone(),
            node_id: n.node_id.map(NodeId::get),
            states: st
                .iter()
                .map(|s| StateStatus {
                    dir: dir_name(s.dir),
                    src: s.src,
                    dst: s.dst,
                    spi: s.spi.wire(),
                    key: s.key.to_string(),
                })
                .collect(),
            policies: pol,
            sent_layout: st
                .iter()
                .find(|s| s.dir == XfrmDir::Out && Some(s.spi.key()) == status.send_spi)
                .map(|s| s.spi.layout().name()),
            missing,
        });
    }
    Ok(status)
}

/// A guard as the status shows it: its role and family, and whether someone changed it.
fn guard_line(g: &XfrmGuard) -> String {
    let role = match g.role {
        GuardRole::Block => "block",
        GuardRole::AcceptDecrypted => "accept-decrypted",
    };
    let broken = if g.intact {
        ""
    } else {
        " (changed by someone)"
    };
    format!("{role} {}{broken}", family_name(g.family))
}

/// Each key of `file`: what it is, when the agent first saw it (`cp`), and its `states`.
fn key_statuses(file: &KeyFile, cp: Option<&Checkpoint>, states: &[XfrmState]) -> Vec<KeyStatus> {
    file.keys
        .iter()
        .map(|k| KeyStatus {
            spi: k.spi(),
            per_pair: k.per_pair(),
            spi_layout: k.layout().name(),
            tag: k.tag().to_string(),
            first_seen_unix: cp.and_then(|c| {
                c.ipsec_keys
                    .iter()
                    .find(|s| s.spi == k.spi())
                    .map(|s| s.first_seen.as_secs())
            }),
            states: states.iter().filter(|s| s.spi.key() == k.spi()).count(),
        })
        .collect()
}

fn read_checkpoint(dir: &std::path::Path) -> anyhow::Result<Option<Checkpoint>> {
    let path = dir.join(checkpoint::store::FILE_NAME);
    checkpoint::read(&path).map_err(|e| match e {
        checkpoint::Unusable::Refused(e) => e.into(),
        e => anyhow::Error::new(e).context(format!("decoding {}", path.display())),
    })
}

/// The SPI most of the pod-CIDR map's entries carry.
fn send_spi(pin: &std::path::Path) -> anyhow::Result<Option<u8>> {
    if !pin.exists() {
        return Ok(None);
    }
    let dump = PodCidrMap::open(pin)?.dump()?;
    let mut count: BTreeMap<u8, usize> = BTreeMap::new();
    for e in dump.entries.iter().filter(|e| e.spi != 0) {
        *count.entry(e.spi).or_default() += 1;
    }
    Ok(count
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(spi, _)| spi))
}

type NodeObjects = (Vec<XfrmState>, usize);

fn per_node(
    states: &[XfrmState],
    policies: &[state::objects::XfrmPolicy],
) -> BTreeMap<NodeId, NodeObjects> {
    let mut out: BTreeMap<NodeId, NodeObjects> = BTreeMap::new();
    for s in states {
        out.entry(s.node_id).or_default().0.push(s.clone());
    }
    for p in policies {
        out.entry(p.node_id).or_default().1 += 1;
    }
    out
}

fn dir_name(d: XfrmDir) -> &'static str {
    match d {
        XfrmDir::Out => "out",
        XfrmDir::In => "in",
    }
}

fn family_name(f: Family) -> &'static str {
    match f {
        Family::V4 => "ipv4",
        Family::V6 => "ipv6",
    }
}

/// The counters worth a look first; the JSON output has them all.
const KEY_COUNTERS: &[&str] = &[
    "XfrmOutPolBlock",
    "XfrmOutNoStates",
    "XfrmInNoStates",
    "XfrmInStateProtoError",
    "XfrmInStateSeqError",
    "XfrmInNoPols",
];

fn print_text(s: &Status, out: &mut impl Write) -> std::io::Result<()> {
    match s.send_spi {
        Some(spi) => writeln!(out, "sending with SPI {spi}")?,
        None => writeln!(out, "not sending encrypted: the pod-CIDR map has no entry")?,
    }
    for k in &s.keys {
        let kind = if k.per_pair { "per-pair" } else { "global" };
        writeln!(
            out,
            "key SPI {} ({kind}, {} layout, tag {}): {} states",
            k.spi, k.spi_layout, k.tag, k.states
        )?;
    }
    writeln!(out, "guards: {}", join_or_none(&s.guards))?;
    writeln!(
        out,
        "{:<24} {:>7} {:>10} {:>8} {:>10}  MISSING",
        "NODE", "NODE_ID", "STATES", "POLICIES", "SENT"
    )?;
    for n in &s.nodes {
        let id = n.node_id.map_or_else(|| "-".into(), |i| i.to_string());
        writeln!(
            out,
            "{:<24} {:>7} {:>10} {:>8} {:>10}  {}",
            n.name,
            id,
            n.states.len(),
            n.policies,
            n.sent_layout.unwrap_or("-"),
            join_or_none(&n.missing)
        )?;
    }
    writeln!(
        out,
        "{} nodes, {} missing a state",
        s.nodes.len(),
        s.nodes_missing_states.len()
    )?;
    if s.xfrm_stat.is_empty() {
        writeln!(out, "xfrm counters: this kernel keeps none")
    } else {
        let shown: Vec<String> = KEY_COUNTERS
            .iter()
            .map(|n| format!("{n} {}", s.xfrm_stat.get(*n).copied().unwrap_or(0)))
            .collect();
        writeln!(out, "xfrm counters: {}", shown.join(", "))
    }
}

fn join_or_none(v: &[String]) -> String {
    if v.is_empty() {
        "-".into()
    } else {
        v.join(", ")
    }
}

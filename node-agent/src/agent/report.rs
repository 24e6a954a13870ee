//! What the agent reports: the `--output json` summary of `run --once`, and plans as tables or
//! JSON for `--dry-run` and `node-agent plan`.

use serde::{Deserialize, Serialize};
use state::objects::Op;
use state::plan::{HoldKind, Plan};

use super::reconciler::apply::OpResult;
use crate::source::live::LiveState;

/// One line naming an object the way `ip` and `bpftool` users read it.
pub fn describe(obj: &state::objects::KernelObject) -> String {
    obj.to_string()
}

#[derive(Debug, Serialize)]
pub struct NodeErrorReport {
    pub node: String,
    pub error: String,
    /// Whether it is a conflict over an address, a pod CIDR or a kernel identity.
    pub conflict: bool,
}

/// What the brake holds, for reports, `/readyz` and `node-agent prune status`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BrakeReport {
    /// `ratio` (a fresh list after the confirm delay releases it), `wipe` (only an operator
    /// does), or `no_local_node` (the list is no view of this cluster; nothing changes).
    pub kind: String,
    /// What `node-agent prune confirm` takes.
    pub id: String,
    /// The held nodes.
    pub nodes: Vec<String>,
    /// How many nodes are held (as before format changes: the length of `nodes`).
    pub stale_nodes: usize,
    /// Held orphan objects.
    pub orphans: usize,
    /// Node removals counted: those asked for now and those removed within the window.
    pub removed_nodes: usize,
    pub known_nodes: usize,
    /// Of `removed_nodes` and `known_nodes`: the nodes removed within the window. A hold file
    /// written by an agent that did not count the window yet reads as 0, which is what that
    /// agent's counts meant.
    #[serde(default)]
    pub window_nodes: usize,
    /// The larger of `node_ratio` and `orphan_ratio`: what went over `max_ratio`.
    pub ratio: f64,
    pub node_ratio: f64,
    pub orphan_ratio: f64,
    pub max_ratio: f64,
    /// Objects kept because of the hold.
    pub held_deletes: usize,
    /// When a fresh list may confirm the hold (Unix seconds); absent when only an operator can.
    pub confirmable_at_unix: Option<u64>,
    pub message: String,
}

#[derive(Debug, Serialize)]
pub struct FailedOpReport {
    pub node: Option<String>,
    pub op: String,
    pub error: String,
}

/// The single JSON object `run --once --output json` prints.
#[derive(Debug, Serialize)]
pub struct RunReport {
    pub synced: bool,
    pub live_nodes: usize,
    pub restored_nodes: usize,
    pub pruned_nodes: usize,
    /// Names of the stale nodes cleaned up.
    pub pruned: Vec<String>,
    /// Kernel mutations actually performed.
    pub kernel_writes: usize,
    /// Per-node input errors: malformed nodes, conflicts (with other nodes, the local node, or
    /// foreign objects), a full map, no free ID; each node held or skipped.
    pub errors: Vec<NodeErrorReport>,
    /// Kernel operations that still failed when the run ended.
    pub failed_ops: Vec<FailedOpReport>,
    pub brake: Option<BrakeReport>,
    /// The agent's peak resident memory so far (`VmHWM`), in KiB: what to size its memory limit
    /// by. `None` where `/proc` does not say.
    pub peak_rss_kib: Option<u64>,
}

/// This process's peak resident memory (`VmHWM` of `/proc/self/status`), in KiB.
pub fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

pub fn node_errors(plan: &Plan, live: &LiveState) -> Vec<NodeErrorReport> {
    live.errors()
        .iter()
        .map(|(node, e)| NodeErrorReport {
            node: node.clone(),
            error: e.to_string(),
            conflict: false,
        })
        .chain(live.duplicates().iter().map(|(node, d)| NodeErrorReport {
            node: node.clone(),
            error: d.to_string(),
            conflict: false,
        }))
        .chain(plan.errors.iter().map(|e| NodeErrorReport {
            node: e.node.clone(),
            error: e.problem.to_string(),
            conflict: e.problem.is_conflict(),
        }))
        .collect()
}

pub fn brake(plan: &Plan) -> Option<BrakeReport> {
    plan.brake.as_ref().map(|b| BrakeReport {
        kind: match b.kind {
            HoldKind::Ratio => "ratio",
            HoldKind::Wipe => "wipe",
            HoldKind::NoLocalNode => "no_local_node",
        }
        .into(),
        id: b.id.clone(),
        nodes: b.nodes.clone(),
        stale_nodes: b.nodes.len(),
        orphans: b.orphans,
        removed_nodes: b.count.removed_nodes(),
        known_nodes: b.count.known_nodes,
        window_nodes: b.count.window_nodes,
        ratio: b.count.node_ratio().max(b.count.orphan_ratio()),
        node_ratio: b.count.node_ratio(),
        orphan_ratio: b.count.orphan_ratio(),
        max_ratio: b.max_ratio,
        held_deletes: b.deletes.len(),
        confirmable_at_unix: b.confirmable_at.map(|t| t.as_secs()),
        message: b.to_string(),
    })
}

pub fn failed_ops(failed: &[OpResult]) -> Vec<FailedOpReport> {
    failed
        .iter()
        .map(|f| FailedOpReport {
            node: f.node.clone(),
            op: op_line(&f.op),
            error: match &f.result {
                Err(e) => e.to_string(),
                Ok(()) => String::new(),
            },
        })
        .collect()
}

fn op_line(op: &Op) -> String {
    format!("{} {}", op.verb(), op.object())
}

/// A plan as data, for `--output json`.
#[derive(Debug, Serialize)]
pub struct PlanReport {
    pub synced: bool,
    pub deletes: Vec<PlannedChange>,
    pub upserts: Vec<PlannedChange>,
    pub allocations: Vec<(String, u16)>,
    /// How many of the errors are conflicts.
    pub conflicts: usize,
    pub errors: Vec<NodeErrorReport>,
    pub brake: Option<BrakeReport>,
}

#[derive(Debug, Serialize)]
pub struct PlannedChange {
    pub object: String,
    pub node: Option<String>,
    /// For deletes: why. For upserts: `add` or `update`.
    pub reason: String,
}

/// The plan as a report: deletes and upserts each in the order they run.
pub fn plan_report(plan: &Plan, live: &LiveState) -> PlanReport {
    let mut deletes: Vec<_> = plan.deletes.iter().collect();
    deletes.sort_by_key(|d| {
        let kind = d.object.kind();
        (kind.deleted_last(), std::cmp::Reverse(kind.rank()))
    });
    PlanReport {
        synced: live.synced(),
        deletes: deletes
            .into_iter()
            .map(|d| PlannedChange {
                object: d.object.to_string(),
                node: d.node.clone(),
                reason: d.reason.to_string(),
            })
            .collect(),
        upserts: plan
            .upserts
            .iter()
            .map(|u| PlannedChange {
                object: u.object.to_string(),
                node: Some(u.node.clone()),
                reason: if u.update { "update" } else { "add" }.into(),
            })
            .collect(),
        allocations: plan
            .allocations
            .iter()
            .map(|a| (a.node.clone(), a.id.get()))
            .collect(),
        conflicts: plan
            .errors
            .iter()
            .filter(|e| e.problem.is_conflict())
            .count(),
        errors: node_errors(plan, live),
        brake: brake(plan),
    }
}

/// A plan as a table for people.
pub fn plan_table(report: &PlanReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "{:<8} {:<20} {:<22} OBJECT", "ACTION", "NODE", "REASON");
    for d in &report.deletes {
        let node = d.node.as_deref().unwrap_or("-");
        let _ = writeln!(
            s,
            "{:<8} {:<20} {:<22} {}",
            "delete", node, d.reason, d.object
        );
    }
    for u in &report.upserts {
        let node = u.node.as_deref().unwrap_or("-");
        let _ = writeln!(s, "{:<8} {:<20} {:<22} {}", u.reason, node, "", u.object);
    }
    for e in &report.errors {
        let action = if e.conflict { "conflict" } else { "error" };
        let _ = writeln!(s, "{:<8} {:<20} {}", action, e.node, e.error);
    }
    if let Some(b) = report.brake.as_ref().filter(|b| b.kind == "no_local_node") {
        let _ = writeln!(s, "NO CHANGE: {}", b.message);
    } else if let Some(b) = &report.brake {
        let _ = writeln!(s, "BRAKE ({}, hold {}): {}", b.kind, b.id, b.message);
        if !b.nodes.is_empty() {
            let _ = writeln!(s, "held nodes: {}", b.nodes.join(", "));
        }
        if b.orphans > 0 {
            let _ = writeln!(s, "held orphan objects: {}", b.orphans);
        }
    }
    let _ = writeln!(
        s,
        "{} deletes, {} adds/updates, synced: {}",
        report.deletes.len(),
        report.upserts.len(),
        report.synced
    );
    s
}

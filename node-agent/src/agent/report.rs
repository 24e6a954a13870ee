//! What the agent reports: the `--output json` summary of `run --once`, and plans as tables or
//! JSON for `--dry-run` and `node-agent plan`.

use serde::Serialize;
use state::objects::{KernelObject, XfrmDir};
use state::plan::Plan;

use super::reconciler::FailedOp;
use crate::source::live::LiveState;

/// One line naming an object the way `ip` and `bpftool` users read it.
pub fn describe(obj: &KernelObject) -> String {
    let dir = |d: XfrmDir| match d {
        XfrmDir::Out => "out",
        XfrmDir::In => "in",
    };
    match obj {
        KernelObject::MapEntry(e) => format!("map {} -> node {}", e.ip, e.node_id),
        KernelObject::Route(r) => format!("route {} via {}", r.dst, r.gateway),
        KernelObject::XfrmState(s) => format!(
            "xfrm state {} {} -> {} spi {} node {}",
            dir(s.dir),
            s.src,
            s.dst,
            s.spi,
            s.node_id
        ),
        KernelObject::XfrmPolicy(p) => format!(
            "xfrm policy {} {} -> {} via {} -> {} node {}",
            dir(p.dir),
            p.src,
            p.dst,
            p.tmpl_src,
            p.tmpl_dst,
            p.node_id
        ),
    }
}

#[derive(Debug, Serialize)]
pub struct NodeErrorReport {
    pub node: String,
    pub error: String,
}

#[derive(Debug, Serialize)]
pub struct BrakeReport {
    /// The stale nodes whose deletion is held.
    pub nodes: Vec<String>,
    pub stale_nodes: usize,
    pub known_nodes: usize,
    pub ratio: f64,
    pub max_ratio: f64,
    pub held_deletes: usize,
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
    /// Per-node input errors: malformed nodes and conflicts, each skipped.
    pub errors: Vec<NodeErrorReport>,
    /// Kernel operations that still failed when the run ended.
    pub failed_ops: Vec<FailedOpReport>,
    pub brake: Option<BrakeReport>,
}

pub fn node_errors(plan: &Plan, live: &LiveState) -> Vec<NodeErrorReport> {
    live.errors()
        .iter()
        .map(|(node, e)| NodeErrorReport {
            node: node.clone(),
            error: e.to_string(),
        })
        .chain(plan.errors.iter().map(|e| NodeErrorReport {
            node: e.node.clone(),
            error: e.problem.to_string(),
        }))
        .collect()
}

pub fn brake(plan: &Plan) -> Option<BrakeReport> {
    plan.brake.as_ref().map(|b| BrakeReport {
        nodes: b.nodes.clone(),
        stale_nodes: b.stale_nodes,
        known_nodes: b.known_nodes,
        ratio: b.ratio,
        max_ratio: b.max_ratio,
        held_deletes: b.deletes.len(),
        message: b.to_string(),
    })
}

pub fn failed_ops(failed: &[FailedOp]) -> Vec<FailedOpReport> {
    failed
        .iter()
        .map(|f| FailedOpReport {
            node: f.node.clone(),
            op: match &f.op {
                state::objects::Op::Upsert(o) => format!("upsert {}", describe(o)),
                state::objects::Op::Delete(o) => format!("delete {}", describe(o)),
            },
            error: f.error.to_string(),
        })
        .collect()
}

/// A plan as data, for `--output json`.
#[derive(Debug, Serialize)]
pub struct PlanReport {
    pub synced: bool,
    pub deletes: Vec<PlannedChange>,
    pub upserts: Vec<PlannedChange>,
    pub allocations: Vec<(String, u16)>,
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

pub fn plan_report(plan: &Plan, live: &LiveState) -> PlanReport {
    PlanReport {
        synced: live.synced(),
        deletes: plan
            .deletes
            .iter()
            .map(|d| PlannedChange {
                object: describe(&d.object),
                node: d.node.clone(),
                reason: d.reason.to_string(),
            })
            .collect(),
        upserts: plan
            .upserts
            .iter()
            .map(|u| PlannedChange {
                object: describe(&u.object),
                node: Some(u.node.clone()),
                reason: if u.update { "update" } else { "add" }.into(),
            })
            .collect(),
        allocations: plan
            .allocations
            .iter()
            .map(|a| (a.node.clone(), a.id.get()))
            .collect(),
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
        let _ = writeln!(s, "{:<8} {:<20} {}", "error", e.node, e.error);
    }
    if let Some(b) = &report.brake {
        let _ = writeln!(s, "BRAKE: {}", b.message);
        let _ = writeln!(s, "held nodes: {}", b.nodes.join(", "));
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

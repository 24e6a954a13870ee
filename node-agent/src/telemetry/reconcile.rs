//! What a reconcile tells the outside: the metrics it sets, the line that sums it up, and its
//! input problems, each logged once.
//!
//! The reconciler hands over what happened; nothing here decides anything. The log lines keep
//! the reconciler's target ([`RECONCILER`]), the one operators filter by and the docs show.

use std::collections::BTreeSet;
use std::time::Instant;

use state::checkpoint::Checkpoint;
use state::inventory::Inventory;
use state::objects::{ObjectKind, Op, SpiLayout};
use state::plan::{HoldKind, InputProblem, IpsecConfig, Plan};

use super::Telemetry;
use super::metrics::{KindLabel, OpLabels, StateLabel};
use crate::source::live::LiveState;

/// The target of the reconciler's log lines, whichever of its steps writes them.
pub const RECONCILER: &str = "node_agent::agent::reconciler";

impl Telemetry {
    /// Counts one operation of an apply, done (`ok`) or not
    /// (`node_agent_operations_total{kind,op,result}`).
    pub fn count_op(&self, op: &Op, ok: bool) {
        self.metrics
            .operations
            .get_or_create(&OpLabels {
                kind: op.object().kind().name().into(),
                op: op_label(op).into(),
                result: if ok { "ok" } else { "error" }.into(),
            })
            .inc();
    }

    /// Counts the repair of an object of `kind` that had drifted.
    pub fn count_repair(&self, kind: ObjectKind) {
        self.metrics
            .drift_repaired
            .get_or_create(&KindLabel {
                kind: kind.name().into(),
            })
            .inc();
    }

    /// Sets where the IPsec key rotation stands: the key sent with and its SPI layout, and how
    /// many keys have states.
    pub fn record_keys(&self, ipsec: &IpsecConfig) {
        let per_sender = ipsec.send_layout() == SpiLayout::PerSender;
        self.metrics.ipsec_send_spi.set(i64::from(ipsec.send_spi));
        self.metrics
            .ipsec_send_per_sender_spi
            .set(i64::from(per_sender));
        self.metrics.ipsec_keys_in_use.set(ipsec.keys.len() as i64);
    }

    /// Sets what a reconcile left: the record's nodes, the brake's hold, the plan's input
    /// problems (with `live_problems` more the live view rejected), the nodes waiting for an
    /// ID (readiness names them), the kernel's objects against a node-ID map of `capacity`;
    /// and observes how long it took since `started`.
    pub fn record_outcome(
        &self,
        plan: &Plan,
        cp: &Checkpoint,
        live_problems: usize,
        kernel: (&Inventory, u32),
        started: Instant,
    ) {
        let m = &self.metrics;
        for (state, n) in [
            ("live", cp.nodes.len()),
            ("pending_delete", cp.pending_deletes.len()),
        ] {
            m.nodes
                .get_or_create(&StateLabel {
                    state: state.into(),
                })
                .set(n as i64);
        }
        m.brake_held.set(i64::from(
            plan.brake
                .as_ref()
                .is_some_and(|b| b.kind != HoldKind::NoLocalNode),
        ));
        m.brake_held_nodes
            .set(plan.brake.as_ref().map_or(0, |b| b.nodes.len()) as i64);
        m.local_node_missing.set(i64::from(
            plan.brake
                .as_ref()
                .is_some_and(|b| b.kind == HoldKind::NoLocalNode),
        ));
        let conflicts = plan
            .errors
            .iter()
            .filter(|e| e.problem.is_conflict())
            .count();
        m.conflicts.set(conflicts as i64);
        m.node_input_errors
            .set((plan.errors.len() - conflicts + live_problems) as i64);
        let no_id: Vec<&str> = plan
            .errors
            .iter()
            .filter(|e| matches!(e.problem, InputProblem::Ids(_)))
            .map(|e| e.node.as_str())
            .collect();
        m.id_exhausted.set(no_id.len() as i64);
        for a in plan.allocations.iter().filter(|a| a.reused_after.is_some()) {
            m.id_reuses
                .get_or_create(&KindLabel {
                    kind: if a.early { "early" } else { "cooled" }.into(),
                })
                .inc();
        }
        self.set_ids_exhausted(match no_id.as_slice() {
            [] => None,
            [first, ..] => Some(format!(
                "{} nodes held with no node ID free (every ID in use or cooling down), {first} \
                 among them",
                no_id.len()
            )),
        });
        m.reconcile_duration
            .observe(started.elapsed().as_secs_f64());
        self.record_objects(kernel.0, kernel.1);
    }

    /// Sets the kernel-object gauges from what the kernel holds, and the node-ID map's fill
    /// against its `capacity`.
    pub fn record_objects(&self, inventory: &Inventory, capacity: u32) {
        let m = &self.metrics;
        for kind in ObjectKind::ALL {
            m.kernel_objects
                .get_or_create(&KindLabel {
                    kind: kind.name().into(),
                })
                .set(inventory.count(kind) as i64);
        }
        let capacity = f64::from(capacity.max(1));
        m.node_map_fill_ratio
            .set(inventory.count(ObjectKind::MapEntry) as f64 / capacity);
    }
}

/// The `op` label of an operation: `upsert` (a create or an in-place replace) or `delete`.
fn op_label(op: &Op) -> &'static str {
    match op {
        Op::Create(_) | Op::Replace(_) => "upsert",
        Op::Delete(_) => "delete",
    }
}

/// What one reconcile did, for the line that sums it up.
pub struct Reconciled<'a> {
    pub plan: &'a Plan,
    pub writes: usize,
    pub failures: usize,
    pub started: Instant,
    /// How long the kernel writes took, of the whole.
    pub applied: std::time::Duration,
    /// The kernel was dumped (rather than the last reconcile's result planned from).
    pub dumped: bool,
}

impl Reconciled<'_> {
    /// Logs the line: at info when the reconcile had something to do, else at debug.
    pub fn log(&self) {
        let Self {
            plan,
            writes,
            failures,
            dumped,
            ..
        } = *self;
        let elapsed_ms = self.started.elapsed().as_millis() as u64;
        let apply_ms = self.applied.as_millis() as u64;
        let (deletes, upserts) = (plan.deletes.len(), plan.upserts.len());
        let event_sized = plan.scope.is_some();
        if plan.is_empty() && failures == 0 {
            // A resync or a relist that found nothing to do: not worth a line at info.
            tracing::debug!(
                target: RECONCILER,
                writes,
                elapsed_ms,
                dumped,
                event_sized,
                "reconciled"
            );
        } else {
            tracing::info!(
                target: RECONCILER,
                writes,
                failed = failures,
                deletes,
                upserts,
                elapsed_ms,
                apply_ms,
                dumped,
                event_sized,
                settled = plan.settled,
                "reconciled"
            );
        }
    }
}

/// The input problems and holds last logged, so that each is logged once, when it first
/// appears, not at every reconcile.
#[derive(Default)]
pub struct ProblemLog {
    logged: BTreeSet<String>,
}

impl ProblemLog {
    /// Logs what is new among `plan`'s problems and hold and `live`'s rejected nodes, and the
    /// plan's reused IDs and released removals (a release only where the last plan held,
    /// `was_held`).
    pub fn log(&mut self, plan: &Plan, live: &LiveState, was_held: bool) {
        let mut now = BTreeSet::new();
        for e in &plan.errors {
            let line = e.to_string();
            if !self.logged.contains(&line) {
                tracing::warn!(target: RECONCILER, node = %e.node, "skipping: {}", e.problem);
            }
            now.insert(line);
        }
        for (node, e) in live.errors() {
            let line = format!("{node}: {e}");
            if !self.logged.contains(&line) {
                tracing::warn!(target: RECONCILER, %node, "malformed node: {e}");
            }
            now.insert(line);
        }
        for (node, d) in live.duplicates() {
            let line = format!("{node}: {d}");
            if !self.logged.contains(&line) {
                tracing::warn!(target: RECONCILER, %node, "name listed twice: {d}");
            }
            now.insert(line);
        }
        if let Some(hold) = &plan.brake {
            let line = format!("hold {} {:?}", hold.id, hold.kind);
            if !self.logged.contains(&line) {
                tracing::error!(
                    target: RECONCILER,
                    nodes = ?hold.nodes,
                    orphans = hold.orphans,
                    "{hold}"
                );
            }
            now.insert(line);
        }
        for a in plan.allocations.iter().filter(|a| a.reused_after.is_some()) {
            if a.early {
                tracing::warn!(
                    target: RECONCILER,
                    node = %a.node,
                    id = a.id.get(),
                    "every node ID is in use or cooling down: reusing the one that has cooled \
                     longest before its cool-down has passed (past --id-reuse-floor)"
                );
            } else {
                tracing::warn!(
                    target: RECONCILER,
                    node = %a.node,
                    id = a.id.get(),
                    "every never-used node ID is taken: reusing an ID whose cool-down has passed"
                );
            }
        }
        if !plan.released_nodes.is_empty() && was_held {
            tracing::warn!(
                target: RECONCILER,
                nodes = ?plan.released_nodes,
                "the brake released held removals"
            );
        }
        self.logged = now;
    }
}

//! The reconciler: the single owner of every kernel mutation.
//!
//! Each reconcile dumps what the kernel really holds (ours, and foreign objects at identities we
//! might write), asks the planner what to delete and add given the agent's record, the live view
//! and the brake's memory, applies the plan in phases, and keeps the record the outcome implies
//! (failed cleanups stay pending deletes). Because one task does all of it, a prune and a
//! concurrent re-add of the same node can never interleave. It drives the kernel through one seam,
//! [`Kernel`], so unit tests run it against a fake that fails on command.
//!
//! [`Reconciler::reconcile_with`] is a reconcile, step by step; each step is a module:
//!
//! | step | module |
//! |---|---|
//! | the view: a dump, or the last reconcile's result | `view.rs` |
//! | where the IPsec key rotation stands | `rotation.rs` |
//! | an event-sized plan where one will do, else a full one | `plan.rs` |
//! | dumping again where routes it replaces are contested, planning again once the maps grew | `replan.rs`, `growth.rs` |
//! | the apply, in phases | `apply.rs` |
//! | the record the outcome implies | `splice.rs` |
//! | the brake's memory and hold, `--force-prune` spent | `brake.rs` |
//!
//! What a reconcile tells the outside (metrics, its summary line, its input problems) is
//! [`crate::telemetry::reconcile`].

pub mod apply;
mod brake;
mod growth;
mod plan;
mod replan;
mod rotation;
mod splice;
#[cfg(test)]
pub(crate) mod testing;
mod view;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use state::checkpoint::Checkpoint;
use state::inventory::Inventory;
use state::plan::{BrakeHold, BrakeMemory, HostAddresses, Plan, PlanConfig};

use self::apply::{Applied, OpResult};
use self::brake::Brake;
use self::plan::EventPlans;
use self::replan::Replanned;
use self::rotation::KeysUsed;
use self::splice::{Books, Spliced, merge_freed};
use self::view::{InventoryFrom, View};
use super::config::AgentConfig;
use super::intake::Intake;
use super::{AgentError, report};
use crate::kernel::Kernel;
use crate::runtime::AgentClock;
use crate::source::SourceEvent;
use crate::source::live::LiveState;
use crate::telemetry::Telemetry;
use crate::telemetry::reconcile::{ProblemLog, Reconciled};

/// What one reconcile did.
#[derive(Debug)]
pub struct Outcome {
    pub plan: Plan,
    /// Kernel mutations performed (successful operations).
    pub writes: usize,
    /// Operations that failed or were not attempted.
    pub failed: Vec<OpResult>,
    /// Stale nodes whose every delete succeeded in this reconcile.
    pub pruned: BTreeSet<String>,
    /// The record differs from the one before in more than when it was made: a checkpoint
    /// write is due.
    pub record_changed: bool,
}

pub struct Reconciler<K: Kernel> {
    config: AgentConfig,
    /// The planner's configuration, less what the live view says of the local node
    /// ([`Self::plan_config`] adds it).
    plan_config: PlanConfig,
    kernel: K,
    live: LiveState,
    /// The time the plans and the record count in (the brake's window and holds, cool-downs).
    clock: AgentClock,
    telemetry: Arc<Telemetry>,
    /// The agent's record, and the node IDs it allocated.
    books: Books,
    /// The brake's memory, its last hold, and an operator's confirmation.
    brake: Brake,
    /// What event-sized plans need of the last plan.
    events: EventPlans,
    /// What the kernel holds as far as the last reconcile knows.
    view: View,
    /// With IPsec: the key file's digest the last plan used, and when the rotation moves on.
    keys: Option<KeysUsed>,
    /// What the host held at the last dump: the local node's too (the address policy).
    host: HostAddresses,
    /// A map capacity the kernel refused to grow to: not asked for again.
    grow_refused: Option<u32>,
    problems: ProblemLog,
    totals: Totals,
}

/// What the reconciles did so far, for the run report.
struct Totals {
    /// Nodes found in the checkpoint at start.
    restored_nodes: usize,
    /// Kernel mutations.
    writes: usize,
    /// Stale nodes cleaned up.
    pruned: BTreeSet<String>,
}

impl<K: Kernel> Reconciler<K> {
    /// A reconciler over `kernel`, starting from the restored checkpoint `record`. The freed IDs
    /// the kernel remembers are merged into the record's, so their cool-down survives a lost
    /// checkpoint.
    pub fn new(
        config: AgentConfig,
        record: Option<Checkpoint>,
        mut kernel: K,
        telemetry: Arc<Telemetry>,
    ) -> Self {
        let mut ids = record.as_ref().map(|c| c.ids.clone()).unwrap_or_default();
        match kernel.freed_ids() {
            Ok(freed) => merge_freed(&mut ids, freed),
            Err(e) => tracing::warn!("reading the kernel's record of freed node IDs: {e}"),
        }
        let kept = kernel.recent_removals();
        let plan_config = PlanConfig {
            local_node: config.node_name.clone(),
            local_addresses: Vec::new(),
            ipsec: None,
            max_prune_ratio: config.max_prune_ratio,
            force_prune: config.force_prune,
            confirm_delay: config.prune_confirm_delay,
            confirm_by_relist: false,
            map_capacity: config.datapath.node_map_max as usize,
            id_cooldown: config.id_cooldown,
            id_reuse_floor: config.id_reuse_floor,
            max_node_id: config.max_node_id,
            include_external_ips: config.include_external_ips,
            route_nexthops: kernel.route_nexthops(),
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            ..PlanConfig::default()
        };
        let totals = Totals {
            restored_nodes: record.as_ref().map_or(0, |cp| cp.records().count()),
            writes: 0,
            pruned: BTreeSet::new(),
        };
        let brake = Brake::restored(BrakeMemory::restored(record.as_ref(), kept, &ids));
        Self {
            live: LiveState::new(config.node_name.clone())
                .with_external_ips(config.include_external_ips),
            clock: AgentClock::resume(record.as_ref()),
            config,
            plan_config,
            kernel,
            telemetry,
            books: Books { record, ids },
            brake,
            events: EventPlans::default(),
            view: View::default(),
            keys: None,
            host: HostAddresses::default(),
            grow_refused: None,
            problems: ProblemLog::default(),
            totals,
        }
    }

    pub fn config(&self) -> &AgentConfig {
        &self.config
    }

    pub fn live(&self) -> &LiveState {
        &self.live
    }

    pub fn kernel(&mut self) -> &mut K {
        &mut self.kernel
    }

    /// The record, stamped with the time now (the agent's, and the boot clock's) for writing:
    /// what the checkpoint should say.
    pub fn stamp_record(&mut self) -> Option<&Checkpoint> {
        let record = self.books.record.as_mut()?;
        (record.written_at, record.boot) = self.clock.stamp();
        Some(record)
    }

    /// The time the plans and the record count in.
    pub fn now(&self) -> Duration {
        self.clock.now()
    }

    /// The record the last reconcile implied.
    pub fn record(&self) -> Option<&Checkpoint> {
        self.books.record.as_ref()
    }

    /// What the brake held at the last plan.
    pub fn hold(&self) -> Option<&BrakeHold> {
        self.brake.hold.as_ref()
    }

    /// Nodes found in the checkpoint at start.
    pub fn restored_nodes(&self) -> usize {
        self.totals.restored_nodes
    }

    /// Kernel mutations so far.
    pub fn total_writes(&self) -> usize {
        self.totals.writes
    }

    /// Stale nodes cleaned up so far.
    pub fn pruned(&self) -> &BTreeSet<String> {
        &self.totals.pruned
    }

    /// Folds a source event into the live view; `true` if a reconcile is due: the view changed,
    /// or a fresh full list arrived that a held brake waits for (one whose confirm delay has
    /// passed: a list confirms nothing sooner, nor a wipe's hold or one of no view, and at
    /// 65,000 nodes a plan per relist is no small thing).
    pub fn on_event(&mut self, event: SourceEvent) -> bool {
        let taken = self.sync_parts().1.take(event);
        let now = self.clock.now();
        let waits_for_a_list = self
            .brake
            .hold
            .as_ref()
            .and_then(|h| h.confirmable_at)
            .is_some_and(|at| at <= now);
        self.live.synced() && (taken.changed || (taken.relisted && waits_for_a_list))
    }

    /// The kernel and the event intake, borrowed apart: at start the source's first list is
    /// taken in while the kernel is dumped for the first reconcile ([`Self::keep_early_dump`]).
    pub fn sync_parts(&mut self) -> (&mut K, Intake<'_>) {
        let intake = Intake {
            live: &mut self.live,
            telemetry: &self.telemetry,
        };
        (&mut self.kernel, intake)
    }

    /// Plans against the kernel as it is now, without changing anything.
    pub async fn plan(&mut self) -> Result<Plan, AgentError> {
        let inventory = self.dump_kernel().await?;
        self.record_objects(&inventory);
        let now = self.clock.now();
        self.refresh_ipsec(now, true);
        Ok(self.make_plan(&inventory, now, &self.plan_config()))
    }

    /// Dumps, plans, applies. The record the outcome implies becomes the agent's record; the
    /// caller writes it to the checkpoint when the schedule says so.
    pub async fn reconcile(&mut self) -> Result<Outcome, AgentError> {
        self.reconcile_with(InventoryFrom::Dump).await
    }

    /// Plans and applies after a source event. The kernel is dumped only where the last
    /// reconcile's result cannot stand in for it (none yet, or an operation failed); otherwise
    /// the plan starts from what the last reconcile left, the way Felix keeps its dataplane view
    /// between resyncs, and drift and foreign objects that appeared since are found at the next
    /// periodic resync (which always dumps). Creates stay exclusive and deletes carry our
    /// markers, so a stale view can fail an operation, never touch what is not ours.
    pub async fn reconcile_event(&mut self) -> Result<Outcome, AgentError> {
        self.reconcile_with(InventoryFrom::Cached).await
    }

    /// One reconcile, step by step.
    async fn reconcile_with(&mut self, from: InventoryFrom) -> Result<Outcome, AgentError> {
        let started = Instant::now();
        let changes = self.live.take_changes();
        let mut seen = self.look(from).await?;
        let now = self.clock.now();
        let names = seen.event_names(&changes);
        self.refresh_ipsec(now, names.is_none());
        let config = self.plan_config();
        let plan = self.plan_for(names, &seen.inventory, now, &config);
        let Replanned {
            plan,
            config,
            contested,
        } = self.replan(plan, config, &mut seen, now).await?;
        self.brake.confirmed = None;
        self.purge_junk(seen.dumped).await?;
        self.problems
            .log(&plan, &self.live, self.brake.hold.is_some());
        if plan.scope.is_none() {
            // A full plan's working tables are freed by now: hand their pages back before the
            // apply builds the new view (at scale, the two would add up in the peak RSS).
            crate::runtime::memory::give_back();
        }
        let applying = Instant::now();
        let Applied { writes, failed } = self.apply(&plan, &mut seen, &contested).await;
        let applied = applying.elapsed();
        let Spliced { pruned, changed } = self.splice(&plan, &failed);
        self.record_outcome(&plan, &seen.inventory, started);
        self.view.keep(seen.inventory, failed.is_empty());
        self.events.after(&plan, config, failed.is_empty());
        self.keep_brake(&plan);
        self.totals.writes += writes;
        self.totals.pruned.extend(pruned.iter().cloned());
        let (failures, dumped) = (failed.len(), seen.dumped);
        Reconciled {
            plan: &plan,
            writes,
            failures,
            started,
            applied,
            dumped,
        }
        .log();
        Ok(Outcome {
            plan,
            writes,
            failed,
            pruned,
            record_changed: changed,
        })
    }

    /// Hands what a reconcile (started at `started`) left to telemetry: the record, `plan`'s
    /// hold and problems, the live view's, and the kernel's objects (`inventory`).
    fn record_outcome(&self, plan: &Plan, inventory: &Inventory, started: Instant) {
        if let Some(record) = &self.books.record {
            let live_problems = self.live.errors().len() + self.live.duplicates().len();
            let kernel = (inventory, self.config.datapath.node_map_max);
            self.telemetry
                .record_outcome(plan, record, live_problems, kernel, started);
        }
    }

    /// Sets the kernel-object gauges from what the kernel holds.
    fn record_objects(&self, inventory: &Inventory) {
        let capacity = self.config.datapath.node_map_max;
        self.telemetry.record_objects(inventory, capacity);
    }

    /// The run report for `--once --output json`.
    pub fn report(&self, plan: &Plan, failed: &[OpResult]) -> report::RunReport {
        report::RunReport {
            synced: self.live.synced(),
            live_nodes: self.live.view().nodes.len(),
            restored_nodes: self.totals.restored_nodes,
            pruned_nodes: self.totals.pruned.len(),
            pruned: self.totals.pruned.iter().cloned().collect(),
            kernel_writes: self.totals.writes,
            errors: report::node_errors(plan, &self.live),
            failed_ops: report::failed_ops(failed),
            brake: report::brake(plan),
            peak_rss_kib: report::peak_rss_kib(),
        }
    }
}

//! The reconciler: the single owner of every kernel mutation.
//!
//! Each reconcile dumps what the kernel really holds (ours, and foreign objects at identities we
//! might write), asks the planner what to delete and add given the agent's record, the live view
//! and the brake's memory, applies the plan in phases, and keeps the record the outcome implies
//! (failed cleanups stay pending deletes). Because one task does all of it, a prune and a
//! concurrent re-add of the same node can never interleave. It drives the kernel through one seam,
//! [`Kernel`], so unit tests run it against a fake that fails on command.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use state::checkpoint::Checkpoint;
use state::ids::{AllocatorState, FreedId};
use state::inventory::Inventory;
use state::node::AddressKind;
use state::objects::{KernelObject, ObjectId, ObjectKind, Op, XfrmDir};
use state::plan::{
    BrakeHold, BrakeMemory, ClaimIndex, DeleteReason, HoldKind, InputProblem, LiveView, Plan,
    PlanConfig, PlanInput,
};
use state::rotation::rotation;

pub mod apply;

use self::apply::{OpResult, apply_plan, routes_now};
use super::clock::AgentClock;
use super::config::AgentConfig;
use super::drift::{Drift, Found};
use super::intake::Intake;
use super::kernel::Kernel;
use super::{AgentError, report};
use crate::backends::RoutesSinceDump;
use crate::source::SourceEvent;
use crate::source::live::{Changes, LiveState};
use crate::telemetry::Telemetry;
use crate::telemetry::metrics::{KindLabel, OpLabels, StateLabel};

/// Dumps a reconcile takes again when someone else keeps changing routes at destinations its
/// plan would replace; then the rest of the plan goes ahead, and those replaces wait for the
/// retry (with backoff).
const MAX_REDUMPS: usize = 2;

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
    plan_config: PlanConfig,
    /// The agent's record: the restored checkpoint at first, then the one each reconcile implies.
    record: Option<Checkpoint>,
    /// Which records claim what, for event-sized plans: built from a steady record, kept
    /// across their splices, dropped when a full plan replaces the record.
    claims: Option<ClaimIndex>,
    restored_nodes: usize,
    ids: AllocatorState,
    brake: BrakeMemory,
    live: LiveState,
    kernel: K,
    /// The time the plans and the record count in (the brake's window and holds, cool-downs).
    clock: AgentClock,
    /// The hold an operator confirmed, until a plan has seen it.
    confirmed_hold: Option<String>,
    /// The last plan's hold.
    hold: Option<BrakeHold>,
    /// The input errors last logged, so each is logged once, not at every reconcile.
    logged_errors: BTreeSet<String>,
    /// What the kernel should hold after the last reconcile: the next dump's drift is measured
    /// against it, and a reconcile for a source event plans against it without dumping.
    expected: Option<Inventory>,
    /// Every operation of the last reconcile succeeded, so [`Self::expected`] is what the
    /// kernel holds as far as the agent knows; after a failure the next reconcile dumps.
    expected_exact: bool,
    /// The dump taken while the source synced at start, until the first reconcile uses it.
    early_dump: Option<Inventory>,
    total_writes: usize,
    pruned: BTreeSet<String>,
    telemetry: Arc<Telemetry>,
    /// With IPsec: the key file's digest the last plan used, and when the rotation moves on.
    keys: Option<KeysUsed>,
    /// A map capacity the kernel refused to grow to: not asked for again.
    grow_refused: Option<u32>,
    /// The last plan was steady ([`Plan::steady`]) and applied without a failure, with this
    /// configuration, leaving these nodes unsettled: a change to a few nodes under the same
    /// configuration may be planned event-sized, with the unsettled nodes beside it.
    steady: Option<Steady>,
}

/// The nodes a plan pruned: those whose stale objects it deleted, and the removals it carried
/// out (released by the brake now, or pending deletes released before) that left the record
/// with or without writes (a retry that finds nothing left to delete completes a removal too),
/// never a node with a failed op.
fn pruned_by(
    plan: &Plan,
    before: Option<&Checkpoint>,
    after: &Checkpoint,
    failed_nodes: &BTreeSet<&str>,
) -> BTreeSet<String> {
    let still_pending: BTreeSet<&str> = after
        .pending_deletes
        .iter()
        .map(|p| p.node.name.as_str())
        .collect();
    let retried = before
        .into_iter()
        .flat_map(|r| &r.pending_deletes)
        .filter(|p| p.held.is_none())
        .map(|p| &p.node.name);
    let completed = retried
        .chain(&plan.released_nodes)
        .filter(|n| !still_pending.contains(n.as_str()));
    plan.deletes
        .iter()
        .filter(|d| d.reason == DeleteReason::StaleNode)
        .filter_map(|d| d.node.as_ref())
        .chain(completed)
        .filter(|n| !failed_nodes.contains(n.as_str()))
        .cloned()
        .collect()
}

/// What the last steady plan left: its configuration and its unsettled nodes.
struct Steady {
    config: PlanConfig,
    unsettled: Vec<String>,
}

/// What the last plan made of the IPsec key file.
struct KeysUsed {
    digest: [u8; 32],
    /// The file as it was then could not be used.
    unusable: bool,
    /// Since the Unix epoch.
    next_change: Option<Duration>,
    /// The abrupt switch was already reported for this file.
    abrupt_reported: bool,
    /// The SPI sent with and the SPIs with states: a change is a step of a rotation, logged.
    spis: (u8, Vec<u8>),
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
            max_node_id: config.max_node_id,
            include_external_ips: config.include_external_ips,
            route_nexthops: kernel.route_nexthops(),
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            ..PlanConfig::default()
        };
        Self {
            live: LiveState::new(config.node_name.clone()),
            restored_nodes: record.as_ref().map_or(0, |cp| cp.records().count()),
            brake: BrakeMemory::restored(record.as_ref(), kept, &ids),
            clock: AgentClock::resume(record.as_ref()),
            config,
            plan_config,
            record,
            claims: None,
            ids,
            kernel,
            confirmed_hold: None,
            hold: None,
            logged_errors: BTreeSet::new(),
            expected: None,
            expected_exact: false,
            early_dump: None,
            total_writes: 0,
            pruned: BTreeSet::new(),
            telemetry,
            keys: None,
            grow_refused: None,
            steady: None,
        }
    }

    /// As a daemon, a fresh full list after the confirm delay releases a hold; one-shot runs
    /// only release with `--force-prune`.
    pub fn confirm_by_relist(&mut self, yes: bool) {
        self.plan_config.confirm_by_relist = yes;
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

    /// The record the last reconcile implied: what the checkpoint should say.
    /// The record, marked as written at `now` (since the Unix epoch): about to be written.
    /// The record, stamped with the time now (the agent's, and the boot clock's) for writing.
    pub fn stamp_record(&mut self) -> Option<&Checkpoint> {
        let record = self.record.as_mut()?;
        (record.written_at, record.boot) = self.clock.stamp();
        Some(record)
    }

    /// The time the plans and the record count in.
    pub fn now(&self) -> Duration {
        self.clock.now()
    }

    pub fn record(&self) -> Option<&Checkpoint> {
        self.record.as_ref()
    }

    /// What the brake held at the last plan.
    pub fn hold(&self) -> Option<&BrakeHold> {
        self.hold.as_ref()
    }

    /// Nodes found in the checkpoint at start.
    pub fn restored_nodes(&self) -> usize {
        self.restored_nodes
    }

    /// Kernel mutations so far.
    pub fn total_writes(&self) -> usize {
        self.total_writes
    }

    /// Stale nodes cleaned up so far.
    pub fn pruned(&self) -> &BTreeSet<String> {
        &self.pruned
    }

    /// Folds a source event into the live view; `true` if a reconcile is due: the view changed,
    /// or a fresh full list arrived that a held brake waits for (one whose confirm delay has
    /// passed: a list confirms nothing sooner, nor a wipe's hold or one of no view, and at
    /// 65,000 nodes a plan per relist is no small thing).
    pub fn on_event(&mut self, event: SourceEvent) -> bool {
        let taken = self.sync_parts().1.take(event);
        let now = self.clock.now();
        let waits_for_a_list = self
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

    /// A dump of the kernel taken while the source synced at start: the first reconcile (or
    /// plan) starts from it instead of dumping again. Nothing of the agent's has written to the
    /// kernel since, and a foreign change since is what any dump can miss before its apply:
    /// creates are exclusive and deletes carry our markers, and the nexthop users' watch counts
    /// from the start of this dump.
    pub fn keep_early_dump(&mut self, inventory: Inventory) {
        self.early_dump = Some(inventory);
    }

    /// An operator confirmed the hold `id` (`node-agent prune confirm`); the next plan releases
    /// it if it is still exactly that hold.
    pub fn confirm_hold(&mut self, id: String) {
        tracing::warn!(hold = %id, "an operator confirmed a held prune");
        self.confirmed_hold = Some(id);
    }

    fn plan_config(&self) -> PlanConfig {
        let mut config = self.plan_config.clone();
        config.local_boot_id = self
            .live
            .get(&self.config.node_name)
            .map_or_else(String::new, |n| n.boot_id.to_string());
        let local = self.live.get(&self.config.node_name);
        config.local_addresses = local.map_or_else(Vec::new, |n| {
            n.addresses
                .iter()
                .filter(|a| a.kind == AddressKind::InternalIP)
                .map(|a| a.ip)
                .collect()
        });
        config.local_pod_cidrs = local.map_or_else(Vec::new, |n| n.pod_cidrs.to_vec());
        config
    }

    /// Reads the IPsec keys again and works out where the rotation stands at `now`: the keys
    /// the next plan writes states for, and the one it sends with. Before a plan of the whole
    /// cluster (`full`), the key book may forget derived keys no plan asks for any more; an
    /// event-sized plan asks for a few pairs only, so it leaves the book as it is.
    fn refresh_ipsec(&mut self, now: Duration, full: bool) {
        let Some(read) = self.kernel.ipsec_keys() else {
            self.plan_config.ipsec = None;
            return;
        };
        self.telemetry.set_key_file_error(read.error.clone());
        let seen = self.record.as_ref().map_or(&[][..], |c| &c.ipsec_keys[..]);
        if full {
            read.tags.plan_begins();
        }
        let r = rotation(&read.keys, seen, now, self.config.key_delays, read.tags);
        let same_file = self.keys.as_ref().is_some_and(|k| k.digest == read.digest);
        let reported = same_file && self.keys.as_ref().is_some_and(|k| k.abrupt_reported);
        if r.abrupt && !reported {
            tracing::warn!(
                spi = r.ipsec.send_spi,
                "none of the IPsec keys in the key file was seen before: the key this node sent \
                 with is gone from the file, so it sends with the newest key at once, and nodes \
                 that have not read the new file yet drop its traffic until they do. Rotate by \
                 appending the new key and keeping the old line until the rotation completes"
            );
        }
        let spis = (
            r.ipsec.send_spi,
            r.ipsec.keys.iter().map(|k| k.spi).collect::<Vec<_>>(),
        );
        if self.keys.as_ref().is_none_or(|k| k.spis != spis) {
            tracing::info!(
                send_spi = spis.0,
                keys = ?spis.1,
                next_step_s = r.next_change.map(|t| t.saturating_sub(now).as_secs_f32()),
                "IPsec keys: sending with SPI {}, states for {:?}",
                spis.0,
                spis.1
            );
        }
        let m = &self.telemetry.metrics;
        m.ipsec_send_spi.set(i64::from(r.ipsec.send_spi));
        m.ipsec_keys_in_use.set(r.ipsec.keys.len() as i64);
        self.keys = Some(KeysUsed {
            digest: read.digest,
            unusable: read.error.is_some(),
            next_change: r.next_change,
            abrupt_reported: r.abrupt || reported,
            spis,
        });
        self.plan_config.ipsec = Some(r.ipsec);
    }

    /// Whether the IPsec key file changed since the last plan (read again now): new keys, or
    /// a file that became unusable or usable again (readiness says so at the next reconcile).
    pub fn keys_changed(&mut self) -> bool {
        let now = self
            .kernel
            .ipsec_keys()
            .map(|r| (r.digest, r.error.is_some()));
        now != self.keys.as_ref().map(|k| (k.digest, k.unusable))
    }

    /// When the IPsec key rotation moves on by itself (since the Unix epoch), if it will.
    pub fn next_rotation_change(&self) -> Option<Duration> {
        self.keys.as_ref().and_then(|k| k.next_change)
    }

    fn input<'a>(
        &'a self,
        live: &'a LiveView,
        inventory: &'a Inventory,
        now: Duration,
        config: &'a PlanConfig,
    ) -> PlanInput<'a> {
        PlanInput {
            record: self.record.as_ref(),
            live,
            inventory,
            allocator: &self.ids,
            brake: &self.brake,
            confirmed_hold: self.confirmed_hold.as_deref(),
            now,
            config,
        }
    }

    fn make_plan(&mut self, inventory: &Inventory, now: Duration, config: &PlanConfig) -> Plan {
        // The record this plan implies replaces the indexed one; at scale the index would add
        // to the full plan's peak memory.
        self.claims = None;
        let view = self.live.view();
        state::plan::plan(&self.input(&view, inventory, now, config))
    }

    /// The event-sized plan for a change to the nodes `names`, where one will do: the last plan
    /// was steady under the same configuration, the view is the one it left, and the change
    /// with the nodes that plan left unsettled is small next to the cluster (a large one costs
    /// a full plan's work anyway).
    fn plan_event(
        &mut self,
        names: &BTreeSet<String>,
        inventory: &Inventory,
        now: Duration,
        config: &PlanConfig,
    ) -> Option<Plan> {
        let steady = self.steady.as_ref().filter(|s| s.config == *config)?;
        let mut touched = names.clone();
        touched.extend(steady.unsettled.iter().cloned());
        let known = self.record.as_ref().map_or(0, |r| r.nodes.len());
        if touched.len() > (known / 8).max(16) {
            return None;
        }
        self.prepare_event_plans();
        let index = self.claims.as_ref()?;
        let view = self.live.view_of(&touched);
        state::plan::plan_scoped(&self.input(&view, inventory, now, config), index, &touched)
    }

    /// Builds what event-sized plans need of a steady record, if it is not there yet: the
    /// daemon calls this after each reconcile, so that building it after a full plan (tens of
    /// milliseconds at 65,000 nodes) is not part of the next event's latency.
    pub fn prepare_event_plans(&mut self) {
        if self.steady.is_some() && self.claims.is_none() {
            self.claims = self.record.as_ref().map(ClaimIndex::of);
        }
    }

    /// Forgets the view the last reconcile left, so that the next one dumps without comparing:
    /// a one-shot run's pass after a failed one, milliseconds after its writes, has no drift to
    /// find, and the view is as large as the dump it would be compared with.
    pub fn forget_view(&mut self) {
        self.expected = None;
        self.expected_exact = false;
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

    async fn reconcile_with(&mut self, from: InventoryFrom) -> Result<Outcome, AgentError> {
        let started = Instant::now();
        let changes = self.live.take_changes();
        let cached = match from {
            InventoryFrom::Cached if self.expected_exact => self.expected.take(),
            _ => None,
        };
        let mut dumped = cached.is_none();
        let (mut inventory, mut drift) = match cached {
            Some(inventory) => (inventory, Drift::default()),
            None => self.dump().await?,
        };
        let now = self.clock.now();
        let names = match &changes {
            Changes::Names(names) if !dumped => Some(names),
            _ => None,
        };
        self.refresh_ipsec(now, names.is_none());
        let mut config = self.plan_config();
        let mut plan = match names.and_then(|n| self.plan_event(n, &inventory, now, &config)) {
            Some(plan) => plan,
            None => self.make_plan(&inventory, now, &config),
        };
        let mut grown = false;
        let mut contested;
        loop {
            // Every plan is checked against the routes changed since its view was read, the
            // plan made again after the maps grew included. Where someone keeps changing one,
            // the rest of the plan goes ahead without replacing it.
            let mut redumps = 0;
            loop {
                contested = self.contested(&plan, dumped);
                if contested.is_empty() || redumps == MAX_REDUMPS {
                    break;
                }
                // The next dump is compared with this view: with a dump's, what changed since
                // is added to what that dump found.
                self.expected = Some(inventory);
                drop(plan);
                let later;
                (inventory, later) = self.dump().await?;
                drift.merge(later);
                (dumped, redumps) = (true, redumps + 1);
                plan = self.make_plan(&inventory, now, &config);
            }
            if grown || !self.grow_maps_for(&plan, &inventory) {
                break;
            }
            grown = true;
            config = self.plan_config();
            // Only nodes held for want of room see the new capacity: without any, the plan
            // stands as it is, and a second full plan (on every cold start of a cluster past
            // 49,000 dual-stack nodes, which grows the maps) would only make it again.
            if !plan
                .errors
                .iter()
                .any(|e| matches!(e.problem, InputProblem::MapFull { .. }))
            {
                break;
            }
            // One plan at a time: at scale, two would be the reconcile's peak memory.
            drop(plan);
            plan = self.make_plan(&inventory, now, &config);
        }
        self.confirmed_hold = None;
        if dumped && self.live.synced() {
            let purged = self.kernel.purge_junk().await?;
            self.total_writes += purged;
        }
        self.log_problems(&plan);
        if plan.scope.is_none() {
            // A full plan's working tables are freed by now: hand their pages back before the
            // apply builds the new view (at scale, the two would add up in the peak RSS).
            crate::memory::give_back();
        }
        let reasons: HashMap<ObjectId, DeleteReason> = plan
            .deletes
            .iter()
            .map(|d| (d.object.id(), d.reason))
            .collect();
        inventory.reserve(plan.upserts.iter().filter(|u| !u.update).count());
        let telemetry = &self.telemetry;
        let mut writes = 0;
        let mut failed = Vec::new();
        let routes = routes_now(&plan, &inventory);
        apply_plan(
            &mut self.kernel,
            &plan,
            &routes,
            &contested,
            |op, node, result| {
                telemetry
                    .metrics
                    .operations
                    .get_or_create(&OpLabels {
                        kind: op.object().kind().name().into(),
                        op: op_label(&op).into(),
                        result: if result.is_ok() { "ok" } else { "error" }.into(),
                    })
                    .inc();
                match result {
                    Ok(()) => {
                        writes += 1;
                        match &op {
                            Op::Delete(o) => {
                                let reason = reasons.get(&o.id()).map_or("", |r| r.as_str());
                                tracing::info!(node = node.unwrap_or("-"), reason, "deleted {o}");
                            }
                            Op::Create(o) | Op::Replace(o) => {
                                if let Some(found) = drift.at(&o.id()) {
                                    repaired(telemetry, node, o, found);
                                }
                            }
                        }
                        inventory.apply(&op);
                    }
                    Err(e) => {
                        tracing::error!(node = node.unwrap_or("-"), "{e}");
                        failed.push(OpResult {
                            op,
                            node: node.map(str::to_owned),
                            result: Err(e),
                        });
                    }
                }
            },
        )
        .await;
        let failed_ops: Vec<Op> = failed.iter().map(|f| f.op.clone()).collect();
        let failed_nodes: BTreeSet<&str> =
            failed.iter().filter_map(|f| f.node.as_deref()).collect();
        let cp = plan.checkpoint_after(&failed_ops);
        let pruned = pruned_by(&plan, self.record.as_ref(), &cp, &failed_nodes);
        self.remember_freed(&plan, &cp);
        let record_changed = match (&plan.scope, self.record.as_mut()) {
            (Some(names), Some(record)) => {
                if let Some(index) = &mut self.claims {
                    index.splice(record, names, &cp.nodes);
                }
                record.splice(names, cp)
            }
            _ => {
                let changed = self
                    .record
                    .as_ref()
                    .is_none_or(|old| !old.same_content(&cp));
                self.record = Some(cp);
                changed
            }
        };
        if let Some(record) = &self.record {
            self.ids = record.ids.clone();
            self.record_outcome(&plan, record, &inventory, started);
        }
        self.expected = Some(inventory);
        self.expected_exact = failed.is_empty();
        self.steady = match &plan.steady {
            Some(unsettled) if failed.is_empty() => Some(Steady {
                config,
                unsettled: unsettled.clone(),
            }),
            _ => None,
        };
        self.remember_removal(&plan.brake_memory);
        self.brake = plan.brake_memory.clone();
        self.hold = plan.brake.clone();
        self.spend_force_prune(&plan);
        self.total_writes += writes;
        self.pruned.extend(pruned.iter().cloned());
        let elapsed_ms = started.elapsed().as_millis() as u64;
        let (deletes, upserts, failures) = (plan.deletes.len(), plan.upserts.len(), failed.len());
        let event_sized = plan.scope.is_some();
        if plan.is_empty() && failed.is_empty() {
            // A resync or a relist that found nothing to do: not worth a line at info.
            tracing::debug!(writes, elapsed_ms, dumped, event_sized, "reconciled");
        } else {
            tracing::info!(
                writes,
                failed = failures,
                deletes,
                upserts,
                elapsed_ms,
                dumped,
                event_sized,
                settled = plan.settled,
                "reconciled"
            );
        }
        Ok(Outcome {
            plan,
            writes,
            failed,
            pruned,
            record_changed,
        })
    }

    /// `--force-prune` in the daemon is for the plan after a restart, the one the operator
    /// looked at: kept for every plan, as a setting left in a DaemonSet's environment would
    /// be, it turned the brake off for good, near-total wipes included.
    /// A plan of no view (no local node) is not the one: it released nothing.
    fn spend_force_prune(&mut self, plan: &Plan) {
        let no_view = plan
            .brake
            .as_ref()
            .is_some_and(|b| b.kind == HoldKind::NoLocalNode);
        if self.plan_config.force_prune && self.plan_config.confirm_by_relist && !no_view {
            self.plan_config.force_prune = false;
            tracing::warn!(
                "--force-prune applied to the first plan after start; the brake holds again \
                 from now on (`node-agent prune confirm` releases a later hold)"
            );
        }
    }

    /// Dumps the kernel, and what drifted from the view the last reconcile left. Until a dump
    /// succeeds, no reconcile plans from the view it was to check.
    async fn dump(&mut self) -> Result<(Inventory, Drift), AgentError> {
        self.expected_exact = false;
        let inventory = self.dump_kernel().await?;
        // The view is done with once compared: at scale it is as large as the dump, and the
        // plan about to be made is the reconcile's peak memory.
        let drift = self
            .expected
            .take()
            .map(|e| Drift::detect(&e, &inventory))
            .unwrap_or_default();
        Ok((inventory, drift))
    }

    /// The kernel's objects: the early dump the first time, if there is one.
    async fn dump_kernel(&mut self) -> Result<Inventory, AgentError> {
        match self.early_dump.take() {
            Some(inventory) => Ok(inventory),
            None => Ok(self.kernel.dump().await?),
        }
    }

    /// The destinations of the routes `plan` replaces where the view it was made from no
    /// longer holds: someone else changed a route there since the last dump began (a replace
    /// takes whatever route is at its destination). A view from the last reconcile (`dumped`
    /// false) holds nowhere where that is not known; a fresh dump's holds then, as nothing
    /// says otherwise.
    fn contested(&mut self, plan: &Plan, dumped: bool) -> Vec<IpNet> {
        let replaced = replaced_routes(plan);
        if replaced.is_empty() {
            return replaced;
        }
        match self.kernel.routes_since_dump(&replaced) {
            RoutesSinceDump::Untouched => Vec::new(),
            RoutesSinceDump::Unknown if dumped => Vec::new(),
            RoutesSinceDump::Unknown => replaced,
            RoutesSinceDump::Touched => replaced
                .into_iter()
                .filter(|d| {
                    self.kernel.routes_since_dump(std::slice::from_ref(d))
                        == RoutesSinceDump::Touched
                })
                .collect(),
        }
    }

    /// Grows the maps when `plan` would leave them more than three quarters full or could not
    /// place a node for want of room; returns whether they grew (the plan is then made again if
    /// it held a node for want of room). A capacity the kernel refused is not asked for again by
    /// this agent.
    fn grow_maps_for(&mut self, plan: &Plan, inventory: &Inventory) -> bool {
        let capacity = self.plan_config.map_capacity;
        if !self.config.node_map_grow {
            return false;
        }
        let Some(target) = map_growth(plan, inventory, capacity) else {
            return false;
        };
        if self.grow_refused == Some(target) {
            return false;
        }
        match self.kernel.grow_maps(target) {
            Ok(()) => {
                tracing::info!(from = capacity, to = target, "node-ID map grown online");
                self.plan_config.map_capacity = target as usize;
                self.config.datapath.node_map_max = target;
                true
            }
            Err(e) => {
                tracing::error!("{e}; the maps keep their {capacity} entries");
                self.grow_refused = Some(target);
                false
            }
        }
    }

    /// Logs each input problem and hold once, when it first appears.
    fn log_problems(&mut self, plan: &Plan) {
        let mut now = BTreeSet::new();
        for e in &plan.errors {
            let line = e.to_string();
            if !self.logged_errors.contains(&line) {
                tracing::warn!(node = %e.node, "skipping: {}", e.problem);
            }
            now.insert(line);
        }
        for (node, e) in self.live.errors() {
            let line = format!("{node}: {e}");
            if !self.logged_errors.contains(&line) {
                tracing::warn!(%node, "malformed node: {e}");
            }
            now.insert(line);
        }
        for (node, d) in self.live.duplicates() {
            let line = format!("{node}: {d}");
            if !self.logged_errors.contains(&line) {
                tracing::warn!(%node, "name listed twice: {d}");
            }
            now.insert(line);
        }
        if let Some(hold) = &plan.brake {
            let line = format!("hold {} {:?}", hold.id, hold.kind);
            if !self.logged_errors.contains(&line) {
                tracing::error!(nodes = ?hold.nodes, orphans = hold.orphans, "{hold}");
            }
            now.insert(line);
        }
        for a in plan.allocations.iter().filter(|a| a.reused_after.is_some()) {
            tracing::warn!(node = %a.node, id = a.id.get(), "every never-used node ID is taken: reusing an ID whose cool-down has passed");
        }
        if !plan.released_nodes.is_empty() && self.hold.is_some() {
            tracing::warn!(nodes = ?plan.released_nodes, "the brake released held removals");
        }
        self.logged_errors = now;
    }

    /// Writes the IDs this reconcile freed into the kernel's record of freed IDs.
    fn remember_freed(&mut self, plan: &Plan, cp: &Checkpoint) {
        let frees: HashSet<_> = plan.frees.iter().collect();
        let freed: Vec<FreedId> = cp
            .ids
            .freed
            .iter()
            .filter(|f| frees.contains(&f.id))
            .copied()
            .collect();
        if freed.is_empty() {
            return;
        }
        if let Err(e) = self.kernel.remember_freed(&freed) {
            tracing::warn!(
                "remembering freed node IDs in the kernel (the checkpoint has them): {e}"
            );
        }
    }

    /// Writes the removals this plan let through (the entry it added to the window: the one the
    /// last window lacks, whatever the clock did) into the kernel's record of recent removals,
    /// which outlives a lost checkpoint.
    fn remember_removal(&mut self, next: &BrakeMemory) {
        let Some(&added) = next.window.last() else {
            return;
        };
        if self.brake.window.contains(&added) {
            return;
        }
        let keep_since = added.at.saturating_sub(self.plan_config.confirm_delay);
        if let Err(e) = self.kernel.remember_removal(added, keep_since) {
            tracing::warn!(
                "remembering the removals just made in the kernel (the checkpoint has them): {e}"
            );
        }
    }

    fn record_outcome(
        &self,
        plan: &Plan,
        cp: &Checkpoint,
        inventory: &Inventory,
        started: Instant,
    ) {
        let m = &self.telemetry.metrics;
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
        m.node_input_errors.set(
            (plan.errors.len() - conflicts
                + self.live.errors().len()
                + self.live.duplicates().len()) as i64,
        );
        let no_id: Vec<&str> = plan
            .errors
            .iter()
            .filter(|e| matches!(e.problem, state::plan::InputProblem::Ids(_)))
            .map(|e| e.node.as_str())
            .collect();
        m.id_exhausted.set(no_id.len() as i64);
        self.telemetry.set_ids_exhausted(match no_id.as_slice() {
            [] => None,
            [first, ..] => Some(format!(
                "{} nodes held with no node ID free (every ID in use or cooling down), {first} \
                 among them",
                no_id.len()
            )),
        });
        m.reconcile_duration
            .observe(started.elapsed().as_secs_f64());
        self.record_objects(inventory);
    }

    /// Sets the kernel-object gauges from what the kernel holds.
    fn record_objects(&self, inventory: &Inventory) {
        let m = &self.telemetry.metrics;
        for kind in ObjectKind::ALL {
            m.kernel_objects
                .get_or_create(&KindLabel {
                    kind: kind.name().into(),
                })
                .set(inventory.count(kind) as i64);
        }
        let capacity = f64::from(self.config.datapath.node_map_max.max(1));
        m.node_map_fill_ratio
            .set(inventory.count(ObjectKind::MapEntry) as f64 / capacity);
    }

    /// The run report for `--once --output json`.
    pub fn report(&self, plan: &Plan, failed: &[OpResult]) -> report::RunReport {
        report::RunReport {
            synced: self.live.synced(),
            live_nodes: self.live.view().nodes.len(),
            restored_nodes: self.restored_nodes,
            pruned_nodes: self.pruned.len(),
            pruned: self.pruned.iter().cloned().collect(),
            kernel_writes: self.total_writes,
            errors: report::node_errors(plan, &self.live),
            failed_ops: report::failed_ops(failed),
            brake: report::brake(plan),
            peak_rss_kib: report::peak_rss_kib(),
        }
    }
}

/// Counts and logs the repair of an object that drifted.
fn repaired(telemetry: &Telemetry, node: Option<&str>, o: &KernelObject, found: &Found) {
    telemetry
        .metrics
        .drift_repaired
        .get_or_create(&KindLabel {
            kind: o.kind().name().into(),
        })
        .inc();
    let node = node.unwrap_or("-");
    match found {
        Found::Missing if matches!(o, KernelObject::XfrmState(x) if x.dir == XfrmDir::Out) => {
            tracing::error!(
                node,
                "repaired drift: {o} had gone from the kernel; written back with the same \
                 key, so its sequence numbers start over: the peer's anti-replay window \
                 drops its packets (and GCM nonces repeat) until the IPsec key is rotated; \
                 rotate it (docs/ipsec.md)"
            );
        }
        Found::Missing => {
            tracing::warn!(
                node,
                "repaired drift: {o} had gone from the kernel; written back"
            );
        }
        Found::Changed(was) => {
            tracing::warn!(node, "repaired drift: found {was}, written back as {o}");
        }
    }
}

/// The capacity the maps should grow to for `plan`, if they should: when the entries it leaves
/// in either map, plus those of nodes it held for want of room, fill more than three quarters of
/// `capacity`, double it until they do not (a hash map that full keeps its lookups short, and a
/// burst of new nodes finds room), up to the largest map the agent makes.
fn map_growth(plan: &Plan, inventory: &Inventory, capacity: usize) -> Option<u32> {
    let after = |kind: ObjectKind| {
        let creates = plan
            .upserts
            .iter()
            .filter(|u| !u.update && u.object.kind() == kind)
            .count();
        let deletes = plan
            .deletes
            .iter()
            .filter(|d| d.object.kind() == kind)
            .count();
        (inventory.count(kind) + creates).saturating_sub(deletes)
    };
    let waiting: usize = plan
        .errors
        .iter()
        .filter_map(|e| match e.problem {
            InputProblem::MapFull { needed, .. } => Some(needed),
            _ => None,
        })
        .sum();
    let need = after(ObjectKind::MapEntry).max(after(ObjectKind::PodCidrEntry)) + waiting;
    let max = node_agent_common::MAX_NODE_MAP_MAX as usize;
    let mut target = capacity.max(1);
    while need * 4 > target * 3 && target < max {
        target = (target * 2).min(max);
    }
    (target > capacity).then_some(target as u32)
}

/// The destinations where a plan made from the last reconcile's view replaces a route: it is
/// made again from a dump unless the kernel can tell that no one else changed a route at any
/// of them since the last one (a replace matches the destination, whoever's route is there
/// now; a readdressed node's routes move to its new nexthop so). A plan that deletes a nexthop
/// needs none: the backend reads the routes before it deletes one, and leaves alone a nexthop
/// something goes through.
fn replaced_routes(plan: &Plan) -> Vec<IpNet> {
    plan.upserts
        .iter()
        .filter(|u| u.update)
        .filter_map(|u| match &u.object {
            KernelObject::Route(r) => Some(r.dst),
            _ => None,
        })
        .collect()
}

/// Where a reconcile's view of the kernel comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum InventoryFrom {
    /// A dump, always.
    Dump,
    /// The last reconcile's result when it can stand in for a dump.
    Cached,
}

/// Merges freed IDs the kernel remembers into the checkpoint's, keeping the later time of each:
/// the safer cool-down.
fn merge_freed(ids: &mut AllocatorState, kernel: Vec<FreedId>) {
    let mut by_id: BTreeMap<u16, FreedId> = ids.freed.iter().map(|f| (f.id.get(), *f)).collect();
    for f in kernel {
        by_id
            .entry(f.id.get())
            .and_modify(|e| e.freed_at = e.freed_at.max(f.freed_at))
            .or_insert(f);
    }
    ids.freed = by_id.into_values().collect();
}

/// The `op` label of an operation: `upsert` (a create or an in-place replace) or `delete`.
fn op_label(op: &Op) -> &'static str {
    match op {
        Op::Create(_) | Op::Replace(_) => "upsert",
        Op::Delete(_) => "delete",
    }
}

#[cfg(test)]
mod tests {
    use state::node::RawNode;
    use state::objects::{KernelObject, ObjectKind};

    use super::*;
    use crate::agent::kernel::fake::FakeKernel;

    fn raw(name: &str, ip: &str, cidr: &str) -> RawNode {
        RawNode {
            name: name.into(),
            uid: format!("uid-{name}"),
            addresses: vec![("InternalIP".into(), ip.into())],
            pod_cidrs: vec![cidr.into()],
            boot_id: String::new(),
        }
    }

    fn config() -> AgentConfig {
        AgentConfig::new("local", "/nonexistent-state", "/nonexistent-bpffs")
    }

    fn reconciler(nodes: &[(&str, u8)]) -> Reconciler<FakeKernel> {
        reconciler_with(config(), FakeKernel::default(), nodes)
    }

    /// A reconciler over `kernel`, synced on the local node and `nodes` (`10.0.0.<i>`,
    /// `10.1.<i>.0/24`).
    fn reconciler_with(
        config: AgentConfig,
        kernel: FakeKernel,
        nodes: &[(&str, u8)],
    ) -> Reconciler<FakeKernel> {
        restarted(config, None, kernel, nodes)
    }

    /// A reconciler restarted from `record` over `kernel`, synced on the local node and `nodes`.
    fn restarted(
        config: AgentConfig,
        record: Option<Checkpoint>,
        kernel: FakeKernel,
        nodes: &[(&str, u8)],
    ) -> Reconciler<FakeKernel> {
        let telemetry = Arc::new(Telemetry::new(Duration::MAX));
        let mut rec = Reconciler::new(config, record, kernel, telemetry);
        relist(&mut rec, nodes);
        rec
    }

    /// A full list of the local node and `nodes` (`10.0.0.<i>`, `10.1.<i>.0/24`): whether a
    /// reconcile is due.
    fn relist(rec: &mut Reconciler<FakeKernel>, nodes: &[(&str, u8)]) -> bool {
        rec.on_event(SourceEvent::Init);
        rec.on_event(SourceEvent::InitApply(raw(
            "local",
            "10.0.0.100",
            "10.1.100.0/24",
        )));
        for (n, i) in nodes {
            rec.on_event(SourceEvent::InitApply(raw(
                n,
                &format!("10.0.0.{i}"),
                &format!("10.1.{i}.0/24"),
            )));
        }
        rec.on_event(SourceEvent::InitDone)
    }

    /// Ten nodes, `n01` to `n10`, numbered 1 to 10.
    fn ten() -> Vec<(&'static str, u8)> {
        const NAMES: [&str; 10] = [
            "n01", "n02", "n03", "n04", "n05", "n06", "n07", "n08", "n09", "n10",
        ];
        NAMES.into_iter().zip(1..).collect()
    }

    fn metric(rec: &Reconciler<FakeKernel>, series: &str) -> Option<f64> {
        let text = rec.telemetry.metrics.encode();
        text.lines()
            .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    #[tokio::test(flavor = "current_thread")]
    async fn drift_is_repaired_counted_and_foreign_objects_are_not_repaired() {
        let mut rec = reconciler(&[("a", 1), ("b", 2)]);
        rec.reconcile().await.unwrap();
        let k = rec.kernel();
        let route_a = k
            .ours
            .values()
            .find(|o| o.kind() == ObjectKind::Route && o.to_string().contains("10.1.1.0/24"))
            .cloned()
            .unwrap();
        let entry_b = k
            .ours
            .values()
            .find(|o| matches!(o, KernelObject::MapEntry(e) if e.ip.to_string() == "10.0.0.2"))
            .cloned()
            .unwrap();
        // Someone deletes a's route and rewrites b's entry; someone else's route takes the place
        // of... nothing of ours: it stands beside them.
        k.ours.remove(&route_a.id());
        if let KernelObject::MapEntry(mut e) = entry_b.clone() {
            e.node_id = state::objects::NodeId::new(999).unwrap();
            k.ours.insert(entry_b.id(), KernelObject::MapEntry(e));
        }
        let o = rec.reconcile().await.unwrap();
        assert_eq!(o.writes, 2);
        assert!(rec.kernel().ours.contains_key(&route_a.id()));
        assert_eq!(rec.kernel().ours[&entry_b.id()], entry_b);
        assert_eq!(
            metric(&rec, "node_agent_drift_repaired_total{kind=\"route\"}"),
            Some(1.0)
        );
        assert_eq!(
            metric(&rec, "node_agent_drift_repaired_total{kind=\"map_entry\"}"),
            Some(1.0)
        );
        // A foreign route replaces ours: reported, never "repaired".
        let k = rec.kernel();
        k.ours.remove(&route_a.id());
        k.foreign.insert(
            route_a.id(),
            "route 10.1.1.0/24 metric 0 proto static".into(),
        );
        let o = rec.reconcile().await.unwrap();
        assert_eq!(o.writes, 0);
        assert!(o.plan.errors.iter().any(|e| e.problem.is_conflict()));
        assert_eq!(
            metric(&rec, "node_agent_drift_repaired_total{kind=\"route\"}"),
            Some(1.0)
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_failed_delete_keeps_the_node_pending_with_its_id() {
        let mut rec = reconciler(&[("a", 1), ("b", 2), ("c", 3)]);
        rec.reconcile().await.unwrap();
        rec.on_event(SourceEvent::Delete("c".into()));
        rec.kernel().faults.kinds = vec![ObjectKind::Route];
        let o = rec.reconcile().await.unwrap();
        assert_eq!(o.failed.len(), 1);
        assert!(o.pruned.is_empty());
        let cp = rec.record().unwrap();
        assert_eq!(cp.pending_deletes.len(), 1);
        assert_eq!(cp.pending_deletes[0].attempts, 1);
        assert!(cp.ids.freed.is_empty(), "its ID is still in use");
        // The kernel lets go: the retry deletes it, without the brake counting it again.
        rec.kernel().faults.kinds.clear();
        let o = rec.reconcile().await.unwrap();
        assert!(o.failed.is_empty() && o.plan.brake.is_none());
        assert_eq!(o.pruned.len(), 1);
        assert!(rec.record().unwrap().pending_deletes.is_empty());
        assert_eq!(
            rec.kernel().freed.len(),
            1,
            "the kernel remembers the freed ID"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_pending_delete_whose_retry_finds_nothing_left_is_reported_pruned() {
        let mut rec = reconciler(&[("a", 1), ("b", 2), ("c", 3)]);
        rec.reconcile().await.unwrap();
        rec.on_event(SourceEvent::Delete("c".into()));
        rec.kernel().faults.kinds = vec![ObjectKind::Route];
        let o = rec.reconcile().await.unwrap();
        assert!(o.pruned.is_empty());
        assert_eq!(rec.record().unwrap().pending_deletes.len(), 1);
        // Someone else deleted the route that failed: the retry has nothing left to write.
        rec.kernel().faults.kinds.clear();
        rec.kernel()
            .ours
            .retain(|_, o| !(o.kind() == ObjectKind::Route && o.to_string().contains(".3.")));
        let o = rec.reconcile().await.unwrap();
        assert!(o.plan.deletes.is_empty(), "{:?}", o.plan.deletes);
        assert!(rec.record().unwrap().pending_deletes.is_empty());
        assert_eq!(o.pruned, BTreeSet::from(["c".to_string()]));
        assert_eq!(rec.pruned(), &BTreeSet::from(["c".to_string()]));
        println!("pruned without writes: {:?}", o.pruned);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_cooldown_survives_a_lost_checkpoint_through_the_kernel() {
        let mut rec = reconciler(&[("a", 1), ("b", 2)]);
        rec.reconcile().await.unwrap();
        rec.on_event(SourceEvent::Delete("b".into()));
        rec.reconcile().await.unwrap();
        let freed: Vec<u16> = rec.kernel().freed.keys().copied().collect();
        assert_eq!(freed.len(), 1);
        // A restart without the checkpoint, on the same kernel: a newcomer must not get it.
        let kernel = std::mem::take(rec.kernel());
        let mut config = AgentConfig::new("local", "/nonexistent-state", "/nonexistent-bpffs");
        config.max_node_id = 2;
        let telemetry = Arc::new(Telemetry::new(Duration::MAX));
        let mut rec = Reconciler::new(config, None, kernel, telemetry);
        rec.on_event(SourceEvent::Init);
        rec.on_event(SourceEvent::InitApply(raw(
            "local",
            "10.0.0.100",
            "10.1.100.0/24",
        )));
        rec.on_event(SourceEvent::InitApply(raw("a", "10.0.0.1", "10.1.1.0/24")));
        rec.on_event(SourceEvent::InitApply(raw("z", "10.0.0.9", "10.1.9.0/24")));
        rec.on_event(SourceEvent::InitDone);
        let o = rec.reconcile().await.unwrap();
        assert!(
            o.plan
                .errors
                .iter()
                .any(|e| e.node == "z" && e.to_string().contains("cooling")),
            "{:?}",
            o.plan.errors
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_brake_window_survives_a_lost_checkpoint_through_the_kernel() {
        let nodes = ten();
        let mut rec = reconciler(&nodes);
        rec.reconcile().await.unwrap();
        // Four of ten go: within the ratio, and the kernel remembers it.
        for (n, _) in &nodes[..4] {
            rec.on_event(SourceEvent::Delete((*n).into()));
        }
        let o = rec.reconcile().await.unwrap();
        assert!(o.plan.brake.is_none() && o.pruned.len() == 4);
        let kept = rec.kernel().removals.clone().unwrap_or_default();
        assert_eq!(kept.iter().map(|r| r.nodes).sum::<u32>(), 4, "{kept:?}");
        // A restart without the checkpoint, on a kernel that remembers no freed ID either: two
        // more are six of ten within the window.
        let mut kernel = std::mem::take(rec.kernel());
        kernel.freed.clear();
        let mut rec = reconciler_with(config(), kernel, &nodes[6..]);
        let o = rec.reconcile().await.unwrap();
        let hold = o.plan.brake.as_ref().expect("held");
        assert_eq!(
            (hold.count.removed_nodes(), hold.count.known_nodes),
            (6, 10)
        );
        assert!(o.pruned.is_empty());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn force_prune_in_the_daemon_releases_the_first_plans_hold_only() {
        let nodes = ten();
        // Six of ten go while the agent is down: the restarted daemon holds them.
        let mut rec = reconciler(&nodes);
        rec.reconcile().await.unwrap();
        let record = rec.stamp_record().cloned();
        let kernel = std::mem::take(rec.kernel());
        let restart = |config: AgentConfig, kernel: FakeKernel| {
            let mut rec = restarted(config, record.clone(), kernel, &nodes[6..]);
            rec.confirm_by_relist(true);
            rec
        };
        let mut held = restart(config(), kernel);
        assert!(held.reconcile().await.unwrap().plan.brake.is_some());
        let kernel = std::mem::take(held.kernel());
        // Restarted with --force-prune: the first plan releases the six...
        let mut forced = config();
        forced.force_prune = true;
        let mut rec = restart(forced, kernel);
        let o = rec.reconcile().await.unwrap();
        assert!(o.plan.brake.is_none());
        assert_eq!(o.pruned.len(), 6);
        // ... and no later one: three of the four left go, held.
        for (n, _) in &nodes[6..9] {
            rec.on_event(SourceEvent::Delete((*n).into()));
        }
        let o = rec.reconcile().await.unwrap();
        assert!(
            o.plan.brake.is_some(),
            "three of four, held: {:?}",
            o.pruned
        );
        assert!(o.pruned.is_empty());
    }

    /// A relist reconciles while a hold waits for one: only a ratio hold whose confirm delay
    /// has passed. A hold no list confirms (a wipe's, or one not yet ripe) made every relist a
    /// plan of the whole cluster.
    #[tokio::test(flavor = "current_thread")]
    async fn only_a_ripe_ratio_hold_makes_a_relist_reconcile() {
        let nodes = ten();
        for (kept, kind) in [(1, HoldKind::Wipe), (4, HoldKind::Ratio)] {
            let mut rec = reconciler(&nodes);
            rec.confirm_by_relist(true);
            rec.reconcile().await.unwrap();
            relist(&mut rec, &nodes[..kept]);
            let o = rec.reconcile().await.unwrap();
            assert_eq!(o.plan.brake.as_ref().map(|b| b.kind), Some(kind));
            assert!(
                !relist(&mut rec, &nodes[..kept]),
                "{kind:?}: the same list again"
            );
        }
        // Ripe: with no confirm delay, the list after the hold's is the one it waits for.
        let mut ripe = config();
        ripe.prune_confirm_delay = Duration::ZERO;
        let mut rec = reconciler_with(ripe, FakeKernel::default(), &nodes);
        rec.confirm_by_relist(true);
        rec.reconcile().await.unwrap();
        relist(&mut rec, &nodes[..4]);
        assert!(rec.reconcile().await.unwrap().plan.brake.is_some());
        assert!(relist(&mut rec, &nodes[..4]), "a ripe hold's list");
    }

    fn keys(spis: &[u8], digest: u8) -> crate::agent::kernel::KeyRead {
        crate::agent::kernel::KeyRead {
            keys: spis
                .iter()
                .map(|spi| state::rotation::FileKey {
                    spi: *spi,
                    tag: state::objects::KeyTag(u64::from(*spi)),
                })
                .collect(),
            digest: [digest; 32],
            error: None,
            tags: Arc::new(state::plan::GlobalTags),
        }
    }

    fn count(rec: &mut Reconciler<FakeKernel>, kind: ObjectKind) -> usize {
        rec.kernel()
            .ours
            .values()
            .filter(|o| o.kind() == kind)
            .count()
    }

    fn sent_with(rec: &mut Reconciler<FakeKernel>) -> Vec<u8> {
        let mut spis: Vec<u8> = rec
            .kernel()
            .ours
            .values()
            .filter_map(|o| match o {
                KernelObject::PodCidrEntry(e) => Some(e.spi),
                _ => None,
            })
            .collect();
        spis.dedup();
        spis
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_appended_key_gets_states_at_once_and_a_replaced_file_switches_at_once() {
        let mut rec = reconciler(&[("a", 1), ("b", 2)]);
        rec.kernel().keys = Some(keys(&[3], 1));
        rec.reconcile().await.unwrap();
        assert_eq!(
            count(&mut rec, ObjectKind::XfrmState),
            4,
            "2 nodes, in and out"
        );
        assert_eq!(count(&mut rec, ObjectKind::PodCidrEntry), 2);
        assert_eq!(count(&mut rec, ObjectKind::XfrmGuard), 2, "IPv4 only");
        assert_eq!(sent_with(&mut rec), [3]);
        let seen = rec.record().unwrap().ipsec_keys.clone();
        assert_eq!(seen.iter().map(|k| k.spi).collect::<Vec<_>>(), [3]);
        assert_eq!(metric(&rec, "node_agent_ipsec_send_spi"), Some(3.0));

        // A line appended: the daemon's poll sees the change; both keys get states, the
        // traffic stays on 3 until the propagation delay has passed.
        rec.kernel().keys = Some(keys(&[3, 4], 2));
        assert!(rec.keys_changed());
        rec.reconcile().await.unwrap();
        assert_eq!(count(&mut rec, ObjectKind::XfrmState), 8);
        assert_eq!(sent_with(&mut rec), [3]);
        assert_eq!(metric(&rec, "node_agent_ipsec_keys_in_use"), Some(2.0));
        let next = rec.next_rotation_change().unwrap();
        let in_90s = rec.now() + Duration::from_secs(90);
        assert!(
            next <= in_90s && next + Duration::from_secs(5) > in_90s,
            "{next:?}"
        );
        assert!(!rec.keys_changed(), "nothing new in the file");

        // The file replaced by one new key: nothing to wait for, the old key is unusable.
        rec.kernel().keys = Some(keys(&[5], 3));
        rec.reconcile().await.unwrap();
        assert_eq!(sent_with(&mut rec), [5]);
        assert_eq!(count(&mut rec, ObjectKind::XfrmState), 4);
        assert_eq!(rec.next_rotation_change(), None);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_unusable_key_file_keeps_the_keys_and_says_so_in_readiness() {
        let mut rec = reconciler(&[("a", 1)]);
        rec.kernel().keys = Some(keys(&[3], 1));
        rec.reconcile().await.unwrap();
        let mut bad = keys(&[3], 1);
        bad.error = Some("IPsec key file /k line 2: SPI must be a decimal number 1..=15".into());
        rec.kernel().keys = Some(bad);
        assert!(rec.keys_changed(), "a file gone bad is news for readiness");
        let outcome = rec.reconcile().await.unwrap();
        assert!(outcome.plan.is_empty(), "nothing changes");
        assert_eq!(metric(&rec, "node_agent_ipsec_key_file_error"), Some(1.0));
        rec.telemetry.set_reconciled(Ok(()));
        let ready = rec.telemetry.ready().unwrap();
        assert!(
            ready.contains("IPsec key file unusable") && ready.contains("line 2"),
            "{ready}"
        );
        rec.kernel().keys = Some(keys(&[3], 1));
        rec.reconcile().await.unwrap();
        assert_eq!(metric(&rec, "node_agent_ipsec_key_file_error"), Some(0.0));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn turning_ipsec_off_removes_every_ipsec_object() {
        let mut rec = reconciler(&[("a", 1)]);
        rec.kernel().keys = Some(keys(&[3], 1));
        rec.reconcile().await.unwrap();
        rec.kernel().keys = None;
        rec.reconcile().await.unwrap();
        let kinds: BTreeSet<ObjectKind> = rec.kernel().ours.values().map(|o| o.kind()).collect();
        assert_eq!(
            kinds,
            BTreeSet::from([ObjectKind::MapEntry, ObjectKind::Route])
        );
        assert!(rec.record().unwrap().ipsec_keys.is_empty());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_map_that_would_be_full_grows_before_the_plan_is_applied() {
        let mut config = config();
        config.datapath.node_map_max = 4;
        let nodes = [
            ("n1", 1),
            ("n2", 2),
            ("n3", 3),
            ("n4", 4),
            ("n5", 5),
            ("n6", 6),
        ];
        let mut rec = reconciler_with(config, FakeKernel::default(), &nodes);
        let out = rec.reconcile().await.unwrap();
        assert_eq!(
            rec.kernel().grown,
            [8],
            "six entries do not fit 4, nor 3/4 of 4"
        );
        assert!(out.plan.errors.is_empty(), "{:?}", out.plan.errors);
        assert_eq!(count(&mut rec, ObjectKind::MapEntry), 6);
        assert_eq!(metric(&rec, "node_agent_node_map_fill_ratio"), Some(0.75));
        // Room enough now: the next reconcile grows nothing.
        rec.reconcile().await.unwrap();
        assert_eq!(rec.kernel().grown, [8]);
        // A seventh fits in 8 but fills more than 3/4 of it: the map grows, nothing was held,
        // and the plan made before the growth is applied. The next event is still planned
        // event-sized, under the grown capacity.
        rec.prepare_event_plans();
        rec.on_event(SourceEvent::Apply(raw("n7", "10.0.0.7", "10.1.7.0/24")));
        let out = rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().grown, [8, 16]);
        assert!(out.plan.errors.is_empty(), "{:?}", out.plan.errors);
        assert_eq!(count(&mut rec, ObjectKind::MapEntry), 7);
        rec.on_event(SourceEvent::Apply(raw("n8", "10.0.0.8", "10.1.8.0/24")));
        let out = rec.reconcile_event().await.unwrap();
        assert!(
            out.plan.scope.is_some(),
            "event-sized under the grown capacity"
        );
        assert_eq!(count(&mut rec, ObjectKind::MapEntry), 8);
    }

    #[test]
    fn maps_grow_past_three_quarters_by_doubling_and_never_past_the_largest() {
        let plan_with = |entries: usize| {
            let live = state::plan::LiveView {
                nodes: Vec::new(),
                synced: false,
                ..Default::default()
            };
            let inventory: Inventory = (1..=entries as u32)
                .map(|i| {
                    KernelObject::MapEntry(state::objects::MapEntry {
                        ip: std::net::IpAddr::from(i.to_be_bytes()),
                        node_id: state::objects::NodeId::new(1).unwrap(),
                        spi: 0,
                    })
                })
                .collect();
            let plan = state::plan::plan(&state::plan::PlanInput {
                record: None,
                live: &live,
                inventory: &inventory,
                allocator: &AllocatorState::default(),
                brake: &BrakeMemory::default(),
                confirmed_hold: None,
                now: Duration::from_secs(1),
                config: &PlanConfig::default(),
            });
            (plan, inventory)
        };
        let (p, inv) = plan_with(75);
        assert_eq!(map_growth(&p, &inv, 100), None, "three quarters is fine");
        let (p, inv) = plan_with(76);
        assert_eq!(map_growth(&p, &inv, 100), Some(200));
        let (p, inv) = plan_with(200);
        assert_eq!(
            map_growth(&p, &inv, 100),
            Some(400),
            "doubled until under 3/4"
        );
        let max = node_agent_common::MAX_NODE_MAP_MAX as usize;
        assert_eq!(map_growth(&p, &inv, max), None);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_event_reconcile_plans_from_the_last_result_and_a_failure_or_a_resync_dumps() {
        let mut rec = reconciler(&[("a", 1)]);
        rec.reconcile().await.unwrap();
        assert_eq!(rec.kernel().dumps, 1);
        rec.on_event(SourceEvent::Apply(raw("b", "10.0.0.2", "10.1.2.0/24")));
        rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().dumps, 1, "planned from the last result");
        assert_eq!(count(&mut rec, ObjectKind::Route), 2);
        // A failed operation leaves the view uncertain: the next event reconcile dumps.
        rec.kernel().faults.kinds = vec![ObjectKind::Route];
        rec.on_event(SourceEvent::Apply(raw("c", "10.0.0.3", "10.1.3.0/24")));
        let out = rec.reconcile_event().await.unwrap();
        assert_eq!((out.failed.len(), rec.kernel().dumps), (1, 1));
        rec.kernel().faults.kinds.clear();
        rec.on_event(SourceEvent::Delete("a".into()));
        rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().dumps, 2);
        assert_eq!(
            count(&mut rec, ObjectKind::Route),
            2,
            "c's route retried, a's gone"
        );
        // What changed behind the agent's back is found by the resync, which always dumps.
        rec.kernel()
            .ours
            .retain(|_, o| o.kind() != ObjectKind::Route);
        rec.on_event(SourceEvent::Apply(raw("d", "10.0.0.4", "10.1.4.0/24")));
        rec.reconcile_event().await.unwrap();
        assert_eq!(
            count(&mut rec, ObjectKind::Route),
            1,
            "only d's, until the resync"
        );
        rec.reconcile().await.unwrap();
        assert_eq!(rec.kernel().dumps, 3);
        assert_eq!(
            count(&mut rec, ObjectKind::Route),
            3,
            "the resync repaired b and c"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn after_a_settled_reconcile_an_event_is_planned_event_sized_and_the_record_follows() {
        let mut rec = reconciler(&[("a", 1), ("b", 2)]);
        let first = rec.reconcile().await.unwrap();
        assert!(first.plan.scope.is_none() && first.plan.settled);
        rec.on_event(SourceEvent::Apply(raw("c", "10.0.0.3", "10.1.3.0/24")));
        let out = rec.reconcile_event().await.unwrap();
        assert_eq!(out.plan.scope.as_deref(), Some(&["c".to_string()][..]));
        assert!(out.record_changed);
        // A conflict with an untouched node brings that node into the plan, and is reported.
        rec.on_event(SourceEvent::Apply(raw("d", "10.0.0.4", "10.1.1.0/24")));
        let out = rec.reconcile_event().await.unwrap();
        let scope = out.plan.scope.clone().expect("event-sized");
        assert_eq!(scope, ["d", "a"]);
        assert_eq!(out.plan.errors.len(), 1, "{:?}", out.plan.errors);
        assert!(!out.plan.settled);
        assert_eq!(out.plan.steady, Some(vec!["d".to_string()]));
        // With the conflict standing, the next event is planned event-sized with the held node
        // (and what it conflicts with) beside it: the conflict is reported again.
        rec.on_event(SourceEvent::Apply(raw("e", "10.0.0.5", "10.1.5.0/24")));
        let out = rec.reconcile_event().await.unwrap();
        let scope = out.plan.scope.clone().expect("event-sized");
        assert_eq!(scope, ["d", "e", "a"]);
        assert_eq!(out.plan.errors.len(), 1, "{:?}", out.plan.errors);
        let names: Vec<&str> = rec
            .record()
            .unwrap()
            .nodes
            .iter()
            .map(|n| n.name.as_str())
            .collect();
        assert_eq!(names, ["a", "b", "c", "e"], "d is held and has no record");
        // The record the event-sized plans left is the one a full plan makes.
        let full = rec.plan().await.unwrap();
        assert!(full.is_empty());
        assert!(rec.record().unwrap().same_content(&full.checkpoint));
        assert_eq!(count(&mut rec, ObjectKind::Route), 4);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_claim_index_follows_the_record_across_event_sized_plans_and_goes_with_a_full_one()
    {
        // Through nexthops, a readdressed node's routes stay as they are: its event stays
        // event-sized.
        let kernel = FakeKernel {
            nexthops: true,
            ..FakeKernel::default()
        };
        let mut rec = reconciler_with(config(), kernel, &[("a", 1), ("b", 2), ("c", 3)]);
        rec.reconcile().await.unwrap();
        assert!(
            rec.claims.is_none(),
            "built when an event needs it, or by the daemon"
        );
        rec.prepare_event_plans();
        let events = [
            SourceEvent::Apply(raw("d", "10.0.0.4", "10.1.4.0/24")),
            SourceEvent::Apply(raw("b", "10.0.0.12", "10.1.2.0/24")),
            SourceEvent::Delete("a".into()),
        ];
        for ev in events {
            rec.on_event(ev);
            let out = rec.reconcile_event().await.unwrap();
            assert!(out.plan.scope.is_some() && out.plan.settled);
            let record = rec.record().unwrap();
            assert_eq!(rec.claims.as_ref(), Some(&ClaimIndex::of(record)));
        }
        rec.reconcile().await.unwrap();
        assert!(rec.claims.is_none(), "a full plan replaced the record");
    }

    /// A readdressed node's routes move to its new nexthop by replace, which matches the
    /// destination whoever's route is there: from the last reconcile's view only while the
    /// kernel says no one else changed a route at those destinations since the last dump, else
    /// from a fresh dump.
    #[tokio::test(flavor = "current_thread")]
    async fn a_readdress_replaces_routes_from_the_last_view_only_while_no_one_else_changed_one_there()
     {
        let kernel = FakeKernel {
            nexthops: true,
            ..FakeKernel::default()
        };
        let mut rec = reconciler_with(config(), kernel, &[("a", 1), ("b", 2)]);
        rec.reconcile().await.unwrap();
        // Someone else changed a route at a destination that is none of ours: no matter.
        let elsewhere: ipnet::IpNet = "192.168.50.0/24".parse().unwrap();
        rec.kernel().routes_touched.push(elsewhere);
        rec.on_event(SourceEvent::Apply(raw("a", "10.0.0.11", "10.1.1.0/24")));
        let out = rec.reconcile_event().await.unwrap();
        assert!(out.plan.scope.is_some() && out.plan.settled);
        assert_eq!(rec.kernel().dumps, 1, "planned from the last view");
        assert!(
            out.plan
                .ops()
                .iter()
                .any(|op| matches!(op, Op::Replace(KernelObject::Route(_)))),
            "the route moved to the new nexthop: {:?}",
            out.plan.ops()
        );
        // Someone else's route took b's destination since: the view no longer holds.
        let dst: ipnet::IpNet = "10.1.2.0/24".parse().unwrap();
        let theirs = ObjectId::Route { dst, metric: 0 };
        rec.kernel().ours.remove(&theirs);
        rec.kernel()
            .foreign
            .insert(theirs.clone(), "route 10.1.2.0/24 proto static".into());
        rec.kernel().routes_touched.push(dst);
        rec.on_event(SourceEvent::Apply(raw("b", "10.0.0.12", "10.1.2.0/24")));
        let out = rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().dumps, 2, "made again from a dump");
        assert!(out.plan.scope.is_none());
        assert!(
            !out.plan.ops().iter().any(|op| op.object().id() == theirs),
            "theirs is left alone: {:?}",
            out.plan.ops()
        );
        assert!(
            out.plan.errors.iter().any(|e| e.node == "b"),
            "and reported: {:?}",
            out.plan.errors
        );
    }

    /// A fresh dump is checked too: a route someone else changed at a destination the plan
    /// replaces while the dump was read means a dump again; if it keeps changing, that route
    /// is not replaced (a failed operation, retried with backoff), and the rest goes ahead.
    #[tokio::test(flavor = "current_thread")]
    async fn a_route_changed_while_the_kernel_was_dumped_is_never_replaced_from_that_dump() {
        let kernel = FakeKernel {
            nexthops: true,
            ..FakeKernel::default()
        };
        let mut rec = reconciler_with(config(), kernel, &[("a", 1), ("b", 2)]);
        rec.reconcile().await.unwrap();
        let dst: ipnet::IpNet = "10.1.1.0/24".parse().unwrap();
        rec.kernel().touched_during_dumps = vec![vec![dst]];
        rec.on_event(SourceEvent::Apply(raw("a", "10.0.0.11", "10.1.1.0/24")));
        let out = rec.reconcile().await.unwrap();
        assert_eq!(
            rec.kernel().dumps,
            3,
            "dumped again once the first was in doubt"
        );
        assert!(
            out.plan
                .ops()
                .iter()
                .any(|op| matches!(op, Op::Replace(KernelObject::Route(r)) if r.dst == dst)),
            "{:?}",
            out.plan.ops()
        );

        rec.kernel().touched_during_dumps = vec![vec![dst]; 3];
        rec.on_event(SourceEvent::Apply(raw("a", "10.0.0.21", "10.1.1.0/24")));
        rec.on_event(SourceEvent::Apply(raw("c", "10.0.0.3", "10.1.3.0/24")));
        let before = rec.kernel().applied.len();
        let out = rec.reconcile().await.unwrap();
        assert_eq!(rec.kernel().dumps, 6, "one dump and two more, then no more");
        let contested = out
            .failed
            .iter()
            .filter(|f| matches!(f.result, Err(crate::backends::OpError::RouteContested(at)) if at == dst))
            .count();
        assert_eq!(contested, 1, "{:?}", out.failed);
        assert!(
            !rec.kernel().applied[before..].iter().any(
                |op| matches!(op, Op::Replace(KernelObject::Route(r)) if r.dst == dst)
                    || matches!(op, Op::Delete(KernelObject::Nexthop(_)))
            ),
            "neither the route nor the nexthop it may still use is touched"
        );
        let routed =
            rec.kernel().ours.keys().any(
                |k| matches!(k, ObjectId::Route { dst, .. } if dst.to_string() == "10.1.3.0/24"),
            );
        assert!(routed, "the rest of the plan went ahead");
    }

    /// A route through a nexthop the plan did not write goes only through one that is ours
    /// now: someone may have put theirs at its ID since the view was read, and the kernel
    /// routes by ID alone.
    #[tokio::test(flavor = "current_thread")]
    async fn a_route_never_goes_through_a_nexthop_someone_took_since_the_view() {
        let kernel = FakeKernel {
            nexthops: true,
            ..FakeKernel::default()
        };
        let mut rec = reconciler_with(config(), kernel, &[("a", 1), ("b", 2)]);
        rec.reconcile().await.unwrap();
        let taken = ObjectId::Nexthop {
            id: state::objects::NexthopId(201_400_001),
        };
        assert!(rec.kernel().ours.remove(&taken).is_some());
        rec.kernel()
            .foreign
            .insert(taken.clone(), "nexthop 201400001 proto static".into());
        // a's pod CIDR moves: a new route through its nexthop, which the view holds as ours.
        rec.on_event(SourceEvent::Apply(raw("a", "10.0.0.1", "10.1.9.0/24")));
        let out = rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().dumps, 1, "planned from the last view");
        assert!(
            matches!(&out.failed[..], [f] if f.op.object().to_string().contains("10.1.9.0/24")
                && f.result.as_ref().is_err_and(|e| e.to_string().contains("proto static"))),
            "{:?}",
            out.failed
        );
        let routed =
            rec.kernel().ours.keys().any(
                |k| matches!(k, ObjectId::Route { dst, .. } if dst.to_string() == "10.1.9.0/24"),
            );
        assert!(!routed, "no route through their nexthop");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_event_plan_never_deletes_a_nexthop_a_route_came_to_use_since_the_last_dump() {
        let kernel = FakeKernel {
            nexthops: true,
            ..FakeKernel::default()
        };
        let nodes = [("n1", 1), ("n2", 2), ("n3", 3), ("n4", 4)];
        let mut rec = reconciler_with(config(), kernel, &nodes);
        rec.reconcile().await.unwrap();
        assert_eq!(count(&mut rec, ObjectKind::Nexthop), 4);
        rec.on_event(SourceEvent::Delete("n4".into()));
        rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().dumps, 1, "a removal needs no dump");
        assert_eq!(count(&mut rec, ObjectKind::Nexthop), 3);
        // A foreign route came to use n1's nexthop since the last dump.
        let n1 = ObjectId::Nexthop {
            id: state::objects::NexthopId(201_400_001),
        };
        rec.kernel()
            .used_by
            .insert(n1.clone(), "route 192.168.7.0/24 table 100".into());
        rec.on_event(SourceEvent::Delete("n1".into()));
        let out = rec.reconcile_event().await.unwrap();
        assert!(
            matches!(&out.failed[..], [f] if matches!(f.result, Err(crate::backends::OpError::InUse { .. }))),
            "{:?}",
            out.failed
        );
        assert!(
            rec.kernel().ours.contains_key(&n1),
            "kept for the route that uses it"
        );
        // The failure makes the next reconcile dump, see the user and report it.
        let out = rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().dumps, 2);
        assert!(rec.kernel().ours.contains_key(&n1));
        assert!(
            out.plan.errors.iter().any(|e| e.node == "n1"),
            "{:?}",
            out.plan.errors
        );
    }
}

//! The reconciler: the single owner of every kernel mutation.
//!
//! Each reconcile dumps what the kernel really holds (by owner mark), asks the planner what to
//! delete and add given the last known checkpoint and the live view, applies the plan, and keeps
//! the checkpoint that the outcome implies (failed cleanups stay pending deletes). Because one
//! task does all of it, a prune and a concurrent re-add of the same node can never interleave.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use state::checkpoint::{self, Checkpoint, CheckpointStore, LoadOutcome, StoreError};
use state::ids::AllocatorState;
use state::node::AddressKind;
use state::objects::{KernelObject, ObjectId, ObjectKind, Op};
use state::plan::{DeleteReason, IpsecConfig, Plan, PlanConfig, PlanInput};

use super::config::AgentConfig;
use crate::backends::map::MapBackend;
use crate::backends::routes::RouteBackend;
use crate::backends::xfrm::XfrmBackend;
use crate::backends::{Backends, DumpError, OpError};
use crate::datapath::{Datapath, DatapathError, node_ids_pin};
use crate::ipsec_key::KeyFile;
use crate::node_map::NodeMapError;
use crate::source::SourceEvent;
use crate::source::live::LiveState;
use crate::telemetry::Telemetry;
use crate::telemetry::metrics::{KindLabel, OpLabels, ResultLabel, StateLabel};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Invariant 11: one agent per node. The message names the holder's PID.
    #[error("node-agent is already running: {0}")]
    AlreadyRunning(StoreError),
    #[error(transparent)]
    Store(StoreError),
    #[error("reading checkpoint {path} (read-only): {source}")]
    ReadCheckpoint {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error(transparent)]
    NodeMap(Box<NodeMapError>),
    #[error("opening the routing netlink socket: {0}")]
    Netlink(std::io::Error),
    #[error("kernel inventory: {0}")]
    Dump(#[from] DumpError),
    #[error("removing invalid node-ID map entries: {0}")]
    Purge(Box<NodeMapError>),
    #[error("the node source did not complete a full list within {0:?}")]
    SyncTimeout(Duration),
    #[error("the node source ended before completing a full list")]
    SourceEnded,
    #[error("installing the signal handlers: {0}")]
    Signal(std::io::Error),
    #[error(transparent)]
    IpsecKey(#[from] crate::ipsec_key::KeyError),
    #[error("opening the xfrm netlink socket: {0}")]
    XfrmSocket(std::io::Error),
    /// IPsec is configured but the kernel cannot create ESP states: a start-up error, since
    /// running without the encryption the operator asked for is worse than not running.
    #[error(transparent)]
    Esp(#[from] crate::backends::xfrm::ProbeError),
}

/// One operation that failed, with the node it was for.
#[derive(Debug)]
pub struct FailedOp {
    pub op: Op,
    pub node: Option<String>,
    pub error: OpError,
}

/// What one reconcile did.
#[derive(Debug)]
pub struct Outcome {
    pub plan: Plan,
    /// Kernel mutations performed (successful operations).
    pub writes: usize,
    pub failed: Vec<FailedOp>,
    /// Stale nodes whose every delete succeeded in this reconcile.
    pub pruned: BTreeSet<String>,
}

/// A brake hold being watched for confirmation.
#[derive(Debug)]
struct BrakeWatch {
    since: Instant,
    /// Full lists completed when the hold began; confirmation needs a newer one.
    relists: u64,
    nodes: Vec<String>,
    /// The last plan that saw this hold.
    checked: Instant,
}

/// Shortest wait between two brake re-checks once the confirm delay has passed.
const BRAKE_RECHECK: Duration = Duration::from_millis(250);

pub struct Reconciler {
    config: AgentConfig,
    plan_config: PlanConfig,
    /// `None` in dry-run: nothing is locked and nothing is written.
    store: Option<CheckpointStore>,
    /// The restored checkpoint at first, then the one implied by the last reconcile.
    known: Option<Checkpoint>,
    restored_nodes: usize,
    ids: AllocatorState,
    live: LiveState,
    backends: Backends,
    _datapath: Option<Datapath>,
    brake: Option<BrakeWatch>,
    dirty: bool,
    last_write: Option<Instant>,
    total_writes: usize,
    pruned: BTreeSet<String>,
    telemetry: Arc<Telemetry>,
}

impl From<StoreError> for AgentError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::AlreadyRunning { .. } => Self::AlreadyRunning(e),
            other => Self::Store(other),
        }
    }
}

impl From<NodeMapError> for AgentError {
    fn from(e: NodeMapError) -> Self {
        Self::NodeMap(Box::new(e))
    }
}

fn now_since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

impl Reconciler {
    /// Start-up steps 1-3: lock the state dir, load the checkpoint (moving a corrupt one aside),
    /// open the pinned maps (loading and attaching the datapath). With `dry_run` nothing is
    /// locked, created, attached or written: the checkpoint is read as it is and the maps only
    /// if they already exist.
    pub async fn start(
        config: AgentConfig,
        dry_run: bool,
        telemetry: Arc<Telemetry>,
    ) -> Result<Self, AgentError> {
        let (store, restored) = if dry_run {
            (None, read_checkpoint(&config.state_dir)?)
        } else {
            let store = CheckpointStore::open(&config.state_dir)?;
            let restored = match store.load()? {
                LoadOutcome::Loaded(cp) => Some(cp),
                LoadOutcome::NotFound => {
                    tracing::info!(path = %store.path().display(), "no checkpoint: first start or lost; the kernel sweep alone decides what is ours");
                    None
                }
                LoadOutcome::MovedAside { reason, moved_to } => {
                    tracing::error!(%reason, moved_to = %moved_to.display(), "checkpoint unreadable, moved aside; continuing on the kernel sweep alone");
                    None
                }
            };
            (Some(store), restored)
        };

        let pin = node_ids_pin(&config.datapath.bpffs);
        let (datapath, map) = if dry_run {
            let map = if pin.exists() {
                Some(MapBackend::open(&pin, config.datapath.node_map_max)?)
            } else {
                None
            };
            (None, map)
        } else {
            let dp = Datapath::load(&config.datapath)?;
            (
                Some(dp),
                Some(MapBackend::open(&pin, config.datapath.node_map_max)?),
            )
        };
        let routes = RouteBackend::new(config.route_protocol, config.route_table)
            .map_err(AgentError::Netlink)?;
        let (xfrm, ipsec) = match &config.ipsec_key_file {
            None => (None, None),
            Some(path) => {
                let file = KeyFile::load(path)?;
                let spi = file.key.spi();
                let backend = XfrmBackend::new(Some(file.key)).map_err(AgentError::XfrmSocket)?;
                if !dry_run {
                    backend.probe_esp().await?;
                }
                (Some(backend), Some(IpsecConfig { spi }))
            }
        };

        let plan_config = PlanConfig {
            local_node: config.node_name.clone(),
            local_addresses: Vec::new(),
            ipsec,
            max_prune_ratio: config.max_prune_ratio,
            force_prune: config.force_prune,
            map_capacity: config.datapath.node_map_max as usize,
            id_cooldown: config.id_cooldown,
            include_external_ips: config.include_external_ips,
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        };
        let restored_nodes = restored.as_ref().map_or(0, |cp| cp.records().count());
        let ids = restored
            .as_ref()
            .map(|cp| cp.ids.clone())
            .unwrap_or_default();
        Ok(Self {
            config,
            plan_config,
            store,
            known: restored,
            restored_nodes,
            ids,
            live: LiveState::default(),
            backends: Backends {
                map,
                routes: Some(routes),
                xfrm,
            },
            _datapath: datapath,
            brake: None,
            dirty: false,
            last_write: None,
            total_writes: 0,
            pruned: BTreeSet::new(),
            telemetry,
        })
    }

    pub fn config(&self) -> &AgentConfig {
        &self.config
    }

    pub fn live(&self) -> &LiveState {
        &self.live
    }

    /// Folds a source event into the live view; `true` if a reconcile is due.
    pub fn on_event(&mut self, event: SourceEvent) -> bool {
        let m = &self.telemetry.metrics;
        if matches!(event, SourceEvent::Error(_)) {
            m.source_errors.inc();
        }
        let relists = self.live.relists();
        let due = self.live.apply(event) && self.live.synced();
        if self.live.relists() > relists {
            m.source_relists.inc();
        }
        m.source_synced.set(i64::from(self.live.synced()));
        due
    }

    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.telemetry
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

    /// Whether a held brake has been confirmed: held for at least the confirm delay, and a full
    /// list completed since it began still asks for the same deletions.
    fn brake_confirmed(&self) -> bool {
        self.brake.as_ref().is_some_and(|w| {
            w.since.elapsed() >= self.config.prune_confirm_delay && self.live.relists() > w.relists
        })
    }

    /// When a held brake could next be confirmed, for the daemon's timer.
    pub fn brake_recheck_at(&self) -> Option<Instant> {
        self.brake
            .as_ref()
            .map(|w| (w.since + self.config.prune_confirm_delay).max(w.checked + BRAKE_RECHECK))
    }

    fn local_addresses(&self) -> Vec<IpAddr> {
        self.live
            .get(&self.config.node_name)
            .map_or_else(Vec::new, |n| {
                n.addresses
                    .iter()
                    .filter(|a| a.kind == AddressKind::InternalIP)
                    .map(|a| a.ip)
                    .collect()
            })
    }

    /// Plans against the kernel as it is now, without changing anything.
    pub async fn plan(&mut self) -> Result<Plan, AgentError> {
        let (plan, inventory) = self.plan_with_inventory().await?;
        self.record_objects(inventory.iter().map(|o| (o.id(), o.kind())).collect());
        Ok(plan)
    }

    async fn plan_with_inventory(&mut self) -> Result<(Plan, Vec<KernelObject>), AgentError> {
        let inventory = self.backends.dump().await?;
        let view = self.live.view();
        let mut config = self.plan_config.clone();
        config.local_addresses = self.local_addresses();
        let confirmed = self.brake_confirmed();
        if confirmed {
            tracing::warn!(
                "brake confirmed by a fresh full list after the confirm delay; deleting the held nodes"
            );
            config.force_prune = true;
        }
        let input = PlanInput {
            restored: self.known.as_ref(),
            live: &view,
            inventory: &inventory,
            allocator: &self.ids,
            now: now_since_epoch(),
            config: &config,
        };
        let plan = state::plan::plan(&input);
        self.watch_brake(&plan);
        Ok((plan, inventory))
    }

    /// Sets the kernel-object gauges from the objects (by identity) the kernel holds.
    fn record_objects(&self, objects: HashMap<ObjectId, ObjectKind>) {
        let m = &self.telemetry.metrics;
        let mut by_kind: BTreeMap<&'static str, i64> =
            ["map_entry", "route", "xfrm_state", "xfrm_policy"]
                .into_iter()
                .map(|k| (k, 0))
                .collect();
        for kind in objects.values() {
            *by_kind.entry(kind_name(*kind)).or_default() += 1;
        }
        for (kind, n) in &by_kind {
            m.kernel_objects
                .get_or_create(&KindLabel {
                    kind: (*kind).into(),
                })
                .set(*n);
        }
        let capacity = f64::from(self.config.datapath.node_map_max.max(1));
        m.node_map_fill_ratio
            .set(by_kind["map_entry"] as f64 / capacity);
    }

    fn watch_brake(&mut self, plan: &Plan) {
        match &plan.brake {
            None => self.brake = None,
            Some(hold) => {
                if let Some(w) = self.brake.as_mut().filter(|w| w.nodes == hold.nodes) {
                    w.checked = Instant::now();
                } else {
                    tracing::error!(nodes = ?hold.nodes, "{hold}");
                    self.brake = Some(BrakeWatch {
                        since: Instant::now(),
                        relists: self.live.relists(),
                        nodes: hold.nodes.clone(),
                        checked: Instant::now(),
                    });
                }
            }
        }
    }

    /// Plans and applies once. The checkpoint the outcome implies becomes the known state and is
    /// marked for writing.
    pub async fn reconcile(&mut self) -> Result<Outcome, AgentError> {
        let started = Instant::now();
        let (plan, inventory) = self.plan_with_inventory().await?;
        // What the kernel holds once the successful ops are in, for the gauges.
        let mut objects: HashMap<ObjectId, ObjectKind> =
            inventory.iter().map(|o| (o.id(), o.kind())).collect();
        if let Some(map) = &mut self.backends.map
            && !map.invalid().is_empty()
        {
            let n = map
                .purge_invalid()
                .map_err(|e| AgentError::Purge(Box::new(e)))?;
            self.total_writes += n;
        }
        for e in &plan.errors {
            tracing::warn!(node = %e.node, "skipping: {}", e.problem);
        }
        for (node, e) in self.live.errors() {
            tracing::warn!(%node, "malformed node: {e}");
        }
        let ops = plan.ops();
        let results = self.backends.apply(&ops).await;
        let mut failed = Vec::new();
        let mut writes = 0;
        let m = &self.telemetry.metrics;
        for (op, result) in ops.into_iter().zip(results) {
            m.operations
                .get_or_create(&OpLabels {
                    kind: kind_name(op.object().kind()).into(),
                    op: if matches!(op, Op::Upsert(_)) {
                        "upsert"
                    } else {
                        "delete"
                    }
                    .into(),
                    result: if result.is_ok() { "ok" } else { "error" }.into(),
                })
                .inc();
            match result {
                Ok(()) => {
                    writes += 1;
                    match &op {
                        Op::Upsert(o) => objects.insert(o.id(), o.kind()),
                        Op::Delete(o) => objects.remove(&o.id()),
                    };
                }
                Err(error) => {
                    let node = node_of(&plan, &op.object().id());
                    tracing::error!(node = node.as_deref().unwrap_or("-"), "{error}");
                    failed.push(FailedOp { op, node, error });
                }
            }
        }
        let failed_ops: Vec<Op> = failed.iter().map(|f| f.op.clone()).collect();
        let failed_nodes: BTreeSet<&str> =
            failed.iter().filter_map(|f| f.node.as_deref()).collect();
        let pruned: BTreeSet<String> = plan
            .deletes
            .iter()
            .filter(|d| d.reason == DeleteReason::StaleNode)
            .filter_map(|d| d.node.clone())
            .filter(|n| !failed_nodes.contains(n.as_str()))
            .collect();
        for d in &plan.deletes {
            tracing::info!(node = d.node.as_deref().unwrap_or("-"), reason = %d.reason, "deleted {}", super::report::describe(&d.object));
        }
        let cp = plan.checkpoint_after(&failed_ops);
        m.nodes
            .get_or_create(&StateLabel {
                state: "live".into(),
            })
            .set(cp.nodes.len() as i64);
        m.nodes
            .get_or_create(&StateLabel {
                state: "pending_delete".into(),
            })
            .set(cp.pending_deletes.len() as i64);
        m.brake_held.set(i64::from(plan.brake.is_some()));
        m.node_input_errors
            .set((plan.errors.len() + self.live.errors().len()) as i64);
        m.reconcile_duration
            .observe(started.elapsed().as_secs_f64());
        self.record_objects(objects);
        self.ids = cp.ids.clone();
        self.known = Some(cp);
        self.dirty = true;
        self.total_writes += writes;
        self.pruned.extend(pruned.iter().cloned());
        tracing::info!(
            writes,
            failed = failed.len(),
            deletes = plan.deletes.len(),
            upserts = plan.upserts.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "reconciled"
        );
        Ok(Outcome {
            plan,
            writes,
            failed,
            pruned,
        })
    }

    /// Writes the checkpoint if it changed, at most once per checkpoint interval unless `force`.
    pub fn flush_checkpoint(&mut self, force: bool) -> Result<(), AgentError> {
        let (Some(store), Some(cp)) = (&self.store, &mut self.known) else {
            return Ok(());
        };
        if !self.dirty {
            return Ok(());
        }
        if !force
            && self
                .last_write
                .is_some_and(|t| t.elapsed() < self.config.checkpoint_interval)
        {
            return Ok(());
        }
        cp.written_at = now_since_epoch();
        let written = store.write(cp);
        let result = if written.is_ok() { "ok" } else { "error" };
        self.telemetry
            .metrics
            .checkpoint_writes
            .get_or_create(&ResultLabel {
                result: result.into(),
            })
            .inc();
        written?;
        self.dirty = false;
        self.last_write = Some(Instant::now());
        Ok(())
    }

    /// When a coalesced checkpoint write is due, if one is pending.
    pub fn checkpoint_due_at(&self) -> Option<Instant> {
        self.dirty.then(|| {
            self.last_write
                .map_or_else(Instant::now, |t| t + self.config.checkpoint_interval)
        })
    }
}

fn kind_name(kind: ObjectKind) -> &'static str {
    match kind {
        ObjectKind::MapEntry => "map_entry",
        ObjectKind::Route => "route",
        ObjectKind::XfrmState => "xfrm_state",
        ObjectKind::XfrmPolicy => "xfrm_policy",
    }
}

/// The node an operation was planned for.
fn node_of(plan: &Plan, id: &ObjectId) -> Option<String> {
    plan.deletes
        .iter()
        .find(|d| &d.object.id() == id)
        .and_then(|d| d.node.clone())
        .or_else(|| {
            plan.upserts
                .iter()
                .find(|u| &u.object.id() == id)
                .map(|u| u.node.clone())
        })
}

/// The checkpoint as it is on disk, without taking the lock (for dry runs and `plan`).
fn read_checkpoint(dir: &std::path::Path) -> Result<Option<Checkpoint>, AgentError> {
    let path = dir.join("nodes.ckpt");
    match std::fs::read(&path) {
        Ok(bytes) => match checkpoint::decode(&bytes) {
            Ok(cp) => Ok(Some(cp)),
            Err(e) => {
                tracing::warn!(path = %path.display(), "checkpoint unreadable ({e}); planning on the kernel sweep alone");
                Ok(None)
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(AgentError::ReadCheckpoint { path, source }),
    }
}

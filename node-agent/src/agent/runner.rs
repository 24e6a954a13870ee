//! Driving the reconciler: the daemon loop, and the one-shot run.
//!
//! The daemon does what its [`Schedule`] says is due and sleeps until the next deadline: a
//! reconcile after source changes (debounced), at the resync interval, or on a backoff after a
//! failure; a checkpoint write when the record changed (coalesced, and on a backoff while the
//! state directory cannot be written); a request for a fresh list when a held brake is ripe.
//! Nothing polls: waiting for a confirmation, for an API server, for disk space costs one
//! heartbeat every few seconds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::mpsc;
use tokio::time::sleep_until;

use super::checkpointer::Checkpointer;
use super::config::AgentConfig;
use super::deadline::Deadline;
use super::intake::Intake;
use super::reconciler::{Outcome, Reconciler};
use super::report::{self, RunReport};
use super::schedule::{HEARTBEAT, Reconciled, Schedule};
use super::{AgentError, hold_file};
use crate::backends::Backends;
use crate::datapath::link_watch::LinkWatch;
use crate::kernel::Kernel;
use crate::source::{SourceEvent, SourceRequest};
use crate::telemetry::Telemetry;

/// How a run ended, as the process exit status: 0 converged, 3 brake held, 1 failed ops remain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitStatus {
    Converged,
    BrakeHeld,
    Failed,
}

impl ExitStatus {
    pub fn code(self) -> u8 {
        match self {
            Self::Converged => 0,
            Self::Failed => 1,
            Self::BrakeHeld => 3,
        }
    }
}

/// How often "still waiting for sync" is logged.
const WAIT_LOG_EVERY: Duration = Duration::from_secs(10);
/// Passes `--once` makes before it settles for what failed.
const ONCE_MAX_PASSES: usize = 5;
/// How often the daemon looks at the IPsec key file (a small read; a Secret volume changes by an
/// atomic symlink swap, so the next read sees the whole new file).
const KEY_FILE_POLL: Duration = Duration::from_secs(2);

/// How old the dump taken while the source synced may be when the sync completes, for the first
/// reconcile to start from it. Its plan misses what changed in the kernel since (creates stay
/// exclusive and deletes carry our markers, so it cannot touch what is not ours, but a
/// repair would wait for the next resync); a sync slower than this already dominates the start,
/// and a fresh dump is then the smaller cost.
const EARLY_DUMP_MAX_AGE: Duration = Duration::from_secs(5);

/// How the wait for the first full list may end early.
struct SyncWait {
    /// A one-shot run's deadline, told what the wait is waiting on.
    deadline: Option<Deadline>,
    /// A source error before sync ends the wait (a one-shot run on a file that does not parse:
    /// no list can come until someone edits it).
    fail_on_error: bool,
}

/// Start-up step: feeds events in until the source completes its first full list, and dumps
/// the kernel meanwhile for the first reconcile. At 65,000 nodes the list takes about half a
/// second to arrive and the dump a second; one after the other, they were most of a restart.
/// A dump that fails is not kept, nor one that the sync outlasted by more than
/// [`EARLY_DUMP_MAX_AGE`]: the first reconcile then dumps again (and reports a failure).
async fn sync_and_dump<K: Kernel>(
    rec: &mut Reconciler<K>,
    rx: &mut mpsc::Receiver<SourceEvent>,
    wait: SyncWait,
) -> Result<(), AgentError> {
    let (kernel, mut intake) = rec.sync_parts();
    // Tokio's clock, which the tests can pause.
    let dump = async { (kernel.dump().await, tokio::time::Instant::now()) };
    let (synced, (dumped, at)) = tokio::join!(wait_for_sync(&mut intake, rx, wait), dump);
    synced?;
    match dumped {
        Ok(inventory) if at.elapsed() <= EARLY_DUMP_MAX_AGE => rec.keep_early_dump(inventory),
        Ok(_) => tracing::debug!("the source synced long after the dump taken meanwhile"),
        Err(e) => tracing::debug!("the dump taken while syncing failed: {e}"),
    }
    Ok(())
}

/// Feeds events in until the source completes its first full list.
async fn wait_for_sync(
    intake: &mut Intake<'_>,
    rx: &mut mpsc::Receiver<SourceEvent>,
    wait: SyncWait,
) -> Result<(), AgentError> {
    let started = Instant::now();
    let mut next_log = started + WAIT_LOG_EVERY;
    while !intake.live().synced() {
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(SourceEvent::Error(e)) if wait.fail_on_error => {
                    return Err(AgentError::SourceUnusable(e));
                }
                Some(ev) => { intake.take(ev); }
                None => return Err(AgentError::SourceEnded),
            },
            () = sleep_until(next_log.into()) => {
                let last_error = intake.live().last_error().unwrap_or("-");
                tracing::info!(waited_s = started.elapsed().as_secs(), last_error, "still waiting for the node source to sync; nothing is pruned before it does");
                if let Some(d) = &wait.deadline {
                    d.waiting_for(format!("the node source's first full list (last error: {last_error})"));
                }
                next_log = Instant::now() + WAIT_LOG_EVERY;
            }
        }
    }
    // Take in whatever else already arrived, so the first plan sees it.
    while let Ok(ev) = rx.try_recv() {
        intake.take(ev);
    }
    Ok(())
}

/// What `run --once` (and `--dry-run`, `node-agent plan`) produced.
pub struct OnceResult {
    pub status: ExitStatus,
    pub report: RunReport,
    /// The plan, for a dry run.
    pub plan: Option<report::PlanReport>,
}

/// `--once` and `--dry-run`: sync, reconcile to convergence (or only plan), write the
/// checkpoint, report. `file_source` makes a source error before sync fatal. `deadline` was
/// started before the source was (building a Kubernetes client reads files too), and bounds
/// every wait up to the first full list.
pub async fn run_once(
    config: AgentConfig,
    dry_run: bool,
    file_source: bool,
    mut rx: mpsc::Receiver<SourceEvent>,
    deadline: Deadline,
) -> Result<OnceResult, AgentError> {
    deadline.waiting_for(format!(
        "the lock and checkpoint of {}",
        config.state_dir.display()
    ));
    let telemetry = Arc::new(Telemetry::new(Duration::MAX));
    let (mut checkpointer, record) = Checkpointer::open(&config.state_dir, dry_run)?;
    checkpointer.lock_pins(&config.datapath.bpffs)?;
    deadline.waiting_for("the kernel's objects (the datapath's pins, netlink)");
    let backends = Backends::open(&config.backends(), dry_run).await?;
    let mut rec = Reconciler::new(config, record, backends, telemetry);
    deadline.waiting_for("the node source's first full list");
    let wait = SyncWait {
        deadline: Some(deadline.clone()),
        fail_on_error: file_source,
    };
    sync_and_dump(&mut rec, &mut rx, wait).await?;
    deadline.met();
    crate::runtime::memory::give_back();
    if dry_run {
        let plan = rec.plan().await?;
        let plan_report = report::plan_report(&plan, rec.live());
        let status = if plan.brake.is_some() {
            ExitStatus::BrakeHeld
        } else {
            ExitStatus::Converged
        };
        return Ok(OnceResult {
            status,
            report: rec.report(&plan, &[]),
            plan: Some(plan_report),
        });
    }
    let mut last: Option<Outcome> = None;
    for _ in 0..ONCE_MAX_PASSES {
        let clean = last.as_ref().is_some_and(|o| o.failed.is_empty());
        // The last pass's plan goes before the next is made: at scale, two at once would be
        // the run's peak memory.
        drop(last.take());
        crate::runtime::memory::give_back();
        // A pass after one that applied without a failure (nodes that waited for an ID that
        // pass freed) plans against the view it left: its dump plus its writes, milliseconds
        // old. That is what the daemon's event reconciles trust too, and at 65,000 nodes a
        // dump costs a second. After a failure the kernel is dumped again, without comparing.
        let outcome = if clean {
            rec.reconcile_event().await?
        } else {
            rec.forget_view();
            rec.reconcile().await?
        };
        // A settled plan applied without a failure leaves nothing to do (the planner's model
        // test holds it to that, and the daemon's event-sized reconciles rely on it): no
        // verifying pass, which at 65,000 nodes would be another full dump and plan. The
        // daemon's periodic resync is what checks the kernel against the view.
        let done = outcome.plan.is_empty()
            || outcome.writes == 0
            || (outcome.plan.settled && outcome.failed.is_empty());
        last = Some(outcome);
        if done {
            break;
        }
    }
    if let Some(cp) = rec.stamp_record() {
        checkpointer.write(cp)?;
    }
    let outcome = last.expect("at least one pass");
    // Converged means a pass that found nothing left to do, apart from what the brake holds.
    let status = if outcome.plan.brake.is_some() {
        ExitStatus::BrakeHeld
    } else if !outcome.failed.is_empty() {
        ExitStatus::Failed
    } else {
        ExitStatus::Converged
    };
    Ok(OnceResult {
        status,
        report: rec.report(&outcome.plan, &outcome.failed),
        plan: None,
    })
}

/// The record as it is written: stamped with the time of writing.
/// The signals the daemon handles.
struct Signals {
    term: Signal,
    int: Signal,
    /// `node-agent prune confirm` left a confirmation.
    usr1: Signal,
}

impl Signals {
    fn install() -> Result<Self, AgentError> {
        let s = |kind| signal(kind).map_err(AgentError::Signal);
        Ok(Self {
            term: s(SignalKind::terminate())?,
            int: s(SignalKind::interrupt())?,
            usr1: s(SignalKind::user_defined1())?,
        })
    }
}

/// The daemon: start up, wait for sync, then do what the schedule says until SIGTERM or
/// SIGINT; then write the checkpoint once more and return. The maps stay pinned and the programs
/// attached when it returns. An unwritable state directory at the end is an error (the exit
/// status says the record is stale); nothing else of it ever stops the daemon.
pub async fn run(
    config: AgentConfig,
    telemetry: Arc<Telemetry>,
    mut rx: mpsc::Receiver<SourceEvent>,
    relist: mpsc::Sender<SourceRequest>,
) -> Result<(), AgentError> {
    let mut signals = Signals::install()?;
    let (mut checkpointer, record) = Checkpointer::open(&config.state_dir, false)?;
    checkpointer.lock_pins(&config.datapath.bpffs)?;
    let backends = Backends::open(&config.backends(), false).await?;
    let ipsec = config.ipsec_key_file.is_some();
    let mut rec = Reconciler::new(config, record, backends, telemetry.clone());
    rec.confirm_by_relist(true);
    let beat = tokio::spawn({
        // Liveness while waiting for sync: the loop below beats on its own turns.
        let t = telemetry.clone();
        async move {
            loop {
                t.beat();
                tokio::time::sleep(HEARTBEAT).await;
            }
        }
    });
    let wait = SyncWait {
        deadline: None,
        fail_on_error: false,
    };
    let synced = tokio::select! {
        r = sync_and_dump(&mut rec, &mut rx, wait) => Some(r),
        _ = signals.term.recv() => None,
        _ = signals.int.recv() => None,
    };
    beat.abort();
    match synced {
        Some(r) => r?,
        None => {
            tracing::info!("signalled before sync; exiting without changes");
            return Ok(());
        }
    }
    let mut daemon = Daemon {
        schedule: Schedule::new(
            Instant::now(),
            rec.config().debounce,
            rec.config().resync_interval,
            rec.config().checkpoint_interval,
        ),
        rec,
        checkpointer,
        telemetry,
        stale_since: None,
        published_hold: None,
        confirmation_error: None,
    };
    if ipsec {
        daemon.schedule.watch_keys(Instant::now(), KEY_FILE_POLL);
    }
    daemon.check_attachments();
    // A device made or deleted wakes the attach check at once; the periodic check stays behind
    // it (notifications can be lost).
    let mut links = match LinkWatch::open() {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(
                "link notifications unavailable ({e}): attachments are checked every second only"
            );
            None
        }
    };
    loop {
        daemon.turn(&relist).await;
        let wake = daemon.schedule.next_wake(Instant::now());
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => daemon.on_event(ev),
                None => {
                    tracing::error!("node source ended; keeping the kernel state as it is");
                    break;
                }
            },
            () = sleep_until(wake.into()) => {}
            r = link_changed(&mut links) => {
                if let Err(e) = r {
                    tracing::warn!("link notifications failed ({e}): attachments are checked every second only");
                    links = None;
                }
                daemon.schedule.links_changed(Instant::now());
            }
            _ = signals.usr1.recv() => {}
            _ = signals.term.recv() => { tracing::info!("SIGTERM: writing the final checkpoint"); break; }
            _ = signals.int.recv() => { tracing::info!("SIGINT: writing the final checkpoint"); break; }
        }
    }
    daemon.shutdown()
}

/// The next link notification; never, without the watch.
async fn link_changed(links: &mut Option<LinkWatch>) -> std::io::Result<()> {
    match links {
        Some(w) => w.changed().await,
        None => std::future::pending().await,
    }
}

/// The daemon's state between turns.
struct Daemon<K: Kernel> {
    rec: Reconciler<K>,
    schedule: Schedule,
    checkpointer: Checkpointer,
    telemetry: Arc<Telemetry>,
    /// Since when the record has had changes the checkpoint file lacks, while writes fail.
    stale_since: Option<Instant>,
    /// The hold last published in the state directory, by ID.
    published_hold: Option<String>,
    /// The last problem with an operator's confirmation file, reported once.
    confirmation_error: Option<String>,
}

impl<K: Kernel> Daemon<K> {
    fn on_event(&mut self, ev: SourceEvent) {
        if self.rec.on_event(ev) {
            self.schedule.source_changed(Instant::now());
        } else if !self.schedule.reconcile_pending() {
            // An event that changes nothing to plan (a node turned malformed keeps its good
            // record): the kernel already reflects the view at its newest version.
            self.publish_revision(self.rec.live().revision());
        }
    }

    /// `node_agent_source_revision`: the newest resourceVersion the kernel reflects.
    fn publish_revision(&self, revision: Option<u64>) {
        if let Some(r) = revision {
            self.telemetry
                .metrics
                .source_revision
                .set(i64::try_from(r).unwrap_or(i64::MAX));
        }
    }

    /// One turn: whatever is due, in order.
    async fn turn(&mut self, relist: &mpsc::Sender<SourceRequest>) {
        self.telemetry.beat();
        self.take_confirmation();
        let due = self.schedule.due(Instant::now());
        if due.reconcile {
            self.reconcile(due.resync).await;
        }
        if due.relist {
            tracing::info!("a held prune is ripe: asking the node source for a fresh full list");
            // A full channel means a request is already pending: one is enough.
            let _ = relist.try_send(SourceRequest::Relist);
            self.schedule.relist_asked();
        }
        if due.keys {
            let changed = self.rec.keys_changed();
            self.schedule.keys_checked(Instant::now(), changed);
        }
        if due.attach {
            self.check_attachments();
        }
        if self.schedule.due(Instant::now()).checkpoint {
            self.write_checkpoint();
        }
        let stale = self.stale_since.map_or(0.0, |t| t.elapsed().as_secs_f64());
        self.telemetry.metrics.checkpoint_stale_seconds.set(stale);
    }

    /// Checks the attachments of every uplink and pod interface and makes the missing ones;
    /// keeps checking (and says so in readiness) while any is missing.
    fn check_attachments(&mut self) {
        let missing = self.rec.kernel().check_attachments();
        let dp = &self.rec.config().datapath;
        let watched = !dp.ifaces.is_empty() || !dp.pod_ifaces.is_empty();
        self.schedule
            .attachments_checked(Instant::now(), !missing.is_empty(), watched);
        self.telemetry.set_attachments_missing(&missing);
    }

    fn take_confirmation(&mut self) {
        match hold_file::take_confirmation(self.checkpointer.dir()) {
            Ok(Some(id)) => {
                self.rec.confirm_hold(id);
                self.schedule.reconcile_now(Instant::now());
            }
            Ok(None) => self.confirmation_error = None,
            // Reported when it first appears, not at every turn it stays.
            Err(e) => {
                let e = e.to_string();
                if self.confirmation_error.as_ref() != Some(&e) {
                    tracing::warn!("{e}");
                    self.confirmation_error = Some(e);
                }
            }
        }
    }

    /// Reconciles: with a dump of the kernel when `resync` says so (or the reconciler needs
    /// one), otherwise from the last reconcile's view.
    async fn reconcile(&mut self, resync: bool) {
        // Every event folded in so far is in the view this reconcile plans from.
        let revision = self.rec.live().revision();
        let result = match resync {
            true => self.rec.reconcile().await,
            false => self.rec.reconcile_event().await,
        };
        let now = Instant::now();
        self.publish_revision(revision);
        let changed = result.as_ref().is_ok_and(|o| o.record_changed);
        let outcome = match &result {
            Ok(o) if o.failed.is_empty() => {
                self.telemetry.set_reconciled(Ok(()));
                Reconciled::Done
            }
            Ok(o) => {
                let why = format!(
                    "{} operations failed, first: {}",
                    o.failed.len(),
                    o.failed[0]
                        .result
                        .as_ref()
                        .err()
                        .map_or_else(String::new, ToString::to_string)
                );
                tracing::warn!("{why}; retrying with backoff");
                self.telemetry.set_reconciled(Err(why));
                Reconciled::Failed
            }
            Err(e) => {
                tracing::error!("reconcile failed: {e}; retrying with backoff");
                self.telemetry.set_reconciled(Err(e.to_string()));
                Reconciled::Failed
            }
        };
        let plan = result.as_ref().ok().map(|o| &o.plan);
        let hold = plan.and_then(|p| p.brake.as_ref());
        self.telemetry.set_brake(hold.map(ToString::to_string));
        // When a fresh list may confirm the hold, on this process's clock (a time no clock
        // reaches, which only a checkpoint could carry, is never).
        let agent_now = self.rec.now();
        let on_this_clock = |at: Duration| now.checked_add(at.saturating_sub(agent_now));
        let confirmable = hold.and_then(|h| h.confirmable_at).and_then(on_this_clock);
        self.schedule.reconciled(now, outcome, changed, confirmable);
        let rotation = self.rec.next_rotation_change();
        self.schedule
            .rotation_moves_at(rotation.and_then(on_this_clock));
        if let Some(plan) = plan {
            self.publish_hold(plan);
        }
        self.rec.prepare_event_plans();
    }

    /// Keeps `<state-dir>/hold.json` in step with the brake, for `node-agent prune`.
    fn publish_hold(&mut self, plan: &state::plan::Plan) {
        let report = report::brake(plan);
        let id = report.as_ref().map(|r| r.id.clone());
        if id == self.published_hold {
            return;
        }
        match hold_file::publish(self.checkpointer.dir(), report.as_ref()) {
            Ok(()) => self.published_hold = id,
            Err(e) => tracing::warn!("publishing the brake's hold for `node-agent prune`: {e}"),
        }
    }

    fn write_checkpoint(&mut self) {
        // Stamped in place: a copy of a large record would cost as much as writing it.
        let Some(cp) = self.rec.stamp_record() else {
            return;
        };
        let now = Instant::now();
        let result = self.checkpointer.write(cp);
        let ok = result.is_ok();
        let label = if ok { "ok" } else { "error" };
        self.telemetry
            .metrics
            .checkpoint_writes
            .get_or_create(&crate::telemetry::metrics::ResultLabel {
                result: label.into(),
            })
            .inc();
        let retry = self.schedule.checkpoint_written(now, ok);
        match result {
            Ok(_) => {
                if self.stale_since.take().is_some() {
                    tracing::info!("checkpoint written again; the record is current");
                }
                self.telemetry.set_checkpoint_failing(None);
            }
            Err(e) => {
                let since = *self.stale_since.get_or_insert(now);
                let retry_in = retry.map_or(Duration::ZERO, |t| t - now);
                tracing::error!(
                    retry_in_s = retry_in.as_secs(),
                    "checkpoint write failed: {e}; kernel work goes on, the record on disk is stale"
                );
                self.telemetry.set_checkpoint_failing(Some(format!(
                    "{e} (stale for {}s)",
                    since.elapsed().as_secs()
                )));
            }
        }
    }

    /// The final checkpoint write: tried once; a failure is the exit status.
    fn shutdown(mut self) -> Result<(), AgentError> {
        if !self.schedule.dirty() {
            return Ok(());
        }
        let Some(cp) = self.rec.stamp_record() else {
            return Ok(());
        };
        self.checkpointer.write(cp).map_err(|e| {
            tracing::error!("final checkpoint write failed: {e}; the record on disk is stale (the kernel state is right)");
            AgentError::from(e)
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use state::node::RawNode;

    use super::*;
    use crate::kernel::fake::FakeKernel;

    use crate::agent::reconciler::testing::raw;

    fn list(rec: &mut Reconciler<FakeKernel>, nodes: &[RawNode]) -> bool {
        let mut due = rec.on_event(SourceEvent::Init);
        for n in nodes {
            due |= rec.on_event(SourceEvent::InitApply(n.clone()));
        }
        due | rec.on_event(SourceEvent::InitDone)
    }

    fn cluster(n: u8) -> Vec<RawNode> {
        let mut v = vec![raw("local", &["10.0.0.100"], &["10.1.100.0/24"])];
        v.extend((1..=n).map(|i| {
            raw(
                &format!("n{i}"),
                &[&format!("10.0.0.{i}")],
                &[&format!("10.1.{i}.0/24")],
            )
        }));
        v
    }

    /// A daemon over a fake kernel with its state in `dir`, synced on `nodes`.
    fn daemon(dir: &Path, nodes: &[RawNode]) -> Daemon<FakeKernel> {
        let mut config = AgentConfig::new("local", dir, "/nonexistent-bpffs");
        config.checkpoint_interval = Duration::ZERO;
        let (checkpointer, record) = Checkpointer::open(dir, false).unwrap();
        let telemetry = Arc::new(Telemetry::new(Duration::MAX));
        let mut rec = Reconciler::new(config, record, FakeKernel::default(), telemetry.clone());
        rec.confirm_by_relist(true);
        list(&mut rec, nodes);
        Daemon {
            schedule: Schedule::new(
                Instant::now(),
                Duration::ZERO,
                Duration::from_secs(300),
                Duration::ZERO,
            ),
            rec,
            checkpointer,
            telemetry,
            stale_since: None,
            published_hold: None,
            confirmation_error: None,
        }
    }

    fn relist_channel() -> (mpsc::Sender<SourceRequest>, mpsc::Receiver<SourceRequest>) {
        mpsc::channel(1)
    }

    fn errors(d: &Daemon<FakeKernel>) -> String {
        d.telemetry.metrics.encode()
    }

    /// A reconciler restarted over `kernel` with `record`, and the source's first list of
    /// `nodes` on its way, `delay` before its end.
    fn restarted(
        kernel: FakeKernel,
        record: Option<state::checkpoint::Checkpoint>,
        nodes: Vec<RawNode>,
        delay: Duration,
    ) -> (Reconciler<FakeKernel>, mpsc::Receiver<SourceEvent>) {
        let config = AgentConfig::new("local", "/nonexistent-state", "/nonexistent-bpffs");
        let telemetry = Arc::new(Telemetry::new(Duration::MAX));
        let rec = Reconciler::new(config, record, kernel, telemetry);
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            tx.send(SourceEvent::Init).await.unwrap();
            for n in nodes {
                tx.send(SourceEvent::InitApply(n)).await.unwrap();
            }
            tokio::time::sleep(delay).await;
            tx.send(SourceEvent::InitDone).await.unwrap();
        });
        (rec, rx)
    }

    const SYNC: SyncWait = SyncWait {
        deadline: None,
        fail_on_error: true,
    };

    /// A kernel programmed for `cluster(2)`, and the record that says so.
    async fn programmed() -> (FakeKernel, Option<state::checkpoint::Checkpoint>) {
        let config = AgentConfig::new("local", "/nonexistent-state", "/nonexistent-bpffs");
        let telemetry = Arc::new(Telemetry::new(Duration::MAX));
        let mut rec = Reconciler::new(config, None, FakeKernel::default(), telemetry);
        list(&mut rec, &cluster(2));
        rec.reconcile().await.unwrap();
        let record = rec.record().cloned();
        let mut kernel = std::mem::take(rec.kernel());
        kernel.dumps = 0;
        (kernel, record)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_first_reconcile_plans_from_the_dump_taken_while_the_source_synced() {
        let (kernel, record) = programmed().await;
        let before = kernel.ours.len();
        // n2 went away while the agent was down.
        let (mut rec, mut rx) = restarted(kernel, record, cluster(1), Duration::ZERO);
        sync_and_dump(&mut rec, &mut rx, SYNC).await.unwrap();
        assert_eq!(rec.kernel().dumps, 1, "dumped while syncing");
        let outcome = rec.reconcile().await.unwrap();
        assert_eq!(
            rec.kernel().dumps,
            1,
            "the first reconcile did not dump again"
        );
        assert!(outcome.pruned.contains("n2"), "{:?}", outcome.pruned);
        assert_eq!(
            rec.kernel().ours.len(),
            before - 2,
            "n2's route and map entry"
        );
        rec.reconcile().await.unwrap();
        assert_eq!(rec.kernel().dumps, 2, "later reconciles dump");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_dump_the_sync_outlasted_is_not_planned_from() {
        let (kernel, record) = programmed().await;
        let late = EARLY_DUMP_MAX_AGE + Duration::from_secs(1);
        let (mut rec, mut rx) = restarted(kernel, record, cluster(2), late);
        sync_and_dump(&mut rec, &mut rx, SYNC).await.unwrap();
        assert_eq!(rec.kernel().dumps, 1);
        // Meanwhile n1's route went away behind the agent's back: a dump now sees it.
        let route = rec
            .kernel()
            .ours
            .keys()
            .find(|id| matches!(id, state::objects::ObjectId::Route { .. }))
            .cloned()
            .unwrap();
        rec.kernel().ours.remove(&route);
        let outcome = rec.reconcile().await.unwrap();
        assert_eq!(rec.kernel().dumps, 2, "dumped again");
        assert_eq!(outcome.writes, 1, "the route is put back");
        assert!(rec.kernel().ours.contains_key(&route));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_failed_dump_while_syncing_leaves_the_first_reconcile_to_dump() {
        let (mut kernel, record) = programmed().await;
        kernel.faults.dumps = 1;
        let (mut rec, mut rx) = restarted(kernel, record, cluster(2), Duration::ZERO);
        sync_and_dump(&mut rec, &mut rx, SYNC).await.unwrap();
        let outcome = rec.reconcile().await.unwrap();
        assert_eq!(rec.kernel().dumps, 2);
        assert_eq!(outcome.writes, 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_checkpoint_that_cannot_be_written_backs_off_and_recovers_without_a_restart() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let mut d = daemon(&dir, &cluster(2));
        let (tx, _rx) = relist_channel();
        d.turn(&tx).await;
        assert!(dir.join("nodes.ckpt").exists());
        assert_eq!(d.rec.kernel().ours.len(), 4);
        // The state directory goes away (as a full or read-only one would fail the write).
        let moved = tmp.path().join("moved");
        std::fs::rename(&dir, &moved).unwrap();
        d.on_event(SourceEvent::Apply(raw(
            "n3",
            &["10.0.0.3"],
            &["10.1.3.0/24"],
        )));
        d.turn(&tx).await;
        assert_eq!(d.rec.kernel().ours.len(), 6, "kernel work goes on");
        let metrics = errors(&d);
        assert!(
            metrics.contains("node_agent_checkpoint_writes_total{result=\"error\"} 1"),
            "{metrics}"
        );
        let ready = d
            .telemetry
            .ready()
            .expect("the datapath is right: still ready");
        assert!(ready.contains("checkpoint failing"), "{ready}");
        // The next turns do not retry at once: the schedule backs off.
        for _ in 0..50 {
            d.turn(&tx).await;
        }
        assert!(errors(&d).contains("node_agent_checkpoint_writes_total{result=\"error\"} 1"));
        // Space is back: the retry succeeds, and readiness has no complaint left.
        std::fs::rename(&moved, &dir).unwrap();
        d.write_checkpoint();
        assert!(errors(&d).contains("node_agent_checkpoint_writes_total{result=\"ok\"} 2"));
        assert_eq!(d.telemetry.ready(), Ok("ready".into()));
        assert!(!d.schedule.dirty());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn sigterm_with_an_unwritable_state_dir_tries_once_and_fails() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let mut d = daemon(&dir, &cluster(1));
        let (tx, _rx) = relist_channel();
        d.turn(&tx).await;
        d.on_event(SourceEvent::Apply(raw(
            "n2",
            &["10.0.0.2"],
            &["10.1.2.0/24"],
        )));
        d.turn(&tx).await;
        std::fs::remove_dir_all(&dir).unwrap();
        d.on_event(SourceEvent::Delete("n2".into()));
        d.turn(&tx).await;
        assert!(d.schedule.dirty());
        let e = d.shutdown().unwrap_err();
        assert!(e.to_string().contains("state"), "{e}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn sigterm_writes_what_changed_since_the_last_write() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let mut d = daemon(&dir, &cluster(1));
        let (tx, _rx) = relist_channel();
        d.turn(&tx).await;
        d.on_event(SourceEvent::Apply(raw(
            "n2",
            &["10.0.0.2"],
            &["10.1.2.0/24"],
        )));
        d.schedule.checkpoint_written(Instant::now(), false);
        d.turn(&tx).await;
        assert!(d.schedule.dirty());
        d.shutdown().unwrap();
        let cp =
            state::checkpoint::decode(&std::fs::read(dir.join("nodes.ckpt")).unwrap()).unwrap();
        assert_eq!(cp.nodes.len(), 2);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_failing_dump_never_turns_into_deletes_and_the_reconcile_backs_off() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let mut d = daemon(&dir, &cluster(2));
        let (tx, _rx) = relist_channel();
        d.turn(&tx).await;
        let applied = d.rec.kernel().applied.len();
        // n2 goes away as the resync comes round, and the next dumps fail halfway (ENOBUFS).
        d.rec.kernel().faults.dumps = 2;
        d.on_event(SourceEvent::Delete("n2".into()));
        d.schedule.resync_now(Instant::now());
        d.turn(&tx).await;
        assert_eq!(d.rec.kernel().applied.len(), applied, "nothing applied");
        let why = d.telemetry.ready().unwrap_err();
        assert!(why.contains("kernel inventory"), "{why}");
        // The retry waits for its backoff and dumps again (a view the failed resync could not
        // check is not planned from), then goes ahead once the dump works.
        assert!(!d.schedule.due(Instant::now()).reconcile);
        d.schedule.reconcile_now(Instant::now());
        assert!(
            !d.schedule.due(Instant::now()).reconcile,
            "not even an operator hurries the retry"
        );
        d.schedule.retry_now(Instant::now());
        d.turn(&tx).await;
        d.schedule.retry_now(Instant::now());
        d.turn(&tx).await;
        assert_eq!(
            d.rec.kernel().ours.len(),
            2,
            "n2's objects went once the dump worked"
        );
        assert_eq!(
            d.rec.kernel().dumps,
            4,
            "the first reconcile, two failures, the success"
        );
        assert_eq!(d.telemetry.ready(), Ok("ready".into()));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_ripe_hold_asks_the_source_for_one_relist_and_waits_without_reconciling() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let mut d = daemon(&dir, &cluster(4));
        let (tx, mut rx) = relist_channel();
        d.turn(&tx).await;
        // Three of four go at once: held.
        list(&mut d.rec, &cluster(1));
        d.schedule.source_changed(Instant::now());
        d.turn(&tx).await;
        assert!(d.rec.hold().is_some());
        // Pretend the confirm delay has passed: the hold is ripe.
        d.schedule.reconciled(
            Instant::now(),
            Reconciled::Done,
            false,
            Some(Instant::now()),
        );
        let dumps = d.rec.kernel().dumps;
        d.turn(&tx).await;
        assert_eq!(rx.try_recv(), Ok(SourceRequest::Relist));
        for _ in 0..20 {
            d.turn(&tx).await;
        }
        assert!(rx.try_recv().is_err(), "asked once");
        assert_eq!(
            d.rec.kernel().dumps,
            dumps,
            "no dump or plan while waiting for the list"
        );
    }
}

//! Driving the reconciler: the daemon loop, and the one-shot run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::time::sleep_until;

use super::config::AgentConfig;
use super::reconciler::{AgentError, Outcome, Reconciler};
use super::report::{self, RunReport};
use crate::source::SourceEvent;
use crate::telemetry::{Readiness, Telemetry};

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

/// The loop turns at least this often, so `/healthz` can tell a stuck loop from an idle one.
const HEARTBEAT: Duration = Duration::from_secs(5);
/// How often "still waiting for sync" is logged.
const WAIT_LOG_EVERY: Duration = Duration::from_secs(10);
/// Passes `--once` makes before it settles for what failed.
const ONCE_MAX_PASSES: usize = 5;

/// Start-up step 5: feeds events in until the source completes its first full list.
async fn wait_for_sync(
    rec: &mut Reconciler,
    rx: &mut mpsc::Receiver<SourceEvent>,
    timeout: Option<Duration>,
) -> Result<(), AgentError> {
    let started = Instant::now();
    let mut next_log = started + WAIT_LOG_EVERY;
    while !rec.live().synced() {
        let deadline = timeout.map(|t| started + t);
        let wake = deadline.map_or(next_log, |d| d.min(next_log));
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => { rec.on_event(ev); }
                None => return Err(AgentError::SourceEnded),
            },
            () = sleep_until(wake.into()) => {
                if let (Some(d), Some(t)) = (deadline, timeout) && Instant::now() >= d {
                    return Err(AgentError::SyncTimeout(t));
                }
                tracing::info!(waited_s = started.elapsed().as_secs(), last_error = rec.live().last_error().unwrap_or("-"), "still waiting for the node source to sync; nothing is pruned before it does");
                next_log = Instant::now() + WAIT_LOG_EVERY;
            }
        }
    }
    // Take in whatever else already arrived, so the first plan sees it.
    while let Ok(ev) = rx.try_recv() {
        rec.on_event(ev);
    }
    Ok(())
}

/// `--once` and `--dry-run`: sync, reconcile to convergence (or only plan), write the
/// checkpoint, report.
pub async fn run_once(
    config: AgentConfig,
    dry_run: bool,
    mut rx: mpsc::Receiver<SourceEvent>,
) -> Result<(ExitStatus, RunReport, Option<report::PlanReport>), AgentError> {
    let timeout = config.sync_timeout;
    let telemetry = Arc::new(Telemetry::new(Duration::MAX));
    let mut rec = Reconciler::start(config, dry_run, telemetry).await?;
    wait_for_sync(&mut rec, &mut rx, Some(timeout)).await?;
    if dry_run {
        let plan = rec.plan().await?;
        let plan_report = report::plan_report(&plan, rec.live());
        let run = summary(&rec, &plan, &[]);
        let status = if plan.brake.is_some() {
            ExitStatus::BrakeHeld
        } else {
            ExitStatus::Converged
        };
        return Ok((status, run, Some(plan_report)));
    }
    let mut last: Option<Outcome> = None;
    for _ in 0..ONCE_MAX_PASSES {
        let outcome = rec.reconcile().await?;
        let done = outcome.plan.is_empty() || outcome.writes == 0;
        last = Some(outcome);
        if done {
            break;
        }
    }
    rec.flush_checkpoint(true)?;
    let outcome = last.expect("at least one pass");
    // Converged means a pass that found nothing left to do, apart from what the brake holds.
    let status = if outcome.plan.brake.is_some() {
        ExitStatus::BrakeHeld
    } else if !outcome.failed.is_empty() {
        ExitStatus::Failed
    } else {
        ExitStatus::Converged
    };
    let report = summary(&rec, &outcome.plan, &outcome.failed);
    Ok((status, report, None))
}

fn summary(
    rec: &Reconciler,
    plan: &state::plan::Plan,
    failed: &[super::reconciler::FailedOp],
) -> RunReport {
    RunReport {
        synced: rec.live().synced(),
        live_nodes: rec.live().view().nodes.len(),
        restored_nodes: rec.restored_nodes(),
        pruned_nodes: rec.pruned().len(),
        pruned: rec.pruned().iter().cloned().collect(),
        kernel_writes: rec.total_writes(),
        errors: report::node_errors(plan, rec.live()),
        failed_ops: report::failed_ops(failed),
        brake: report::brake(plan),
    }
}

/// The daemon: start up, then reconcile on source changes (coalesced), on the resync interval,
/// on retry backoff after failures, and when a held brake may be confirmed; write the checkpoint
/// coalesced; on SIGTERM or SIGINT write it once more and return. The maps stay pinned and the
/// programs attached when it returns.
pub async fn run(
    config: AgentConfig,
    telemetry: Arc<Telemetry>,
    mut rx: mpsc::Receiver<SourceEvent>,
) -> Result<(), AgentError> {
    let mut term = signal(SignalKind::terminate()).map_err(AgentError::Signal)?;
    let mut int = signal(SignalKind::interrupt()).map_err(AgentError::Signal)?;
    let mut rec = Reconciler::start(config, false, telemetry.clone()).await?;
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
    tokio::select! {
        r = wait_for_sync(&mut rec, &mut rx, None) => { beat.abort(); r? },
        _ = term.recv() => { beat.abort(); tracing::info!("SIGTERM before sync; exiting without changes"); return Ok(()); }
        _ = int.recv() => { beat.abort(); tracing::info!("SIGINT before sync; exiting without changes"); return Ok(()); }
    }
    let resync = rec.config().resync_interval;
    let debounce = rec.config().debounce;
    let mut backoff = Duration::from_secs(1);
    let mut reconcile_at = Some(Instant::now());
    let mut resync_at = Instant::now() + resync;
    let mut ready = false;
    loop {
        telemetry.beat();
        let mut wake = resync_at.min(Instant::now() + HEARTBEAT);
        for t in [
            reconcile_at,
            rec.checkpoint_due_at(),
            rec.brake_recheck_at(),
        ]
        .into_iter()
        .flatten()
        {
            wake = wake.min(t);
        }
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => {
                    if rec.on_event(ev) {
                        let at = Instant::now() + debounce;
                        reconcile_at = Some(reconcile_at.map_or(at, |t| t.min(at)));
                    }
                }
                None => {
                    tracing::error!("node source ended; keeping the kernel state as it is");
                    break;
                }
            },
            () = sleep_until(wake.into()) => {
                let now = Instant::now();
                let brake_due = rec.brake_recheck_at().is_some_and(|t| t <= now);
                if reconcile_at.is_some_and(|t| t <= now) || resync_at <= now || brake_due {
                    reconcile_at = None;
                    if resync_at <= now {
                        resync_at = now + resync;
                    }
                    let result = rec.reconcile().await;
                    telemetry.set_readiness(match &result {
                        Ok(o) if o.plan.brake.is_some() => Readiness::BrakeHeld(
                            o.plan.brake.as_ref().map(ToString::to_string).unwrap_or_default(),
                        ),
                        Ok(o) if !o.failed.is_empty() => Readiness::Failing(format!(
                            "{} operations failed, first: {}",
                            o.failed.len(),
                            o.failed[0].error
                        )),
                        Ok(_) => Readiness::Ready,
                        Err(e) => Readiness::Failing(e.to_string()),
                    });
                    match result {
                        Ok(outcome) if outcome.failed.is_empty() => {
                            backoff = Duration::from_secs(1);
                            if !ready {
                                ready = true;
                                rec.flush_checkpoint(true)?;
                                tracing::info!("ready: first reconcile done");
                            }
                        }
                        Ok(outcome) => {
                            tracing::warn!(failed = outcome.failed.len(), retry_in_s = backoff.as_secs(), "some operations failed; retrying");
                            reconcile_at = Some(now + backoff);
                            backoff = (backoff * 2).min(Duration::from_secs(60));
                        }
                        Err(e) => {
                            tracing::error!("reconcile failed: {e}; retrying in {backoff:?}");
                            reconcile_at = Some(now + backoff);
                            backoff = (backoff * 2).min(Duration::from_secs(60));
                        }
                    }
                }
                if let Err(e) = rec.flush_checkpoint(false) {
                    tracing::error!("checkpoint write failed: {e}");
                }
            },
            _ = term.recv() => { tracing::info!("SIGTERM: writing the final checkpoint"); break; }
            _ = int.recv() => { tracing::info!("SIGINT: writing the final checkpoint"); break; }
        }
    }
    rec.flush_checkpoint(true)?;
    Ok(())
}

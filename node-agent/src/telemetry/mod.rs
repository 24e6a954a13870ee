//! What the agent tells the outside: Prometheus metrics and the health and readiness state.
//!
//! The reconciler and the source write into one shared [`Telemetry`]; the HTTP endpoints
//! ([`http`]) only read it, so a slow scrape can never hold up a reconcile.

pub mod http;
pub mod metrics;

use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use metrics::Metrics;

/// Why the agent is not ready, or that it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Readiness {
    NotSynced,
    BrakeHeld(String),
    Failing(String),
    Ready,
}

#[derive(Debug)]
struct Status {
    readiness: Readiness,
    /// The reconciler loop's last turn: `/healthz` fails when it is too old.
    heartbeat: Instant,
    /// Whether any reconcile has succeeded yet: readiness stays false until one has.
    reconciled: bool,
}

#[derive(Debug)]
pub struct Telemetry {
    pub metrics: Metrics,
    status: Mutex<Status>,
    /// How long the loop may go without a turn before it counts as stuck.
    stall_after: Duration,
}

impl Telemetry {
    pub fn new(stall_after: Duration) -> Self {
        Self {
            metrics: Metrics::default(),
            status: Mutex::new(Status {
                readiness: Readiness::NotSynced,
                heartbeat: Instant::now(),
                reconciled: false,
            }),
            stall_after,
        }
    }

    fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        // A panic while holding this lock leaves plain data behind; keep serving it.
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The reconciler loop is alive.
    pub fn beat(&self) {
        self.status().heartbeat = Instant::now();
    }

    pub fn set_readiness(&self, r: Readiness) {
        let mut s = self.status();
        if r == Readiness::Ready {
            s.reconciled = true;
        }
        s.readiness = r;
    }

    /// `Ok` when alive, or why not.
    pub fn health(&self) -> Result<(), String> {
        let age = self.status().heartbeat.elapsed();
        if age > self.stall_after {
            return Err(format!(
                "reconciler loop stuck: no turn for {}s",
                age.as_secs()
            ));
        }
        Ok(())
    }

    /// `Ok` when ready (a reconcile succeeded and nothing holds it back), or why not.
    pub fn ready(&self) -> Result<(), String> {
        let s = self.status();
        match &s.readiness {
            Readiness::Ready if s.reconciled => Ok(()),
            Readiness::Ready | Readiness::NotSynced => {
                Err("not synced: waiting for the node source's first full list".into())
            }
            Readiness::BrakeHeld(why) => Err(format!("brake held: {why}")),
            Readiness::Failing(why) => Err(format!("last reconcile failed: {why}")),
        }
    }
}

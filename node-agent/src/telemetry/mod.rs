//! What the agent tells the outside: Prometheus metrics and the health and readiness state.
//!
//! The reconciler and the source write into one shared [`Telemetry`]; the HTTP endpoints
//! ([`http`]) only read it, so a slow scrape can never hold up a reconcile.
//! [`reconcile`] is what the reconciler hands over of each reconcile: the metrics it sets and
//! the lines it logs.

pub mod http;
pub mod metrics;
pub mod reconcile;

use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use metrics::Metrics;

/// What readiness is made of. Each part is set by whoever knows it; [`Telemetry::ready`] joins
/// them.
#[derive(Debug)]
struct Status {
    /// The reconciler loop's last turn: `/healthz` fails when it is too old.
    heartbeat: Instant,
    /// Whether any reconcile has succeeded yet: readiness stays false until one has.
    reconciled: bool,
    /// The last reconcile failed, or some of its operations did.
    failing: Option<String>,
    /// What the brake holds.
    brake: Option<String>,
    /// The node source's error since its last success: the agent cannot see node changes.
    source: Option<String>,
    /// The checkpoint cannot be written: the datapath is right, only the record is stale, so
    /// the agent stays ready and says so.
    checkpoint: Option<String>,
    /// The IPsec key file as it is now cannot be used; the keys read before stay in use, so
    /// the agent stays ready and says so.
    key_file: Option<String>,
    /// New nodes wait for a node ID: the programmed ones are right, so the agent stays ready
    /// and says so.
    ids: Option<String>,
    /// Classifiers missing on an uplink or pod interface (most often: it does not exist, yet
    /// or any more; attached as soon as it does): ready, and each one named.
    attachments: Option<String>,
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
                heartbeat: Instant::now(),
                reconciled: false,
                failing: None,
                brake: None,
                source: None,
                checkpoint: None,
                key_file: None,
                ids: None,
                attachments: None,
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

    /// A reconcile ended: `Ok` when everything applied, or what failed.
    pub fn set_reconciled(&self, result: Result<(), String>) {
        let mut s = self.status();
        match result {
            Ok(()) => {
                s.reconciled = true;
                s.failing = None;
            }
            Err(why) => s.failing = Some(why),
        }
    }

    pub fn set_brake(&self, held: Option<String>) {
        self.status().brake = held;
    }

    pub fn set_source_failing(&self, why: Option<&str>) {
        self.status().source = why.map(str::to_owned);
        self.metrics.source_failing.set(i64::from(why.is_some()));
    }

    pub fn set_checkpoint_failing(&self, why: Option<String>) {
        self.status().checkpoint = why;
    }

    /// The attachments missing, one line per interface (see
    /// [`crate::datapath::attachments::describe`]).
    pub fn set_attachments_missing(&self, missing: &[String]) {
        self.status().attachments = (!missing.is_empty()).then(|| missing.join("; "));
    }

    pub fn set_ids_exhausted(&self, why: Option<String>) {
        self.status().ids = why;
    }

    pub fn set_key_file_error(&self, why: Option<String>) {
        self.metrics
            .ipsec_key_file_error
            .set(i64::from(why.is_some()));
        self.status().key_file = why;
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

    /// `Ok` with details worth knowing when ready; otherwise why not, every reason on its line.
    pub fn ready(&self) -> Result<String, String> {
        let s = self.status();
        let mut not = Vec::new();
        if !s.reconciled {
            not.push(
                "not synced: waiting for the node source's first full list and a first reconcile"
                    .to_string(),
            );
        }
        if let Some(why) = &s.source {
            not.push(format!(
                "node source failing: {why}; no node change can be seen, nothing is pruned"
            ));
        }
        if let Some(why) = &s.brake {
            not.push(format!("brake held: {why}"));
        }
        if let Some(why) = &s.failing {
            not.push(format!("last reconcile failed: {why}"));
        }
        let detail: Vec<String> = [
            s.checkpoint
                .as_ref()
                .map(|why| format!("checkpoint failing: {why}")),
            s.key_file.as_ref().map(|why| {
                format!("IPsec key file unusable, the keys read before stay in use: {why}")
            }),
            s.ids.clone(),
            s.attachments.clone(),
        ]
        .into_iter()
        .flatten()
        .collect();
        if not.is_empty() {
            match detail.is_empty() {
                true => Ok("ready".into()),
                false => Ok(format!("ready; {}", detail.join("; "))),
            }
        } else {
            not.extend(detail);
            Err(not.join("\n"))
        }
    }
}

//! Source events into the live view, with the metrics that count them.
//!
//! Apart from the reconciler's kernel on purpose: at start the agent takes in the source's first
//! list while it dumps the kernel for the first reconcile ([`super::reconciler::Reconciler::sync_parts`]),
//! and the two must be borrowed at once.

use crate::source::SourceEvent;
use crate::source::live::LiveState;
use crate::telemetry::Telemetry;

pub struct Intake<'a> {
    pub(super) live: &'a mut LiveState,
    pub(super) telemetry: &'a Telemetry,
}

/// What one event did to the live view.
pub struct Taken {
    /// The view changed.
    pub changed: bool,
    /// A fresh full list completed.
    pub relisted: bool,
}

impl Intake<'_> {
    pub fn live(&self) -> &LiveState {
        self.live
    }

    /// Folds `event` into the live view.
    pub fn take(&mut self, event: SourceEvent) -> Taken {
        let m = &self.telemetry.metrics;
        if matches!(event, SourceEvent::Error(_)) {
            m.source_errors.inc();
        }
        let relists = self.live.relists();
        let changed = self.live.apply(event);
        let relisted = self.live.relists() > relists;
        if relisted {
            m.source_relists.inc();
        }
        m.source_synced.set(i64::from(self.live.synced()));
        self.telemetry.set_source_failing(self.live.failing());
        Taken { changed, relisted }
    }
}

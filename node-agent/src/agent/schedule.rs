//! The daemon's timers as data: when to reconcile, when to write the checkpoint, when to ask the
//! source for a fresh list, and when to wake up next.
//!
//! Everything here is pure: time comes in as an [`Instant`] argument and nothing sleeps, so unit
//! tests drive it with a made-up clock. The runner does the I/O that [`Schedule::due`] asks for
//! and reports the outcome back. Waiting costs nothing: every timer is a deadline, and with none
//! pending the next wake-up is only the heartbeat.

use std::time::{Duration, Instant};

use crate::runtime::Backoff;

/// How often the loop turns at the least, so `/healthz` can tell a stuck loop from an idle one.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// Retries of a failed reconcile: 1 s, doubling, at most a minute apart.
pub const RECONCILE_BACKOFF: Backoff =
    Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
/// Retries of a failed checkpoint write: 1 s, doubling, at most 30 s apart.
pub const CHECKPOINT_BACKOFF: Backoff =
    Backoff::new(Duration::from_secs(1), Duration::from_secs(30));

/// What is due now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Due {
    pub reconcile: bool,
    /// The periodic resync is among the reasons: the reconcile dumps the kernel.
    pub resync: bool,
    pub checkpoint: bool,
    /// Ask the source for a fresh full list (a hold is ripe for confirmation).
    pub relist: bool,
    /// Look at the IPsec key file again.
    pub keys: bool,
    /// Look for pod interfaces that did not exist yet.
    pub attach: bool,
}

/// How a reconcile went, as far as timing is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reconciled {
    /// Everything applied.
    Done,
    /// Some operations failed, or the reconcile failed as a whole: retry with backoff.
    Failed,
}

#[derive(Clone, Debug)]
pub struct Schedule {
    debounce: Duration,
    resync: Duration,
    checkpoint_interval: Duration,
    reconcile_at: Option<Instant>,
    resync_at: Instant,
    reconcile_backoff: Backoff,
    /// After a failed reconcile: nothing reconciles before this, whatever asks for it (an
    /// event, the resync, a rotation step already due, an operator). Every trigger that could
    /// come due at once would otherwise retry a failure that recurs (a kernel dump that fails)
    /// back to back.
    retry_at: Option<Instant>,
    /// The record changed since it was last written: since when.
    dirty_since: Option<Instant>,
    last_write: Option<Instant>,
    checkpoint_retry_at: Option<Instant>,
    checkpoint_backoff: Backoff,
    /// When a hold may be confirmed by a fresh list, until the source has been asked for one.
    relist_at: Option<Instant>,
    /// With IPsec: when to look at the key file again, and how often.
    keys_at: Option<(Instant, Duration)>,
    /// When the IPsec key rotation moves on by itself (a switch, a retirement).
    rotation_at: Option<Instant>,
    /// When to check the attachments again (uplinks and pod interfaces).
    attach_at: Option<Instant>,
}

impl Schedule {
    /// A schedule whose first reconcile is due at once.
    pub fn new(now: Instant, debounce: Duration, resync: Duration, checkpoint: Duration) -> Self {
        Self {
            debounce,
            resync,
            checkpoint_interval: checkpoint,
            reconcile_at: Some(now),
            resync_at: now + resync,
            reconcile_backoff: RECONCILE_BACKOFF,
            retry_at: None,
            dirty_since: None,
            last_write: None,
            checkpoint_retry_at: None,
            checkpoint_backoff: CHECKPOINT_BACKOFF,
            relist_at: None,
            keys_at: None,
            rotation_at: None,
            attach_at: None,
        }
    }

    /// How often a missing attachment is looked at: its classifier must be back before much
    /// traffic passes the interface (a link notification usually comes first).
    pub const ATTACH_POLL: Duration = Duration::from_millis(200);
    /// How often the attachments are checked when none is missing, for a device deleted or
    /// made again whose notification was lost: an `if_nametoindex` and a query each.
    pub const ATTACHED_POLL: Duration = Duration::from_secs(1);

    /// The attachments were checked: some are missing (`pending`): check again soon; or some
    /// are asked for (`watched`): check again in a while; or there are none.
    pub fn attachments_checked(&mut self, now: Instant, pending: bool, watched: bool) {
        self.attach_at = if pending {
            Some(now + Self::ATTACH_POLL)
        } else {
            watched.then(|| now + Self::ATTACHED_POLL)
        };
    }

    /// A link was made or deleted (or notifications were lost): check the attachments now.
    pub fn links_changed(&mut self, now: Instant) {
        if self.attach_at.is_some() {
            self.attach_at = Some(now);
        }
    }

    /// Look at the IPsec key file every `every`, starting `every` from `now`.
    pub fn watch_keys(&mut self, now: Instant, every: Duration) {
        self.keys_at = Some((now + every, every));
    }

    /// The key file was looked at; `changed` makes a reconcile due at once.
    pub fn keys_checked(&mut self, now: Instant, changed: bool) {
        if let Some((_, every)) = self.keys_at {
            self.keys_at = Some((now + every, every));
        }
        if changed {
            self.reconcile_now(now);
        }
    }

    /// Reconcile when the key rotation moves on by itself, if it will.
    pub fn rotation_moves_at(&mut self, at: Option<Instant>) {
        self.rotation_at = at;
    }

    /// The live view changed: reconcile after the debounce (bursts coalesce into one).
    pub fn source_changed(&mut self, now: Instant) {
        self.reconcile_soon(now + self.debounce);
    }

    /// Make the periodic resync due at once (tests drive the dump with it).
    #[cfg(test)]
    pub fn resync_now(&mut self, now: Instant) {
        self.resync_at = now;
    }

    /// The wait after a failed reconcile is over, and the retry due now (tests stand in for
    /// the time passing with it).
    #[cfg(test)]
    pub fn retry_now(&mut self, now: Instant) {
        self.retry_at = Some(now);
        self.reconcile_now(now);
    }

    /// Whether a reconcile waits to run (a change not reconciled yet, a failed one's retry):
    /// while none does, the kernel reflects the live view as the last reconcile planned it.
    pub fn reconcile_pending(&self) -> bool {
        self.reconcile_at.is_some() || self.retry_at.is_some()
    }

    /// Reconcile at once (an operator's confirmation, a fresh list a hold waits for), or as
    /// soon as a failed reconcile's backoff allows.
    pub fn reconcile_now(&mut self, now: Instant) {
        self.reconcile_soon(now);
    }

    fn reconcile_soon(&mut self, at: Instant) {
        self.reconcile_at = Some(self.reconcile_at.map_or(at, |t| t.min(at)));
    }

    /// When a coalesced checkpoint write may happen.
    fn checkpoint_at(&self) -> Option<Instant> {
        let since = self.dirty_since?;
        let coalesced = self.last_write.map(|t| t + self.checkpoint_interval);
        Some(
            [coalesced, self.checkpoint_retry_at]
                .into_iter()
                .flatten()
                .fold(since, Instant::max),
        )
    }

    /// When the next reconcile is due: the first of its triggers, but never before a failed
    /// one's retry.
    fn reconcile_due_at(&self) -> Instant {
        let first = [self.reconcile_at, self.rotation_at]
            .into_iter()
            .flatten()
            .fold(self.resync_at, Instant::min);
        self.retry_at.map_or(first, |r| first.max(r))
    }

    pub fn due(&self, now: Instant) -> Due {
        let reconcile = self.reconcile_due_at() <= now;
        Due {
            reconcile,
            resync: reconcile && self.resync_at <= now,
            checkpoint: self.checkpoint_at().is_some_and(|t| t <= now),
            relist: self.relist_at.is_some_and(|t| t <= now),
            keys: self.keys_at.is_some_and(|(t, _)| t <= now),
            attach: self.attach_at.is_some_and(|t| t <= now),
        }
    }

    /// The next moment something is due, or the heartbeat, whichever comes first.
    pub fn next_wake(&self, now: Instant) -> Instant {
        [
            Some(self.reconcile_due_at()),
            self.checkpoint_at(),
            self.relist_at,
            self.keys_at.map(|(t, _)| t),
            self.attach_at,
        ]
        .into_iter()
        .flatten()
        .fold(now + HEARTBEAT, Instant::min)
    }

    /// A reconcile ran. `changed_record` says whether the record it left differs from the one
    /// before (then a checkpoint write is due); `confirmable` is when a hold of the brake may be
    /// confirmed by a fresh list, if one is held that a list can confirm.
    pub fn reconciled(
        &mut self,
        now: Instant,
        outcome: Reconciled,
        changed_record: bool,
        confirmable: Option<Instant>,
    ) {
        self.reconcile_at = None;
        if self.rotation_at.is_some_and(|t| t <= now) {
            self.rotation_at = None;
        }
        if self.resync_at <= now {
            self.resync_at = now + self.resync;
        }
        match outcome {
            Reconciled::Done => {
                self.reconcile_backoff.reset();
                self.retry_at = None;
            }
            Reconciled::Failed => {
                let at = now + self.reconcile_backoff.next_delay();
                self.retry_at = Some(at);
                self.reconcile_soon(at);
            }
        }
        if changed_record && self.dirty_since.is_none() {
            self.dirty_since = Some(now);
        }
        self.relist_at = confirmable;
    }

    /// The source was asked for a fresh list; its arrival triggers the next reconcile.
    pub fn relist_asked(&mut self) {
        self.relist_at = None;
    }

    /// A checkpoint write was tried; returns when the next try is due after a failure.
    pub fn checkpoint_written(&mut self, now: Instant, ok: bool) -> Option<Instant> {
        if ok {
            self.dirty_since = None;
            self.last_write = Some(now);
            self.checkpoint_retry_at = None;
            self.checkpoint_backoff.reset();
            None
        } else {
            let at = now + self.checkpoint_backoff.next_delay();
            self.checkpoint_retry_at = Some(at);
            Some(at)
        }
    }

    /// Whether a checkpoint write is pending.
    pub fn dirty(&self) -> bool {
        self.dirty_since.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn schedule(t0: Instant) -> Schedule {
        Schedule::new(t0, Duration::from_millis(100), 300 * S, S)
    }

    #[test]
    fn a_link_change_makes_the_attach_check_due_at_once_and_the_periodic_one_stays_behind() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        s.reconciled(t0, Reconciled::Done, false, None);
        s.links_changed(t0);
        assert!(!s.due(t0).attach, "nothing to attach: no check");
        s.attachments_checked(t0, false, true);
        assert!(!s.due(t0).attach);
        assert!(s.due(t0 + Schedule::ATTACHED_POLL).attach, "periodic");
        s.links_changed(t0 + S / 10);
        assert!(s.due(t0 + S / 10).attach, "at once on a link change");
        s.attachments_checked(t0 + S / 10, true, true);
        assert!(
            s.due(t0 + S / 10 + Schedule::ATTACH_POLL).attach,
            "sooner while missing"
        );
    }

    #[test]
    fn key_checks_and_the_rotation_wake_the_loop_only_when_due() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        s.reconciled(t0, Reconciled::Done, false, None);
        s.watch_keys(t0, 2 * S);
        assert_eq!(s.next_wake(t0), t0 + 2 * S);
        assert!(s.due(t0 + 2 * S).keys && !s.due(t0 + 2 * S).reconcile);
        s.keys_checked(t0 + 2 * S, false);
        assert!(!s.due(t0 + 3 * S).keys && !s.due(t0 + 3 * S).reconcile);
        s.keys_checked(t0 + 4 * S, true);
        assert!(
            s.due(t0 + 4 * S).reconcile,
            "a changed file is planned at once"
        );
        s.reconciled(t0 + 4 * S, Reconciled::Done, false, None);
        s.rotation_moves_at(Some(t0 + 90 * S));
        assert!(!s.due(t0 + 89 * S).reconcile);
        assert!(s.due(t0 + 90 * S).reconcile);
        s.reconciled(t0 + 90 * S, Reconciled::Done, false, None);
        assert!(
            !s.due(t0 + 91 * S).reconcile,
            "a rotation step wakes the loop once"
        );
    }

    #[test]
    fn the_first_reconcile_is_due_at_once_then_only_on_change_or_resync() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        assert!(s.due(t0).reconcile);
        s.reconciled(t0, Reconciled::Done, false, None);
        assert!(!s.due(t0 + 10 * S).reconcile);
        assert_eq!(s.next_wake(t0), t0 + HEARTBEAT, "idle: only the heartbeat");
        // A change is reconciled after the debounce, bursts coalesced.
        s.source_changed(t0 + 20 * S);
        s.source_changed(t0 + 20 * S + Duration::from_millis(50));
        assert!(!s.due(t0 + 20 * S).reconcile);
        assert_eq!(
            s.next_wake(t0 + 20 * S),
            t0 + 20 * S + Duration::from_millis(100)
        );
        s.reconciled(t0 + 21 * S, Reconciled::Done, false, None);
        // The resync comes round on its own.
        assert!(!s.due(t0 + 299 * S).reconcile);
        assert!(s.due(t0 + 300 * S).reconcile);
        s.reconciled(t0 + 300 * S, Reconciled::Done, false, None);
        assert!(!s.due(t0 + 301 * S).reconcile);
        assert!(s.due(t0 + 600 * S).reconcile);
    }

    #[test]
    fn a_failing_reconcile_backs_off_and_a_success_resets_it() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        let mut t = t0;
        let mut gaps = Vec::new();
        let mut wakes = 0;
        for _ in 0..8 {
            s.reconciled(t, Reconciled::Failed, false, None);
            // Sleep from wake-up to wake-up, as the runner does, until the retry is due.
            let failed_at = t;
            loop {
                t = s.next_wake(t);
                wakes += 1;
                assert!(t - failed_at <= 60 * S, "no retry within a minute");
                if s.due(t).reconcile {
                    break;
                }
            }
            gaps.push((t - failed_at).as_secs());
        }
        assert_eq!(gaps, [1, 2, 4, 8, 16, 32, 60, 60]);
        let heartbeats = (t - t0).as_secs() / HEARTBEAT.as_secs();
        assert!(
            wakes <= heartbeats + 2 * 8,
            "{wakes} wake-ups in {}s: no busy loop",
            (t - t0).as_secs()
        );
        // A success resets the backoff to one second.
        s.reconciled(t, Reconciled::Done, false, None);
        s.reconciled(t + S, Reconciled::Failed, false, None);
        assert!(!s.due(t + S + S / 2).reconcile);
        assert!(s.due(t + 2 * S).reconcile);
    }

    /// Whatever asks for a reconcile while reconciles fail (events, a rotation step left due
    /// because the failed reconcile never got to move the rotation on, the resync, an
    /// operator), the retries keep the backoff's pace.
    #[test]
    fn no_trigger_hurries_the_retry_of_a_failed_reconcile() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        s.reconciled(t0, Reconciled::Done, false, None);
        s.watch_keys(t0, 2 * S);
        let mut t = t0 + 10 * S;
        let mut attempts = Vec::new();
        while t < t0 + 200 * S {
            // Every turn: an event, an operator, a rotation step due since t0 + 10 s, the key
            // file changed, and the resync at t0 + 300 s.
            s.source_changed(t);
            s.reconcile_now(t);
            s.rotation_moves_at(Some(t0 + 10 * S));
            if s.due(t).keys {
                s.keys_checked(t, true);
            }
            if s.due(t).reconcile {
                attempts.push((t - t0).as_secs());
                s.reconciled(t, Reconciled::Failed, false, None);
            }
            let next = s.next_wake(t);
            assert!(next > t, "the loop sleeps between turns");
            t = next.min(t + S / 10);
        }
        assert_eq!(attempts, [10, 11, 13, 17, 25, 41, 73, 133, 193]);
        // A success ends the backoff: the next trigger is served at once.
        s.reconciled(t, Reconciled::Done, false, None);
        s.rotation_moves_at(None);
        s.reconcile_now(t);
        assert!(s.due(t).reconcile);
    }

    #[test]
    fn checkpoint_writes_coalesce_and_failures_back_off_to_30s() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        s.reconciled(t0, Reconciled::Done, true, None);
        assert!(s.due(t0).checkpoint, "the first write goes at once");
        assert_eq!(s.checkpoint_written(t0, true), None);
        assert!(!s.due(t0).checkpoint);
        // Two changes within the interval make one write at its end.
        s.reconciled(t0 + S / 4, Reconciled::Done, true, None);
        s.reconciled(t0 + S / 2, Reconciled::Done, true, None);
        assert!(!s.due(t0 + S / 2).checkpoint);
        assert!(s.due(t0 + S).checkpoint);
        // The disk is full: retries back off, 1 s doubling to 30 s, never a busy loop.
        let mut t = t0 + S;
        let mut gaps = Vec::new();
        for _ in 0..8 {
            let next = s.checkpoint_written(t, false).expect("a retry");
            assert!(!s.due(next - Duration::from_millis(1)).checkpoint);
            assert!(s.due(next).checkpoint);
            gaps.push((next - t).as_secs());
            t = next;
        }
        assert_eq!(gaps, [1, 2, 4, 8, 16, 30, 30, 30]);
        // Space is back: the next attempt succeeds and the backoff starts over.
        s.checkpoint_written(t, true);
        assert!(!s.dirty());
        s.reconciled(t + 5 * S, Reconciled::Done, true, None);
        assert!(s.due(t + 5 * S).checkpoint);
        s.checkpoint_written(t + 5 * S, false);
        assert!(s.due(t + 6 * S).checkpoint);
    }

    #[test]
    fn a_held_brake_asks_for_one_relist_when_ripe_and_never_polls() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        s.reconciled(t0, Reconciled::Done, false, Some(t0 + 60 * S));
        assert!(!s.due(t0 + 59 * S).relist);
        assert_eq!(s.next_wake(t0 + 58 * S), t0 + 60 * S);
        assert!(s.due(t0 + 60 * S).relist);
        assert!(
            !s.due(t0 + 60 * S).reconcile,
            "no plan until the list comes"
        );
        s.relist_asked();
        assert!(!s.due(t0 + 61 * S).relist && !s.due(t0 + 61 * S).reconcile);
        assert_eq!(
            s.next_wake(t0 + 61 * S),
            t0 + 61 * S + HEARTBEAT,
            "waiting for the list costs only the heartbeat"
        );
    }

    #[test]
    fn an_operator_confirmation_reconciles_at_once() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        s.reconciled(t0, Reconciled::Done, false, None);
        s.reconcile_now(t0 + 7 * S);
        assert!(s.due(t0 + 7 * S).reconcile);
    }
}

//! The one-shot run's deadline (`--sync-timeout`): every wait before the first plan, whatever
//! blocks.
//!
//! `run --once`, `--dry-run` and `plan` wait on several things before they plan: the state
//! directory's lock and checkpoint, the kernel's objects, the source's first full list (a file
//! settling, an API server answering). Any of them can block where no timer of the run reaches:
//! a read on a hung network filesystem, a FUSE mount, a thread of the runtime's blocking pool that
//! a runtime shutdown then waits for. So the deadline is a thread of its own that knows what the
//! run is waiting for, and at the deadline reports it and ends the process. Nothing has been
//! written by then: the run is still before its first plan.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The exit status of a one-shot run that gave up: that of any other failed run.
const EXIT: i32 = 1;

#[derive(Debug)]
enum Phase {
    Waiting(String),
    Met,
}

/// A running deadline; [`Deadline::met`] disarms it.
#[derive(Debug, Clone)]
pub struct Deadline {
    state: Arc<(Mutex<Phase>, Condvar)>,
}

impl Deadline {
    /// Starts the clock: at `timeout` from now, unless met, the process ends.
    pub fn start(timeout: Duration, waiting_for: impl Into<String>) -> Self {
        let state = Arc::new((
            Mutex::new(Phase::Waiting(waiting_for.into())),
            Condvar::new(),
        ));
        let watched = state.clone();
        let end = Instant::now().checked_add(timeout);
        std::thread::Builder::new()
            .name("sync-deadline".into())
            .spawn(move || {
                if let Some(what) = wait(&watched, end) {
                    eprintln!(
                        "node-agent: gave up after {timeout:?} (--sync-timeout) waiting for {what}; nothing was changed"
                    );
                    std::process::exit(EXIT);
                }
            })
            .expect("starting the deadline's thread");
        Self { state }
    }

    /// What the run waits for now, for the message at the deadline.
    pub fn waiting_for(&self, what: impl Into<String>) {
        let mut phase = self.state.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Phase::Waiting(w) = &mut *phase {
            *w = what.into();
        }
    }

    /// The run got past its waits: the deadline no longer applies.
    pub fn met(&self) {
        *self.state.0.lock().unwrap_or_else(|e| e.into_inner()) = Phase::Met;
        self.state.1.notify_all();
    }
}

/// Waits until the phase is met (`None`) or `end` passes: what was still awaited then.
fn wait(state: &(Mutex<Phase>, Condvar), end: Option<Instant>) -> Option<String> {
    let (lock, cvar) = state;
    let mut phase = lock.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let what = match &*phase {
            Phase::Met => return None,
            Phase::Waiting(what) => what,
        };
        let now = Instant::now();
        match end {
            Some(end) if now >= end => return Some(what.clone()),
            Some(end) => {
                phase = cvar
                    .wait_timeout(phase, end - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
            None => phase = cvar.wait(phase).unwrap_or_else(|e| e.into_inner()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_met_deadline_lets_the_wait_end_without_an_answer() {
        let state = (Mutex::new(Phase::Waiting("x".into())), Condvar::new());
        *state.0.lock().unwrap() = Phase::Met;
        assert_eq!(
            wait(&state, Some(Instant::now() + Duration::from_secs(60))),
            None
        );
    }

    #[test]
    fn a_passed_deadline_names_what_was_awaited_last() {
        let state = (
            Mutex::new(Phase::Waiting("the lock".into())),
            Condvar::new(),
        );
        *state.0.lock().unwrap() = Phase::Waiting("the first full list".into());
        let end = Instant::now() + Duration::from_millis(20);
        assert_eq!(
            wait(&state, Some(end)).as_deref(),
            Some("the first full list")
        );
        assert!(Instant::now() >= end);
    }
}

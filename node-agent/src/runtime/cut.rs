//! Test cuts: one way for a test to end the process (a crash) or fail a step (a refused
//! syscall) at a chosen point of a sequence, so that recovery from *every* point can be
//! enumerated deterministically instead of hoped for with a timed kill.
//!
//! Debug builds only: `NODE_AGENT_TEST_CUT=<sequence>:<n>:<kill|fail>[,...]` cuts the `n`th
//! (from 1) point of each named sequence, before it does anything. The sequences:
//!
//! * `growth`, `recovery`: the steps of a pin transaction and of its recovery
//!   ([`crate::datapath::txn`]);
//! * `ops`: the kernel operations the reconciler applies, counted over the process's life
//!   ([`crate::backends::Backends`]); a `fail` makes that one operation fail;
//! * `checkpoint`: the checkpoint writes ([`crate::agent::checkpointer`]), so a kill lands
//!   after every kernel write of a reconcile and before its record is on disk.
//!
//! A cut prints one line to stderr (`NODE_AGENT_TEST_CUT: <sequence> step <n> (<name>):
//! <kill|fail>`), which tests count. A release build never reads the variable.

/// The variable a test sets.
pub const CUT_ENV: &str = "NODE_AGENT_TEST_CUT";
/// The exit status of a process a test cut with `kill`.
pub const CUT_EXIT: i32 = 86;

/// Where a test cuts one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    /// The point cut, from 1.
    pub at: u64,
    kill: bool,
}

impl Cut {
    /// The cut set for `sequence`, if any.
    #[cfg(debug_assertions)]
    pub fn from_env(sequence: &str) -> Option<Self> {
        let v = std::env::var(CUT_ENV).ok()?;
        v.split(',').find_map(|one| {
            let mut parts = one.split(':');
            let (s, at, how) = (parts.next()?, parts.next()?, parts.next()?);
            (s == sequence).then_some(())?;
            Some(Self {
                at: at.parse().ok()?,
                kill: match how {
                    "kill" => true,
                    "fail" => false,
                    _ => return None,
                },
            })
        })
    }

    #[cfg(not(debug_assertions))]
    pub fn from_env(_: &str) -> Option<Self> {
        None
    }

    /// Cuts point `at` of `sequence` (named `name`): ends the process at once with `kill`,
    /// else returns the injected failure.
    pub fn apply(self, sequence: &str, name: &str) -> String {
        eprintln!(
            "{CUT_ENV}: {sequence} step {} ({name}): {}",
            self.at,
            if self.kill { "kill" } else { "fail" }
        );
        if self.kill {
            // SAFETY: _exit(2) ends the process at once, as a crash would: nothing after runs,
            // no destructor, no buffered write.
            unsafe { libc::_exit(CUT_EXIT) };
        }
        "failed by the test (injected)".into()
    }
}

/// A sequence counted as it goes, cut where the environment says.
#[derive(Debug)]
pub struct Counted {
    sequence: &'static str,
    done: u64,
    cut: Option<Cut>,
}

impl Counted {
    pub fn new(sequence: &'static str) -> Self {
        Self {
            sequence,
            done: 0,
            cut: Cut::from_env(sequence),
        }
    }

    /// Where among the next `n` points the cut falls (0-based), if it does; counts them as done.
    pub fn within(&mut self, n: usize) -> Option<(usize, Cut)> {
        let first = self.done + 1;
        self.done += n as u64;
        let cut = self.cut.filter(|c| (first..=self.done).contains(&c.at))?;
        Some(((cut.at - first) as usize, cut))
    }

    /// Counts the next point, named `name`; the injected failure if it is the one cut.
    pub fn next(&mut self, name: &str) -> Result<(), String> {
        match self.within(1) {
            Some((_, cut)) => Err(cut.apply(self.sequence, name)),
            None => Ok(()),
        }
    }

    pub fn sequence(&self) -> &'static str {
        self.sequence
    }

    /// How many points have been counted.
    pub fn done(&self) -> u64 {
        self.done
    }
}

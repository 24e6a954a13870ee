//! The agent's side of the checkpoint file: open and load at start, write when the schedule
//! says so. The store does the file work (lock, atomic replace, corrupt files moved aside); this
//! adds what the agent does about each outcome.

use std::cell::RefCell;
use std::path::{Path, PathBuf};

use state::checkpoint::{self, Checkpoint, CheckpointStore, LoadOutcome, StoreError, Unusable};
use state::input::Problem;

use super::AgentError;
use crate::runtime::cut::Counted;

pub struct Checkpointer {
    /// `None` in a dry run: nothing is locked and nothing is written.
    store: Option<CheckpointStore>,
    dir: PathBuf,
    /// The writes so far, where a test may cut one ([`crate::runtime::cut`]).
    writes: RefCell<Counted>,
    /// The node's pin lock ([`Checkpointer::lock_pins`]), held as long as the store's.
    pins: Option<std::fs::File>,
}

impl Checkpointer {
    /// Locks the state directory and loads the checkpoint, moving a corrupt one aside; in a dry
    /// run, reads the file as it is without locking.
    pub fn open(dir: &Path, dry_run: bool) -> Result<(Self, Option<Checkpoint>), AgentError> {
        if dry_run {
            let cp = read(dir)?;
            return Ok((
                Self {
                    store: None,
                    dir: dir.to_owned(),
                    writes: RefCell::new(Counted::new("checkpoint")),
                    pins: None,
                },
                cp,
            ));
        }
        let store = CheckpointStore::open(dir)?;
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
        Ok((
            Self {
                store: Some(store),
                dir: dir.to_owned(),
                writes: RefCell::new(Counted::new("checkpoint")),
                pins: None,
            },
            restored,
        ))
    }

    /// Takes the node's pin lock: an exclusive `flock` on `<bpffs>/node-agent` itself, kept
    /// with the state directory's for the life of the agent (invariant 11). A second agent with
    /// another `--state-dir` (an operator's `run --once`) would otherwise detach the first's
    /// classifiers and prune its objects as orphans; every agent that writes to the kernel
    /// writes the pins, so this one lock keeps them apart. A
    /// dry run (and `plan`, `state show`, `ipsec status`, `prune`, which only read, or write
    /// only in the state directory) takes neither lock. The descriptor is close-on-exec and the
    /// lock dies with the process: a restarted daemon never waits on its predecessor.
    pub fn lock_pins(&mut self, bpffs: &Path) -> Result<(), AgentError> {
        if self.store.is_none() {
            return Ok(());
        }
        crate::datapath::check_bpffs(bpffs).map_err(crate::backends::OpenError::from)?;
        self.pins = Some(checkpoint::lock_pin_dir(&crate::datapath::pin_dir(bpffs))?);
        Ok(())
    }

    /// Whether writes happen at all (not in a dry run).
    pub fn writes(&self) -> bool {
        self.store.is_some()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `cp`; returns its size. Nothing happens in a dry run.
    pub fn write(&self, cp: &Checkpoint) -> Result<usize, StoreError> {
        match &self.store {
            Some(store) => {
                if let Err(injected) = self.writes.borrow_mut().next("write the checkpoint") {
                    return Err(StoreError::Io {
                        what: "writing checkpoint",
                        path: store.path(),
                        source: std::io::Error::other(injected),
                    });
                }
                store.write(cp)
            }
            None => Ok(0),
        }
    }
}

/// The checkpoint as it is on disk, without taking the lock (for dry runs and `plan`). One the
/// input gate refuses or that does not decode is planned without, as a locked start would after
/// moving it aside.
fn read(dir: &Path) -> Result<Option<Checkpoint>, AgentError> {
    let path = dir.join(checkpoint::store::FILE_NAME);
    match checkpoint::read(&path) {
        Ok(cp) => Ok(cp),
        Err(Unusable::Refused(e)) if matches!(e.problem, Problem::Io(_)) => Err(e.into()),
        Err(e) => {
            tracing::warn!(path = %path.display(), "checkpoint unusable ({e}); planning on the kernel sweep alone");
            Ok(None)
        }
    }
}

//! The agent: one reconciler that owns every kernel mutation, fed by a node source.
//!
//! [`reconciler::Reconciler`] joins the source's live view, the agent's record and the kernel
//! (through the [`crate::kernel::Kernel`] seam) with the state crate's planner, and
//! [`reconciler::apply`] carries a plan out in phases. [`schedule::Schedule`] is the daemon's
//! timers as data, [`checkpointer`] the checkpoint file, [`hold_file`] the operator's side of a
//! held prune; [`runner`] is the daemon loop around them all, and the one-shot form (`--once`,
//! `--dry-run`, `node-agent plan`).

pub mod checkpointer;
pub mod config;
pub mod deadline;
pub mod drift;
pub mod hold_file;
pub mod intake;
pub mod reconciler;
pub mod report;
mod runner;
pub mod schedule;

use state::checkpoint::StoreError;

pub use config::AgentConfig;
pub use reconciler::Reconciler;
pub use runner::{ExitStatus, run, run_once};

use crate::kernel::DumpError;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Invariant 11: one agent per node (per state directory, and per node's pins). The
    /// message names the holder's PID.
    #[error("node-agent is already running: {0}")]
    AlreadyRunning(StoreError),
    #[error(transparent)]
    Store(StoreError),
    #[error(transparent)]
    Input(#[from] state::input::InputError),
    #[error(transparent)]
    Open(#[from] crate::backends::OpenError),
    #[error("kernel inventory: {0}")]
    Dump(#[from] DumpError),
    #[error("removing invalid node-ID map entries: {0}")]
    Purge(#[from] crate::kernel::OpError),
    #[error("the node source ended before completing a full list")]
    SourceEnded,
    #[error("the node source cannot deliver a list: {0}")]
    SourceUnusable(String),
    #[error("installing the signal handlers: {0}")]
    Signal(#[source] std::io::Error),
}

impl From<StoreError> for AgentError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::AlreadyRunning { .. } | StoreError::PinsHeld { .. } => {
                Self::AlreadyRunning(e)
            }
            other => Self::Store(other),
        }
    }
}

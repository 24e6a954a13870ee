//! The agent: one reconciler that owns every kernel mutation, fed by a node source.
//!
//! [`reconciler::Reconciler`] joins the source's live view, the checkpoint and the kernel
//! backends through the state crate's planner; [`run`] is the daemon loop around it and
//! [`run_once`] the one-shot form (`--once`, `--dry-run`, `node-agent plan`).

pub mod config;
pub mod reconciler;
pub mod report;
mod runner;

pub use config::AgentConfig;
pub use reconciler::{AgentError, Reconciler};
pub use runner::{ExitStatus, run, run_once};

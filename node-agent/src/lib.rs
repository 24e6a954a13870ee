//! node-agent: programs the kernel state of every remote node and cleans it up after restarts.
//!
//! See `docs/design.md` for the architecture. This crate holds the I/O side: the datapath loader,
//! the kernel backends and the command line.

pub mod agent;
pub mod backends;
pub mod cli;
pub mod datapath;
pub mod kernel;
pub mod runtime;
pub mod source;
pub mod telemetry;

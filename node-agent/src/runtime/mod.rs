//! What the running process itself relies on, whichever part of it asks: the agent's clock,
//! the pace of retries, and handing freed memory back. The agent, the node sources and the
//! telemetry all use these, so they live under none of them.

pub mod backoff;
pub mod clock;
pub mod memory;

pub use backoff::Backoff;
pub use clock::{AgentClock, wall_clock};

//! What the running process itself relies on, whichever part of it asks: the agent's clock,
//! the pace of retries, handing freed memory back, the capabilities checked at start-up, and the
//! points where tests cut it short. The agent, the node sources, the telemetry and the command
//! line all use these, so they live under none of them.

pub mod backoff;
pub mod caps;
pub mod clock;
pub mod cut;
pub mod memory;

pub use backoff::Backoff;
pub use clock::{AgentClock, wall_clock};

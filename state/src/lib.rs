//! Node model, checkpoint and reconcile planner.
//!
//! Everything here is pure except the checkpoint store, whose only I/O is the checkpoint file.

pub mod address_policy;
pub mod checkpoint;
mod family;
pub mod ids;
pub mod input;
pub mod inventory;
pub mod node;
pub mod objects;
pub mod plan;
pub mod rotation;
pub mod spi;
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod testing;
pub mod text;

/// Public at the crate's top, where the tests' oracle and the backends' tooling derive the
/// same objects the planner does.
pub use plan::desired;

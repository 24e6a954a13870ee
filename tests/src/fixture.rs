//! Small builders the test files share: where the workspace is, and operation lists for the
//! backends. Nodes are built by [`crate::agent::TestNode`] (and [`crate::agent::k8s_node`] for
//! the API server's objects).

use node_agent::kernel::OpError;
use state::objects::{KernelObject, Op};

pub use xtask::host::workspace_root;

/// A replace of each object.
pub fn upserts(objs: &[KernelObject]) -> Vec<Op> {
    objs.iter().cloned().map(Op::Replace).collect()
}

/// A delete of each object.
pub fn deletes(objs: &[KernelObject]) -> Vec<Op> {
    objs.iter().cloned().map(Op::Delete).collect()
}

/// Panics with the first failed operation of a backend's results.
pub fn all_ok(results: Vec<Result<(), OpError>>) {
    for r in results {
        r.unwrap_or_else(|e| panic!("operation failed: {e}"));
    }
}

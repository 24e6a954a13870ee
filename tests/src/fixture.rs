//! Small builders the test files share: where the workspace is, and operation lists for the
//! backends. Nodes are built by [`crate::agent::TestNode`] (and [`crate::agent::k8s_node`] for
//! the API server's objects).

use std::path::{Path, PathBuf};

use node_agent::backends::OpError;
use state::objects::{KernelObject, Op};

/// The workspace root (the tests crate lives in `tests/` inside it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the workspace")
        .to_owned()
}

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

//! Small builders the test files share: where the workspace is, operation lists for the
//! backends, and xfrm objects. Nodes are built by [`crate::agent::TestNode`] (and [`crate::agent::k8s_node`] for
//! the API server's objects).

use node_agent::kernel::OpError;
use state::objects::{KernelObject, KeyTag, Op, Spi, XfrmDir, XfrmPolicy, XfrmState};
use state::testing::{id, ip, net};

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

/// The SPI of the xfrm objects built here: key 3, in the key layout.
pub const XFRM_SPI: u8 = 3;

/// Node `node`'s OUT policy toward pod CIDR `dst` through `tmpl_dst`, from this node
/// (`10.0.0.1` or `fd00::1`).
pub fn xfrm_policy(node: u16, dst: &str, tmpl_dst: &str) -> XfrmPolicy {
    let v6 = dst.contains(':');
    XfrmPolicy {
        src: net(if v6 { "::/0" } else { "0.0.0.0/0" }),
        dst: net(dst),
        dir: XfrmDir::Out,
        node_id: id(node),
        tmpl_src: ip(if v6 { "fd00::1" } else { "10.0.0.1" }),
        tmpl_dst: ip(tmpl_dst),
        spi: Spi::from_wire(XFRM_SPI.into()).unwrap(),
    }
}

/// Node `node`'s state from `src` to `dst`, holding the key tagged `key`.
pub fn xfrm_state(node: u16, src: &str, dst: &str, dir: XfrmDir, key: KeyTag) -> XfrmState {
    XfrmState {
        src: ip(src),
        dst: ip(dst),
        spi: Spi::from_wire(XFRM_SPI.into()).unwrap(),
        dir,
        node_id: id(node),
        key,
    }
}

//! Kernel backends: each one dumps the objects it owns and applies the planner's operations,
//! reporting what the kernel really did with each one.
//!
//! The planner (`state::plan`) decides; backends never decide anything. Ownership is decided
//! by markers, never by guesswork: map entries are ours because we own the map, routes carry our
//! route protocol, xfrm objects carry our mark bits. A dump lists only what carries the marker,
//! so anything else in the kernel can never reach a delete.

pub mod map;
pub mod routes;
pub mod xfrm;

use std::future::Future;

use state::objects::{KernelObject, ObjectKind, Op};

/// Why one operation failed. Per-operation, so one bad node never stops the others.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error("node-ID map full at {capacity} entries; raise --node-map-max")]
    MapFull { capacity: u32 },
    #[error("gateway {gateway} is unreachable for route {dst}: {source}")]
    GatewayUnreachable {
        dst: ipnet::IpNet,
        gateway: std::net::IpAddr,
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Kernel {
        what: String,
        source: std::io::Error,
    },
    #[error("the {kind:?} backend is not enabled")]
    Disabled { kind: ObjectKind },
}

/// Why a whole dump failed.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error("dumping {kind:?} objects: {source}")]
    Kernel {
        kind: ObjectKind,
        source: std::io::Error,
    },
}

/// One kind of kernel state.
pub trait Backend {
    /// The kind of object this backend owns.
    fn kind(&self) -> ObjectKind;

    /// Every object carrying our marker, as the kernel has it now.
    fn dump(&mut self) -> impl Future<Output = Result<Vec<KernelObject>, DumpError>> + Send;

    /// Applies `ops` (all of this backend's kind) and returns one result per op, in order.
    fn apply(&mut self, ops: &[Op]) -> impl Future<Output = Vec<Result<(), OpError>>> + Send;
}

/// The three backends behind one interface: the reconciler dumps and applies through this.
///
/// A backend is `None` where it is not in use: the map in a dry run before any pin exists,
/// routes when disabled. A missing backend dumps nothing and fails every op of its kind.
pub struct Backends {
    pub map: Option<map::MapBackend>,
    pub routes: Option<routes::RouteBackend>,
    /// Owns both xfrm kinds: states and policies.
    pub xfrm: Option<xfrm::XfrmBackend>,
}

impl Backends {
    /// Everything we own in the kernel, all kinds together.
    pub async fn dump(&mut self) -> Result<Vec<KernelObject>, DumpError> {
        let mut all = Vec::new();
        if let Some(m) = &mut self.map {
            all.extend(m.dump().await?);
        }
        if let Some(r) = &mut self.routes {
            all.extend(r.dump().await?);
        }
        if let Some(x) = &mut self.xfrm {
            all.extend(x.dump().await?);
        }
        Ok(all)
    }

    /// Applies `ops` in order, each by the backend of its kind; one result per op.
    ///
    /// Consecutive ops of one kind go to their backend as a batch, so backends can pipeline,
    /// while the order across kinds is kept (the plan orders deletes before the upserts that
    /// might reuse an identity).
    pub async fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        let mut results = Vec::with_capacity(ops.len());
        for chunk in ops.chunk_by(|a, b| a.object().kind() == b.object().kind()) {
            let kind = chunk[0].object().kind();
            match kind {
                ObjectKind::MapEntry => match &mut self.map {
                    Some(m) => results.extend(m.apply(chunk).await),
                    None => results.extend(chunk.iter().map(|_| Err(OpError::Disabled { kind }))),
                },
                ObjectKind::Route => match &mut self.routes {
                    Some(r) => results.extend(r.apply(chunk).await),
                    None => results.extend(chunk.iter().map(|_| Err(OpError::Disabled { kind }))),
                },
                ObjectKind::XfrmState | ObjectKind::XfrmPolicy => match &mut self.xfrm {
                    Some(x) => results.extend(x.apply(chunk).await),
                    None => results.extend(chunk.iter().map(|_| Err(OpError::Disabled { kind }))),
                },
            }
        }
        results
    }
}

//! What can go wrong across the seam, and what the kernel's route announcements tell.

use state::objects::ObjectKind;

/// Why one operation failed. Per-operation, so one bad node never stops the others.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error("{map} map full at {capacity} entries; raise --node-map-max")]
    MapFull { map: &'static str, capacity: u32 },
    #[error("gateway {gateway} is unreachable for {object}: {source}")]
    GatewayUnreachable {
        /// The route or nexthop, in words.
        object: String,
        gateway: std::net::IpAddr,
        source: std::io::Error,
    },
    /// An exclusive create found something at the identity: it appeared since the dump. It is
    /// left alone; the next dump shows what it is.
    #[error(
        "{what} is not written: something else is there (it appeared since the last dump) and is left alone"
    )]
    Occupied { what: String },
    /// A delete found a route using the object (a route through a nexthop), which the kernel
    /// would delete along: the object is left alone and the next reconcile dumps and reports it.
    #[error(
        "{what} is not deleted: {user} goes through it now, and the kernel would delete it along; left alone"
    )]
    InUse { what: String, user: String },
    #[error("{what}: {source}")]
    Kernel {
        what: String,
        source: std::io::Error,
    },
    #[error("the {kind:?} backend is not enabled")]
    Disabled { kind: ObjectKind },
    /// Not attempted: the node's map entry could not be written (invariant 17).
    #[error("not attempted: the node's map entry could not be written")]
    Skipped,
    /// Not attempted: someone else kept changing routes at this route's destination while
    /// the reconcile's dumps were read, and a replace would take theirs.
    #[error(
        "not attempted: someone else changed the route at {0} in our table while each of this \
         reconcile's dumps was read; it is replaced once a dump sees it settled"
    )]
    RouteContested(ipnet::IpNet),
    /// Not attempted: the route's nexthop could not be written.
    #[error("not attempted: the node's nexthop could not be written")]
    NexthopMissing,
    /// Not attempted: a route operation failed, so a route may still go through the nexthop,
    /// and deleting it would delete that route too. The next reconcile tries again.
    #[error("not attempted yet: a route may still go through it (a route operation failed)")]
    RoutesUnsettled,
}

/// Why a whole dump failed. A failed dump is retried; a partial inventory never reaches the
/// planner, so it can never turn into deletes.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error("dumping {} objects: {source}", kind.name())]
    Kernel {
        kind: ObjectKind,
        source: std::io::Error,
    },
    #[error("reading the host's addresses: {source}")]
    Host { source: std::io::Error },
}

/// What the announcements say about routes at some destinations since the last full dump began.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoutesSinceDump {
    /// No one else changed a route in our table at any of them.
    Untouched,
    /// Someone else changed a route in our table at one of them: what the dump found there may
    /// no longer be ours.
    Touched,
    /// Not known: no dump completed since announcements were last lost, or no watch.
    Unknown,
}

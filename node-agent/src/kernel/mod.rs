//! The reconciler's one seam to the kernel: the [`Kernel`] trait, the errors and answers that
//! cross it, and (for unit tests) one fake behind it.
//!
//! [`crate::backends::Backends`] implements it with netlink and the pinned maps; unit tests
//! implement it with `fake::FakeKernel` (built for tests only), which holds objects in memory
//! and fails on command. The same behaviours stay proven against the real kernel in the kernel
//! tier: the fake adds speed and fault injection, it replaces nothing.
//!
//! The seam depends on the state crate alone, so that the agent above it and the backends below
//! it both depend on it and never on each other's insides.

mod error;
#[cfg(test)]
pub mod fake;

pub use error::{DumpError, OpError, RoutesSinceDump};

use std::future::Future;
use std::time::Duration;

use ipnet::IpNet;

use state::checkpoint::RecentRemovals;
use state::ids::FreedId;
use state::inventory::Inventory;
use state::objects::{NexthopId, Op};
use state::plan::HostAddresses;
use state::rotation::FileKey;

/// What the reconciler needs from the kernel.
pub trait Kernel {
    /// Every object of ours, and the identities foreign objects occupy. All of it or an error:
    /// a partial inventory must never reach the planner, where missing objects could read as
    /// gone.
    fn dump(&mut self) -> impl Future<Output = Result<Inventory, DumpError>>;

    /// What the host holds, which the address policy counts as the local node's: every
    /// address of its interfaces and every on-link prefix of its main table. Read after each
    /// dump; the on-link prefixes may be those that dump found.
    fn host(&mut self) -> impl Future<Output = Result<HostAddresses, DumpError>>;

    /// Applies `ops` in order; one result per op.
    fn apply(&mut self, ops: &[Op]) -> impl Future<Output = Vec<Result<(), OpError>>>;

    /// Whether each of `ids` holds a nexthop of ours now (read back, not from the last view).
    fn nexthops_ours(
        &mut self,
        ids: &[NexthopId],
    ) -> impl Future<Output = Vec<Result<(), OpError>>>;

    /// Removes what the last dump found that can be no object of ours (a map entry with an
    /// undecodable key or ID 0); returns how many.
    fn purge_junk(&mut self) -> impl Future<Output = Result<usize, OpError>>;

    /// The freed node IDs the kernel remembers, so their cool-down survives a lost checkpoint
    /// (invariant 5).
    fn freed_ids(&mut self) -> Result<Vec<FreedId>, OpError>;

    /// Remembers freed node IDs in the kernel.
    fn remember_freed(&mut self, freed: &[FreedId]) -> Result<(), OpError>;

    /// The removals the brake let through that the kernel remembers, so that its window
    /// survives a lost checkpoint (invariant 9); `None` when the kernel's record was made by
    /// this start and knows nothing of the ones before.
    fn recent_removals(&mut self) -> Option<Vec<RecentRemovals>>;

    /// Remembers a removal the brake let through; entries it displaces from a full record are
    /// merged into it while they are younger than `keep_since`.
    fn remember_removal(
        &mut self,
        removal: RecentRemovals,
        keep_since: Duration,
    ) -> Result<(), OpError>;

    /// The IPsec keys states are written with, read again from the key file (the kernel side
    /// holds the key material; the planner sees SPIs and tags only); `None` without IPsec.
    fn ipsec_keys(&mut self) -> Option<KeyRead>;

    /// Grows the node-ID and pod-CIDR maps to `capacity` entries under the running datapath.
    fn grow_maps(&mut self, capacity: u32) -> Result<(), OpError>;

    /// Whether routes go through nexthop objects: the kernel has them and they are not turned
    /// off.
    fn route_nexthops(&self) -> bool;

    /// Whether anyone else changed a route in our table at any of `at` since the last dump
    /// began, as far as the kernel's announcements tell: while no one did, the routes the
    /// last view holds as ours there are still ours, and a plan may replace them.
    fn routes_since_dump(&mut self, at: &[IpNet]) -> RoutesSinceDump;

    /// Checks every attachment the configuration asks for (uplinks and pod interfaces) and
    /// makes the missing ones whose interface exists; returns what is still missing, one
    /// readiness line per interface.
    fn check_attachments(&mut self) -> Vec<String>;
}

/// The IPsec keys, as the planner sees them.
#[derive(Clone, Debug)]
pub struct KeyRead {
    /// In key-file order; the last good ones when the file cannot be used now.
    pub keys: Vec<FileKey>,
    /// Changes whenever the file's bytes change.
    pub digest: [u8; 32],
    /// Why the file as it is now cannot be used (unreadable, invalid): the keys above are the
    /// previous ones.
    pub error: Option<String>,
    /// The tags of the states of these keys, by node pair.
    pub tags: std::sync::Arc<dyn state::plan::KeyTags>,
}

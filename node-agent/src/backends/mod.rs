//! Kernel backends: each one dumps the objects it owns (and the foreign objects at identities it
//! would write) and applies the planner's operations, reporting what the kernel really did with
//! each one.
//!
//! The planner (`state::plan`) decides; backends never decide anything. Ownership is decided
//! by markers, never by guesswork: map entries are ours because we own the map, routes carry our
//! route protocol, xfrm objects carry our mark bits. A dump lists as ours only what carries the
//! marker, so anything else in the kernel can never reach a delete.
//!
//! [`Backends`] puts them behind the reconciler's one seam, [`crate::kernel::Kernel`], and
//! [`Backends::open`] opens them from their own [`BackendsConfig`].

pub mod host;
pub mod map;
pub mod netlink;
pub mod nexthops;
mod open;
pub mod routes;
pub mod users_watch;
pub mod xfrm;

use std::future::Future;
use std::time::Duration;

use ipnet::IpNet;

use state::checkpoint::RecentRemovals;
use state::ids::FreedId;
use state::inventory::Inventory;
use state::objects::{KernelObject, NexthopId, ObjectKind, Op};
use state::plan::HostAddresses;

pub use self::open::{BackendsConfig, OpenError, load_datapath};
use self::users_watch::UsersWatch;
use self::xfrm::KeyFileState;
use crate::datapath::maps::NodeMapError;
use crate::datapath::pins::RecordError;
use crate::datapath::records::{FreedIds, RecentRemovalsRecord};
use crate::datapath::{Datapath, node_ids_pin, pod_cidrs_pin};
use crate::kernel::{DumpError, Kernel, KeyRead, OpError, RoutesSinceDump};
use crate::runtime::cut::Counted;

/// One kind of kernel state.
pub trait Backend {
    /// Adds every object carrying our marker, as the kernel has it now, to `inv`, and the
    /// identities of foreign objects that sit where ours would go.
    fn dump_into(&mut self, inv: &mut Inventory) -> impl Future<Output = Result<(), DumpError>>;

    /// Applies `ops` (all of this backend's kinds) and returns one result per op, in order.
    fn apply(&mut self, ops: &[Op]) -> impl Future<Output = Vec<Result<(), OpError>>>;

    /// Our objects alone, in identity order (for tools and tests).
    fn dump(&mut self) -> impl Future<Output = Result<Vec<KernelObject>, DumpError>> {
        async {
            let mut inv = Inventory::new();
            self.dump_into(&mut inv).await?;
            let mut objects: Vec<KernelObject> = inv.objects().cloned().collect();
            objects.sort();
            Ok(objects)
        }
    }
}

/// The backends behind one interface: the reconciler dumps and applies through this.
///
/// A backend is `None` where it is not in use: the maps in a dry run before any pin exists,
/// the xfrm backend and the pod-CIDR map without IPsec. A missing backend dumps nothing and
/// fails every op of its kind.
pub struct Backends {
    pub map: Option<map::MapBackend>,
    /// The pod-CIDR map: with IPsec, and without it where a run with IPsec left it, so that
    /// its marks are removed.
    pub pod_cidrs: Option<map::PodCidrBackend>,
    pub routes: Option<routes::RouteBackend>,
    /// `None` where the kernel has no nexthop objects. Open also with `--route-nexthops false`,
    /// so that the nexthops an earlier run made are dumped and removed.
    pub nexthops: Option<nexthops::NexthopBackend>,
    /// Routes go through nexthops: the kernel has them and they are not turned off.
    route_nexthops: bool,
    /// Owns the xfrm kinds: states, policies and guards. Open without IPsec too where a run
    /// with IPsec left some ([`open::leftover_xfrm`]), so that they are dumped and removed: its
    /// marks, policies and guards would go on encrypting toward peers, or dropping, with no
    /// agent keeping them.
    pub xfrm: Option<xfrm::XfrmBackend>,
    /// IPsec is off and `xfrm` is there only for that cleanup: a dump it cannot make is
    /// reported and taken as empty, never the reconcile's failure.
    xfrm_leftovers_only: bool,
    /// The IPsec key file and what it held when last read.
    pub key_file: Option<KeyFileState>,
    /// The kernel's record of freed node IDs; `None` in a dry run before it exists.
    pub freed: Option<FreedIds>,
    /// The kernel's record of the brake's recent removals; `None` in a dry run before it exists.
    pub removals: Option<RecentRemovalsRecord>,
    /// The loaded datapath (not in a dry run): the map backend writes what it reads.
    pub datapath: Option<Datapath>,
    /// Whether anything could have come to use our nexthops since the last dump; `None` where
    /// the announcements cannot be joined, and then every nexthop delete reads the routes.
    pub watch: Option<UsersWatch>,
    /// The kernel operations applied so far, where a test may cut one ([`crate::runtime::cut`]).
    ops: Counted,
}

impl Backends {
    /// Applies `ops` through the backend of each one's kind, in order.
    async fn apply_kinds(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        let mut results = Vec::with_capacity(ops.len());
        for chunk in ops.chunk_by(|a, b| a.object().kind() == b.object().kind()) {
            let kind = chunk[0].object().kind();
            let disabled = || chunk.iter().map(|_| Err(OpError::Disabled { kind }));
            match kind {
                ObjectKind::MapEntry => match &mut self.map {
                    Some(m) => results.extend(m.apply(chunk).await),
                    None => results.extend(disabled()),
                },
                ObjectKind::PodCidrEntry => match &mut self.pod_cidrs {
                    Some(p) => results.extend(p.apply(chunk).await),
                    None => results.extend(disabled()),
                },
                ObjectKind::Nexthop => match &mut self.nexthops {
                    Some(n) => results.extend(
                        nexthops::apply_nexthops(
                            n,
                            self.routes.as_mut(),
                            self.watch.as_mut(),
                            chunk,
                        )
                        .await,
                    ),
                    None => results.extend(disabled()),
                },
                ObjectKind::Route => match &mut self.routes {
                    Some(r) => results.extend(r.apply(chunk).await),
                    None => results.extend(disabled()),
                },
                ObjectKind::XfrmState | ObjectKind::XfrmPolicy | ObjectKind::XfrmGuard => {
                    match &mut self.xfrm {
                        Some(x) => results.extend(x.apply(chunk).await),
                        None => results.extend(disabled()),
                    }
                }
            }
        }
        results
    }

    /// Reads the key file again; new keys go to the xfrm backend.
    fn reload_keys(&mut self) -> Option<KeyRead> {
        let state = self.key_file.as_mut()?;
        if let (Some(book), Some(x)) = (state.reload(), &mut self.xfrm) {
            x.set_keys(book);
        }
        Some(state.read())
    }

    /// Every backend's objects, in one inventory.
    async fn dump_all(&mut self) -> Result<Inventory, DumpError> {
        let mut inv = Inventory::new();
        if let Some(m) = &mut self.map {
            m.dump_into(&mut inv).await?;
            // A remote node has about as many routes and nexthops as map entries: room for them
            // at once, rather than growing by doubling (each rehashes every object so far; at
            // 65,000 nodes that was a tenth of an unchanged restart). Room not used is address
            // space, never touched.
            inv.reserve(2 * inv.len());
        }
        if let Some(p) = &mut self.pod_cidrs {
            p.dump_into(&mut inv).await?;
        }
        if let Some(n) = &mut self.nexthops {
            n.dump_into(&mut inv).await?;
        }
        if let Some(r) = &mut self.routes {
            r.dump_into(&mut inv).await?;
        }
        if let Some(x) = &mut self.xfrm {
            match x.dump_into(&mut inv).await {
                Err(e) if self.xfrm_leftovers_only => tracing::warn!(
                    "IPsec is off; looking for xfrm objects an earlier run left: {e}; taken as none"
                ),
                r => r?,
            }
        }
        Ok(inv)
    }
}

impl Kernel for Backends {
    async fn dump(&mut self) -> Result<Inventory, DumpError> {
        if let Some(w) = &mut self.watch {
            w.dumping();
        }
        let dumped = self.dump_all().await;
        if let (Err(_), Some(w)) = (&dumped, &mut self.watch) {
            w.forget();
        }
        dumped
    }

    async fn host(&mut self) -> Result<HostAddresses, DumpError> {
        match &mut self.routes {
            Some(r) => r.host().await,
            None => Ok(HostAddresses::default()),
        }
    }

    /// Applies `ops` in order, each by the backend of its kind; one result per op.
    ///
    /// Consecutive ops of one kind go to their backend together, so backends can batch them,
    /// while the order across kinds is kept (the plan orders deletes before the upserts that
    /// might reuse an identity).
    async fn nexthops_ours(&mut self, ids: &[NexthopId]) -> Vec<Result<(), OpError>> {
        match &mut self.nexthops {
            Some(n) => n.still_ours(ids).await,
            None => ids
                .iter()
                .map(|_| {
                    Err(OpError::Disabled {
                        kind: ObjectKind::Nexthop,
                    })
                })
                .collect(),
        }
    }

    async fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        let Some((at, cut)) = self.ops.within(ops.len()) else {
            return self.apply_kinds(ops).await;
        };
        // A test's cut: the operations before it are applied, then it ends the process or
        // fails that one operation, and those after it are applied.
        let mut results = self.apply_kinds(&ops[..at]).await;
        let object = ops[at].object().to_string();
        let injected = cut.apply(self.ops.sequence(), &object);
        results.push(Err(OpError::Kernel {
            what: object,
            source: std::io::Error::other(injected),
        }));
        results.extend(self.apply_kinds(&ops[at + 1..]).await);
        results
    }
    async fn purge_junk(&mut self) -> Result<usize, OpError> {
        let mut purged = 0;
        if let Some(m) = &mut self.map {
            purged += m.purge_invalid()?;
        }
        if let Some(p) = &mut self.pod_cidrs {
            purged += p.purge_invalid()?;
        }
        Ok(purged)
    }

    fn freed_ids(&mut self) -> Result<Vec<FreedId>, OpError> {
        match &self.freed {
            Some(f) => f.read().map_err(freed_error),
            None => Ok(Vec::new()),
        }
    }

    fn remember_freed(&mut self, freed: &[FreedId]) -> Result<(), OpError> {
        match &mut self.freed {
            Some(f) => f.write(freed).map_err(freed_error),
            None => Ok(()),
        }
    }

    fn recent_removals(&mut self) -> Option<Vec<RecentRemovals>> {
        self.removals.as_ref().and_then(RecentRemovalsRecord::read)
    }

    fn remember_removal(
        &mut self,
        removal: RecentRemovals,
        keep_since: Duration,
    ) -> Result<(), OpError> {
        match &mut self.removals {
            Some(r) => r.push(removal, keep_since).map_err(|e| OpError::Kernel {
                what: "the kernel's record of recent removals".into(),
                source: std::io::Error::other(e.to_string()),
            }),
            None => Ok(()),
        }
    }

    fn ipsec_keys(&mut self) -> Option<KeyRead> {
        self.reload_keys()
    }

    fn route_nexthops(&self) -> bool {
        self.route_nexthops
    }

    fn routes_since_dump(&mut self, at: &[IpNet]) -> RoutesSinceDump {
        self.watch
            .as_mut()
            .map_or(RoutesSinceDump::Unknown, |w| w.since_dump(at))
    }

    fn grow_maps(&mut self, capacity: u32) -> Result<(), OpError> {
        let Some(datapath) = &mut self.datapath else {
            return Err(OpError::Disabled {
                kind: ObjectKind::MapEntry,
            });
        };
        let bpffs = datapath.config().bpffs.clone();
        let reopen = |e: NodeMapError| OpError::Kernel {
            what: "opening the grown maps".into(),
            source: std::io::Error::other(e.to_string()),
        };
        let result = datapath.grow(capacity);
        // Whatever happened, the backends write to the maps pinned now, at their capacity.
        let now = datapath.capacity();
        self.map = Some(map::MapBackend::open(&node_ids_pin(&bpffs), now).map_err(reopen)?);
        if self.pod_cidrs.is_some() {
            self.pod_cidrs =
                Some(map::PodCidrBackend::open(&pod_cidrs_pin(&bpffs), now).map_err(reopen)?);
        }
        result.map_err(|e| OpError::Kernel {
            what: format!("growing the maps to {capacity} entries"),
            source: std::io::Error::other(e.to_string()),
        })
    }

    fn check_attachments(&mut self) -> Vec<String> {
        self.datapath
            .as_mut()
            .map(|d| crate::datapath::attachments::describe(d.check_attachments()))
            .unwrap_or_default()
    }
}

fn freed_error(e: RecordError) -> OpError {
    OpError::Kernel {
        what: "the kernel's record of freed node IDs".into(),
        source: std::io::Error::other(e.to_string()),
    }
}

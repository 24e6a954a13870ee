//! Kernel backends: each one dumps the objects it owns (and the foreign objects at identities it
//! would write) and applies the planner's operations, reporting what the kernel really did with
//! each one.
//!
//! The planner (`state::plan`) decides; backends never decide anything. Ownership is decided
//! by markers, never by guesswork: map entries are ours because we own the map, routes carry our
//! route protocol, xfrm objects carry our mark bits. A dump lists as ours only what carries the
//! marker, so anything else in the kernel can never reach a delete.
//!
//! [`Backends`] puts them behind the reconciler's one seam, [`crate::agent::kernel::Kernel`].

pub mod batch;
pub mod map;
pub mod netlink;
pub mod nexthops;
pub mod pod_cidrs;
pub mod request;
pub mod routes;
pub mod users_watch;
pub mod xfrm;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;

pub use users_watch::RoutesSinceDump;
use users_watch::UsersWatch;

use state::checkpoint::RecentRemovals;
use state::ids::FreedId;
use state::inventory::Inventory;
use state::objects::{KernelObject, NexthopId, ObjectId, ObjectKind, Op};
use state::rotation::FileKey;

use std::sync::Arc;

use self::xfrm::keys::{KeyBook, KeyError, KeyFile};
use crate::agent::AgentConfig;
use crate::agent::kernel::{Kernel, KeyRead};
use crate::datapath::pins::RecordError;
use crate::datapath::{Datapath, DatapathError, node_ids_pin, pod_cidrs_pin};
use crate::freed_ids::{self, FreedIds};
use crate::node_map::NodeMapError;
use crate::recent_removals::{self, RecentRemovalsRecord};

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
}

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

/// Why the kernel side could not be opened at start-up.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error(transparent)]
    NodeMap(Box<NodeMapError>),
    /// The freed-ID record or the record of recent removals.
    #[error(transparent)]
    Record(Box<RecordError>),
    #[error("opening the routing netlink socket: {0}")]
    Netlink(std::io::Error),
    #[error("opening the xfrm netlink socket: {0}")]
    XfrmSocket(std::io::Error),
    #[error(transparent)]
    IpsecKey(#[from] KeyError),
    /// IPsec is configured but the kernel cannot create ESP states: a start-up error, since
    /// running without the encryption the operator asked for is worse than not running.
    #[error(transparent)]
    Esp(#[from] xfrm::ProbeError),
}

impl From<RecordError> for OpenError {
    fn from(e: RecordError) -> Self {
        Self::Record(Box::new(e))
    }
}

impl From<NodeMapError> for OpenError {
    fn from(e: NodeMapError) -> Self {
        Self::NodeMap(Box::new(e))
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
    pub pod_cidrs: Option<pod_cidrs::PodCidrBackend>,
    pub routes: Option<routes::RouteBackend>,
    /// `None` where the kernel has no nexthop objects. Open also with `--route-nexthops false`,
    /// so that the nexthops an earlier run made are dumped and removed.
    pub nexthops: Option<nexthops::NexthopBackend>,
    /// Routes go through nexthops: the kernel has them and they are not turned off.
    route_nexthops: bool,
    /// Owns the xfrm kinds: states, policies and guards. Open without IPsec too where a run
    /// with IPsec left some ([`leftover_xfrm`]), so that they are dumped and removed: its
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
}

impl Backends {
    /// Opens everything the agent writes: loads and attaches the datapath (reusing compatible
    /// pins), opens the maps, the freed-ID record, the netlink sockets, and with IPsec the key
    /// file, checking that the kernel can create ESP states. With `dry_run` nothing is created,
    /// attached or written: the maps are opened only if they already exist.
    pub async fn open(config: &AgentConfig, dry_run: bool) -> Result<Self, OpenError> {
        let bpffs = &config.datapath.bpffs;
        let capacity = config.datapath.node_map_max;
        let pin = node_ids_pin(bpffs);
        let cidr_pin = pod_cidrs_pin(bpffs);
        let freed_pin = freed_ids::pin(bpffs);
        let removals_pin = recent_removals::pin(bpffs);
        let ipsec = config.ipsec_key_file.is_some();
        // IPsec's prerequisites first (a valid key file, a kernel with ESP): a start-up that
        // fails on them changes nothing.
        let (xfrm, key_file) = match &config.ipsec_key_file {
            None => (leftover_xfrm(dry_run).await, None),
            Some(path) => {
                let file = KeyFile::load(path)?;
                warn_about(&file);
                let mut state = KeyFileState::new(path.clone(), &file);
                let backend = xfrm::XfrmBackend::new(KeyBook::new(file.keys))
                    .map_err(OpenError::XfrmSocket)?;
                state.book = backend.book();
                if !dry_run {
                    backend.probe_esp().await?;
                    backend.probe_policy_marks().await?;
                }
                (Some(backend), Some(state))
            }
        };
        let datapath = match dry_run {
            true => None,
            false => Some(load_datapath(&config.datapath)?),
        };
        // In a dry run the pins are read only if they exist; otherwise the load made them.
        let exists = |p: &PathBuf| !dry_run || p.exists();
        let map = match exists(&pin) {
            true => Some(map::MapBackend::open(&pin, capacity)?),
            false => None,
        };
        let pod_cidrs = match (ipsec && exists(&cidr_pin)) || cidr_pin.exists() {
            true => Some(pod_cidrs::PodCidrBackend::open(&cidr_pin, capacity)?),
            false => None,
        };
        let freed = match (dry_run, freed_pin.exists()) {
            (false, _) => Some(FreedIds::open_or_create(&freed_pin)?),
            (true, true) => Some(FreedIds::open(&freed_pin)?),
            (true, false) => None,
        };
        let removals = match (dry_run, removals_pin.exists()) {
            (false, _) => Some(RecentRemovalsRecord::open_or_create(&removals_pin)?),
            (true, true) => Some(RecentRemovalsRecord::open(&removals_pin)?),
            (true, false) => None,
        };
        let routes = routes::RouteBackend::new(config.route_protocol, config.route_table)
            .map_err(OpenError::Netlink)?;
        let nexthops = nexthops::NexthopBackend::open(config.route_protocol)
            .await
            .map_err(OpenError::Netlink)?;
        if config.route_nexthops && nexthops.is_none() {
            tracing::warn!(
                "this kernel has no nexthop objects (they came in 5.3): routes carry their gateways"
            );
        }
        let watch = UsersWatch::open(config.route_protocol, config.route_table)
            .inspect_err(|e| {
                tracing::warn!(
                    "route and nexthop announcements unavailable ({e}): every node removal reads the routes"
                );
            })
            .ok();
        Ok(Self {
            map,
            pod_cidrs,
            routes: Some(routes),
            route_nexthops: config.route_nexthops && nexthops.is_some(),
            nexthops,
            xfrm,
            xfrm_leftovers_only: !ipsec,
            key_file,
            freed,
            removals,
            datapath,
            watch,
        })
    }
}

/// Loads the datapath at the pinned maps' capacity, and grows them online to the configured one
/// if that is larger (`--node-map-max` raised over an existing pin).
fn load_datapath(config: &crate::datapath::DatapathConfig) -> Result<Datapath, OpenError> {
    let wanted = config.node_map_max;
    let mut at_pin = config.clone();
    if let Some(pinned) = crate::datapath::pinned_capacity(&config.bpffs)? {
        at_pin.node_map_max = pinned.min(wanted);
    }
    let mut datapath = Datapath::load(&at_pin)?;
    datapath.grow(wanted)?;
    Ok(datapath)
}

/// The IPsec key file: where it is, and what the last good read found (never the key material,
/// which only the xfrm backend holds).
pub struct KeyFileState {
    path: PathBuf,
    keys: Vec<FileKey>,
    digest: [u8; 32],
    /// The last error, so it is logged once, not at every read.
    error: Option<String>,
    /// The keys, shared with the xfrm backend.
    book: Arc<KeyBook>,
}

impl KeyFileState {
    fn new(path: PathBuf, file: &KeyFile) -> Self {
        Self {
            path,
            keys: file_keys(file),
            digest: file.digest,
            error: None,
            book: Arc::default(),
        }
    }

    fn read(&self) -> KeyRead {
        KeyRead {
            keys: self.keys.clone(),
            digest: self.digest,
            error: self.error.clone(),
            tags: self.book.clone(),
        }
    }
}

/// Logs what is worth knowing about a key file just read: its permissions, global keys.
fn warn_about(file: &KeyFile) {
    for w in &file.warnings {
        tracing::warn!(path = %file.path.display(), "{w}");
    }
    for k in file.keys.iter().filter(|k| !k.per_pair()) {
        tracing::warn!(
            spi = k.spi(),
            "IPsec key SPI {} is one key for every node pair: their GCM nonces overlap, and a \
             rebooted node's traffic is dropped by its peers' anti-replay windows until the key \
             is rotated; write it as `{}+` for per-pair keys",
            k.spi(),
            k.spi()
        );
    }
}

fn file_keys(file: &KeyFile) -> Vec<FileKey> {
    file.keys
        .iter()
        .map(|k| FileKey {
            spi: k.spi(),
            tag: k.tag(),
        })
        .collect()
}

impl Backends {
    /// Reads the key file again; new keys go to the xfrm backend. A file that cannot be used
    /// keeps the previous keys, and says why once.
    fn reload_keys(&mut self) -> Option<KeyRead> {
        let state = self.key_file.as_mut()?;
        match KeyFile::load(&state.path) {
            Ok(file) if file.digest == state.digest => state.error = None,
            Ok(file) => {
                warn_about(&file);
                state.keys = file_keys(&file);
                state.digest = file.digest;
                state.error = None;
                let spis: Vec<u8> = state.keys.iter().map(|k| k.spi).collect();
                tracing::info!(path = %state.path.display(), ?spis, "IPsec key file changed");
                state.book = Arc::new(KeyBook::new(file.keys));
                if let Some(x) = &mut self.xfrm {
                    x.set_keys(state.book.clone());
                }
            }
            Err(e) => {
                let e = e.to_string();
                if state.error.as_ref() != Some(&e) {
                    tracing::error!("{e}; keeping the keys read before");
                }
                state.error = Some(e);
            }
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

/// With IPsec off, an xfrm backend only to remove what a run with IPsec left: none where the
/// kernel has no xfrm netlink or nothing of ours is there now (this run makes none). Before
/// anything is removed, the kernel must match policy marks exactly (the probe IPsec runs at
/// start): on one that does not, a delete of our policy would take someone else's unmarked
/// policy at its selector, and the leftovers are left, reported.
async fn leftover_xfrm(dry_run: bool) -> Option<xfrm::XfrmBackend> {
    let mut backend = xfrm::XfrmBackend::new(KeyBook::default())
        .inspect_err(|e| tracing::debug!("no xfrm netlink ({e}): no IPsec objects to look for"))
        .ok()?;
    let mut found = Inventory::new();
    if let Err(e) = backend.dump_into(&mut found).await {
        tracing::warn!("IPsec is off; looking for xfrm objects an earlier run left: {e}");
        return None;
    }
    if found.is_empty() {
        return None;
    }
    if !dry_run && let Err(e) = backend.probe_policy_marks().await {
        tracing::warn!(
            "IPsec is off, and {} xfrm objects an earlier run left stay: {e}",
            found.len()
        );
        return None;
    }
    Some(backend)
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
                        apply_nexthops(n, self.routes.as_mut(), self.watch.as_mut(), chunk).await,
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
                Some(pod_cidrs::PodCidrBackend::open(&pod_cidrs_pin(&bpffs), now).map_err(reopen)?);
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

/// Applies nexthop operations. Deleting a nexthop deletes every route through it (and changes
/// every group holding it), and the kernel has no lookup of a nexthop's users, so before any
/// delete every route and group is read (a dump of the routes and of the groups alone, not of
/// the whole kernel): a nexthop something still goes through is left alone
/// ([`OpError::InUse`]), whoever's the user is. If they cannot be read, no nexthop is deleted.
pub async fn apply_nexthops(
    nexthops: &mut nexthops::NexthopBackend,
    routes: Option<&mut routes::RouteBackend>,
    watch: Option<&mut UsersWatch>,
    ops: &[Op],
) -> Vec<Result<(), OpError>> {
    let deleting: HashSet<ObjectId> = ops
        .iter()
        .filter(|op| matches!(op, Op::Delete(_)))
        .map(|op| op.object().id())
        .collect();
    if deleting.is_empty() {
        return nexthops.apply(ops).await;
    }
    let users = users_of(nexthops, routes, watch, &deleting).await;
    let blocked = |op: &Op| -> Option<OpError> {
        if !matches!(op, Op::Delete(_)) {
            return None;
        }
        match &users {
            Err(e) => Some(OpError::Kernel {
                what: format!(
                    "{} {}: reading what might go through it: {e}",
                    op.verb(),
                    op.object()
                ),
                source: std::io::Error::from_raw_os_error(libc::EAGAIN),
            }),
            Ok(users) => users.get(&op.object().id()).map(|user| OpError::InUse {
                what: op.object().to_string(),
                user: user.clone(),
            }),
        }
    };
    let mut results: Vec<Option<Result<(), OpError>>> =
        ops.iter().map(|op| blocked(op).map(Err)).collect();
    let allowed: Vec<Op> = ops
        .iter()
        .zip(&results)
        .filter(|(_, r)| r.is_none())
        .map(|(op, _)| op.clone())
        .collect();
    let mut applied = nexthops.apply(&allowed).await.into_iter();
    for r in results.iter_mut().filter(|r| r.is_none()) {
        *r = applied.next();
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or(Err(OpError::Skipped)))
        .collect()
}

/// What goes through each of the nexthops `ids` now: routes, and groups. Nothing is read when
/// `watch` says nothing could have come to use our nexthops since the last read: the plan
/// already knows every user then (the planner keeps the nexthops others use, and our routes
/// go before their nexthops). Otherwise this is a read of its own: of every route and group.
pub async fn users_of(
    nexthops: &mut nexthops::NexthopBackend,
    routes: Option<&mut routes::RouteBackend>,
    mut watch: Option<&mut UsersWatch>,
    ids: &HashSet<ObjectId>,
) -> Result<HashMap<ObjectId, String>, DumpError> {
    if let Some(w) = watch.as_deref_mut() {
        if w.unchanged_since_read() {
            return Ok(HashMap::new());
        }
        w.reading();
    }
    let read = async {
        let mut users = nexthops.groups_holding(ids).await?;
        if let Some(r) = routes {
            for (id, user) in r.users_of(ids).await? {
                users.entry(id).or_insert(user);
            }
        }
        Ok(users)
    }
    .await;
    if let (Err(_), Some(w)) = (&read, watch) {
        w.forget();
    }
    read
}

fn freed_error(e: RecordError) -> OpError {
    OpError::Kernel {
        what: "the kernel's record of freed node IDs".into(),
        source: std::io::Error::other(e.to_string()),
    }
}

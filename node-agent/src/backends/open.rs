//! Opening the kernel side at start-up: the datapath, the pinned maps and records, the netlink
//! sockets, and with IPsec the key file and the ESP checks.

use std::path::PathBuf;

use super::users_watch::UsersWatch;
use super::xfrm::KeyFileState;
use super::xfrm::keys::{KeyBook, KeyError, KeyFile};
use super::{Backend, Backends, map, nexthops, routes, xfrm};
use crate::datapath::maps::NodeMapError;
use crate::datapath::pins::RecordError;
use crate::datapath::records::{FreedIds, RecentRemovalsRecord, freed_ids, recent_removals};
use crate::datapath::{Datapath, DatapathConfig, DatapathError, node_ids_pin, pod_cidrs_pin};
use state::inventory::Inventory;

/// What the backends need to know to open: the part of the agent's configuration that is about
/// the kernel.
#[derive(Clone, Debug)]
pub struct BackendsConfig {
    pub datapath: DatapathConfig,
    /// Route protocol number that marks our routes.
    pub route_protocol: u8,
    pub route_table: u32,
    /// Routes go through nexthop objects where the kernel has them.
    pub route_nexthops: bool,
    /// The IPsec key file; `None` runs without xfrm state.
    pub ipsec_key_file: Option<PathBuf>,
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

impl Backends {
    /// Opens everything the agent writes: loads and attaches the datapath (reusing compatible
    /// pins), opens the maps, the freed-ID record, the netlink sockets, and with IPsec the key
    /// file, checking that the kernel can create ESP states. With `dry_run` nothing is created,
    /// attached or written: the maps are opened only if they already exist.
    pub async fn open(config: &BackendsConfig, dry_run: bool) -> Result<Self, OpenError> {
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
                xfrm::key_file::warn_about(&file);
                let mut state = KeyFileState::new(path.clone(), &file);
                let backend = xfrm::XfrmBackend::new(KeyBook::new(file.keys))
                    .map_err(OpenError::XfrmSocket)?;
                state.set_book(backend.book());
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
            true => Some(map::PodCidrBackend::open(&cidr_pin, capacity)?),
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
            ops: crate::runtime::cut::Counted::new("ops"),
        })
    }
}

/// The start's datapath: loads it at the pinned maps' own capacities, and grows both maps
/// online (a pin transaction) to the larger of the pins' capacities and the configured one:
/// `--node-map-max` raised over existing pins, or pins of unequal capacities. No map shrinks.
pub fn load_datapath(config: &DatapathConfig) -> Result<Datapath, OpenError> {
    let mut datapath = Datapath::load(config)?;
    let pinned = crate::datapath::pinned_capacity(&config.bpffs)?;
    datapath.grow(pinned.map_or(config.node_map_max, |p| p.max(config.node_map_max)))?;
    Ok(datapath)
}

/// With IPsec off, an xfrm backend only to remove what a run with IPsec left: none where the
/// kernel has no xfrm netlink or nothing of ours is there now (this run makes none). Before
/// anything is removed, the kernel must match policy marks exactly (the probe IPsec runs at
/// start): on one that does not, a delete of our policy would take someone else's unmarked
/// policy at its selector, and the leftovers are left, reported.
pub(super) async fn leftover_xfrm(dry_run: bool) -> Option<xfrm::XfrmBackend> {
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

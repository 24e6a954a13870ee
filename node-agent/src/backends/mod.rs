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

pub mod map;
pub mod routes;
pub mod xfrm;

use std::future::Future;

use state::ids::FreedId;
use state::inventory::Inventory;
use state::objects::{KernelObject, ObjectKind, Op};
use state::plan::IpsecConfig;

use crate::agent::AgentConfig;
use crate::agent::kernel::Kernel;
use crate::datapath::{Datapath, DatapathError, node_ids_pin};
use crate::freed_ids::{self, FreedIds, FreedIdsError};
use crate::ipsec_key::{KeyError, KeyFile};
use crate::node_map::NodeMapError;

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
    /// An exclusive create found something at the identity: it appeared since the dump. It is
    /// left alone; the next dump shows what it is.
    #[error(
        "{what} is not written: something else is there (it appeared since the last dump) and is left alone"
    )]
    Occupied { what: String },
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
    #[error(transparent)]
    FreedIds(#[from] FreedIdsError),
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

impl From<NodeMapError> for OpenError {
    fn from(e: NodeMapError) -> Self {
        Self::NodeMap(Box::new(e))
    }
}

/// The backends behind one interface: the reconciler dumps and applies through this.
///
/// A backend is `None` where it is not in use: the map in a dry run before any pin exists,
/// routes when disabled. A missing backend dumps nothing and fails every op of its kind.
pub struct Backends {
    pub map: Option<map::MapBackend>,
    pub routes: Option<routes::RouteBackend>,
    /// Owns both xfrm kinds: states and policies.
    pub xfrm: Option<xfrm::XfrmBackend>,
    /// The kernel's record of freed node IDs; `None` in a dry run before it exists.
    pub freed: Option<FreedIds>,
    /// The loaded datapath (not in a dry run): the map backend writes what it reads.
    pub datapath: Option<Datapath>,
}

impl Backends {
    /// Opens everything the agent writes: loads and attaches the datapath (reusing compatible
    /// pins), opens the map, the freed-ID record, the netlink sockets, and with IPsec the key
    /// file, checking that the kernel can create ESP states. With `dry_run` nothing is created,
    /// attached or written: the maps are opened only if they already exist. Returns the IPsec
    /// settings the planner needs.
    pub async fn open(
        config: &AgentConfig,
        dry_run: bool,
    ) -> Result<(Self, Option<IpsecConfig>), OpenError> {
        let bpffs = &config.datapath.bpffs;
        let pin = node_ids_pin(bpffs);
        let freed_pin = freed_ids::pin(bpffs);
        let (datapath, map, freed) = if dry_run {
            let map = match pin.exists() {
                true => Some(map::MapBackend::open(&pin, config.datapath.node_map_max)?),
                false => None,
            };
            let freed = match freed_pin.exists() {
                true => Some(FreedIds::open(&freed_pin)?),
                false => None,
            };
            (None, map, freed)
        } else {
            let dp = Datapath::load(&config.datapath)?;
            let map = map::MapBackend::open(&pin, config.datapath.node_map_max)?;
            (
                Some(dp),
                Some(map),
                Some(FreedIds::open_or_create(&freed_pin)?),
            )
        };
        let routes = routes::RouteBackend::new(config.route_protocol, config.route_table)
            .map_err(OpenError::Netlink)?;
        let (xfrm, ipsec) = match &config.ipsec_key_file {
            None => (None, None),
            Some(path) => {
                let file = KeyFile::load(path)?;
                let spi = file.key.spi();
                let backend =
                    xfrm::XfrmBackend::new(Some(file.key)).map_err(OpenError::XfrmSocket)?;
                if !dry_run {
                    backend.probe_esp().await?;
                }
                (Some(backend), Some(IpsecConfig { spi }))
            }
        };
        Ok((
            Self {
                map,
                routes: Some(routes),
                xfrm,
                freed,
                datapath,
            },
            ipsec,
        ))
    }
}

impl Kernel for Backends {
    async fn dump(&mut self) -> Result<Inventory, DumpError> {
        let mut inv = Inventory::new();
        if let Some(m) = &mut self.map {
            m.dump_into(&mut inv).await?;
        }
        if let Some(r) = &mut self.routes {
            r.dump_into(&mut inv).await?;
        }
        if let Some(x) = &mut self.xfrm {
            x.dump_into(&mut inv).await?;
        }
        Ok(inv)
    }

    /// Applies `ops` in order, each by the backend of its kind; one result per op.
    ///
    /// Consecutive ops of one kind go to their backend as a batch, so backends can pipeline,
    /// while the order across kinds is kept (the plan orders deletes before the upserts that
    /// might reuse an identity).
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
                ObjectKind::Route => match &mut self.routes {
                    Some(r) => results.extend(r.apply(chunk).await),
                    None => results.extend(disabled()),
                },
                ObjectKind::XfrmState | ObjectKind::XfrmPolicy => match &mut self.xfrm {
                    Some(x) => results.extend(x.apply(chunk).await),
                    None => results.extend(disabled()),
                },
            }
        }
        results
    }

    async fn purge_junk(&mut self) -> Result<usize, OpError> {
        match &mut self.map {
            Some(m) => m.purge_invalid(),
            None => Ok(0),
        }
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
}

fn freed_error(e: FreedIdsError) -> OpError {
    OpError::Kernel {
        what: "the kernel's record of freed node IDs".into(),
        source: std::io::Error::other(e.to_string()),
    }
}

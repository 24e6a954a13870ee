//! What the agent needs to know to run, independent of how the command line spells it.

use std::path::PathBuf;
use std::time::Duration;

use state::rotation::Delays;

use crate::backends::BackendsConfig;
use crate::datapath::DatapathConfig;

#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// The node this agent runs on: never programmed as a remote node.
    pub node_name: String,
    /// Holds the lock and the checkpoint (`nodes.ckpt`).
    pub state_dir: PathBuf,
    pub datapath: DatapathConfig,
    /// Route protocol number that marks our routes.
    pub route_protocol: u8,
    /// The maps grow online when they fill up.
    pub node_map_grow: bool,
    /// Routes go through nexthop objects where the kernel has them.
    pub route_nexthops: bool,
    pub route_table: u32,
    /// Largest share of known remote nodes one prune may delete without confirmation.
    pub max_prune_ratio: f64,
    /// Delete even when the brake would hold.
    pub force_prune: bool,
    /// How long a held prune must persist, across a fresh full list, before it goes ahead.
    pub prune_confirm_delay: Duration,
    /// Full kernel dump and repair interval.
    pub resync_interval: Duration,
    /// Wait between source events and the reconcile they trigger, to coalesce bursts.
    pub debounce: Duration,
    /// Shortest interval between two checkpoint writes.
    pub checkpoint_interval: Duration,
    /// Whether ExternalIPs get map entries (InternalIPs always do).
    pub include_external_ips: bool,
    /// How long a freed node ID rests before reuse.
    pub id_cooldown: Duration,
    /// At the edge of the ID space, how long a freed ID cools at least before an early reuse.
    pub id_reuse_floor: Duration,
    /// The highest node ID handed out: 65535, or less where a test shrinks the ID space.
    pub max_node_id: u16,
    /// With `--once`: how long to wait for the source's first full list.
    pub sync_timeout: Duration,
    /// The IPsec key file; `None` runs without xfrm state.
    pub ipsec_key_file: Option<PathBuf>,
    /// How a key rotation proceeds (`state::rotation`).
    pub key_delays: Delays,
}

impl AgentConfig {
    pub fn new(
        node_name: impl Into<String>,
        state_dir: impl Into<PathBuf>,
        bpffs: impl Into<PathBuf>,
    ) -> Self {
        Self {
            node_name: node_name.into(),
            state_dir: state_dir.into(),
            datapath: DatapathConfig::new(bpffs),
            route_protocol: crate::backends::routes::DEFAULT_ROUTE_PROTOCOL,
            route_nexthops: true,
            node_map_grow: true,
            route_table: crate::backends::routes::MAIN_TABLE,
            max_prune_ratio: 0.5,
            force_prune: false,
            prune_confirm_delay: Duration::from_secs(60),
            resync_interval: Duration::from_secs(300),
            debounce: Duration::from_millis(100),
            checkpoint_interval: Duration::from_secs(1),
            include_external_ips: false,
            id_cooldown: Duration::from_secs(15 * 60),
            id_reuse_floor: Duration::from_secs(2 * 60),
            max_node_id: state::ids::MAX_ID,
            sync_timeout: Duration::from_secs(120),
            ipsec_key_file: None,
            key_delays: Delays {
                propagation: Duration::from_secs(90),
                retirement: Duration::from_secs(300),
            },
        }
    }

    /// What the kernel backends are opened with.
    pub fn backends(&self) -> BackendsConfig {
        BackendsConfig {
            datapath: self.datapath.clone(),
            route_protocol: self.route_protocol,
            route_table: self.route_table,
            route_nexthops: self.route_nexthops,
            ipsec_key_file: self.ipsec_key_file.clone(),
        }
    }
}

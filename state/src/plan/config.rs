//! What the planner is configured with: the local node, the brake's ratios, the map's size, and
//! the IPsec keys in use (with how each state's key is told, [`KeyTags`]).

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;

use crate::checkpoint::KeySeen;
use crate::ids::MAX_ID;
use crate::objects::{KeyTag, SpiLayout};

/// IPsec settings that shape the desired objects.
#[derive(Clone, Debug)]
pub struct IpsecConfig {
    /// The SPI traffic is sent with (1..=15, it lives in 4 mark bits): the map entries carry it.
    pub send_spi: u8,
    /// Every key whose states and policies exist now: the one sent with and, during a
    /// rotation, the one rotated in (received, not yet sent with) or out (still received).
    pub keys: Vec<KeyInUse>,
    /// When the agent first saw each key of the key file: written into the checkpoint, so a
    /// rotation resumes on its schedule after a restart ([`crate::rotation`]).
    pub seen: Vec<KeySeen>,
    /// What each state's key is, by node pair: the key file's own key, or one derived per pair.
    pub tags: Arc<dyn KeyTags>,
}

impl PartialEq for IpsecConfig {
    fn eq(&self, other: &Self) -> bool {
        self.send_spi == other.send_spi
            && self.keys == other.keys
            && self.seen == other.seen
            && Arc::ptr_eq(&self.tags, &other.tags)
    }
}

impl IpsecConfig {
    /// The SPI layout traffic is sent in: the layout of the key sent with.
    pub fn send_layout(&self) -> SpiLayout {
        self.keys
            .iter()
            .find(|k| k.spi == self.send_spi)
            .map_or(SpiLayout::Key, |k| k.layout)
    }

    /// One global key, sent with: no rotation under way.
    pub fn single(spi: u8, tag: KeyTag) -> Self {
        Self {
            send_spi: spi,
            keys: vec![KeyInUse {
                spi,
                tag,
                layout: SpiLayout::Key,
            }],
            seen: Vec::new(),
            tags: Arc::new(GlobalTags),
        }
    }
}

/// A key whose states exist: its number, the tag of the key file's key, and how its states lay
/// out their SPI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyInUse {
    pub spi: u8,
    pub tag: KeyTag,
    pub layout: SpiLayout,
}

/// The two ends of a state and their boot IDs: what a per-pair key is derived from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pair<'a> {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub src_boot: &'a str,
    pub dst_boot: &'a str,
}

/// The tag of the key a state holds. The planner compares tags, never keys: the implementation
/// that knows the keys (the agent's key book) lives with the kernel side.
pub trait KeyTags: fmt::Debug + Send + Sync {
    fn tag(&self, key: &KeyInUse, pair: &Pair<'_>) -> KeyTag;

    /// A plan is about to ask for tags (an implementation that remembers derived keys may
    /// forget those no recent plan asked for).
    fn plan_begins(&self) {}
}

/// Global keys: every state of a key holds the key file's key itself.
#[derive(Debug)]
pub struct GlobalTags;

impl KeyTags for GlobalTags {
    fn tag(&self, key: &KeyInUse, _: &Pair<'_>) -> KeyTag {
        key.tag
    }
}

/// What the host holds, read from its kernel: the local node's, whether or not its Kubernetes
/// record lists it. A remote node's address among `addresses` is the local node's; a remote pod
/// CIDR that overlaps one of `on_link` would take the host's own link (its gateway, its
/// neighbours), so it is judged as one overlapping a local pod CIDR.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostAddresses {
    /// Every address assigned to one of the host's interfaces, both families (loopback and
    /// link-local addresses left out: the policy refuses them anyway).
    pub addresses: Vec<IpAddr>,
    /// Every on-link prefix of the main table: its routes with no gateway, such as the
    /// kernel's connected routes (never a default route, never one of ours).
    pub on_link: Vec<OnLink>,
}

/// A prefix the host reaches on a link, without a gateway.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OnLink {
    pub prefix: IpNet,
    /// The interface's name (its index when it has none now).
    pub device: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlanConfig {
    /// The node this agent runs on; never treated as a remote node.
    pub local_node: String,
    /// This node's boot ID (per-pair IPsec keys are derived from it).
    pub local_boot_id: String,
    /// This node's addresses; the first of each family is the xfrm endpoint. They are the local
    /// node's, whatever a remote node claims (invariant 14), and map entries for them are
    /// deleted (ID 0, the local node, is implicit).
    pub local_addresses: Vec<IpAddr>,
    /// This node's pod CIDRs: with IPsec, remote nodes tunnel traffic toward them, so an IN
    /// state is wanted in each of their families and no other.
    pub local_pod_cidrs: Vec<IpNet>,
    /// What the host itself holds, as the kernel says: the local node's too, whatever its
    /// Kubernetes record lists (the address policy).
    pub host: HostAddresses,
    pub ipsec: Option<IpsecConfig>,
    /// Largest share of known remote nodes (or of our objects, for orphans) that removals may
    /// reach within the window without a confirmation.
    pub max_prune_ratio: f64,
    /// Removals of at least this share are a near-total wipe: only an operator confirms them.
    pub wipe_ratio: f64,
    /// Release every hold now (`--force-prune`).
    pub force_prune: bool,
    /// How long a hold must last before a fresh full list may confirm it; also the window over
    /// which removals are counted together.
    pub confirm_delay: Duration,
    /// Whether a fresh full list after the confirm delay releases a hold (the daemon), or only
    /// `force_prune` and an operator's confirmation do (one-shot runs).
    pub confirm_by_relist: bool,
    /// Entries the node-ID map holds.
    pub map_capacity: usize,
    pub id_cooldown: Duration,
    /// At the edge of the ID space, how long a freed ID cools at least before it is reused early
    /// (`state::ids` says why 2 minutes).
    pub id_reuse_floor: Duration,
    /// The highest node ID handed out: [`MAX_ID`] except where a test shrinks the ID space.
    pub max_node_id: u16,
    /// Whether ExternalIPs get map entries too (InternalIPs always do).
    pub include_external_ips: bool,
    /// Routes go through a nexthop object per node and family (kernels from 5.3); otherwise
    /// each route carries its gateway.
    pub route_nexthops: bool,
    /// Written into the checkpoint.
    pub agent_version: String,
}

impl Default for PlanConfig {
    fn default() -> Self {
        Self {
            local_node: String::new(),
            local_boot_id: String::new(),
            local_addresses: Vec::new(),
            local_pod_cidrs: Vec::new(),
            host: HostAddresses::default(),
            ipsec: None,
            max_prune_ratio: 0.5,
            wipe_ratio: 0.9,
            force_prune: false,
            confirm_delay: Duration::from_secs(60),
            confirm_by_relist: false,
            map_capacity: 65_536,
            id_cooldown: Duration::from_secs(15 * 60),
            id_reuse_floor: Duration::from_secs(2 * 60),
            max_node_id: MAX_ID,
            include_external_ips: true,
            route_nexthops: true,
            agent_version: String::new(),
        }
    }
}

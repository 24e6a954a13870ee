//! What a plan is made from: the live view, the input as a whole, the local node's own
//! addresses and pod CIDRs, and (for an event-sized plan) what lies outside its part.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use foldhash::{HashSet, HashSetExt};
use ipnet::IpNet;

use super::brake_memory::BrakeMemory;
use super::config::{OnLink, PlanConfig};
use super::resource::mapped_ips;
use crate::checkpoint::Checkpoint;
use crate::ids::{AllocatorState, IdSet};
use crate::inventory::Inventory;
use crate::node::{AddressKind, Node};
use crate::objects::KernelObject;

/// A live node none of whose records validated. Its UID, when its record has a readable one,
/// picks the agent's record of this very node among several of its name: after a node was
/// replaced under its name, or a list from another cluster with the same names, the name alone
/// would hand it another node's record, and that node's objects with it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MalformedNode {
    pub name: String,
    /// Empty when unknown: then the agent's newest record of the name stands in.
    pub uid: String,
}

impl MalformedNode {
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            uid: String::new(),
        }
    }
}

/// The nodes the source reports now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LiveView {
    /// Valid records, one per name (the source keeps a node's last good record when a new one
    /// does not validate). Shared with the source's own state: a view of 65,000 nodes is then a
    /// vector of pointers, not a copy of every node.
    pub nodes: Vec<Arc<Node>>,
    /// Live nodes with no valid record at all: their latest record does not validate and the
    /// source never had a good one. The agent's own record of them stands in (invariant 8).
    pub malformed: Vec<MalformedNode>,
    /// The source completed its first full list (Kubernetes: `InitDone`).
    pub synced: bool,
    /// Full lists completed so far that contained the local node: a hold is confirmed only by
    /// such a list, newer than the hold (invariants 15 and 16).
    pub relists: u64,
}

#[derive(Clone, Copy, Debug)]
pub struct PlanInput<'a> {
    /// The agent's record: the checkpoint it restored, then the one each reconcile implies.
    pub record: Option<&'a Checkpoint>,
    pub live: &'a LiveView,
    pub inventory: &'a Inventory,
    pub allocator: &'a AllocatorState,
    pub brake: &'a BrakeMemory,
    /// A hold an operator confirmed, by its ID (`node-agent prune confirm`).
    pub confirmed_hold: Option<&'a str>,
    /// Since the Unix epoch.
    pub now: Duration,
    pub config: &'a PlanConfig,
}

/// The local node's addresses and pod CIDRs: always its own (invariant 14). What the host
/// holds counts too: its addresses among the local node's, and its on-link prefixes, which no
/// remote pod CIDR may overlap.
pub(super) struct Local {
    /// The local node's addresses, listed or the host's own.
    pub ips: HashSet<IpAddr>,
    pub cidrs: HashSet<IpNet>,
    /// The host's on-link prefixes, but those equal to a local pod CIDR (a remote node
    /// claiming one of those is a claim on the local node's, judged as such). Never a prefix of
    /// length 0, which would overlap every CIDR of its family.
    pub on_link: Vec<OnLink>,
    /// The live view has a valid record of the local node with an InternalIP. Without one,
    /// what is the local node's is unknown (a remote node claiming its address would not be
    /// stopped) and so is its xfrm endpoint (every IPsec object would look superseded): the
    /// view is no view of this cluster from this node (invariant 15).
    pub listed: bool,
}

impl Local {
    pub fn new(cfg: &PlanConfig, live: &LiveView) -> Self {
        let mut ips: HashSet<IpAddr> = cfg.local_addresses.iter().copied().collect();
        ips.extend(cfg.host.addresses.iter().copied());
        let mut cidrs = HashSet::new();
        let mut listed = false;
        for n in live.nodes.iter().filter(|n| n.name == cfg.local_node) {
            listed |= n
                .addresses
                .iter()
                .any(|a| a.kind == AddressKind::InternalIP);
            ips.extend(mapped_ips(n, cfg));
            cidrs.extend(n.pod_cidrs.iter().copied());
        }
        let on_link = cfg
            .host
            .on_link
            .iter()
            .filter(|o| o.prefix.prefix_len() > 0 && !cidrs.contains(&o.prefix))
            .cloned()
            .collect();
        Self {
            ips,
            cidrs,
            on_link,
            listed,
        }
    }
}

/// What lies outside the part of the cluster an event-sized plan looks at and still counts in
/// it ([`scope`]): the totals the brake's ratios and the map's room are taken over, and the node
/// IDs the records there carry.
pub(crate) struct Elsewhere {
    /// Records, each a known remote node.
    pub known_nodes: usize,
    /// Our objects in the kernel.
    pub objects: usize,
    /// Our map entries: they stay, so they take room.
    pub map_entries: usize,
    /// Node IDs in use: never handed out, never freed, never inherited.
    pub ids: IdSet,
}

/// A map entry for one of the local node's addresses: never ours to have (ID 0 is implicit), so
/// it is always deleted and never counted by the brake.
pub(super) fn is_local_entry(o: &KernelObject, local: &Local) -> bool {
    matches!(o, KernelObject::MapEntry(e) if local.ips.contains(&e.ip))
}

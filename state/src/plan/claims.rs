//! Step 4: who keeps an address or a pod CIDR when several nodes claim it.
//!
//! A *resource* is a mapped address (it gets a map entry) or a pod CIDR (it gets a route).
//! Addresses that are not mapped take no part (invariant 13). The order of precedence
//! (invariant 14): the local node; nodes that keep what they had whatever they claim now (held
//! live nodes and removals the brake holds); then the incumbent, the live node whose record
//! lists the resource; only then the order in which candidates are admitted.

use std::fmt;
use std::net::IpAddr;

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use ipnet::IpNet;
use smallvec::SmallVec;

use super::PlanConfig;
use super::classify::Live;
use super::records::Record;
use crate::desired::maps_address;
use crate::node::Node;
use crate::objects::{KernelObject, Nexthop, NodeId, Route, Via, XfrmDir};

/// Something only one node can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    Address(IpAddr),
    PodCidr(IpNet),
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Address(ip) => write!(f, "address {ip}"),
            Self::PodCidr(net) => write!(f, "pod CIDR {net}"),
        }
    }
}

/// Why the holder of a resource keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConflictWhy {
    /// The agent's record says it owns the resource.
    Incumbent,
    /// It is held (registering or malformed) and keeps what it had.
    Held,
    /// Its removal is held by the brake, so it keeps what it had.
    HeldRemoval,
    /// No record names an owner; it came first in admission order (known nodes, then names).
    Order,
}

impl fmt::Display for ConflictWhy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Incumbent => "the agent's record says it owns it",
            Self::Held => "it is held and keeps what it had",
            Self::HeldRemoval => "its removal is held by the brake",
            Self::Order => "no record names an owner and it comes first",
        })
    }
}

/// The addresses of `node` that get map entries under `cfg`.
pub fn mapped_ips<'n>(node: &'n Node, cfg: &PlanConfig) -> impl Iterator<Item = IpAddr> + 'n {
    let external = cfg.include_external_ips;
    node.addresses
        .iter()
        .filter(move |a| maps_address(external, a.kind))
        .map(|a| a.ip)
}

/// Every resource `node` claims under `cfg`.
pub(super) fn resources(node: &Node, cfg: &PlanConfig) -> SmallVec<[Resource; 4]> {
    mapped_ips(node, cfg)
        .map(Resource::Address)
        .chain(node.pod_cidrs.iter().map(|c| Resource::PodCidr(*c)))
        .collect()
}

/// The key resource of an object: the one its identity is built on; `None` for the agent's own
/// objects, which belong to no node.
pub(super) fn key_resource(o: &KernelObject) -> Option<Resource> {
    Some(match o {
        KernelObject::MapEntry(e) => Resource::Address(e.ip),
        KernelObject::PodCidrEntry(e) => Resource::PodCidr(e.cidr),
        KernelObject::Route(r) => Resource::PodCidr(r.dst),
        // Owned through the node ID in its kernel ID, then its gateway.
        KernelObject::Nexthop(_) => return None,
        KernelObject::XfrmState(s) => {
            Resource::Address(if s.dir == XfrmDir::Out { s.dst } else { s.src })
        }
        KernelObject::XfrmPolicy(p) => Resource::PodCidr(p.dst),
        KernelObject::XfrmGuard(_) => return None,
    })
}

/// A resource an object uses besides its key: a route's or nexthop's gateway, a policy's tunnel
/// endpoint.
pub(super) fn secondary_resource(o: &KernelObject) -> Option<Resource> {
    match o {
        KernelObject::Route(Route {
            via: Via::Gateway(gw),
            ..
        })
        | KernelObject::Nexthop(Nexthop { gateway: gw, .. }) => Some(Resource::Address(*gw)),
        KernelObject::XfrmPolicy(p) => Some(Resource::Address(p.tmpl_dst)),
        KernelObject::MapEntry(_)
        | KernelObject::PodCidrEntry(_)
        | KernelObject::Route(_)
        | KernelObject::XfrmState(_)
        | KernelObject::XfrmGuard(_) => None,
    }
}

/// Every resource and node ID that any live node (as it is now, and as recorded) or any record
/// claims: an object of ours that touches none of them belongs to nobody, an orphan.
pub(super) struct ClaimedAnywhere {
    resources: HashSet<Resource>,
    ids: HashSet<NodeId>,
}

impl ClaimedAnywhere {
    pub fn new(live: &[Live<'_>], records: &[Record<'_>], cfg: &PlanConfig) -> Self {
        let mut s = Self {
            // Live nodes and records mostly claim the same things: sized for one of them.
            resources: HashSet::with_capacity(4 * live.len().max(records.len())),
            ids: HashSet::with_capacity(records.len()),
        };
        for l in live {
            s.resources.extend(resources(l.node, cfg));
            // Every address, mapped or not: a route or state may use it as an endpoint.
            s.resources
                .extend(l.node.addresses.iter().map(|a| Resource::Address(a.ip)));
        }
        for r in records {
            s.resources.extend(resources(r.node, cfg));
            s.resources
                .extend(r.node.addresses.iter().map(|a| Resource::Address(a.ip)));
            s.ids.extend(r.node.node_id);
        }
        s
    }

    pub fn contains(&self, r: &Resource) -> bool {
        self.resources.contains(r)
    }

    /// Whether anyone claims the object through its key, its node ID or its secondary resource.
    /// The agent's own objects (no key resource) are never anyone's orphans: the brake does not
    /// count them.
    pub fn owns(&self, o: &KernelObject) -> bool {
        key_resource(o).is_none_or(|r| self.contains(&r))
            || o.node_id().is_some_and(|id| self.ids.contains(&id))
            || secondary_resource(o).is_some_and(|r| self.contains(&r))
    }
}

/// Who has a resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Holder {
    Local,
    /// A held live node (index into the live nodes): keeps what its record lists.
    Held(usize),
    /// A removal the brake holds (index into the records).
    Removal(usize),
    /// A candidate admitted before (index into the live nodes).
    Admitted(usize),
}

/// The resources taken so far, and the incumbents.
pub(super) struct Claims {
    taken: HashMap<Resource, Holder>,
    /// Resource -> the live node whose record lists it (the first in name order).
    incumbent: HashMap<Resource, usize>,
}

/// What keeps a candidate from a resource: who has it, or the incumbent that still claims it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Blocker {
    Taken(Holder),
    Incumbent(usize),
}

impl Claims {
    pub fn with_capacity(n: usize) -> Self {
        Self {
            taken: HashMap::with_capacity(n),
            incumbent: HashMap::with_capacity(n),
        }
    }

    /// Gives `r` to `holder` unless someone has it already (the first fixer wins: the local
    /// node is fixed first).
    pub fn fix(&mut self, r: Resource, holder: Holder) {
        self.taken.entry(r).or_insert(holder);
    }

    /// Records that the record of live node `live` lists `r`.
    pub fn incumbent(&mut self, r: Resource, live: usize) {
        self.incumbent.entry(r).or_insert(live);
    }

    /// Whether candidate `who` may take all of `wants`: the first resource it may not, and what
    /// keeps it. `claims_now(j, r)` says whether live node `j` still claims `r`.
    pub fn check(
        &self,
        who: usize,
        wants: &[Resource],
        claims_now: impl Fn(usize, &Resource) -> bool,
    ) -> Result<(), (Resource, Blocker)> {
        for r in wants {
            match self.taken.get(r) {
                None => {}
                Some(Holder::Admitted(j)) if *j == who => {}
                Some(h) => return Err((*r, Blocker::Taken(*h))),
            }
            if let Some(&inc) = self.incumbent.get(r)
                && inc != who
                && claims_now(inc, r)
            {
                return Err((*r, Blocker::Incumbent(inc)));
            }
        }
        Ok(())
    }

    /// Gives every resource of `wants` to candidate `who`.
    pub fn take(&mut self, who: usize, wants: &[Resource]) {
        for r in wants {
            self.taken.insert(*r, Holder::Admitted(who));
        }
    }
}

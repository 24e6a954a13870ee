//! Resources: what only one node can have, a mapped address (it gets a map entry) or a pod CIDR
//! (it gets a route); which a node claims and which an object is built on. Addresses that are not
//! mapped take no part (invariant 13). Every step that weighs claims speaks of these.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;

use ipnet::IpNet;

use super::config::PlanConfig;
use crate::node::{AddressKind, Node};
use crate::objects::{KernelObject, Nexthop, Route, Via, XfrmDir};

/// Whether an address of `kind` gets a map entry: InternalIPs always, ExternalIPs with
/// `include_external_ips`.
pub fn maps_address(include_external_ips: bool, kind: AddressKind) -> bool {
    kind == AddressKind::InternalIP || include_external_ips
}

/// Something only one node can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Resource {
    Address(IpAddr),
    PodCidr(IpNet),
}

impl Resource {
    /// The resource as an address's bits and a tag (kind, family and prefix length): equal
    /// resources, equal pairs.
    pub(super) fn bits(&self) -> (u128, u32) {
        match self {
            Self::Address(IpAddr::V4(a)) => (u32::from(*a).into(), 1),
            Self::Address(IpAddr::V6(a)) => (u128::from(*a), 2),
            Self::PodCidr(IpNet::V4(c)) => {
                (u32::from(c.addr()).into(), 3 + u32::from(c.prefix_len()))
            }
            Self::PodCidr(IpNet::V6(c)) => (u128::from(c.addr()), 200 + u32::from(c.prefix_len())),
        }
    }
}

/// Two writes instead of the derived impl's five or six: the planner hashes every resource of
/// every node once per plan.
impl Hash for Resource {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let (bits, tag) = self.bits();
        state.write_u128(bits);
        state.write_u32(tag);
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Address(ip) => write!(f, "address {ip}"),
            Self::PodCidr(net) => write!(f, "pod CIDR {net}"),
        }
    }
}

/// Every resource a record lists, mapped or not: an object may use any address as an endpoint,
/// so a node claims each one whether or not it gets a map entry.
pub(super) fn resources_of(n: &Node) -> impl Iterator<Item = Resource> + '_ {
    n.ips()
        .map(Resource::Address)
        .chain(n.pod_cidrs.iter().map(|c| Resource::PodCidr(*c)))
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

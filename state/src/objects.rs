//! The kernel objects node-agent owns, as plain values.
//!
//! This is the vocabulary shared by the planner (which decides which objects should exist) and
//! the kernel backends (which dump and apply them). An object's *identity* is what the kernel
//! keys it by; two objects with the same identity but different contents are an update, not an
//! add plus an unrelated delete.

use std::fmt;
use std::net::IpAddr;
use std::num::NonZeroU16;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::family::Family;
pub use crate::spi::{Spi, SpiLayout};

/// A remote node's ID: 1..=65535. Zero is the local node and is never assigned, so it is not
/// representable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(NonZeroU16);

impl NodeId {
    /// `None` for 0, the local node's ID.
    pub const fn new(id: u16) -> Option<Self> {
        match NonZeroU16::new(id) {
            Some(v) => Some(Self(v)),
            None => None,
        }
    }

    pub const fn get(self) -> u16 {
        self.0.get()
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Direction of an xfrm state or policy, as seen from this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum XfrmDir {
    /// Traffic from this node to the remote node.
    Out,
    /// Traffic from the remote node to this node.
    In,
}

/// The xfrm mark layout (Cilium's): node ID in bits 16-31, SPI in bits 12-15, direction in
/// bits 8-11 (0xE00 out, 0xD00 in). Keeping Cilium's layout lets operators who know it read our
/// marks, and leaves bits 0-7 to other users of the mark. The constants are the datapath's
/// (`node_agent_common::xfrm_mark`), which writes these marks on packets.
pub mod mark {
    use super::{NodeId, XfrmDir};
    pub use node_agent_common::xfrm_mark::{DIR_MASK, ID_SHIFT, IN, MASK, OUT, SPI_SHIFT};

    /// The mark of our xfrm objects toward or from `node` under `spi` (0..=15).
    pub const fn encode(node: NodeId, spi: u8, dir: XfrmDir) -> u32 {
        let dir = match dir {
            XfrmDir::Out => OUT,
            XfrmDir::In => IN,
        };
        node_agent_common::xfrm_mark::encode(node.get(), spi, dir)
    }

    /// The node, SPI and direction of one of our marks, or `None` for a mark that is not ours
    /// (wrong direction bits or node ID 0).
    pub fn decode(value: u32) -> Option<(NodeId, u8, XfrmDir)> {
        let dir = match value & DIR_MASK {
            OUT => XfrmDir::Out,
            IN => XfrmDir::In,
            _ => return None,
        };
        let id = NodeId::new((value >> ID_SHIFT) as u16)?;
        Some((id, ((value >> SPI_SHIFT) & 0x0F) as u8, dir))
    }
}

/// An entry of the pinned node-ID map: a remote node address and the ID it maps to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct MapEntry {
    pub ip: IpAddr,
    pub node_id: NodeId,
    /// SPI in use toward the node (0 when IPsec is off).
    pub spi: u8,
}

/// An entry of the pinned pod-CIDR map (IPsec only): a remote pod CIDR and the node traffic
/// toward it is encrypted for. The pod classifier marks such traffic with the node's ID and the
/// SPI in use, which selects the node's OUT policy.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PodCidrEntry {
    pub cidr: IpNet,
    pub node_id: NodeId,
    /// The SPI traffic toward the node is sent with (1..=15).
    pub spi: u8,
}

/// A route to a remote pod CIDR, through the node's nexthop or its address. Table and protocol are
/// the agent's configuration, the same for every route, so they are not part of the object.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Route {
    pub dst: IpNet,
    pub via: Via,
    /// The route's priority. Part of the kernel's identity of a route: a replace matches table,
    /// destination, TOS and metric. The agent writes [`Route::DEFAULT_METRIC_V4`] or
    /// [`Route::DEFAULT_METRIC_V6`], the metrics `ip route add` gives a route without one.
    pub metric: u32,
}

/// How a route reaches its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Via {
    /// Through the node's nexthop object (`nhid`): the agent's way on kernels that have them.
    Nexthop(NexthopId),
    /// Through a gateway written into the route itself: the fallback for kernels without
    /// nexthop objects (before 5.3) or with `--route-nexthops=off`, and what the versions
    /// before nexthops wrote (such a route is replaced in place by one through the nexthop).
    Gateway(IpAddr),
}

impl fmt::Display for Via {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Nexthop(id) => write!(f, "nhid {id}"),
            Self::Gateway(gw) => write!(f, "via {gw}"),
        }
    }
}

/// The kernel ID of one of our nexthop objects. Nexthop IDs are global in a network namespace,
/// so ours live in fixed ranges that read in decimal: `2014NNNNN` for a node's IPv4 nexthop
/// and `2016NNNNN` for its IPv6 one, where `NNNNN` is the node ID (`ip nexthop show id
/// 201400042` is node 42's IPv4 nexthop). Each node and family has a second ID, `2015NNNNN`
/// and `2017NNNNN`: a node that is readdressed while routes use its nexthop gets a new one at
/// the ID it does not hold, its routes move to it, and then the old one goes. Replacing an
/// IPv4 nexthop that routes use instead makes the kernel walk every IPv4 route of the
/// namespace (see "Scale" in `docs/design.md`). An ID in the ranges is still ours only if the
/// nexthop carries our route protocol; anything else there is foreign and left alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NexthopId(pub u32);

impl NexthopId {
    const BASE_V4: u32 = 201_400_000;
    const BASE_V6: u32 = 201_600_000;
    /// From a node's first ID of a family to its second.
    const SECOND: u32 = 100_000;

    /// The first ID of `node`'s nexthop of `family`.
    pub const fn of(node: NodeId, family: Family) -> Self {
        Self(
            match family {
                Family::V4 => Self::BASE_V4,
                Family::V6 => Self::BASE_V6,
            } + node.get() as u32,
        )
    }

    /// The first or the second ID of `node`'s nexthop of `family`.
    pub const fn of_pair(node: NodeId, family: Family, second: bool) -> Self {
        let first = Self::of(node, family);
        if second {
            Self(first.0 + Self::SECOND)
        } else {
            first
        }
    }

    /// The node and family an ID of our ranges stands for; `None` outside them.
    pub fn decode(self) -> Option<(NodeId, Family)> {
        self.decode_pair().map(|(node, family, _)| (node, family))
    }

    /// The node and family an ID of our ranges stands for, and whether it is the second ID of
    /// the pair; `None` outside the ranges.
    pub fn decode_pair(self) -> Option<(NodeId, Family, bool)> {
        let bases = [
            (Self::BASE_V4, Family::V4, false),
            (Self::BASE_V4 + Self::SECOND, Family::V4, true),
            (Self::BASE_V6, Family::V6, false),
            (Self::BASE_V6 + Self::SECOND, Family::V6, true),
        ];
        let (base, family, second) = bases
            .into_iter()
            .find(|(base, ..)| (*base..*base + 65_536).contains(&self.0))?;
        Some((NodeId::new((self.0 - base) as u16)?, family, second))
    }

    /// The other ID of the pair this one belongs to; `None` outside our ranges.
    pub fn other(self) -> Option<Self> {
        let (node, family, second) = self.decode_pair()?;
        Some(Self::of_pair(node, family, !second))
    }
}

impl fmt::Display for NexthopId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A remote node's nexthop object of one family: its InternalIP of that family as the gateway.
/// Every route to the node's pod CIDRs of the family goes through it, so readdressing a node
/// rewrites one nexthop, not every route, and the kernel inserts a route through a nexthop in
/// constant time where one with its own gateway costs more the more routes there are. Marked
/// ours by the route protocol, like the routes; the device is the kernel's answer for the
/// gateway at write time, not part of the object.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Nexthop {
    pub node_id: NodeId,
    pub gateway: IpAddr,
    /// Whether it holds the second of the node's two IDs of the family ([`NexthopId`]).
    pub second: bool,
}

impl Nexthop {
    pub fn id(&self) -> NexthopId {
        NexthopId::of_pair(self.node_id, Family::of(&self.gateway), self.second)
    }
}

impl Route {
    pub const DEFAULT_METRIC_V4: u32 = 0;
    pub const DEFAULT_METRIC_V6: u32 = 1024;

    /// The metric the agent writes for a route to `dst`.
    pub fn default_metric(dst: &IpNet) -> u32 {
        match dst {
            IpNet::V4(_) => Self::DEFAULT_METRIC_V4,
            IpNet::V6(_) => Self::DEFAULT_METRIC_V6,
        }
    }
}

/// An ESP tunnel-mode xfrm state between this node and a remote node.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct XfrmState {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// In the layout of its key, for the sending end `src`.
    pub spi: Spi,
    pub dir: XfrmDir,
    pub node_id: NodeId,
    /// Which key the state holds: a fingerprint of its algorithm, ICV length and key material
    /// (never the key). Not part of the identity: a state whose key changed under the same SPI
    /// is replaced.
    pub key: KeyTag,
}

/// A fingerprint of an xfrm state's key: the first 8 bytes of a SHA-256 over the algorithm
/// name, the ICV length and the key material. Safe to log and to compare across nodes (a node's
/// OUT state toward a peer and the peer's IN state from it carry the same tag); it reveals
/// nothing usable about the key.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct KeyTag(pub u64);

impl fmt::Display for KeyTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// What an [`XfrmGuard`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum GuardRole {
    /// OUT, mark [`mark::OUT`] under [`mark::DIR_MASK`], action block, at the lowest priority:
    /// traffic marked for encryption that no node's OUT policy takes (the policy is missing, or
    /// being replaced) is dropped, never sent in the clear.
    Block,
    /// FWD, mark [`mark::IN`] under [`mark::DIR_MASK`], allow, with an ESP tunnel template:
    /// forwarded traffic our IN states decrypted is let through (the kernel drops decrypted
    /// tunnel-mode traffic no policy accepts).
    AcceptDecrypted,
}

/// An xfrm policy of the agent's own, one per role and address family, belonging to no node:
/// it exists while IPsec is on.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct XfrmGuard {
    pub family: Family,
    pub role: GuardRole,
    /// The kernel's policy has the shape the agent writes (action, priority, template). Always
    /// true in what the agent wants; a dump says false for a guard someone changed, and the
    /// planner then replaces it. Not part of the identity.
    pub intact: bool,
}

impl XfrmGuard {
    /// Every guard of `family`, as the agent writes them.
    pub fn all(family: Family) -> [Self; 2] {
        [GuardRole::Block, GuardRole::AcceptDecrypted].map(|role| Self {
            family,
            role,
            intact: true,
        })
    }
}

/// An xfrm OUT policy sending traffic to a remote pod CIDR through the OUT state toward it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct XfrmPolicy {
    /// Traffic selector source (the whole family: 0.0.0.0/0 or ::/0).
    pub src: IpNet,
    /// Traffic selector destination: the remote pod CIDR.
    pub dst: IpNet,
    pub dir: XfrmDir,
    pub node_id: NodeId,
    /// Tunnel endpoints of the template: this node and the remote node.
    pub tmpl_src: IpAddr,
    pub tmpl_dst: IpAddr,
    /// The SPI of the OUT state the template selects (its mark carries the key's number).
    pub spi: Spi,
}

/// Any object we own in the kernel.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum KernelObject {
    MapEntry(MapEntry),
    PodCidrEntry(PodCidrEntry),
    Nexthop(Nexthop),
    Route(Route),
    XfrmState(XfrmState),
    XfrmPolicy(XfrmPolicy),
    XfrmGuard(XfrmGuard),
}

/// What the kernel keys an object by. Two objects with the same identity cannot coexist.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ObjectId {
    MapEntry {
        ip: IpAddr,
    },
    PodCidrEntry {
        cidr: IpNet,
    },
    Nexthop {
        id: NexthopId,
    },
    Route {
        dst: IpNet,
        metric: u32,
    },
    /// The kernel keys a state by destination, SPI, protocol and mark: two states that differ
    /// only in their source cannot coexist, two that differ in their mark (another node ID)
    /// can, and are two objects.
    XfrmState {
        dst: IpAddr,
        spi: Spi,
        mark: u32,
    },
    XfrmPolicy {
        src: IpNet,
        dst: IpNet,
        dir: XfrmDir,
        mark: u32,
    },
    XfrmGuard {
        family: Family,
        role: GuardRole,
    },
}

/// The kinds of object, for metrics, per-kind reporting and dispatch to a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ObjectKind {
    MapEntry,
    PodCidrEntry,
    Nexthop,
    Route,
    XfrmState,
    XfrmPolicy,
    XfrmGuard,
}

impl ObjectKind {
    pub const ALL: [Self; 7] = [
        Self::MapEntry,
        Self::PodCidrEntry,
        Self::Nexthop,
        Self::Route,
        Self::XfrmState,
        Self::XfrmPolicy,
        Self::XfrmGuard,
    ];

    /// The name metrics and reports use: `map_entry`, `pod_cidr_entry`, `nexthop`, `route`,
    /// `xfrm_state`, `xfrm_policy`, `xfrm_guard`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::MapEntry => "map_entry",
            Self::PodCidrEntry => "pod_cidr_entry",
            Self::Nexthop => "nexthop",
            Self::Route => "route",
            Self::XfrmState => "xfrm_state",
            Self::XfrmPolicy => "xfrm_policy",
            Self::XfrmGuard => "xfrm_guard",
        }
    }

    /// Where the kind's changes go in a plan: an object is created after what it uses and
    /// deleted before it. The guards come first (so traffic marked for encryption is never
    /// without its block policy), then the datapath's entries, nexthops, the routes through
    /// them, states, and the policies that select the states. A node's pod-CIDR entry goes in
    /// before its route and xfrm objects: traffic marked before its policy exists is dropped by
    /// the guard, never sent in the clear; on removal the policy and state go first, and the
    /// mark last. Nexthops are the exception on removal: see [`ObjectKind::deleted_last`].
    pub const fn rank(self) -> u8 {
        match self {
            Self::XfrmGuard => 0,
            Self::MapEntry => 1,
            Self::PodCidrEntry => 2,
            Self::Nexthop => 3,
            Self::Route => 4,
            Self::XfrmState => 5,
            Self::XfrmPolicy => 6,
        }
    }

    /// Kinds whose deletes run after the plan's upserts, and only once every route operation
    /// succeeded. Deleting a nexthop deletes every route still through it, and makes the
    /// kernel walk them: a node whose nexthop changes (a new node ID) has its routes moved to
    /// the new nexthop first, so the old one goes with no route through it, and no route of a
    /// live node is ever missing. A pod-CIDR entry (IPsec's mark) goes after its route too: a
    /// route whose delete failed and that lost its mark carried pod traffic in the clear
    /// (invariant 18); kept, the mark sends it to the block guard.
    pub const fn deleted_last(self) -> bool {
        matches!(self, Self::Nexthop | Self::PodCidrEntry)
    }

    /// The kinds written into the datapath's maps: a node gets nothing else until all of its
    /// entries went in (invariant 17).
    pub const fn is_datapath_entry(self) -> bool {
        matches!(self, Self::MapEntry | Self::PodCidrEntry)
    }
}

impl KernelObject {
    pub fn id(&self) -> ObjectId {
        match self {
            Self::MapEntry(e) => ObjectId::MapEntry { ip: e.ip },
            Self::PodCidrEntry(e) => ObjectId::PodCidrEntry { cidr: e.cidr },
            Self::Nexthop(n) => ObjectId::Nexthop { id: n.id() },
            Self::Route(r) => ObjectId::Route {
                dst: r.dst,
                metric: r.metric,
            },
            Self::XfrmState(s) => ObjectId::XfrmState {
                dst: s.dst,
                spi: s.spi,
                mark: mark::encode(s.node_id, s.spi.key(), s.dir),
            },
            Self::XfrmPolicy(p) => ObjectId::XfrmPolicy {
                src: p.src,
                dst: p.dst,
                dir: p.dir,
                mark: mark::encode(p.node_id, p.spi.key(), p.dir),
            },
            Self::XfrmGuard(g) => ObjectId::XfrmGuard {
                family: g.family,
                role: g.role,
            },
        }
    }

    pub fn kind(&self) -> ObjectKind {
        match self {
            Self::MapEntry(_) => ObjectKind::MapEntry,
            Self::PodCidrEntry(_) => ObjectKind::PodCidrEntry,
            Self::Nexthop(_) => ObjectKind::Nexthop,
            Self::Route(_) => ObjectKind::Route,
            Self::XfrmState(_) => ObjectKind::XfrmState,
            Self::XfrmPolicy(_) => ObjectKind::XfrmPolicy,
            Self::XfrmGuard(_) => ObjectKind::XfrmGuard,
        }
    }

    /// The object of ours this one needs in the kernel: a route needs its nexthop.
    pub fn uses(&self) -> Option<ObjectId> {
        match self {
            Self::Route(Route {
                via: Via::Nexthop(id),
                ..
            }) => Some(ObjectId::Nexthop { id: *id }),
            _ => None,
        }
    }

    /// The node ID the object carries, where it carries one: a route through a nexthop of
    /// ours carries the nexthop's; routes with their own gateway and guards carry none.
    pub fn node_id(&self) -> Option<NodeId> {
        match self {
            Self::MapEntry(e) => Some(e.node_id),
            Self::PodCidrEntry(e) => Some(e.node_id),
            Self::Nexthop(n) => Some(n.node_id),
            Self::Route(r) => match r.via {
                Via::Nexthop(id) => id.decode().map(|(node, _)| node),
                Via::Gateway(_) => None,
            },
            Self::XfrmGuard(_) => None,
            Self::XfrmState(s) => Some(s.node_id),
            Self::XfrmPolicy(p) => Some(p.node_id),
        }
    }
}

/// One line naming the object the way `ip` and `bpftool` users read it.
impl fmt::Display for KernelObject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dir = |d: XfrmDir| match d {
            XfrmDir::Out => "out",
            XfrmDir::In => "in",
        };
        match self {
            Self::MapEntry(e) => write!(f, "map {} -> node {}", e.ip, e.node_id),
            Self::PodCidrEntry(e) => write!(
                f,
                "pod-cidr map {} -> node {} spi {}",
                e.cidr, e.node_id, e.spi
            ),
            Self::Nexthop(n) => {
                write!(f, "nexthop {} via {} node {}", n.id(), n.gateway, n.node_id)
            }
            Self::Route(r) => write!(f, "route {} {} metric {}", r.dst, r.via, r.metric),
            Self::XfrmState(s) => write!(
                f,
                "xfrm state {} {} -> {} spi {} node {} key {}",
                dir(s.dir),
                s.src,
                s.dst,
                s.spi,
                s.node_id,
                s.key
            ),
            Self::XfrmPolicy(p) => write!(
                f,
                "xfrm policy {} {} -> {} via {} -> {} spi {} node {}",
                dir(p.dir),
                p.src,
                p.dst,
                p.tmpl_src,
                p.tmpl_dst,
                p.spi,
                p.node_id
            ),
            Self::XfrmGuard(g) => {
                let family = match g.family {
                    Family::V4 => "ipv4",
                    Family::V6 => "ipv6",
                };
                match g.role {
                    GuardRole::Block => write!(f, "xfrm policy out block {family} (guard)"),
                    GuardRole::AcceptDecrypted => {
                        write!(f, "xfrm policy fwd accept-decrypted {family} (guard)")
                    }
                }
            }
        }
    }
}

/// One change for a backend to make.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// Create the object where nothing has its identity. Backends create exclusively
    /// (`NLM_F_EXCL`, `XFRM_MSG_NEW*`): an object that appeared since the dump, ours or not, makes
    /// the create fail rather than be replaced (invariant 6).
    Create(KernelObject),
    /// Replace the object of ours that the dump found at this identity.
    Replace(KernelObject),
    /// Remove exactly this object (matched by identity and our marker).
    Delete(KernelObject),
}

impl Op {
    pub fn object(&self) -> &KernelObject {
        match self {
            Self::Create(o) | Self::Replace(o) | Self::Delete(o) => o,
        }
    }

    /// `create`, `replace` or `delete`, for logs and metrics.
    pub fn verb(&self) -> &'static str {
        match self {
            Self::Create(_) => "create",
            Self::Replace(_) => "replace",
            Self::Delete(_) => "delete",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_id_zero_is_not_representable() {
        assert!(NodeId::new(0).is_none());
        assert_eq!(NodeId::new(65535).map(NodeId::get), Some(65535));
    }

    #[test]
    fn nexthop_ids_round_trip_and_only_our_range_decodes() {
        let id = NodeId::new(42).unwrap();
        assert_eq!(NexthopId::of(id, Family::V4), NexthopId(201_400_042));
        assert_eq!(NexthopId::of(id, Family::V6), NexthopId(201_600_042));
        let top = NodeId::new(65535).unwrap();
        for family in [Family::V4, Family::V6] {
            for n in [id, top] {
                assert_eq!(NexthopId::of(n, family).decode(), Some((n, family)));
            }
        }
        assert_eq!(
            NexthopId::of_pair(id, Family::V4, true),
            NexthopId(201_500_042)
        );
        assert_eq!(
            NexthopId::of_pair(id, Family::V6, true),
            NexthopId(201_700_042)
        );
        for family in [Family::V4, Family::V6] {
            for n in [id, top] {
                for second in [false, true] {
                    let nh = NexthopId::of_pair(n, family, second);
                    assert_eq!(nh.decode_pair(), Some((n, family, second)));
                    assert_eq!(nh.decode(), Some((n, family)));
                    assert_eq!(nh.other(), Some(NexthopId::of_pair(n, family, !second)));
                }
            }
        }
        for outside in [
            201_400_000,
            201_465_536,
            201_500_000,
            201_565_536,
            201_765_536,
            7,
        ] {
            assert_eq!(NexthopId(outside).decode(), None, "{outside}");
            assert_eq!(NexthopId(outside).other(), None, "{outside}");
        }
    }

    #[test]
    fn mark_round_trips_and_rejects_foreign_marks() {
        let id = NodeId::new(0x1234).unwrap();
        let m = mark::encode(id, 3, XfrmDir::Out);
        assert_eq!(m, 0x1234_3E00);
        assert_eq!(mark::decode(m), Some((id, 3, XfrmDir::Out)));
        assert_eq!(
            mark::decode(mark::encode(id, 15, XfrmDir::In)),
            Some((id, 15, XfrmDir::In))
        );
        assert_eq!(mark::decode(0x1234_0A00), None, "foreign direction bits");
        assert_eq!(
            mark::decode(0x0000_0E00),
            None,
            "node ID 0 is the local node"
        );
    }
}

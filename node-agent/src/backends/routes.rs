//! The routes backend: one route per remote pod CIDR, through the node's nexthop object (or,
//! without nexthops, via its address), over rtnetlink.
//!
//! Every route we create carries our route protocol number (`--route-protocol`, default 201),
//! and that number is the only thing that makes a route ours. The dump asks the kernel for every
//! route and sorts each answer of our table: our protocol makes it ours; any other protocol
//! makes it foreign, and its identity (destination and metric, what a replace would match) is
//! reported as occupied, so the planner never writes ours over it (invariant 6). A foreign
//! route in any table that goes through one of our nexthops is reported too: the planner keeps
//! that nexthop, since the kernel would delete the route with it. Add `201 node-agent` to `/etc/iproute2/rt_protos.d/node-agent.conf` and
//! `ip route` prints the name.
//!
//! A new route is created exclusively (`NLM_F_CREATE | NLM_F_EXCL`): if anything appeared at its
//! identity since the dump, the kernel refuses and nothing is replaced. A route of ours whose
//! nexthop or gateway changed is replaced in place (`NLM_F_REPLACE`): one atomic change, never a
//! delete-then-add gap. Deletes carry our protocol, so the kernel matches only ours. Writes go in
//! batches, many to a system call ([`super::netlink::batch`]).

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::{Handle, RouteMessageBuilder};
use state::inventory::Inventory;
use state::objects::{KernelObject, NexthopId, ObjectId, ObjectKind, Op, Route, Via};
use state::plan::HostAddresses;

use super::Backend;
use super::netlink::batch::{BATCH, Batcher, Request, unanswered};
use super::netlink::{KernelError, outcome};
use crate::kernel::{DumpError, OpError};

/// Route protocol number marking our routes unless configured otherwise.
pub const DEFAULT_ROUTE_PROTOCOL: u8 = 201;
pub use super::netlink::MAIN_TABLE;

pub struct RouteBackend {
    /// For the dumps.
    handle: Handle,
    /// For the writes.
    batch: Batcher,
    protocol: u8,
    table: u32,
    /// The host's on-link prefixes (with their interfaces' indexes) the last complete dump
    /// found ([`super::host::on_link`]): `None` before one.
    on_link: Option<Vec<(IpNet, u32)>>,
}

impl RouteBackend {
    /// Batches of writes sent so far (system calls; [`Batcher::batches_sent`]).
    pub fn batches_sent(&self) -> u64 {
        self.batch.batches_sent()
    }

    /// Opens an rtnetlink socket in the current network namespace; needs a tokio runtime.
    pub fn new(protocol: u8, table: u32) -> std::io::Result<Self> {
        let (conn, handle, _) = rtnetlink::new_connection_with_strict_check()?;
        tokio::spawn(conn);
        Ok(Self {
            handle,
            batch: Batcher::open(netlink_sys::protocols::NETLINK_ROUTE)?,
            protocol,
            table,
            on_link: None,
        })
    }

    fn message(&self, route: &Route) -> Result<RouteMessage, OpError> {
        let mut msg = match route.dst {
            IpNet::V4(dst) => RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(dst.network(), dst.prefix_len())
                .priority(route.metric)
                .build(),
            IpNet::V6(dst) => RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(dst.network(), dst.prefix_len())
                .priority(route.metric)
                .build(),
        };
        let via = match route.via {
            Via::Nexthop(id) => RouteAttribute::NhId(id.0),
            Via::Gateway(IpAddr::V4(gw)) if route.dst.addr().is_ipv4() => {
                RouteAttribute::Gateway(RouteAddress::Inet(gw))
            }
            Via::Gateway(IpAddr::V6(gw)) if route.dst.addr().is_ipv6() => {
                RouteAttribute::Gateway(RouteAddress::Inet6(gw))
            }
            // The planner pairs a CIDR only with a gateway of its own family.
            Via::Gateway(_) => {
                return Err(OpError::Kernel {
                    what: format!("route {} {}", route.dst, route.via),
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "gateway and destination are of different families",
                    ),
                });
            }
        };
        msg.attributes.push(via);
        Ok(self.stamp(msg))
    }

    /// Puts our protocol and table on a message.
    fn stamp(&self, mut msg: RouteMessage) -> RouteMessage {
        msg.header.protocol = RouteProtocol::from(self.protocol);
        msg.header.scope = RouteScope::Universe;
        msg.header.kind = RouteType::Unicast;
        if self.table > 255 {
            msg.header.table = 252; // RT_TABLE_COMPAT: the real ID is in the attribute
            msg.attributes.push(RouteAttribute::Table(self.table));
        } else {
            msg.header.table = self.table as u8;
        }
        msg
    }

    /// Sorts one route into `inv`: of our table, ours by protocol, or foreign. Routes of ours
    /// in a shape the agent never writes (no single gateway or nexthop, a TOS, a type other
    /// than unicast) are left alone, and count as foreign, so ours is never written over them
    /// either; so does every route of another type in our table (a blackhole, an unreachable
    /// route: an IPv4 replace takes the first route at its destination and metric, which a
    /// prepended blackhole is). A route in any table that is not one we write, through a
    /// nexthop of our range, is a foreign user of that nexthop: deleting the nexthop would
    /// delete it. An on-link prefix of the host's main table goes to `on_link`.
    fn parse_into(&self, msg: &RouteMessage, inv: &mut Inventory, on_link: &mut Vec<(IpNet, u32)>) {
        let mut dst = None;
        let mut gateway = None;
        let mut nexthop = None;
        let mut metric = 0;
        for attr in &msg.attributes {
            match attr {
                RouteAttribute::Destination(RouteAddress::Inet(a)) => dst = Some(IpAddr::V4(*a)),
                RouteAttribute::Destination(RouteAddress::Inet6(a)) => dst = Some(IpAddr::V6(*a)),
                RouteAttribute::Gateway(RouteAddress::Inet(a)) => gateway = Some(IpAddr::V4(*a)),
                RouteAttribute::Gateway(RouteAddress::Inet6(a)) => gateway = Some(IpAddr::V6(*a)),
                RouteAttribute::NhId(id) => nexthop = Some(NexthopId(*id)),
                RouteAttribute::Priority(p) => metric = *p,
                _ => {}
            }
        }
        let len = msg.header.destination_prefix_length;
        let unspecified = match msg.header.address_family {
            AddressFamily::Inet => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            _ => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        let Ok(dst) = IpNet::new(dst.unwrap_or(unspecified), len) else {
            return;
        };
        on_link.extend(super::host::on_link(msg, dst, table_of(msg), self.protocol));
        let ours = msg.header.protocol == RouteProtocol::from(self.protocol);
        // Our protocol, in the shape we write: anything else with our protocol is someone's.
        let our_shape = ours && msg.header.tos == 0 && msg.header.kind == RouteType::Unicast;
        let ours_here = our_shape && table_of(msg) == self.table;
        if let Some(id) = nexthop.filter(|id| id.decode().is_some() && !ours_here) {
            inv.use_by_foreign(ObjectId::Nexthop { id }, describe_foreign(msg, dst, metric));
        }
        if table_of(msg) != self.table {
            return;
        }
        // The kernel also reports the gateway of a route through a nexthop (unless
        // `nexthop_compat_mode` is off): the nexthop is what the route is.
        let via = nexthop.map(Via::Nexthop).or(gateway.map(Via::Gateway));
        match via {
            Some(via) if our_shape => inv.insert(KernelObject::Route(Route { dst, via, metric })),
            _ => {
                if ours {
                    tracing::warn!(%dst, protocol = self.protocol, "route with our protocol but not in a shape we write (no single gateway or nexthop, a TOS, a type other than unicast); leaving it alone");
                }
                inv.occupy(
                    ObjectId::Route { dst, metric },
                    describe_foreign(msg, dst, metric),
                );
            }
        }
    }

    /// What the kernel's answer to `op` means: [`outcome`]'s reading, and an unreachable
    /// gateway, which means something of its own here.
    fn answer_to(op: &Op, answer: Result<(), KernelError>) -> Result<(), OpError> {
        let KernelObject::Route(route) = op.object() else {
            unreachable!("Backends::apply routes only routes here");
        };
        if let Err(e) = &answer
            && let Via::Gateway(gateway) = route.via
            && !matches!(op, Op::Delete(_))
            && matches!(e.errno(), Some(libc::ENETUNREACH | libc::EHOSTUNREACH))
        {
            return Err(OpError::GatewayUnreachable {
                object: op.object().to_string(),
                gateway,
                source: std::io::Error::from_raw_os_error(e.errno().unwrap_or(libc::EHOSTUNREACH)),
            });
        }
        outcome(op, answer, || {
            KernelObject::Route(route.clone()).to_string()
        })
    }
}

/// The request that carries out `op`: creates are exclusive, replaces in place.
fn request_for(op: &Op, msg: RouteMessage) -> Request<RouteNetlinkMessage> {
    match op {
        Op::Create(_) => (
            RouteNetlinkMessage::NewRoute(msg),
            NLM_F_CREATE | NLM_F_EXCL,
        ),
        Op::Replace(_) => (
            RouteNetlinkMessage::NewRoute(msg),
            NLM_F_CREATE | NLM_F_REPLACE,
        ),
        Op::Delete(_) => (RouteNetlinkMessage::DelRoute(msg), 0),
    }
}

/// A foreign route in words: `route 10.1.2.0/24 metric 0 proto static`, with its table when
/// it is not the main one.
fn describe_foreign(msg: &RouteMessage, dst: IpNet, metric: u32) -> String {
    let proto = match msg.header.protocol {
        RouteProtocol::Kernel => "kernel".to_string(),
        RouteProtocol::Boot => "boot".to_string(),
        RouteProtocol::Static => "static".to_string(),
        other => u8::from(other).to_string(),
    };
    // As `ip route` names the types it prints before the destination.
    let kind = match msg.header.kind {
        RouteType::Unicast => String::new(),
        RouteType::BlackHole => "blackhole ".into(),
        RouteType::Unreachable => "unreachable ".into(),
        RouteType::Prohibit => "prohibit ".into(),
        RouteType::Throw => "throw ".into(),
        other => format!("{} ", u8::from(other)),
    };
    match table_of(msg) {
        MAIN_TABLE => format!("route {kind}{dst} metric {metric} proto {proto}"),
        table => format!("route {kind}{dst} metric {metric} table {table} proto {proto}"),
    }
}

fn table_of(msg: &RouteMessage) -> u32 {
    msg.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(msg.header.table))
}

impl RouteBackend {
    /// Every route, of any table and protocol, that goes through one of the nexthops `ids`, by
    /// nexthop, in words: what deleting the nexthop would delete along.
    pub async fn users_of(
        &mut self,
        ids: &HashSet<ObjectId>,
    ) -> Result<HashMap<ObjectId, String>, DumpError> {
        let mut routes = Inventory::new();
        self.dump_into(&mut routes).await?;
        let mut users: HashMap<ObjectId, String> = ids
            .iter()
            .filter_map(|id| Some((id.clone(), routes.foreign_user(id)?.to_owned())))
            .collect();
        for r in routes.objects() {
            if let Some(used) = r.uses().filter(|u| ids.contains(u)) {
                users.entry(used).or_insert_with(|| r.to_string());
            }
        }
        Ok(users)
    }
}

impl RouteBackend {
    /// Every route of every table, whatever its protocol, scope or type: the foreign ones of our
    /// table are the identities we must not write over, and a foreign route anywhere may go
    /// through one of our nexthops.
    async fn read_all(&mut self, inv: &mut Inventory) -> Result<(), DumpError> {
        let mut on_link = Vec::new();
        for filter in [
            RouteMessageBuilder::<Ipv4Addr>::new().build(),
            RouteMessageBuilder::<Ipv6Addr>::new().build(),
        ] {
            let mut filter = self.stamp(filter);
            filter
                .attributes
                .retain(|a| !matches!(a, RouteAttribute::Table(_)));
            filter.header.table = 0;
            filter.header.protocol = RouteProtocol::Unspec;
            filter.header.scope = RouteScope::Universe;
            filter.header.kind = RouteType::Unspec;
            let mut answers = self.handle.route().get(filter).execute();
            while let Some(msg) = answers.try_next().await.map_err(|e| DumpError::Kernel {
                kind: ObjectKind::Route,
                source: match e {
                    rtnetlink::Error::NetlinkError(m) => m.to_io(),
                    other => std::io::Error::other(other.to_string()),
                },
            })? {
                self.parse_into(&msg, inv, &mut on_link);
            }
        }
        self.on_link = Some(on_link);
        Ok(())
    }

    /// What the host holds: its addresses, read now, and its on-link prefixes, as the last
    /// complete route dump found them (the reconciler asks right after a dump; without one,
    /// the routes are dumped for them).
    pub async fn host(&mut self) -> Result<HostAddresses, DumpError> {
        if self.on_link.is_none() {
            self.read_all(&mut Inventory::new()).await?;
        }
        let addresses = super::host::addresses(&self.handle).await?;
        let on_link = super::host::named(self.on_link.as_deref().unwrap_or_default());
        Ok(HostAddresses { addresses, on_link })
    }
}

impl Backend for RouteBackend {
    async fn dump_into(&mut self, inv: &mut Inventory) -> Result<(), DumpError> {
        self.read_all(inv).await
    }

    async fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        // A batch's messages are built as it goes: never all of them at once.
        let mut results = Vec::with_capacity(ops.len());
        for chunk in ops.chunks(BATCH) {
            let messages: Vec<Result<RouteMessage, OpError>> = chunk
                .iter()
                .map(|op| match op.object() {
                    KernelObject::Route(route) => self.message(route),
                    _ => unreachable!("Backends::apply routes only routes here"),
                })
                .collect();
            let mut built = Vec::with_capacity(chunk.len());
            let mut requests = Vec::with_capacity(chunk.len());
            for (op, msg) in chunk.iter().zip(messages) {
                built.push(msg.map(|m| requests.push(request_for(op, m))));
            }
            let mut answers = self.batch.exchange(requests).await.into_iter();
            for (op, msg) in chunk.iter().zip(built) {
                results.push(msg.and_then(|()| {
                    let answer = answers.next().unwrap_or_else(unanswered);
                    Self::answer_to(op, answer.map(drop))
                }));
            }
        }
        results
    }
}

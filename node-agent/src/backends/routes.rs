//! The routes backend: one route per remote pod CIDR, via the node's address, over rtnetlink.
//!
//! Every route we create carries our route protocol number (`--route-protocol`, default 201),
//! and that number is the only thing that makes a route ours: the dump asks the kernel for
//! routes of that protocol and table only (strict dump filtering) and checks both again on each
//! answer, so a route without our protocol can never be listed, let alone deleted. Add `201
//! node-agent` to `/etc/iproute2/rt_protos.d/node-agent.conf` and `ip route` prints the name.
//!
//! Upserts use `NLM_F_REPLACE`, so a gateway change is one atomic replace, never a
//! delete-then-add gap. Requests are pipelined over one netlink socket.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::{StreamExt, TryStreamExt};
use ipnet::IpNet;
use netlink_packet_route::AddressFamily;
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::{Handle, RouteMessageBuilder};
use state::objects::{KernelObject, ObjectKind, Op, Route};

use super::{Backend, DumpError, OpError};

/// Route protocol number marking our routes unless configured otherwise.
pub const DEFAULT_ROUTE_PROTOCOL: u8 = 201;
/// The main routing table.
pub const MAIN_TABLE: u32 = 254;
/// Requests in flight on the netlink socket at once.
const PIPELINE: usize = 128;

pub struct RouteBackend {
    handle: Handle,
    protocol: u8,
    table: u32,
}

impl RouteBackend {
    /// Opens an rtnetlink socket in the current network namespace; needs a tokio runtime.
    pub fn new(protocol: u8, table: u32) -> std::io::Result<Self> {
        let (conn, handle, _) = rtnetlink::new_connection_with_strict_check()?;
        tokio::spawn(conn);
        Ok(Self {
            handle,
            protocol,
            table,
        })
    }

    fn message(&self, route: &Route) -> Result<RouteMessage, OpError> {
        let msg = match (route.dst, route.gateway) {
            (IpNet::V4(dst), IpAddr::V4(gw)) => RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(dst.network(), dst.prefix_len())
                .gateway(gw)
                .build(),
            (IpNet::V6(dst), IpAddr::V6(gw)) => RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(dst.network(), dst.prefix_len())
                .gateway(gw)
                .build(),
            // The planner pairs a CIDR only with a gateway of its own family.
            (dst, gateway) => {
                return Err(OpError::Kernel {
                    what: format!("route {dst} via {gateway}"),
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "gateway and destination are of different families",
                    ),
                });
            }
        };
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

    fn parse(&self, msg: &RouteMessage) -> Option<Route> {
        if msg.header.protocol != RouteProtocol::from(self.protocol) || table_of(msg) != self.table
        {
            return None;
        }
        let mut dst = None;
        let mut gateway = None;
        for attr in &msg.attributes {
            match attr {
                RouteAttribute::Destination(RouteAddress::Inet(a)) => dst = Some(IpAddr::V4(*a)),
                RouteAttribute::Destination(RouteAddress::Inet6(a)) => dst = Some(IpAddr::V6(*a)),
                RouteAttribute::Gateway(RouteAddress::Inet(a)) => gateway = Some(IpAddr::V4(*a)),
                RouteAttribute::Gateway(RouteAddress::Inet6(a)) => gateway = Some(IpAddr::V6(*a)),
                _ => {}
            }
        }
        let len = msg.header.destination_prefix_length;
        let dst = match dst {
            Some(a) => IpNet::new(a, len).ok()?,
            None => match msg.header.address_family {
                AddressFamily::Inet => IpNet::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0).ok()?,
                _ => IpNet::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0).ok()?,
            },
        };
        match gateway {
            Some(gateway) => Some(Route { dst, gateway }),
            None => {
                tracing::warn!(%dst, protocol = self.protocol, "route with our protocol but no single gateway; leaving it alone");
                None
            }
        }
    }

    async fn apply_one(
        handle: Handle,
        op: Op,
        msg: Result<RouteMessage, OpError>,
    ) -> Result<(), OpError> {
        let KernelObject::Route(route) = op.object() else {
            unreachable!("Backends::apply routes only routes here");
        };
        let msg = msg?;
        let result = match &op {
            Op::Upsert(_) => handle.route().add(msg).replace().execute().await,
            Op::Delete(_) => match handle.route().del(msg).execute().await {
                Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ESRCH => Ok(()),
                other => other,
            },
        };
        result.map_err(|e| {
            let source = match &e {
                rtnetlink::Error::NetlinkError(m) => m.to_io(),
                other => std::io::Error::other(other.to_string()),
            };
            let errno = source.raw_os_error();
            if matches!(op, Op::Upsert(_))
                && matches!(errno, Some(libc::ENETUNREACH) | Some(libc::EHOSTUNREACH))
            {
                OpError::GatewayUnreachable {
                    dst: route.dst,
                    gateway: route.gateway,
                    source,
                }
            } else {
                let verb = if matches!(op, Op::Upsert(_)) {
                    "replacing"
                } else {
                    "deleting"
                };
                OpError::Kernel {
                    what: format!("{verb} route {} via {}", route.dst, route.gateway),
                    source,
                }
            }
        })
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

impl Backend for RouteBackend {
    fn kind(&self) -> ObjectKind {
        ObjectKind::Route
    }

    async fn dump(&mut self) -> Result<Vec<KernelObject>, DumpError> {
        let mut out = Vec::new();
        for filter in [
            RouteMessageBuilder::<Ipv4Addr>::new().build(),
            RouteMessageBuilder::<Ipv6Addr>::new().build(),
        ] {
            let mut filter = self.stamp(filter);
            // Scope and type would also filter under strict checking; ours are the defaults,
            // but match on protocol and table only.
            filter.header.scope = RouteScope::Universe;
            filter.header.kind = RouteType::Unspec;
            let msgs: Vec<RouteMessage> = self
                .handle
                .route()
                .get(filter)
                .execute()
                .try_collect()
                .await
                .map_err(|e| DumpError::Kernel {
                    kind: ObjectKind::Route,
                    source: match e {
                        rtnetlink::Error::NetlinkError(m) => m.to_io(),
                        other => std::io::Error::other(other.to_string()),
                    },
                })?;
            out.extend(
                msgs.iter()
                    .filter_map(|m| self.parse(m))
                    .map(KernelObject::Route),
            );
        }
        Ok(out)
    }

    async fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        let jobs: Vec<_> = ops
            .iter()
            .map(|op| {
                let KernelObject::Route(route) = op.object() else {
                    unreachable!("Backends::apply routes only routes here");
                };
                (op.clone(), self.message(route))
            })
            .collect();
        let handle = self.handle.clone();
        futures::stream::iter(jobs)
            .map(|(op, msg)| Self::apply_one(handle.clone(), op, msg))
            .buffered(PIPELINE)
            .collect()
            .await
    }
}

//! The nexthop backend: one nexthop object per remote node and family, which that node's routes
//! go through (`nhid`), over rtnetlink.
//!
//! Our nexthops carry our route protocol (`--route-protocol`, 201 by default) and an ID in the
//! agent's range ([`NexthopId`]); both make one ours. The dump lists every nexthop of the
//! namespace: one in our range without our protocol, or ours in a shape the agent never writes
//! (a group, a blackhole), is foreign, and its ID is reported as occupied, so neither it nor a
//! route through it is ever written (invariant 6).
//!
//! The kernel wants a device for a gateway nexthop. The device is the kernel's own answer for
//! the gateway when it is written (`ip route get fibmatch GW`: the connected route that holds
//! it), asked for each nexthop written, in the same batch; a gateway that is not on a
//! connected prefix is unreachable, as it is for a route that carries its gateway.
//!
//! Creates are exclusive and replaces in place, as for routes. A delete names the ID alone (the
//! kernel takes no protocol on a delete), and so does a replace: the backend reads the nexthop
//! first and deletes or replaces it only if it is still ours. Deleting a nexthop deletes every route through it: the planner has moved or deleted our routes first ([`ObjectKind::deleted_last`]), and
//! never deletes a nexthop a foreign route uses (the route backend reports those).
//!
//! [`ObjectKind::deleted_last`]: state::objects::ObjectKind::deleted_last

pub mod message;
mod users;

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::IpAddr;

use ipnet::IpNet;
use netlink_packet_core::{NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteMessage, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_proto::ConnectionHandle;
use netlink_proto::sys::protocols::NETLINK_ROUTE;
use state::inventory::Inventory;
use state::node::Family;
use state::objects::{KernelObject, Nexthop, NexthopId, ObjectId, ObjectKind, Op};

use self::message::NexthopMessage;
pub use self::users::{apply_nexthops, users_of};
use super::Backend;
use super::netlink::batch::{BATCH, Batcher, Request, unanswered};
use super::netlink::request::{self, request};
use super::netlink::{KernelError, outcome};
use crate::kernel::{DumpError, OpError};

pub struct NexthopBackend {
    /// For the dumps and the probe.
    handle: ConnectionHandle<NexthopMessage>,
    /// For the writes, and the reads each write needs first.
    batch: Batcher,
    protocol: u8,
}

impl NexthopBackend {
    /// Opens the sockets in the current network namespace (needs a tokio runtime) and asks the
    /// kernel whether it has nexthop objects: `Ok(None)` when it has not (before 5.3).
    pub async fn open(protocol: u8) -> io::Result<Option<Self>> {
        let handle = request::connect::<NexthopMessage>(NETLINK_ROUTE)?;
        let probe = NexthopMessage::get(u32::MAX);
        match request(&handle, probe, 0).await {
            Ok(_) => {}
            Err(e) if e.errno() == Some(libc::ENOENT) => {}
            Err(e) if e.errno() == Some(libc::EOPNOTSUPP) => return Ok(None),
            Err(e) => return Err(e.into_io()),
        }
        Ok(Some(Self {
            handle,
            batch: Batcher::open(netlink_sys::protocols::NETLINK_ROUTE)?,
            protocol,
        }))
    }

    /// Sorts one nexthop of the dump into `inv`.
    fn parse_into(&self, m: &NexthopMessage, inv: &mut Inventory) {
        let Some(id) = m.id.map(NexthopId) else {
            return;
        };
        // The agent makes no groups: a group holding one of our nexthops is someone else's.
        for member in m.group.iter().map(|g| NexthopId(*g)) {
            if member.decode().is_some() {
                inv.use_by_foreign(
                    ObjectId::Nexthop { id: member },
                    format!("group {}", describe(m, id)),
                );
            }
        }
        let Some((node_id, family, second)) = id.decode_pair() else {
            return; // not at an identity we write
        };
        let ours = m.protocol == self.protocol;
        match m.gateway {
            Some(gateway) if ours && !m.other && Family::of(&gateway) == family => {
                inv.insert(KernelObject::Nexthop(Nexthop {
                    node_id,
                    gateway,
                    second,
                }));
            }
            _ => {
                if ours {
                    tracing::warn!(%id, protocol = self.protocol, "nexthop with our protocol but not in a shape we write (a group, a blackhole, no gateway of its family); leaving it alone");
                }
                inv.occupy(ObjectId::Nexthop { id }, describe(m, id));
            }
        }
    }

    /// One chunk of ops: first what the writes need to know, in two batched reads (the device
    /// of each gateway to write; whether each nexthop to delete or replace is still ours), then
    /// the writes, batched.
    async fn apply_batch(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        let nexthop = |op: &Op| match op.object() {
            KernelObject::Nexthop(nh) => nh.clone(),
            _ => unreachable!("Backends::apply routes only nexthops here"),
        };
        let writes_gateway = |op: &Op| matches!(op, Op::Create(_) | Op::Replace(_));
        let by_id = |op: &Op| matches!(op, Op::Delete(_) | Op::Replace(_));
        let queries = ops
            .iter()
            .filter(|op| writes_gateway(op))
            .map(|op| (fibmatch(nexthop(op).gateway), 0))
            .collect();
        let mut devices = self.batch.exchange(queries).await.into_iter();
        let looks = ops
            .iter()
            .filter(|op| by_id(op))
            .map(|op| (NexthopMessage::get(nexthop(op).id().0), 0))
            .collect();
        let mut found = self.batch.exchange(looks).await.into_iter();
        // Per op: the write to make, none (done already), or why not.
        let mut writes: Vec<Result<Option<NexthopMessage>, OpError>> = Vec::new();
        let mut flags: Vec<u16> = ops.iter().map(write_flags).collect();
        for (i, op) in ops.iter().enumerate() {
            let nh = nexthop(op);
            let mut msg = match op {
                Op::Delete(_) => Ok(NexthopMessage::del(nh.id().0)),
                _ => connected_device(nh.gateway, devices.next().unwrap_or_else(unanswered))
                    .map(|oif| NexthopMessage::new(nh.id().0, nh.gateway, oif, self.protocol))
                    .map_err(|source| OpError::GatewayUnreachable {
                        object: op.object().to_string(),
                        gateway: nh.gateway,
                        source,
                    }),
            }
            .map(Some);
            if by_id(op) {
                let there = found.next().unwrap_or_else(unanswered);
                msg = match (msg, still_ours(op, nh.id(), there, self.protocol)) {
                    (Err(e), _) | (_, Err(e)) => Err(e),
                    (Ok(_), Ok(There::Gone)) if matches!(op, Op::Delete(_)) => Ok(None),
                    (Ok(m), Ok(There::Gone)) => {
                        // Gone since the dump: made anew, and exclusively, so that a nexthop
                        // someone puts there meanwhile is never overwritten.
                        flags[i] = NLM_F_CREATE | NLM_F_EXCL;
                        Ok(m)
                    }
                    (Ok(m), Ok(There::Ours)) => Ok(m),
                };
            }
            writes.push(msg);
        }
        let sent: Vec<bool> = writes.iter().map(|w| matches!(w, Ok(Some(_)))).collect();
        let requests: Vec<Request<NexthopMessage>> = writes
            .iter_mut()
            .zip(flags)
            .filter_map(|(w, flags)| Some((w.as_mut().ok()?.take()?, flags)))
            .collect();
        let mut answers = self.batch.exchange(requests).await.into_iter();
        ops.iter()
            .zip(writes)
            .zip(sent)
            .map(|((op, w), sent)| match w {
                Err(e) => Err(e),
                Ok(_) if sent => {
                    let answer = answers.next().unwrap_or_else(unanswered).map(drop);
                    outcome(op, answer, || op.object().to_string())
                }
                Ok(_) => Ok(()),
            })
            .collect()
    }
}

impl NexthopBackend {
    /// Whether each of `ids` holds a nexthop of ours now, read back in one batch: before routes
    /// go through a nexthop this reconcile did not write, since someone may have put theirs at
    /// its ID after the view was read (the kernel routes by ID alone).
    pub async fn still_ours(&mut self, ids: &[NexthopId]) -> Vec<Result<(), OpError>> {
        let looks = ids
            .iter()
            .map(|id| (NexthopMessage::get(id.0), 0))
            .collect();
        let found = self.batch.exchange(looks).await;
        ids.iter()
            .zip(found)
            .map(|(id, there)| {
                let what = || format!("routes through nexthop {}", id.0);
                match there {
                    Ok(found)
                        if found
                            .iter()
                            .all(|m| m.protocol == self.protocol && !m.other) =>
                    {
                        Ok(())
                    }
                    Ok(found) => Err(OpError::Kernel {
                        what: format!(
                            "{}: {} is there now and is not ours; left alone",
                            what(),
                            found.first().map_or_else(String::new, |m| describe(m, *id))
                        ),
                        source: io::Error::from_raw_os_error(libc::EPERM),
                    }),
                    Err(e) if e.errno() == Some(libc::ENOENT) => Err(OpError::NexthopMissing),
                    Err(e) => Err(e.into_op(what())),
                }
            })
            .collect()
    }
}

/// What the read-back before a delete or replace found at the nexthop's ID.
enum There {
    /// Ours, still.
    Ours,
    /// Nothing: a delete is done already, a replace is a create.
    Gone,
}

/// Whether the nexthop `op` deletes or replaces at `id` is still ours, from what is there now
/// (the kernel deletes and replaces by ID alone: a nexthop someone else put there since the
/// dump is never deleted or overwritten).
fn still_ours(
    op: &Op,
    id: NexthopId,
    there: Result<Vec<NexthopMessage>, KernelError>,
    protocol: u8,
) -> Result<There, OpError> {
    let what = || format!("{} {}", op.verb(), op.object());
    match there {
        Ok(found) if found.iter().all(|m| m.protocol == protocol && !m.other) => Ok(There::Ours),
        Ok(found) => {
            let foreign = found.first().map_or_else(String::new, |m| describe(m, id));
            Err(OpError::Kernel {
                what: format!(
                    "{}: {foreign} is there now and is not ours; left alone",
                    what()
                ),
                source: io::Error::from_raw_os_error(libc::EPERM),
            })
        }
        Err(e) if e.errno() == Some(libc::ENOENT) => Ok(There::Gone),
        Err(e) => Err(e.into_op(what())),
    }
}

/// Creates are exclusive, replaces in place.
fn write_flags(op: &Op) -> u16 {
    match op {
        Op::Create(_) => NLM_F_CREATE | NLM_F_EXCL,
        Op::Replace(_) => NLM_F_CREATE | NLM_F_REPLACE,
        Op::Delete(_) => 0,
    }
}

/// `ip route get fibmatch <gateway>`: the question for the route that holds `gateway`.
pub fn fibmatch(gateway: IpAddr) -> RouteNetlinkMessage {
    let mut q = RouteMessage::default();
    let (family, len, addr) = match gateway {
        IpAddr::V4(a) => (AddressFamily::Inet, 32, RouteAddress::Inet(a)),
        IpAddr::V6(a) => (AddressFamily::Inet6, 128, RouteAddress::Inet6(a)),
    };
    q.header.address_family = family;
    q.header.destination_prefix_length = len;
    q.header.flags = RouteFlags::FibMatch;
    q.attributes.push(RouteAttribute::Destination(addr));
    RouteNetlinkMessage::GetRoute(q)
}

/// The device of the connected route (no gateway of its own, unicast) that holds `gateway`, from
/// the kernel's answer to [`fibmatch`]. Asked for each gateway: a cache by prefix would miss a
/// more specific route inside it, and the kernel would accept the wrong device.
fn connected_device(
    gateway: IpAddr,
    answer: Result<Vec<RouteNetlinkMessage>, KernelError>,
) -> Result<u32, io::Error> {
    let not_connected = || {
        io::Error::new(
            io::ErrorKind::HostUnreachable,
            "no connected route holds it (only a route via another gateway, or none)",
        )
    };
    for answer in answer.map_err(KernelError::into_io)? {
        let RouteNetlinkMessage::NewRoute(r) = answer else {
            continue;
        };
        let mut dst = None;
        let mut oif = None;
        for a in &r.attributes {
            match a {
                RouteAttribute::Destination(RouteAddress::Inet(a)) => dst = Some(IpAddr::V4(*a)),
                RouteAttribute::Destination(RouteAddress::Inet6(a)) => dst = Some(IpAddr::V6(*a)),
                RouteAttribute::Oif(i) => oif = Some(*i),
                RouteAttribute::Gateway(_) | RouteAttribute::MultiPath(_) => {
                    return Err(not_connected());
                }
                _ => {}
            }
        }
        let unspecified = match gateway {
            IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        };
        let net = IpNet::new(
            dst.unwrap_or(unspecified),
            r.header.destination_prefix_length,
        )
        .map_err(|_| not_connected())?;
        return match (r.header.kind, oif) {
            (RouteType::Unicast, Some(oif)) if net.prefix_len() > 0 => Ok(oif),
            _ => Err(not_connected()),
        };
    }
    Err(not_connected())
}

/// A foreign nexthop in words: `nexthop 201400005 via 10.0.0.2 proto static`.
fn describe(m: &NexthopMessage, id: NexthopId) -> String {
    let proto = match m.protocol {
        2 => "kernel".to_string(),
        3 => "boot".to_string(),
        4 => "static".to_string(),
        p => p.to_string(),
    };
    match m.gateway {
        Some(gw) => format!("nexthop {id} via {gw} proto {proto}"),
        None => format!("nexthop {id} proto {proto}"),
    }
}

impl NexthopBackend {
    /// Every group, ours or not, that holds one of the nexthops `ids`, by nexthop, in words:
    /// deleting the nexthop would change the group (or delete it, with its routes).
    pub async fn groups_holding(
        &mut self,
        ids: &HashSet<ObjectId>,
    ) -> Result<HashMap<ObjectId, String>, DumpError> {
        let groups = request(&self.handle, NexthopMessage::dump_groups(), NLM_F_DUMP)
            .await
            .map_err(|e| DumpError::Kernel {
                kind: ObjectKind::Nexthop,
                source: e.into_io(),
            })?;
        let mut users = HashMap::new();
        for g in &groups {
            let Some(gid) = g.id.map(NexthopId) else {
                continue;
            };
            for member in &g.group {
                let id = ObjectId::Nexthop {
                    id: NexthopId(*member),
                };
                if ids.contains(&id) {
                    users
                        .entry(id)
                        .or_insert_with(|| format!("group {}", describe(g, gid)));
                }
            }
        }
        Ok(users)
    }
}

impl Backend for NexthopBackend {
    async fn dump_into(&mut self, inv: &mut Inventory) -> Result<(), DumpError> {
        let all = request(&self.handle, NexthopMessage::dump(), NLM_F_DUMP)
            .await
            .map_err(|e| DumpError::Kernel {
                kind: ObjectKind::Nexthop,
                source: e.into_io(),
            })?;
        for m in &all {
            self.parse_into(m, inv);
        }
        Ok(())
    }

    async fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        let mut results = Vec::with_capacity(ops.len());
        for chunk in ops.chunks(BATCH) {
            results.extend(self.apply_batch(chunk).await);
        }
        results
    }
}

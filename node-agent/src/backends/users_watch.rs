//! Whether anything could have come to use one of our nexthops since the kernel was last read.
//!
//! Deleting a nexthop deletes every route through it, someone else's too, and changes (or
//! deletes) every group holding it; the kernel has no lookup of a nexthop's users, so before
//! deleting nexthops the agent reads every route and every group ([`super::nexthops::users_of`]). At
//! 65,000 nodes that is 130,000 routes and a kernel walk of 130,000 nexthops, a third of a second
//! for every node removal. But a route or a group can only come to use our nexthop by being
//! added or changed, and the kernel announces every such change to the route and nexthop
//! multicast groups. This socket listens: while every announcement since the last full read was
//! of one of our own routes (our protocol, in our table) or of a nexthop that is not a group,
//! what that read found still stands (the users it found are in the planner's view, and the
//! planner keeps their nexthops), and nothing is read again. Anything else, including a missed
//! announcement (the socket's buffer overran, as our own cold start of 130,000 routes does),
//! makes the next check read them again.
//!
//! The same announcements say where in our table anyone else changed a route since the last
//! full dump ([`UsersWatch::since_dump`]): while no one did at a destination, a route
//! the agent's view holds as its own there is still its own, and the view may be trusted to
//! replace it (a replace matches the destination in the table, whoever's route is there).
//! Routes others change elsewhere, in other tables or at other destinations (a busy node's main
//! table), leave that trust alone.
//!
//! The socket is only read when asked; between reads the kernel queues at most its buffer's
//! worth, and an overrun costs one read, never a wrong answer.

use std::collections::HashSet;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use crate::kernel::RoutesSinceDump;

/// `RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE`: the legacy group bits of the route announcements.
const ROUTE_GROUPS: u32 = 0x40 | 0x400;
/// `RTNLGRP_NEXTHOP`: too high for the legacy bits, joined as a membership.
const NEXTHOP_GROUP: u32 = 32;
const RTM_NEWROUTE: u16 = 24;
const RTN_UNICAST: u8 = 1;
const RTM_DELROUTE: u16 = 25;
const RTM_NEWNEXTHOP: u16 = 104;
const RTA_DST: u16 = 1;
const RTA_GATEWAY: u16 = 5;
const RTA_NH_ID: u16 = 30;
const RTA_TABLE: u16 = 15;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// `struct nhmsg`: family, scope, protocol, reserved, flags (u32).
const NHMSG_LEN: usize = 8;
/// `NHA_GROUP`: the nexthop is a group of others.
const NHA_GROUP: u16 = 2;
const NLMSG_HDRLEN: usize = 16;
/// `struct rtmsg`: family, dst_len, src_len, tos, table, protocol, scope, type, flags (u32).
const RTMSG_LEN: usize = 12;
/// Room for the announcements of a reconcile's own writes between two checks.
const RECEIVE_BUFFER: usize = 4 << 20;
/// Destinations touched by others kept since a dump; past this many, none is trusted until the
/// next dump (a node whose table churns that much gains little from the view anyway).
const MAX_TOUCHED: usize = 4096;

pub struct UsersWatch {
    socket: Socket,
    buf: Vec<u8>,
    protocol: u8,
    table: u32,
    /// Every announcement since the last read of the users was of one of our routes, none
    /// was lost.
    unchanged: bool,
    /// Destinations in our table where someone else changed a route since the last full dump;
    /// `None` when that is not known (no dump yet, one that failed, lost or unreadable
    /// announcements, or more than [`MAX_TOUCHED`] of them).
    touched_since_dump: Option<HashSet<IpNet>>,
}

impl UsersWatch {
    /// Joins the route and nexthop announcement groups of the current network namespace. Until
    /// the first full read, nothing counts as unchanged.
    pub fn open(protocol: u8, table: u32) -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind(&SocketAddr::new(0, ROUTE_GROUPS))?;
        socket.add_membership(NEXTHOP_GROUP)?;
        socket.set_non_blocking(true)?;
        // Best effort: a smaller buffer only overruns sooner.
        let _ = socket.set_rx_buf_sz(RECEIVE_BUFFER);
        Ok(Self {
            socket,
            buf: vec![0; 64 << 10],
            protocol,
            table,
            unchanged: false,
            touched_since_dump: None,
        })
    }

    /// A full dump begins: what was announced before it is in it.
    pub fn dumping(&mut self) {
        self.reading();
        self.touched_since_dump = Some(HashSet::new());
    }

    /// A full read of the routes and nexthops begins: what was announced before it is in it.
    pub fn reading(&mut self) {
        self.drain();
        self.unchanged = true;
    }

    /// The read or dump that began did not complete: nothing counts as read.
    pub fn forget(&mut self) {
        self.unchanged = false;
        self.touched_since_dump = None;
    }

    /// Whether nothing announced since the last full read can have come to use our nexthops.
    pub fn unchanged_since_read(&mut self) -> bool {
        self.drain();
        self.unchanged
    }

    /// Whether someone else changed a route in our table at any of `at` since the last full
    /// dump began, as far as the announcements tell.
    pub fn since_dump(&mut self, at: &[IpNet]) -> RoutesSinceDump {
        self.drain();
        match &self.touched_since_dump {
            None => RoutesSinceDump::Unknown,
            Some(t) if at.iter().any(|dst| t.contains(dst)) => RoutesSinceDump::Touched,
            Some(_) => RoutesSinceDump::Untouched,
        }
    }

    fn drain(&mut self) {
        loop {
            let mut buf = &mut self.buf[..];
            match self.socket.recv(&mut buf, 0) {
                Ok(0) => return,
                Ok(n) => {
                    let (protocol, table) = (self.protocol, self.table);
                    for a in announcements(&self.buf[..n], protocol, table) {
                        self.heard(a);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Announcements were lost: what changed is no longer known. The socket goes on.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => self.heard(Announced::Unknown),
                Err(_) => {
                    self.heard(Announced::Unknown);
                    return;
                }
            }
        }
    }

    fn heard(&mut self, a: Announced) {
        match a {
            Announced::Nothing => {}
            Announced::Group | Announced::Route { in_our_table: None } => self.unchanged = false,
            Announced::Route {
                in_our_table: Some(dst),
            } => {
                self.unchanged = false;
                if let Some(t) = &mut self.touched_since_dump {
                    t.insert(dst);
                    if t.len() > MAX_TOUCHED {
                        self.touched_since_dump = None;
                    }
                }
            }
            Announced::Unknown => {
                self.unchanged = false;
                self.touched_since_dump = None;
            }
        }
    }
}

/// What one announcement can have changed that the watch tracks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Announced {
    /// Nothing: one of our routes (in the shape the route dump takes as ours), or a nexthop
    /// that is not a group.
    Nothing,
    /// A nexthop group, whoever's: it may hold one of our nexthops.
    Group,
    /// Someone else's route: it may go through one of our nexthops, and in our table it is at
    /// a destination where a replace of ours would meet it.
    Route { in_our_table: Option<IpNet> },
    /// Anything: a message that does not parse, or announcements lost.
    Unknown,
}

/// What each announcement in `datagram` can have changed: a route is ours when it has our
/// `protocol`, is in our `table` and has the shape the route dump takes as ours (one gateway or
/// one nexthop, no TOS). Anything else at one of our destinations, our protocol's multipath
/// routes included, is someone else's: the dump leaves it alone, and so must a replace.
fn announcements(datagram: &[u8], protocol: u8, table: u32) -> Vec<Announced> {
    let mut out = Vec::new();
    let mut rest = datagram;
    while rest.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes(rest[4..6].try_into().expect("2 bytes"));
        if len < NLMSG_HDRLEN || len > rest.len() {
            out.push(Announced::Unknown);
            return out;
        }
        let body = &rest[NLMSG_HDRLEN..len];
        out.push(match kind {
            RTM_NEWROUTE | RTM_DELROUTE => route(body, protocol, table),
            RTM_NEWNEXTHOP if is_group(body) => Announced::Group,
            _ => Announced::Nothing,
        });
        rest = &rest[align(len).min(rest.len())..];
    }
    out
}

/// What a route announcement can have changed.
fn route(rtmsg: &[u8], protocol: u8, table: u32) -> Announced {
    let Some(attrs) = rtmsg.get(RTMSG_LEN..).and_then(attributes) else {
        return Announced::Unknown;
    };
    let attr = |kind: u16| attrs.iter().find(|(k, _)| *k == kind).map(|(_, p)| *p);
    let route_table = match attr(RTA_TABLE) {
        Some(p) if p.len() >= 4 => u32::from_ne_bytes(p[..4].try_into().expect("4 bytes")),
        Some(_) => return Announced::Unknown,
        None => u32::from(rtmsg[4]),
    };
    if route_table != table {
        return Announced::Route { in_our_table: None };
    }
    let single_hop = attr(RTA_GATEWAY).is_some() || attr(RTA_NH_ID).is_some();
    // Our protocol, no TOS, unicast, one hop: the shape of ours, as the dump takes them.
    if rtmsg[5] == protocol && rtmsg[3] == 0 && rtmsg[7] == RTN_UNICAST && single_hop {
        return Announced::Nothing;
    }
    // No RTA_DST is the default route of the family.
    let dst = match (rtmsg[0], attr(RTA_DST)) {
        (AF_INET, None) => Some(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
        (AF_INET6, None) => Some(IpAddr::V6(Ipv6Addr::UNSPECIFIED)),
        (AF_INET, Some(p)) => <[u8; 4]>::try_from(p).ok().map(IpAddr::from),
        (AF_INET6, Some(p)) => <[u8; 16]>::try_from(p).ok().map(IpAddr::from),
        _ => None,
    };
    match dst.and_then(|ip| IpNet::new(ip, rtmsg[1]).ok()) {
        Some(dst) => Announced::Route {
            in_our_table: Some(dst),
        },
        None => Announced::Unknown,
    }
}

/// Whether a nexthop message is of a group (or unreadable).
fn is_group(nhmsg: &[u8]) -> bool {
    attributes(nhmsg.get(NHMSG_LEN..).unwrap_or_default())
        .is_none_or(|attrs| attrs.iter().any(|(kind, _)| *kind == NHA_GROUP))
}

/// The attributes of a message body, as (type, payload); `None` if they do not parse.
fn attributes(mut attrs: &[u8]) -> Option<Vec<(u16, &[u8])>> {
    let mut out = Vec::new();
    while attrs.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
        let kind = u16::from_ne_bytes([attrs[2], attrs[3]]) & 0x3fff;
        if len < 4 || len > attrs.len() {
            return None;
        }
        out.push((kind, &attrs[4..len]));
        attrs = &attrs[align(len).min(attrs.len())..];
    }
    Some(out)
}

fn align(len: usize) -> usize {
    (len + 3) & !3
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A route announcement to 10.1.2.0/24 through a nexthop (with `RTA_DST` unless `dst` is
    /// false).
    fn announcement(kind: u16, protocol: u8, table: u32, dst: bool) -> Vec<u8> {
        shaped(kind, protocol, table, dst, 0, Some(RTA_NH_ID))
    }

    /// The same with a TOS, and through `via` (`RTA_NH_ID`, `RTA_GATEWAY`, or neither, as a
    /// multipath route's top level has).
    fn shaped(
        kind: u16,
        protocol: u8,
        table: u32,
        dst: bool,
        tos: u8,
        via: Option<u16>,
    ) -> Vec<u8> {
        let mut body = vec![AF_INET, 24, 0, tos, 254, protocol, 0, 1, 0, 0, 0, 0];
        body.extend_from_slice(&8u16.to_ne_bytes());
        body.extend_from_slice(&RTA_TABLE.to_ne_bytes());
        body.extend_from_slice(&table.to_ne_bytes());
        if dst {
            body.extend_from_slice(&8u16.to_ne_bytes());
            body.extend_from_slice(&RTA_DST.to_ne_bytes());
            body.extend_from_slice(&[10, 1, 2, 0]);
        }
        if let Some(via) = via {
            body.extend_from_slice(&8u16.to_ne_bytes());
            body.extend_from_slice(&via.to_ne_bytes());
            body.extend_from_slice(&[10, 88, 0, 2]);
        }
        let mut msg = ((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes().to_vec();
        msg.extend_from_slice(&kind.to_ne_bytes());
        msg.extend_from_slice(&[0; 10]);
        msg.extend_from_slice(&body);
        msg
    }

    fn heard(datagram: &[u8]) -> Vec<Announced> {
        announcements(datagram, 201, 254)
    }

    #[test]
    fn our_protocol_in_our_table_is_ours_and_anyone_elses_route_is_where_it_is() {
        let at = |dst: &str| Announced::Route {
            in_our_table: Some(dst.parse().unwrap()),
        };
        let ours = announcement(RTM_NEWROUTE, 201, 254, true);
        assert_eq!(heard(&ours), [Announced::Nothing]);
        assert_eq!(
            heard(&announcement(RTM_DELROUTE, 201, 254, true)),
            [Announced::Nothing]
        );
        let mut two = ours.clone();
        two.extend(announcement(RTM_NEWROUTE, 4, 254, true));
        assert_eq!(heard(&two), [Announced::Nothing, at("10.1.2.0/24")]);
        assert_eq!(
            heard(&announcement(RTM_DELROUTE, 4, 254, false)),
            [at("0.0.0.0/24")],
            "without RTA_DST, the family's zero address"
        );
        for protocol in [201, 4] {
            assert_eq!(
                heard(&announcement(RTM_NEWROUTE, protocol, 100, true)),
                [Announced::Route { in_our_table: None }],
                "another table, protocol {protocol}"
            );
        }
        assert_eq!(
            heard(&ours[..ours.len() - 6]),
            [Announced::Unknown],
            "truncated"
        );
        assert_eq!(
            heard(&shaped(RTM_NEWROUTE, 201, 254, true, 0, Some(RTA_GATEWAY))),
            [Announced::Nothing],
            "ours with its own gateway"
        );
        // Our protocol in a shape the dump does not take as ours is someone else's route.
        for (tos, via) in [(0, None), (4, Some(RTA_NH_ID))] {
            assert_eq!(
                heard(&shaped(RTM_NEWROUTE, 201, 254, true, tos, via)),
                [at("10.1.2.0/24")],
                "TOS {tos}, via {via:?}"
            );
        }
    }

    fn nexthop(attr: u16) -> Vec<u8> {
        let mut body = vec![2, 0, 4, 0, 0, 0, 0, 0];
        body.extend_from_slice(&8u16.to_ne_bytes());
        body.extend_from_slice(&attr.to_ne_bytes());
        body.extend_from_slice(&[0; 4]);
        let mut msg = ((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes().to_vec();
        msg.extend_from_slice(&RTM_NEWNEXTHOP.to_ne_bytes());
        msg.extend_from_slice(&[0; 10]);
        msg.extend_from_slice(&body);
        msg
    }

    #[test]
    fn a_nexthop_matters_only_as_a_group() {
        // NHA_ID (1): anyone's plain nexthop uses nothing.
        assert_eq!(heard(&nexthop(1)), [Announced::Nothing]);
        assert_eq!(heard(&nexthop(NHA_GROUP)), [Announced::Group]);
    }
}

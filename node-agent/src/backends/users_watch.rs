//! Whether anything could have come to use one of our nexthops since the kernel was last read.
//!
//! Deleting a nexthop deletes every route through it, someone else's too, and changes (or
//! deletes) every group holding it; the kernel has no lookup of a nexthop's users, so before
//! deleting nexthops the agent reads every route and every group ([`super::users_of`]). At
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
//! The same announcements say whether anyone else changed a route since the last full dump
//! ([`UsersWatch::unchanged_since_dump`]): while no one did, a route the agent's view holds as
//! its own at a destination is still its own there, and the view may be trusted to replace it
//! (a replace matches the destination, whoever's route is there).
//!
//! The socket is only read when asked; between reads the kernel queues at most its buffer's
//! worth, and an overrun costs one read, never a wrong answer.

use std::io;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// `RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE`: the legacy group bits of the route announcements.
const ROUTE_GROUPS: u32 = 0x40 | 0x400;
/// `RTNLGRP_NEXTHOP`: too high for the legacy bits, joined as a membership.
const NEXTHOP_GROUP: u32 = 32;
const RTM_NEWROUTE: u16 = 24;
const RTM_DELROUTE: u16 = 25;
const RTM_NEWNEXTHOP: u16 = 104;
const RTA_TABLE: u16 = 15;
/// `struct nhmsg`: family, scope, protocol, reserved, flags (u32).
const NHMSG_LEN: usize = 8;
/// `NHA_GROUP`: the nexthop is a group of others.
const NHA_GROUP: u16 = 2;
const NLMSG_HDRLEN: usize = 16;
/// `struct rtmsg`: family, dst_len, src_len, tos, table, protocol, scope, type, flags (u32).
const RTMSG_LEN: usize = 12;
/// Room for the announcements of a reconcile's own writes between two checks.
const RECEIVE_BUFFER: usize = 4 << 20;

pub struct UsersWatch {
    socket: Socket,
    buf: Vec<u8>,
    protocol: u8,
    table: u32,
    /// Every announcement since the last read of the users was of one of our routes, none
    /// was lost.
    unchanged: bool,
    /// The same, since the last full dump.
    unchanged_since_dump: bool,
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
            unchanged_since_dump: false,
        })
    }

    /// A full dump begins: what was announced before it is in it.
    pub fn dumping(&mut self) {
        self.reading();
        self.unchanged_since_dump = true;
    }

    /// A full read of the routes and nexthops begins: what was announced before it is in it.
    pub fn reading(&mut self) {
        self.drain();
        self.unchanged = true;
    }

    /// The read or dump that began did not complete: nothing counts as read.
    pub fn forget(&mut self) {
        self.unchanged = false;
        self.unchanged_since_dump = false;
    }

    /// Whether nothing announced since the last full read can have come to use our nexthops.
    pub fn unchanged_since_read(&mut self) -> bool {
        self.drain();
        self.unchanged
    }

    /// Whether no one else changed a route (or a nexthop group) since the last full dump.
    pub fn unchanged_since_dump(&mut self) -> bool {
        self.drain();
        self.unchanged_since_dump
    }

    fn drain(&mut self) {
        loop {
            let mut buf = &mut self.buf[..];
            match self.socket.recv(&mut buf, 0) {
                Ok(0) => return,
                Ok(n) => {
                    if !only_ours(&self.buf[..n], self.protocol, self.table) {
                        self.changed();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Announcements were lost: what changed is no longer known. The socket goes on.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => self.changed(),
                Err(_) => {
                    self.changed();
                    return;
                }
            }
        }
    }

    fn changed(&mut self) {
        self.unchanged = false;
        self.unchanged_since_dump = false;
    }
}

/// Whether no announcement in `datagram` can have made a user of our nexthops: each route is
/// ours (`protocol`, in `table`) and each new nexthop is not a group. Anything unreadable can.
fn only_ours(datagram: &[u8], protocol: u8, table: u32) -> bool {
    let mut rest = datagram;
    while rest.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes(rest[4..6].try_into().expect("2 bytes"));
        if len < NLMSG_HDRLEN || len > rest.len() {
            return false;
        }
        let body = &rest[NLMSG_HDRLEN..len];
        if matches!(kind, RTM_NEWROUTE | RTM_DELROUTE) && !is_ours(body, protocol, table) {
            return false;
        }
        if kind == RTM_NEWNEXTHOP && is_group(body) {
            return false;
        }
        rest = &rest[align(len).min(rest.len())..];
    }
    true
}

fn is_ours(rtmsg: &[u8], protocol: u8, table: u32) -> bool {
    if rtmsg.len() < RTMSG_LEN || rtmsg[5] != protocol {
        return false;
    }
    let Some(attrs) = attributes(&rtmsg[RTMSG_LEN..]) else {
        return false;
    };
    let route_table = attrs
        .iter()
        .find(|(kind, payload)| *kind == RTA_TABLE && payload.len() >= 4)
        .map_or(u32::from(rtmsg[4]), |(_, p)| {
            u32::from_ne_bytes(p[..4].try_into().expect("4 bytes"))
        });
    route_table == table
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

    fn announcement(kind: u16, protocol: u8, table: u32) -> Vec<u8> {
        let mut body = vec![2, 24, 0, 0, 254, protocol, 0, 1, 0, 0, 0, 0];
        body.extend_from_slice(&8u16.to_ne_bytes());
        body.extend_from_slice(&RTA_TABLE.to_ne_bytes());
        body.extend_from_slice(&table.to_ne_bytes());
        let mut msg = ((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes().to_vec();
        msg.extend_from_slice(&kind.to_ne_bytes());
        msg.extend_from_slice(&[0; 10]);
        msg.extend_from_slice(&body);
        msg
    }

    #[test]
    fn only_our_protocol_in_our_table_is_ours() {
        let ours = announcement(RTM_NEWROUTE, 201, 254);
        assert!(only_ours(&ours, 201, 254));
        assert!(only_ours(&announcement(RTM_DELROUTE, 201, 254), 201, 254));
        let mut two = ours.clone();
        two.extend(announcement(RTM_NEWROUTE, 4, 254));
        assert!(!only_ours(&two, 201, 254), "a static route among ours");
        assert!(!only_ours(&announcement(RTM_NEWROUTE, 201, 100), 201, 254));
        assert!(!only_ours(&ours[..ours.len() - 6], 201, 254), "truncated");
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
        assert!(only_ours(&nexthop(1), 201, 254));
        assert!(!only_ours(&nexthop(NHA_GROUP), 201, 254));
    }
}

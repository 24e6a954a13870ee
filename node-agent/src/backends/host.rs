//! What the host holds, for the address policy: every address assigned to one of its
//! interfaces, and every on-link prefix of its main table. The planner counts both as the local
//! node's ([`state::plan::HostAddresses`]), whatever the local node's Kubernetes record lists:
//! a remote node on one of the host's addresses, or a remote pod CIDR over the host's own link
//! (its gateway, its neighbours), is held and reported, never mapped or routed.
//!
//! Read on every dump: the addresses by a dump of their own (a host has few), the on-link
//! prefixes from the route dump the routes backend makes anyway ([`on_link`] picks them out).

use std::collections::HashSet;
use std::ffi::CStr;
use std::net::IpAddr;

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::LinkFlags;
use netlink_packet_route::route::{RouteAttribute, RouteMessage, RouteProtocol, RouteType};
use rtnetlink::Handle;
use state::address_policy::{judge_ip, judge_net};
use state::plan::OnLink;

use super::netlink::MAIN_TABLE;
use crate::kernel::DumpError;

/// Every address assigned to one of the host's interfaces that is up, both families, sorted,
/// without those the address policy refuses (never a node's, whatever the host holds). An
/// interface that is down carries addresses the host does not answer on as its own: kube-proxy's
/// IPVS mode puts every Service's ClusterIP and externalIPs on the dummy `kube-ipvs0`, which
/// stays down, and a Service's externalIPs may well be other nodes' addresses.
pub async fn addresses(handle: &Handle) -> Result<Vec<IpAddr>, DumpError> {
    let failed = |e: rtnetlink::Error| DumpError::Host {
        source: match e {
            rtnetlink::Error::NetlinkError(m) => m.to_io(),
            other => std::io::Error::other(other.to_string()),
        },
    };
    let mut up = HashSet::new();
    let mut links = handle.link().get().execute();
    while let Some(msg) = links.try_next().await.map_err(failed)? {
        if msg.header.flags.contains(LinkFlags::Up) {
            up.insert(msg.header.index);
        }
    }
    let mut out = Vec::new();
    let mut answers = handle.address().get().execute();
    while let Some(msg) = answers.try_next().await.map_err(failed)? {
        if !up.contains(&msg.header.index) {
            continue;
        }
        // IPv4 names the interface's own address `IFA_LOCAL` (`IFA_ADDRESS` is the peer of a
        // point-to-point link); IPv6 has `IFA_ADDRESS` alone.
        let mut address = None;
        let mut local = None;
        for attr in &msg.attributes {
            match attr {
                AddressAttribute::Address(a) => address = Some(*a),
                AddressAttribute::Local(a) => local = Some(*a),
                _ => {}
            }
        }
        out.extend(
            local
                .or(address)
                .filter(|a| judge_ip(a.to_canonical()).is_ok()),
        );
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// The on-link prefix a route of the host stands for, with its interface's index: a unicast
/// route of the main table to a prefix (not the default route) out of an interface with no
/// gateway and no nexthop object (IPv4 connected routes are `scope link`; IPv6 ones carry no
/// scope, and no gateway either), and not one of ours (`protocol`).
pub fn on_link(msg: &RouteMessage, dst: IpNet, table: u32, protocol: u8) -> Option<(IpNet, u32)> {
    if table != MAIN_TABLE
        || msg.header.kind != RouteType::Unicast
        || msg.header.protocol == RouteProtocol::from(protocol)
        || judge_net(dst).is_err()
    {
        return None;
    }
    let mut oif = None;
    for attr in &msg.attributes {
        match attr {
            RouteAttribute::Gateway(_)
            | RouteAttribute::Via(_)
            | RouteAttribute::NhId(_)
            | RouteAttribute::MultiPath(_) => return None,
            RouteAttribute::Oif(i) => oif = Some(*i),
            _ => {}
        }
    }
    Some((dst, oif?))
}

/// The on-link prefixes, named by their interfaces (an index the kernel no longer knows by
/// name stays a number), sorted.
pub fn named(prefixes: &[(IpNet, u32)]) -> Vec<OnLink> {
    let mut out: Vec<OnLink> = prefixes
        .iter()
        .map(|&(prefix, index)| OnLink {
            prefix,
            device: device_name(index),
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

fn device_name(index: u32) -> String {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` holds IF_NAMESIZE bytes, as if_indextoname requires; on success it holds
    // a NUL-terminated name.
    let name = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    if name.is_null() {
        return format!("interface {index}");
    }
    // SAFETY: if_indextoname returned `buf`, NUL-terminated.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_route::route::RouteAddress;
    use std::net::Ipv4Addr;

    fn route(attrs: Vec<RouteAttribute>) -> RouteMessage {
        let mut msg = RouteMessage::default();
        msg.header.kind = RouteType::Unicast;
        msg.header.protocol = RouteProtocol::Kernel;
        msg.attributes = attrs;
        msg
    }

    #[test]
    fn an_on_link_prefix_is_a_main_table_route_out_of_an_interface_with_no_gateway() {
        let dst: IpNet = "10.88.0.0/16".parse().unwrap();
        let connected = route(vec![RouteAttribute::Oif(3)]);
        assert_eq!(on_link(&connected, dst, MAIN_TABLE, 201), Some((dst, 3)));
        assert_eq!(on_link(&connected, dst, 100, 201), None, "another table");
        let default = "0.0.0.0/0".parse().unwrap();
        assert_eq!(on_link(&connected, default, MAIN_TABLE, 201), None);
        let link_local = "fe80::/64".parse().unwrap();
        assert_eq!(on_link(&connected, link_local, MAIN_TABLE, 201), None);
        let gw = RouteAttribute::Gateway(RouteAddress::Inet(Ipv4Addr::new(10, 88, 0, 9)));
        let via = route(vec![RouteAttribute::Oif(3), gw]);
        assert_eq!(on_link(&via, dst, MAIN_TABLE, 201), None, "has a gateway");
        let through = route(vec![RouteAttribute::NhId(201_400_001)]);
        assert_eq!(on_link(&through, dst, MAIN_TABLE, 201), None, "a nexthop");
        let mut ours = route(vec![RouteAttribute::Oif(3)]);
        ours.header.protocol = RouteProtocol::from(201);
        assert_eq!(on_link(&ours, dst, MAIN_TABLE, 201), None, "ours");
        let mut blackhole = route(vec![]);
        blackhole.header.kind = RouteType::BlackHole;
        assert_eq!(on_link(&blackhole, dst, MAIN_TABLE, 201), None);
    }
}

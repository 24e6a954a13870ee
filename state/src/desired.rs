//! The kernel objects a remote node should have, derived from its record alone.
//!
//! Kept apart from the planner so that the planner, the tests' oracle and the backends' debug
//! tooling all agree on one derivation.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::node::{AddressKind, Family, Node};
use crate::objects::{KernelObject, MapEntry, NodeId, Route, XfrmDir, XfrmPolicy, XfrmState};
use crate::plan::{InputProblem, PlanConfig};

/// The local endpoint of `family` for xfrm: the first configured local address of that family.
pub fn local_endpoint(config: &PlanConfig, family: Family) -> Option<IpAddr> {
    config
        .local_addresses
        .iter()
        .copied()
        .find(|ip| Family::of(ip) == family)
}

fn any_net(family: Family) -> IpNet {
    match family {
        Family::V4 => IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::UNSPECIFIED, 0)),
        Family::V6 => IpNet::V6(Ipv6Net::new_assert(Ipv6Addr::UNSPECIFIED, 0)),
    }
}

/// Whether an address of `kind` gets a map entry: InternalIPs always, ExternalIPs with
/// `include_external_ips`.
pub fn maps_address(include_external_ips: bool, kind: AddressKind) -> bool {
    kind == AddressKind::InternalIP || include_external_ips
}

/// Appends the objects `node` should have under `id` to `out`, and the problems that kept some
/// from being derived (a pod CIDR without an InternalIP of its family) to `problems`.
pub fn desired_objects(
    node: &Node,
    id: NodeId,
    config: &PlanConfig,
    out: &mut Vec<KernelObject>,
    problems: &mut Vec<InputProblem>,
) {
    let spi = config.ipsec.map_or(0, |i| i.spi);
    for a in &node.addresses {
        if maps_address(config.include_external_ips, a.kind) {
            out.push(KernelObject::MapEntry(MapEntry {
                ip: a.ip,
                node_id: id,
                spi,
            }));
        }
    }
    for cidr in &node.pod_cidrs {
        let family = Family::of_net(cidr);
        match node.internal_ip(family) {
            Some(gateway) => out.push(KernelObject::Route(Route {
                dst: *cidr,
                gateway,
                metric: Route::default_metric(cidr),
            })),
            None => problems.push(InputProblem::NoGateway {
                cidr: *cidr,
                family,
            }),
        }
    }
    if config.ipsec.is_none() {
        return;
    }
    for family in [Family::V4, Family::V6] {
        let (Some(local), Some(remote)) =
            (local_endpoint(config, family), node.internal_ip(family))
        else {
            continue;
        };
        out.push(KernelObject::XfrmState(XfrmState {
            src: local,
            dst: remote,
            spi,
            dir: XfrmDir::Out,
            node_id: id,
        }));
        out.push(KernelObject::XfrmState(XfrmState {
            src: remote,
            dst: local,
            spi,
            dir: XfrmDir::In,
            node_id: id,
        }));
        for cidr in node
            .pod_cidrs
            .iter()
            .filter(|c| Family::of_net(c) == family)
        {
            out.push(KernelObject::XfrmPolicy(XfrmPolicy {
                src: any_net(family),
                dst: *cidr,
                dir: XfrmDir::Out,
                node_id: id,
                tmpl_src: local,
                tmpl_dst: remote,
                spi,
            }));
        }
    }
}

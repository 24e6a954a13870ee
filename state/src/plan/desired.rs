//! The kernel objects a remote node should have, derived from its record alone, but for
//! which of its two nexthop IDs a nexthop holds: that follows what the kernel holds
//! ([`nexthop_toward`]).
//!
//! Kept apart from the planner's steps, and public at the crate's top (`state::desired`), so
//! that the planner, the tests' oracle and the backends' debug tooling all agree on one
//! derivation. It speaks the planner's vocabulary (its configuration, problems and resources),
//! so it sits in the planner's folder, above those leaves and beneath the steps.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

pub use super::resource::maps_address;
use crate::inventory::Inventory;
use crate::node::{Family, Node};
use crate::objects::{
    KernelObject, MapEntry, Nexthop, NexthopId, NodeId, ObjectId, PodCidrEntry, Route, Spi, Via,
    XfrmDir, XfrmGuard, XfrmPolicy, XfrmState,
};

use super::config::{Pair, PlanConfig};
use super::problem::InputProblem;

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

/// The objects that belong to no node: with IPsec, the guards of every family this node has an
/// xfrm endpoint in.
pub fn global_objects(config: &PlanConfig) -> Vec<KernelObject> {
    if config.ipsec.is_none() {
        return Vec::new();
    }
    [Family::V4, Family::V6]
        .into_iter()
        .filter(|f| local_endpoint(config, *f).is_some())
        .flat_map(XfrmGuard::all)
        .map(KernelObject::XfrmGuard)
        .collect()
}

/// What [`nexthop_toward`] asks of the kernel's view: an [`Inventory`], or an index over one
/// that finds our nexthops faster (the planner's, at scale).
pub trait KernelNexthops {
    /// Our nexthop at `id`, if there is one.
    fn ours(&self, id: NexthopId) -> Option<&Nexthop>;

    /// The view itself: what is foreign, and which of ours foreign objects use.
    fn inventory(&self) -> &Inventory;
}

impl KernelNexthops for Inventory {
    fn ours(&self, id: NexthopId) -> Option<&Nexthop> {
        match self.get(&ObjectId::Nexthop { id }) {
            Some(KernelObject::Nexthop(n)) => Some(n),
            _ => None,
        }
    }

    fn inventory(&self) -> &Inventory {
        self
    }
}

/// Node `id`'s nexthop of `family` toward `gateway`, at the one of its two IDs that `kernel`
/// calls for:
/// 1. the ID of a nexthop of ours that already has this gateway (the first ID if both do);
/// 2. with nothing of ours at either, the first ID nothing foreign holds, so that a fresh
///    start and one that kept the node's nexthop at its second ID agree; with a foreign
///    nexthop at both, the first (it keeps the routes from being written, and is reported, as
///    at any identity of ours);
/// 3. where ours has another gateway (the node was readdressed), an ID with nothing there: the
///    new nexthop is made there, the routes move to it and then the old one is deleted, instead
///    of replacing the old one under its routes, which makes the kernel walk every IPv4 route
///    (see "Scale" in `docs/design.md`). An old one a foreign route or group uses stays as it
///    is (it is kept, and reported): replaced, it would send their traffic to the new gateway;
/// 4. with no ID free, one of ours that nothing foreign uses, replaced in place;
/// 5. failing that (a foreign nexthop or a shared one of ours at each ID), nothing of ours
///    changes under a foreign user: the old one as it is, with the problem to report. The
///    node's routes keep its old gateway until an ID of the pair is to be had.
pub fn nexthop_toward(
    kernel: &impl KernelNexthops,
    id: NodeId,
    family: Family,
    gateway: IpAddr,
) -> (Nexthop, Option<InputProblem>) {
    let at = |second| Nexthop {
        node_id: id,
        gateway,
        second,
    };
    let ours = [false, true].map(|second| kernel.ours(NexthopId::of_pair(id, family, second)));
    if let Some(second) = [false, true]
        .into_iter()
        .find(|&s| ours[usize::from(s)].is_some_and(|n| n.gateway == gateway))
    {
        return (at(second), None);
    }
    let view = kernel.inventory();
    let identity = |second| ObjectId::Nexthop {
        id: NexthopId::of_pair(id, family, second),
    };
    let free = |second| {
        let i = identity(second);
        !view.contains(&i) && view.foreign(&i).is_none()
    };
    let Some(old) = ours[0].or(ours[1]) else {
        return (
            at([false, true]
                .into_iter()
                .find(|&s| free(s))
                .unwrap_or(false)),
            None,
        );
    };
    let unshared = |second: bool| {
        ours[usize::from(second)].is_some() && view.foreign_user(&identity(second)).is_none()
    };
    let second = [false, true]
        .into_iter()
        .find(|&s| free(s))
        .or_else(|| [false, true].into_iter().find(|&s| unshared(s)));
    match second {
        Some(second) => (at(second), None),
        None => {
            let user = view.foreign_user(&identity(old.second)).unwrap_or_default();
            let problem = InputProblem::InUse {
                object: KernelObject::Nexthop(old.clone()).to_string(),
                user: user.to_owned(),
            };
            (old.clone(), Some(problem))
        }
    }
}

/// Appends `node`'s routes to `out`, one per pod CIDR via the node's InternalIP of the CIDR's
/// family; with nexthops (`kernel`), through one nexthop object per family
/// ([`nexthop_toward`]), pushed before the routes that use it.
fn routes(
    node: &Node,
    id: NodeId,
    config: &PlanConfig,
    nexthops: Option<&impl KernelNexthops>,
    out: &mut Vec<KernelObject>,
    problems: &mut Vec<InputProblem>,
) {
    for family in [Family::V4, Family::V6] {
        let mut cidrs = node
            .pod_cidrs
            .iter()
            .filter(|c| Family::of_net(c) == family)
            .peekable();
        if cidrs.peek().is_none() {
            continue;
        }
        let Some(gateway) = node.internal_ip(family) else {
            problems.extend(cidrs.map(|cidr| InputProblem::NoGateway {
                cidr: *cidr,
                family,
            }));
            continue;
        };
        // With IPsec, a route without its mark and policy would carry pod traffic in the
        // clear: where this node has no xfrm endpoint of the family, no route (invariant 18;
        // the plan reports it once, for the local node).
        if config.ipsec.is_some() && local_endpoint(config, family).is_none() {
            continue;
        }
        let via = match nexthops {
            Some(kernel) => {
                let (nexthop, problem) = nexthop_toward(kernel, id, family, gateway);
                problems.extend(problem);
                let via = Via::Nexthop(nexthop.id());
                out.push(KernelObject::Nexthop(nexthop));
                via
            }
            None => Via::Gateway(gateway),
        };
        for cidr in cidrs {
            out.push(KernelObject::Route(Route {
                dst: *cidr,
                via,
                metric: Route::default_metric(cidr),
            }));
        }
    }
}

/// Appends the objects `node` should have under `id` to `out`, and the problems that kept some
/// from being derived (a pod CIDR without an InternalIP of its family) to `problems`. `kernel`
/// is what the kernel holds: it decides which of the node's nexthop IDs are used.
///
/// With IPsec, per family both ends have an address in, for every key in use: an OUT state when
/// the node has pod CIDRs of the family, an IN state when the local node has, an OUT policy per
/// pod CIDR, and a pod-CIDR entry that marks traffic toward the CIDR with the SPI being sent
/// with. A CIDR is marked exactly when it has its policies, and a state exists exactly when a
/// policy (ours or the remote's) sends through it.
pub fn desired_objects(
    node: &Node,
    id: NodeId,
    config: &PlanConfig,
    kernel: &impl KernelNexthops,
    out: &mut Vec<KernelObject>,
    problems: &mut Vec<InputProblem>,
) {
    let spi = config.ipsec.as_ref().map_or(0, |i| i.send_spi);
    for a in &node.addresses {
        if maps_address(config.include_external_ips, a.kind) {
            out.push(KernelObject::MapEntry(MapEntry {
                ip: a.ip,
                node_id: id,
                spi,
            }));
        }
    }
    let nexthops = config.route_nexthops.then_some(kernel);
    routes(node, id, config, nexthops, out, problems);
    let Some(ipsec) = &config.ipsec else {
        return;
    };
    for family in [Family::V4, Family::V6] {
        let (Some(local), Some(remote)) =
            (local_endpoint(config, family), node.internal_ip(family))
        else {
            continue;
        };
        let cidrs = || {
            node.pod_cidrs
                .iter()
                .filter(move |c| Family::of_net(c) == family)
        };
        // A state only where packets use it: OUT toward a node with pod CIDRs of this family
        // (its policies select the state), IN from a node when ours has pod CIDRs of it (the
        // remote's policies tunnel toward them). An unused state costs the kernel a place on
        // its SPI's hash chain, and every node has one per remote node.
        let sends = cidrs().next().is_some();
        let receives = config
            .local_pod_cidrs
            .iter()
            .any(|c| Family::of_net(c) == family);
        let (local_boot, remote_boot) = (config.local_boot_id.as_str(), node.boot_id.as_str());
        for key in &ipsec.keys {
            let ends = [
                (sends, local, remote, local_boot, remote_boot, XfrmDir::Out),
                (
                    receives,
                    remote,
                    local,
                    remote_boot,
                    local_boot,
                    XfrmDir::In,
                ),
            ];
            for (_, src, dst, src_boot, dst_boot, dir) in ends.into_iter().filter(|e| e.0) {
                let pair = Pair {
                    src,
                    dst,
                    src_boot,
                    dst_boot,
                };
                out.push(KernelObject::XfrmState(XfrmState {
                    src,
                    dst,
                    spi: Spi::new(key.spi, key.layout, src),
                    dir,
                    node_id: id,
                    key: ipsec.tags.tag(key, &pair),
                }));
            }
            for cidr in cidrs() {
                out.push(KernelObject::XfrmPolicy(XfrmPolicy {
                    src: any_net(family),
                    dst: *cidr,
                    dir: XfrmDir::Out,
                    node_id: id,
                    tmpl_src: local,
                    tmpl_dst: remote,
                    spi: Spi::new(key.spi, key.layout, local),
                }));
            }
        }
        for cidr in cidrs() {
            out.push(KernelObject::PodCidrEntry(PodCidrEntry {
                cidr: *cidr,
                node_id: id,
                spi,
            }));
        }
    }
}

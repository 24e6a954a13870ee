//! The node record the planner works on, validated once on the way in.
//!
//! The agent's node sources (the Kubernetes watch, a NodeList file) only pull strings out of
//! their objects into a [`RawNode`]; everything that can be wrong with those strings is decided
//! here, so the planner never sees an unparsed or inconsistent address and a bad record becomes a
//! typed error naming the node and the field instead of a crash (invariant 12).

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

pub use crate::family::Family;

use crate::address_policy::{self, Refusal};
use crate::objects::NodeId;
use crate::text::ShortText;

/// The Kubernetes address types we act on. Others (Hostname, InternalDNS, ...) carry no IP and are
/// dropped by [`Node::from_raw`] rather than rejected, since Kubernetes lists them routinely.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum AddressKind {
    InternalIP,
    ExternalIP,
}

impl AddressKind {
    /// `None` for address types without an IP (Hostname, InternalDNS, ExternalDNS).
    fn parse(s: &str) -> Option<Self> {
        match s {
            "InternalIP" => Some(Self::InternalIP),
            "ExternalIP" => Some(Self::ExternalIP),
            _ => None,
        }
    }
}

/// One address of a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeAddress {
    pub kind: AddressKind,
    pub ip: IpAddr,
}

/// A node as the source delivered it: strings only.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct RawNode {
    pub name: String,
    pub uid: String,
    /// `(type, address)` pairs as in `status.addresses`.
    pub addresses: Vec<(String, String)>,
    /// `spec.podCIDRs`.
    pub pod_cidrs: Vec<String>,
    pub boot_id: String,
}

/// A node's addresses: two (a dual-stack node's InternalIPs) kept inline, so that the planner's
/// walks over tens of thousands of nodes read them without following another pointer; a node
/// with more (ExternalIPs too) keeps them on the heap, as a vector would.
pub type Addresses = SmallVec<[NodeAddress; 2]>;
/// A node's pod CIDRs, at most one per family: inline, as [`Addresses`].
pub type PodCidrs = SmallVec<[IpNet; 2]>;

/// A validated node record.
///
/// Fields are public for reading and for tests; a record built by hand can be re-checked with
/// [`Node::validate`], which the checkpoint decoder does for every record it reads.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub name: String,
    pub uid: ShortText,
    pub addresses: Addresses,
    /// At most one per family, each a canonical network address.
    pub pod_cidrs: PodCidrs,
    pub boot_id: ShortText,
    /// Assigned by the planner; what a source delivers is ignored.
    pub node_id: Option<NodeId>,
}

/// What is wrong with a node record. Every variant names the node and the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeError {
    #[error("node record has an empty name")]
    EmptyName,
    #[error("node {node}: address {value:?} (field status.addresses) is not an IP address")]
    BadAddress { node: String, value: String },
    #[error("node {node}: address {ip} (field status.addresses) is listed twice")]
    DuplicateAddress { node: String, ip: IpAddr },
    #[error(
        "node {node}: address {ip} (field status.addresses) is refused by the address policy: it is in {why}, never a node's"
    )]
    UnusableAddress {
        node: String,
        ip: IpAddr,
        why: Refusal,
    },
    #[error(
        "node {node}: pod CIDR {cidr} (field spec.podCIDRs) is refused by the address policy: {}, never routed to a node",
        .why.of_prefix()
    )]
    UnusableCidr {
        node: String,
        cidr: IpNet,
        why: Refusal,
    },
    #[error("node {node}: pod CIDR {value:?} (field spec.podCIDRs) is not a CIDR")]
    BadCidr { node: String, value: String },
    #[error(
        "node {node}: pod CIDR {value} (field spec.podCIDRs) is not a network address, expected {canonical}"
    )]
    NonCanonicalCidr {
        node: String,
        value: String,
        canonical: IpNet,
    },
    #[error(
        "node {node}: more than one {family} pod CIDR (field spec.podCIDRs): {first} and {second}"
    )]
    DuplicateCidrFamily {
        node: String,
        family: Family,
        first: IpNet,
        second: IpNet,
    },
}

impl Node {
    /// Parses and validates what a node source delivered.
    pub fn from_raw(raw: RawNode) -> Result<Self, NodeError> {
        // Not sized by the raw list: it names hostnames and DNS names too, which are dropped,
        // and a list sized for them would leave the inline room unused.
        let mut addresses = Addresses::new();
        for (kind, value) in &raw.addresses {
            let Some(kind) = AddressKind::parse(kind) else {
                continue;
            };
            let ip: IpAddr = value.trim().parse().map_err(|_| NodeError::BadAddress {
                node: raw.name.clone(),
                value: value.clone(),
            })?;
            // An IPv4 address written as IPv4-mapped IPv6 (`::ffff:10.0.0.1`) is that IPv4
            // address: kept as text, it conflicted with nothing (another node's or the local
            // node's 10.0.0.1) and went past the address policy.
            let ip = ip.to_canonical();
            // A node is one node, whatever its address list says (invariant 13): an address
            // listed twice (an InternalIP that is also the ExternalIP, as on a node without
            // NAT) is one address, of the stronger kind, where it first appears.
            match addresses.iter_mut().find(|a| a.ip == ip) {
                Some(first) => first.kind = first.kind.min(kind),
                None => addresses.push(NodeAddress { kind, ip }),
            }
        }
        let mut pod_cidrs = PodCidrs::with_capacity(raw.pod_cidrs.len());
        for value in &raw.pod_cidrs {
            let net: IpNet = value.trim().parse().map_err(|_| NodeError::BadCidr {
                node: raw.name.clone(),
                value: value.clone(),
            })?;
            if net.trunc() != net {
                return Err(NodeError::NonCanonicalCidr {
                    node: raw.name.clone(),
                    value: value.clone(),
                    canonical: net.trunc(),
                });
            }
            pod_cidrs.push(net);
        }
        let node = Self {
            name: raw.name,
            uid: raw.uid.into(),
            addresses,
            pod_cidrs,
            boot_id: raw.boot_id.into(),
            node_id: None,
        };
        node.validate()?;
        Ok(node)
    }

    /// Checks the invariants [`Node::from_raw`] establishes, for records that did not come
    /// through it (a test, a record built by hand): its shape ([`Node::check_shape`]) and the
    /// address policy ([`address_policy`]) for every address and pod CIDR.
    pub fn validate(&self) -> Result<(), NodeError> {
        self.check_shape()?;
        for a in &self.addresses {
            // An IPv4-mapped address is judged as the IPv4 address it is, as `from_raw` keeps it.
            address_policy::judge_ip(a.ip.to_canonical()).map_err(|why| {
                NodeError::UnusableAddress {
                    node: self.name.clone(),
                    ip: a.ip,
                    why,
                }
            })?;
        }
        for net in &self.pod_cidrs {
            address_policy::judge_net(*net).map_err(|why| NodeError::UnusableCidr {
                node: self.name.clone(),
                cidr: *net,
                why,
            })?;
        }
        Ok(())
    }

    /// The record's shape alone: a name, no address twice, canonical pod CIDRs, at most one per
    /// family. The checkpoint decoder checks this much: a record an earlier version wrote with a
    /// value the address policy now refuses still decodes (a checkpoint that does not decode is
    /// moved aside with the brake's holds in it), and its live node, refused by the policy now,
    /// is malformed and keeps what it had (invariant 8) until its record is fixed.
    pub fn check_shape(&self) -> Result<(), NodeError> {
        if self.name.is_empty() {
            return Err(NodeError::EmptyName);
        }
        for (i, a) in self.addresses.iter().enumerate() {
            if self.addresses[..i].iter().any(|b| b.ip == a.ip) {
                return Err(NodeError::DuplicateAddress {
                    node: self.name.clone(),
                    ip: a.ip,
                });
            }
        }
        for (i, net) in self.pod_cidrs.iter().enumerate() {
            if net.trunc() != *net {
                return Err(NodeError::NonCanonicalCidr {
                    node: self.name.clone(),
                    value: net.to_string(),
                    canonical: net.trunc(),
                });
            }
            let family = Family::of_net(net);
            if let Some(first) = self.pod_cidrs[..i]
                .iter()
                .find(|o| Family::of_net(o) == family)
            {
                return Err(NodeError::DuplicateCidrFamily {
                    node: self.name.clone(),
                    family,
                    first: *first,
                    second: *net,
                });
            }
        }
        Ok(())
    }

    /// The node's first InternalIP of `family`: the gateway for its pod CIDRs and the xfrm
    /// endpoint. Kubernetes lists the primary address first, so "first" is the primary.
    pub fn internal_ip(&self, family: Family) -> Option<IpAddr> {
        self.addresses
            .iter()
            .find(|a| a.kind == AddressKind::InternalIP && Family::of(&a.ip) == family)
            .map(|a| a.ip)
    }

    pub fn ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.addresses.iter().map(|a| a.ip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(addresses: &[(&str, &str)], cidrs: &[&str]) -> RawNode {
        RawNode {
            name: "worker-1".into(),
            uid: "uid-1".into(),
            addresses: addresses
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            pod_cidrs: cidrs.iter().map(|s| s.to_string()).collect(),
            boot_id: "boot".into(),
        }
    }

    #[test]
    fn dual_stack_node_parses_and_ignores_hostname_addresses() {
        let n = Node::from_raw(raw(
            &[
                ("InternalIP", "10.0.0.1"),
                ("Hostname", "worker-1"),
                ("InternalIP", "fd00::1"),
                ("ExternalIP", "203.0.113.1"),
            ],
            &["10.1.0.0/24", "fd01::/64"],
        ))
        .unwrap();
        assert_eq!(n.addresses.len(), 3);
        assert_eq!(n.internal_ip(Family::V4), Some("10.0.0.1".parse().unwrap()));
        assert_eq!(n.internal_ip(Family::V6), Some("fd00::1".parse().unwrap()));
        assert_eq!(n.pod_cidrs.len(), 2);
    }

    #[test]
    fn bad_address_names_node_and_value() {
        let e = Node::from_raw(raw(&[("InternalIP", "10.0.0.300")], &[])).unwrap_err();
        assert_eq!(
            e,
            NodeError::BadAddress {
                node: "worker-1".into(),
                value: "10.0.0.300".into()
            }
        );
        assert!(e.to_string().contains("worker-1"));
        assert!(e.to_string().contains("status.addresses"));
    }

    #[test]
    fn bad_and_non_canonical_cidrs_are_rejected() {
        assert!(matches!(
            Node::from_raw(raw(&[], &["10.1.0.0/33"])),
            Err(NodeError::BadCidr { .. })
        ));
        assert!(matches!(
            Node::from_raw(raw(&[], &["10.1.0.5/24"])),
            Err(NodeError::NonCanonicalCidr { canonical, .. }) if canonical.to_string() == "10.1.0.0/24"
        ));
    }

    #[test]
    fn two_cidrs_of_one_family_are_rejected() {
        assert!(matches!(
            Node::from_raw(raw(&[], &["10.1.0.0/24", "10.2.0.0/24"])),
            Err(NodeError::DuplicateCidrFamily {
                family: Family::V4,
                ..
            })
        ));
    }

    #[test]
    fn an_address_listed_twice_is_one_address_of_the_stronger_kind() {
        for pairs in [
            [("InternalIP", "10.0.0.1"), ("ExternalIP", "10.0.0.1")],
            [("ExternalIP", "10.0.0.1"), ("InternalIP", "10.0.0.1")],
            [("InternalIP", "10.0.0.1"), ("InternalIP", " 10.0.0.1")],
        ] {
            let n = Node::from_raw(raw(&pairs, &[])).unwrap();
            assert_eq!(
                n.addresses[..],
                [NodeAddress {
                    kind: AddressKind::InternalIP,
                    ip: "10.0.0.1".parse().unwrap()
                }],
                "{pairs:?}"
            );
        }
        let n = Node::from_raw(raw(
            &[("ExternalIP", "fd00::1"), ("ExternalIP", "fd00::1")],
            &[],
        ))
        .unwrap();
        assert_eq!(n.addresses.len(), 1);
        assert_eq!(n.addresses[0].kind, AddressKind::ExternalIP);
    }

    #[test]
    fn a_record_built_by_hand_with_a_repeated_address_is_invalid() {
        let mut n = Node::from_raw(raw(&[("InternalIP", "10.0.0.1")], &[])).unwrap();
        n.addresses.push(n.addresses[0]);
        assert!(matches!(
            n.validate(),
            Err(NodeError::DuplicateAddress { .. })
        ));
    }

    #[test]
    fn unusable_addresses_and_empty_names_are_rejected() {
        assert!(matches!(
            Node::from_raw(raw(&[("InternalIP", "127.0.0.1")], &[])),
            Err(NodeError::UnusableAddress { .. })
        ));
        assert!(matches!(
            Node::from_raw(RawNode::default()),
            Err(NodeError::EmptyName)
        ));
        for unusable in ["255.255.255.255", "::ffff:127.0.0.1"] {
            assert!(
                matches!(
                    Node::from_raw(raw(&[("InternalIP", unusable)], &[])),
                    Err(NodeError::UnusableAddress { .. })
                ),
                "{unusable}"
            );
        }
    }

    /// The address policy judges addresses and pod CIDRs alike: the cloud's metadata range, a
    /// link-local or multicast address, a default route are refused, each error naming the node,
    /// the value and the range; private, shared and documentation space are kept.
    #[test]
    fn the_address_policy_refuses_addresses_and_pod_cidrs_alike() {
        for ip in [
            "169.254.169.254",
            "fe80::1",
            "ff02::1",
            "240.0.0.1",
            "0.1.2.3",
            "::",
        ] {
            let e = Node::from_raw(raw(&[("InternalIP", ip)], &[])).unwrap_err();
            assert!(matches!(e, NodeError::UnusableAddress { .. }), "{ip}: {e}");
            assert!(
                e.to_string().contains("worker-1") && e.to_string().contains(ip),
                "{e}"
            );
        }
        for cidr in [
            "169.254.169.0/24",
            "127.0.0.0/8",
            "224.0.0.0/24",
            "fe80::/64",
            "ff00::/8",
            "::/0",
            "0.0.0.0/0",
            "0.0.0.0/1",
            "::ffff:10.1.0.0/120",
        ] {
            let e = Node::from_raw(raw(&[("InternalIP", "10.0.0.1")], &[cidr])).unwrap_err();
            assert!(matches!(e, NodeError::UnusableCidr { .. }), "{cidr}: {e}");
            assert!(
                e.to_string().contains("worker-1") && e.to_string().contains(cidr),
                "{e}"
            );
        }
        let e = Node::from_raw(raw(&[("InternalIP", "10.0.0.1")], &["169.254.169.0/24"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("link-local space (169.254.0.0/16)"), "{e}");
        let n = Node::from_raw(raw(
            &[("InternalIP", "100.64.0.1"), ("ExternalIP", "203.0.113.1")],
            &["100.96.0.0/24", "fd01::/64"],
        ))
        .unwrap();
        assert_eq!(n.addresses.len(), 2);
        // A record built by hand meets the same policy; its shape alone passes.
        let mut n = n;
        n.pod_cidrs[0] = "169.254.169.0/24".parse().unwrap();
        assert!(matches!(n.validate(), Err(NodeError::UnusableCidr { .. })));
        assert_eq!(n.check_shape(), Ok(()));
    }

    /// An IPv4 address written as IPv4-mapped IPv6 is that IPv4 address, so it conflicts with
    /// the same address written plainly.
    #[test]
    fn an_ipv4_mapped_address_is_its_ipv4_address() {
        let n = Node::from_raw(raw(&[("InternalIP", "::ffff:10.0.0.1")], &[])).unwrap();
        assert_eq!(n.addresses[0].ip, "10.0.0.1".parse::<IpAddr>().unwrap());
    }
}

//! Builders the workspace's tests share, so a node is made one way everywhere, and the one
//! model kernel they apply plans to ([`ModelKernel`]): the state crate's own tests, its
//! integration tests and benchmarks, and the agent's unit tests (through the `testing`
//! feature, which only dev-dependencies turn on).

use std::net::IpAddr;

use ipnet::IpNet;

use crate::node::{AddressKind, Node, NodeAddress, RawNode};
use crate::objects::NodeId;

mod kernel;

pub use kernel::{ModelKernel, Refusal};

pub fn id(v: u16) -> NodeId {
    NodeId::new(v).unwrap()
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

pub fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

/// A node with InternalIPs and pod CIDRs, its UID derived from its name, no ID yet.
pub fn node(name: &str, ips: &[&str], cidrs: &[&str]) -> Node {
    Node {
        name: name.into(),
        uid: format!("uid-{name}").into(),
        addresses: ips
            .iter()
            .map(|s| NodeAddress {
                kind: AddressKind::InternalIP,
                ip: ip(s),
            })
            .collect(),
        pod_cidrs: cidrs.iter().map(|s| net(s)).collect(),
        boot_id: Default::default(),
        node_id: None,
    }
}

/// The same node as a source hands it over, before validation.
pub fn raw(name: &str, ips: &[&str], cidrs: &[&str]) -> RawNode {
    RawNode {
        name: name.into(),
        uid: format!("uid-{name}"),
        addresses: ips
            .iter()
            .map(|a| ("InternalIP".into(), a.to_string()))
            .collect(),
        pod_cidrs: cidrs.iter().map(|c| c.to_string()).collect(),
        boot_id: String::new(),
    }
}

pub fn with_id(mut n: Node, v: u16) -> Node {
    n.node_id = Some(id(v));
    n
}

pub fn external(mut n: Node, addr: &str) -> Node {
    n.addresses.push(NodeAddress {
        kind: AddressKind::ExternalIP,
        ip: ip(addr),
    });
    n
}

/// The workspace's one seeded random source for generated histories (the planner's and the
/// end-to-end checker's): xorshift64*, small, the same sequence everywhere, so a seed replays.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// 0..n (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// True with probability `pct` percent.
    pub fn chance(&mut self, pct: u64) -> bool {
        self.next_u64() % 100 < pct
    }

    /// True once in `n` draws, on average.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
}

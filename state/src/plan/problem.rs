//! What is wrong with one live node's input, or keeps it from being programmed, as every step
//! reports it.

use std::net::IpAddr;

use ipnet::IpNet;

use super::resource::{ConflictWhy, Resource};
use crate::ids::IdError;
use crate::node::Family;

/// What is wrong with one live node's input, or what keeps it from being programmed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InputProblem {
    #[error("name listed twice in the live view; the first entry is used")]
    DuplicateName,
    #[error(
        "{resource} is claimed by node {holder} too; {holder} keeps it ({why}); this node is held until the conflict clears"
    )]
    Conflict {
        resource: Resource,
        holder: String,
        why: ConflictWhy,
    },
    #[error("{resource} belongs to the local node; this node is held until it no longer claims it")]
    LocalResource { resource: Resource },
    #[error(
        "pod CIDR {cidr} overlaps {local}, the local node's; this node is held until it no longer does (its route would take the local node's traffic)"
    )]
    OverlapsLocal { cidr: IpNet, local: String },
    #[error(
        "pod CIDR {cidr} covers {ip}, the address of node {holder}; this node is held until it no longer does (its route would take {holder}'s traffic)"
    )]
    CoversAddress {
        cidr: IpNet,
        ip: IpAddr,
        holder: String,
    },
    #[error("{object} is not written: {foreign} is there and is not ours; it is left alone")]
    Foreign { object: String, foreign: String },
    #[error(
        "{object} is not deleted: {user} uses it and is not ours, and the kernel would delete it along; both are left alone"
    )]
    InUse { object: String, user: String },
    #[error("pod CIDR {cidr} has no {family} InternalIP to route via; the CIDR is skipped")]
    NoGateway { cidr: IpNet, family: Family },
    #[error(
        "IPsec is on and this node has {family} pod CIDRs but no {family} InternalIP to encrypt from: no {family} pod CIDR of a remote node is routed (its traffic would leave in the clear)"
    )]
    NoLocalEndpoint { family: Family },
    #[error(
        "node-ID map full: {needed} more entries do not fit its {limit} entries; the node is held (raise --node-map-max)"
    )]
    MapFull { limit: usize, needed: usize },
    #[error("{0}; the node is held")]
    Ids(#[from] IdError),
    #[error("its record does not validate now; it keeps what it had")]
    Malformed,
}

impl InputProblem {
    /// Whether the problem is a conflict over a resource or a kernel identity (as opposed to
    /// bad input or a full map), for metrics and reports.
    pub fn is_conflict(&self) -> bool {
        matches!(
            self,
            Self::Conflict { .. }
                | Self::LocalResource { .. }
                | Self::OverlapsLocal { .. }
                | Self::CoversAddress { .. }
                | Self::Foreign { .. }
                | Self::InUse { .. }
        )
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("node {node}: {problem}")]
pub struct InputError {
    pub node: String,
    pub problem: InputProblem,
}

pub(super) fn err(errors: &mut Vec<InputError>, node: &str, problem: InputProblem) {
    errors.push(InputError {
        node: node.to_string(),
        problem,
    });
}

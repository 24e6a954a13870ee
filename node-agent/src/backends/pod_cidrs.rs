//! The pod-CIDR map backend: entries of the pinned `pod_cidrs` LPM trie (IPsec only).
//!
//! Every entry is ours (we own the map). As in the node-ID map, an entry the agent never writes
//! (an undecodable key, node ID 0) is kept aside in [`PodCidrBackend::invalid`], reported and
//! removed.

use std::path::Path;

use ipnet::IpNet;
use node_agent_common::NodeValue;
use state::inventory::Inventory;
use state::objects::{KernelObject, NodeId, ObjectKind, Op, PodCidrEntry};

use super::{Backend, map::op_is_full};
use crate::kernel::{DumpError, OpError};
use crate::node_map::NodeMapError;
use crate::pod_cidr_map::{BadCidrEntry, PodCidrMap, encode};

pub struct PodCidrBackend {
    map: PodCidrMap,
    capacity: u32,
    invalid: Vec<BadCidrEntry>,
}

impl PodCidrBackend {
    pub fn open(pin: &Path, capacity: u32) -> Result<Self, NodeMapError> {
        Ok(Self {
            map: PodCidrMap::open(pin)?,
            capacity,
            invalid: Vec::new(),
        })
    }

    /// Entries found by the last dump that the agent never writes.
    pub fn invalid(&self) -> &[BadCidrEntry] {
        &self.invalid
    }

    /// Removes the entries of [`Self::invalid`], returning how many were removed.
    pub fn purge_invalid(&mut self) -> Result<usize, OpError> {
        let bad = std::mem::take(&mut self.invalid);
        for b in &bad {
            self.map.remove_raw(b).map_err(|e| OpError::Kernel {
                what: format!(
                    "removing the invalid pod-CIDR map entry {:?}/{}",
                    b.key, b.prefix_len
                ),
                source: e.into_io(),
            })?;
        }
        Ok(bad.len())
    }

    fn apply_one(&mut self, op: &Op) -> Result<(), OpError> {
        let KernelObject::PodCidrEntry(e) = op.object() else {
            unreachable!("Backends::apply routes only pod-CIDR entries here");
        };
        let result = match op {
            Op::Create(_) | Op::Replace(_) => self.map.upsert(
                e.cidr,
                NodeValue {
                    id: e.node_id.get(),
                    spi: e.spi,
                    flags: 0,
                },
            ),
            Op::Delete(_) => self.map.remove(e.cidr),
        };
        result.map_err(|err| self.op_error(e.cidr, err))
    }

    fn op_error(&self, cidr: IpNet, err: NodeMapError) -> OpError {
        if op_is_full(err.errno()) {
            return OpError::MapFull {
                map: "pod-CIDR",
                capacity: self.capacity,
            };
        }
        OpError::Kernel {
            what: format!("pod-CIDR map entry {cidr}"),
            source: err.into_io(),
        }
    }
}

impl Backend for PodCidrBackend {
    async fn dump_into(&mut self, inv: &mut Inventory) -> Result<(), DumpError> {
        let dump = self.map.dump().map_err(|e| DumpError::Kernel {
            kind: ObjectKind::PodCidrEntry,
            source: e.into_io(),
        })?;
        self.invalid = dump.undecodable;
        for e in dump.entries {
            match NodeId::new(e.node_id) {
                Some(node_id) => inv.insert(KernelObject::PodCidrEntry(PodCidrEntry {
                    cidr: e.cidr,
                    node_id,
                    spi: e.spi,
                })),
                None => {
                    let key = encode(e.cidr);
                    self.invalid.push(BadCidrEntry {
                        prefix_len: key.prefix_len(),
                        key: key.data(),
                        value: NodeValue {
                            id: e.node_id,
                            spi: e.spi,
                            flags: e.flags,
                        },
                    })
                }
            }
        }
        for b in &self.invalid {
            tracing::warn!(key = ?b.key, prefix_len = b.prefix_len, value = ?b.value, "pod-CIDR map entry the agent never writes; it will be removed");
        }
        Ok(())
    }

    async fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        ops.iter().map(|op| self.apply_one(op)).collect()
    }
}

//! The node-ID map backend: entries of the pinned `node_ids` map.
//!
//! Every entry is ours (we own the map), so the dump needs no filter; but an entry that does not
//! decode, or that maps to ID 0 (the local node, never written), cannot be a planner object. Such
//! entries are kept aside in [`MapBackend::invalid`] so the agent reports and removes them.

use std::net::IpAddr;
use std::path::Path;

use node_agent_common::NodeValue;
use state::inventory::Inventory;
use state::objects::{KernelObject, MapEntry, NodeId, Op};

use super::Backend;
use crate::kernel::{DumpError, OpError};
use crate::node_map::{BadEntry, NodeMap, NodeMapError};

pub struct MapBackend {
    map: NodeMap,
    capacity: u32,
    invalid: Vec<BadEntry>,
}

impl MapBackend {
    pub fn open(pin: &Path, capacity: u32) -> Result<Self, NodeMapError> {
        Ok(Self {
            map: NodeMap::open(pin)?,
            capacity,
            invalid: Vec::new(),
        })
    }

    /// Entries found by the last dump that the agent never writes (undecodable key, ID 0).
    pub fn invalid(&self) -> &[BadEntry] {
        &self.invalid
    }

    /// Removes the entries of [`Self::invalid`], returning how many were removed.
    pub fn purge_invalid(&mut self) -> Result<usize, OpError> {
        let bad = std::mem::take(&mut self.invalid);
        for b in &bad {
            self.map.remove_raw(&b.key).map_err(|e| OpError::Kernel {
                what: format!("removing the invalid node-ID map entry {:?}", b.key),
                source: e.into_io(),
            })?;
        }
        Ok(bad.len())
    }

    fn apply_one(&mut self, op: &Op) -> Result<(), OpError> {
        let KernelObject::MapEntry(e) = op.object() else {
            unreachable!("Backends::apply routes only map entries here");
        };
        let result = match op {
            Op::Create(_) | Op::Replace(_) => self.map.upsert(
                e.ip,
                NodeValue {
                    id: e.node_id.get(),
                    spi: e.spi,
                    flags: 0,
                },
            ),
            Op::Delete(_) => self.map.remove(e.ip),
        };
        result.map_err(|err| self.op_error(e.ip, err))
    }

    fn op_error(&self, ip: IpAddr, err: NodeMapError) -> OpError {
        let errno = err.errno();
        if op_is_full(errno) {
            return OpError::MapFull {
                map: "node-ID",
                capacity: self.capacity,
            };
        }
        OpError::Kernel {
            what: format!("node-ID map entry {ip}"),
            source: err.into_io(),
        }
    }
}

/// The kernel answers E2BIG when a hash map is at `max_entries` (ENOSPC on some paths, and for
/// a full LPM trie).
pub(super) fn op_is_full(errno: Option<i32>) -> bool {
    matches!(errno, Some(libc::E2BIG) | Some(libc::ENOSPC))
}

impl Backend for MapBackend {
    async fn dump_into(&mut self, inv: &mut Inventory) -> Result<(), DumpError> {
        let dump = self.map.dump().map_err(|e| DumpError::Kernel {
            kind: state::objects::ObjectKind::MapEntry,
            source: e.into_io(),
        })?;
        self.invalid = dump.undecodable;
        for e in dump.entries {
            match NodeId::new(e.node_id) {
                Some(node_id) => inv.insert(KernelObject::MapEntry(MapEntry {
                    ip: e.ip,
                    node_id,
                    spi: e.spi,
                })),
                None => self.invalid.push(BadEntry {
                    key: crate::node_map::encode_key(e.ip),
                    value: NodeValue {
                        id: e.node_id,
                        spi: e.spi,
                        flags: e.flags,
                    },
                }),
            }
        }
        for b in &self.invalid {
            tracing::warn!(key = ?b.key, value = ?b.value, "node-ID map entry the agent never writes; it will be removed");
        }
        Ok(())
    }

    async fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        ops.iter().map(|op| self.apply_one(op)).collect()
    }
}

//! The map backends: entries of the pinned `node_ids` map ([`MapBackend`]) and, with IPsec, of
//! the `pod_cidrs` LPM trie ([`PodCidrBackend`]). One backend over the map's key kind, as the
//! maps themselves are one type ([`PinnedMap`]).
//!
//! Every entry is ours (we own the maps), so the dump needs no filter; but an entry that does not
//! decode, or that maps to ID 0 (the local node, never written), cannot be a planner object. Such
//! entries are kept aside in [`PinnedMapBackend::invalid`] so the agent reports and removes them.

use std::fmt::Display;
use std::net::IpAddr;
use std::path::Path;

use ipnet::IpNet;
use node_agent_common::NodeValue;
use state::inventory::Inventory;
use state::objects::{KernelObject, MapEntry, NodeId, ObjectKind, Op, PodCidrEntry};

use super::Backend;
use crate::datapath::maps::{
    BadCidrEntry, BadEntry, KeyKind, NodeIds, NodeMapError, PinnedMap, PodCidrs, encode_key,
};
use crate::kernel::{DumpError, OpError};

/// The node-ID map backend.
pub type MapBackend = PinnedMapBackend<NodeIds>;
/// The pod-CIDR map backend.
pub type PodCidrBackend = PinnedMapBackend<PodCidrs>;

/// How the planner's objects of one kind sit in a pinned map keyed by `Self`.
pub trait MapObjects: KeyKind<Addr: Display> {
    /// Names the map in errors.
    const NAME: &'static str;
    const KIND: ObjectKind;

    /// The key, node ID and SPI an object of this kind writes; `None` for another kind.
    fn entry_of(object: &KernelObject) -> Option<(Self::Addr, NodeId, u8)>;
    /// The key and value of an entry read back.
    fn parts(entry: &Self::Entry) -> (Self::Addr, NodeValue);
    /// The object an entry of a remote node's ID stands for.
    fn object(addr: Self::Addr, node_id: NodeId, spi: u8) -> KernelObject;
    /// An entry that decodes but carries an ID the agent never writes.
    fn bad(addr: Self::Addr, value: NodeValue) -> Self::Bad;
    /// A bad entry's key, for errors.
    fn describe(bad: &Self::Bad) -> String;
    /// Says that a dump found a bad entry.
    fn warn_invalid(bad: &Self::Bad);
}

impl MapObjects for NodeIds {
    const NAME: &'static str = "node-ID";
    const KIND: ObjectKind = ObjectKind::MapEntry;

    fn entry_of(object: &KernelObject) -> Option<(IpAddr, NodeId, u8)> {
        match object {
            KernelObject::MapEntry(e) => Some((e.ip, e.node_id, e.spi)),
            _ => None,
        }
    }

    fn parts(e: &Self::Entry) -> (IpAddr, NodeValue) {
        let value = NodeValue {
            id: e.node_id,
            spi: e.spi,
            flags: e.flags,
        };
        (e.ip, value)
    }

    fn object(ip: IpAddr, node_id: NodeId, spi: u8) -> KernelObject {
        KernelObject::MapEntry(MapEntry { ip, node_id, spi })
    }

    fn bad(ip: IpAddr, value: NodeValue) -> BadEntry {
        BadEntry {
            key: encode_key(ip),
            value,
        }
    }

    fn describe(b: &BadEntry) -> String {
        format!("{:?}", b.key)
    }

    fn warn_invalid(b: &BadEntry) {
        tracing::warn!(key = ?b.key, value = ?b.value, "node-ID map entry the agent never writes; it will be removed");
    }
}

impl MapObjects for PodCidrs {
    const NAME: &'static str = "pod-CIDR";
    const KIND: ObjectKind = ObjectKind::PodCidrEntry;

    fn entry_of(object: &KernelObject) -> Option<(IpNet, NodeId, u8)> {
        match object {
            KernelObject::PodCidrEntry(e) => Some((e.cidr, e.node_id, e.spi)),
            _ => None,
        }
    }

    fn parts(e: &Self::Entry) -> (IpNet, NodeValue) {
        let value = NodeValue {
            id: e.node_id,
            spi: e.spi,
            flags: e.flags,
        };
        (e.cidr, value)
    }

    fn object(cidr: IpNet, node_id: NodeId, spi: u8) -> KernelObject {
        KernelObject::PodCidrEntry(PodCidrEntry { cidr, node_id, spi })
    }

    fn bad(cidr: IpNet, value: NodeValue) -> BadCidrEntry {
        let key = Self::encode(cidr);
        BadCidrEntry {
            prefix_len: key.prefix_len(),
            key: key.data(),
            value,
        }
    }

    fn describe(b: &BadCidrEntry) -> String {
        format!("{:?}/{}", b.key, b.prefix_len)
    }

    fn warn_invalid(b: &BadCidrEntry) {
        tracing::warn!(key = ?b.key, prefix_len = b.prefix_len, value = ?b.value, "pod-CIDR map entry the agent never writes; it will be removed");
    }
}

/// The entries of one pinned map, as planner objects.
pub struct PinnedMapBackend<K: MapObjects> {
    map: PinnedMap<K>,
    capacity: u32,
    invalid: Vec<K::Bad>,
}

impl<K: MapObjects> PinnedMapBackend<K> {
    pub fn open(pin: &Path, capacity: u32) -> Result<Self, NodeMapError> {
        Ok(Self {
            map: PinnedMap::open(pin)?,
            capacity,
            invalid: Vec::new(),
        })
    }

    /// Entries found by the last dump that the agent never writes (undecodable key, ID 0).
    pub fn invalid(&self) -> &[K::Bad] {
        &self.invalid
    }

    /// Removes the entries of [`Self::invalid`], returning how many were removed.
    pub fn purge_invalid(&mut self) -> Result<usize, OpError> {
        let bad = std::mem::take(&mut self.invalid);
        for b in &bad {
            self.map.remove_raw(b).map_err(|e| OpError::Kernel {
                what: format!(
                    "removing the invalid {} map entry {}",
                    K::NAME,
                    K::describe(b)
                ),
                source: e.into_io(),
            })?;
        }
        Ok(bad.len())
    }

    fn apply_one(&mut self, op: &Op) -> Result<(), OpError> {
        let Some((addr, node_id, spi)) = K::entry_of(op.object()) else {
            unreachable!("Backends::apply routes only {} map entries here", K::NAME);
        };
        let result = match op {
            Op::Create(_) | Op::Replace(_) => self.map.upsert(
                addr,
                NodeValue {
                    id: node_id.get(),
                    spi,
                    flags: 0,
                },
            ),
            Op::Delete(_) => self.map.remove(addr),
        };
        result.map_err(|err| self.op_error(addr, err))
    }

    fn op_error(&self, addr: K::Addr, err: NodeMapError) -> OpError {
        if op_is_full(err.errno()) {
            return OpError::MapFull {
                map: K::NAME,
                capacity: self.capacity,
            };
        }
        OpError::Kernel {
            what: format!("{} map entry {addr}", K::NAME),
            source: err.into_io(),
        }
    }
}

/// The kernel answers E2BIG when a hash map is at `max_entries` (ENOSPC on some paths, and for
/// a full LPM trie).
fn op_is_full(errno: Option<i32>) -> bool {
    matches!(errno, Some(libc::E2BIG) | Some(libc::ENOSPC))
}

impl<K: MapObjects> Backend for PinnedMapBackend<K> {
    async fn dump_into(&mut self, inv: &mut Inventory) -> Result<(), DumpError> {
        let dump = self.map.dump().map_err(|e| DumpError::Kernel {
            kind: K::KIND,
            source: e.into_io(),
        })?;
        self.invalid = dump.undecodable;
        for e in &dump.entries {
            let (addr, value) = K::parts(e);
            match NodeId::new(value.id) {
                Some(node_id) => inv.insert(K::object(addr, node_id, value.spi)),
                None => self.invalid.push(K::bad(addr, value)),
            }
        }
        for b in &self.invalid {
            K::warn_invalid(b);
        }
        Ok(())
    }

    async fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        ops.iter().map(|op| self.apply_one(op)).collect()
    }
}

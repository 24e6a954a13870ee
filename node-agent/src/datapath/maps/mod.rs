//! The datapath's pinned maps of node values, opened by path: `node_ids` (a hash map keyed by
//! address) and `pod_cidrs` (an LPM trie keyed by CIDR). Both hold a [`NodeValue`] per key and
//! differ only in their key, so one map type, [`PinnedMap`], serves both over a [`KeyKind`];
//! [`NodeMap`] and [`PodCidrMap`] are its two kinds.
//!
//! Opening by pin (rather than through a loaded [`crate::datapath::Datapath`]) lets read-only
//! tools such as `node-agent map dump` inspect a running agent's maps without loading anything.

pub mod batch;
pub mod node_ids;
pub mod pod_cidrs;

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use aya::maps::{MapData, MapError};
use node_agent_common::NodeValue;

pub use self::node_ids::{
    BadEntry, NodeEntry, NodeIds, NodeMap, NodeStatsMap, decode_key, encode_key,
};
pub use self::pod_cidrs::{BadCidrEntry, PodCidrEntry, PodCidrMap, PodCidrs};

#[derive(Debug, thiserror::Error)]
pub enum NodeMapError {
    #[error("opening the pinned map {pin}: {source}")]
    Open { pin: PathBuf, source: MapError },
    #[error("reading {pin}: {source}")]
    Read { pin: PathBuf, source: MapError },
    #[error("writing {ip} to {pin}: {source}")]
    Write {
        pin: PathBuf,
        ip: IpAddr,
        source: MapError,
    },
}

impl NodeMapError {
    /// The errno behind the error, when the kernel gave one.
    pub fn errno(&self) -> Option<i32> {
        let source = match self {
            Self::Open { source, .. } | Self::Read { source, .. } | Self::Write { source, .. } => {
                source
            }
        };
        match source {
            MapError::SyscallError(e) => e.io_error.raw_os_error(),
            _ => None,
        }
    }

    /// The error as an `io::Error`, keeping the errno where there is one.
    pub fn into_io(self) -> std::io::Error {
        match self.errno() {
            Some(errno) => std::io::Error::new(
                std::io::Error::from_raw_os_error(errno).kind(),
                format!("{self} (os error {errno})"),
            ),
            None => std::io::Error::other(self.to_string()),
        }
    }
}

/// What keys a pinned map of node values, and how the kernel's map of that key is read and
/// written.
pub trait KeyKind {
    /// What a key stands for: an address, a CIDR.
    type Addr: Copy;
    /// The key as the kernel holds it.
    type Raw;
    /// An entry, decoded.
    type Entry: Ord;
    /// An entry with a key the agent would never write: reported rather than guessed at, and
    /// removable by its raw key.
    type Bad;
    /// The aya map that holds keys of this kind.
    type Map;

    fn from_data(data: MapData) -> Result<Self::Map, MapError>;
    /// Every entry as the kernel holds it.
    fn read_all(map: &Self::Map) -> Result<Vec<(Self::Raw, NodeValue)>, MapError>;
    fn insert(map: &mut Self::Map, key: &Self::Raw, value: NodeValue) -> Result<(), MapError>;
    fn remove(map: &mut Self::Map, key: &Self::Raw) -> Result<(), MapError>;

    /// The key of `addr`.
    fn encode(addr: Self::Addr) -> Self::Raw;
    /// The entry a key and its value stand for, or the bad entry they are.
    fn decode(key: Self::Raw, value: NodeValue) -> Result<Self::Entry, Self::Bad>;
    /// The raw key of a bad entry.
    fn raw(bad: &Self::Bad) -> Self::Raw;
    /// The address a write error about `addr` names.
    fn ip(addr: Self::Addr) -> IpAddr;
    /// The address a write error about a bad entry names: its address where that decodes.
    fn shown(bad: &Self::Bad) -> IpAddr;
}

/// Everything found in a pinned map.
pub struct Dump<K: KeyKind> {
    /// Sorted by key.
    pub entries: Vec<K::Entry>,
    pub undecodable: Vec<K::Bad>,
}

impl<K: KeyKind> Default for Dump<K> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            undecodable: Vec::new(),
        }
    }
}

impl<K: KeyKind> Clone for Dump<K>
where
    K::Entry: Clone,
    K::Bad: Clone,
{
    fn clone(&self) -> Self {
        Self {
            entries: self.entries.clone(),
            undecodable: self.undecodable.clone(),
        }
    }
}

impl<K: KeyKind> fmt::Debug for Dump<K>
where
    K::Entry: fmt::Debug,
    K::Bad: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dump")
            .field("entries", &self.entries)
            .field("undecodable", &self.undecodable)
            .finish()
    }
}

impl<K: KeyKind> PartialEq for Dump<K>
where
    K::Bad: PartialEq,
{
    fn eq(&self, other: &Self) -> bool {
        self.entries == other.entries && self.undecodable == other.undecodable
    }
}

impl<K: KeyKind> Eq for Dump<K> where K::Bad: Eq {}

/// A pinned map of node values keyed by `K`, opened from its pin.
pub struct PinnedMap<K: KeyKind> {
    pin: PathBuf,
    map: K::Map,
}

impl<K: KeyKind> PinnedMap<K> {
    pub fn open(pin: &Path) -> Result<Self, NodeMapError> {
        let open = |source| NodeMapError::Open {
            pin: pin.to_owned(),
            source,
        };
        let data = MapData::from_pin(pin).map_err(open)?;
        let map = K::from_data(data).map_err(open)?;
        Ok(Self {
            pin: pin.to_owned(),
            map,
        })
    }

    /// Every entry, decoded where the key is one the agent writes.
    pub fn dump(&self) -> Result<Dump<K>, NodeMapError> {
        let items = K::read_all(&self.map).map_err(|source| NodeMapError::Read {
            pin: self.pin.clone(),
            source,
        })?;
        let mut dump = Dump::default();
        for (key, value) in items {
            match K::decode(key, value) {
                Ok(entry) => dump.entries.push(entry),
                Err(bad) => dump.undecodable.push(bad),
            }
        }
        dump.entries.sort();
        Ok(dump)
    }

    /// Inserts or updates the entry for `addr`.
    pub fn upsert(&mut self, addr: K::Addr, value: NodeValue) -> Result<(), NodeMapError> {
        K::insert(&mut self.map, &K::encode(addr), value)
            .map_err(|source| self.write_error(K::ip(addr), source))
    }

    /// Removes the entry for `addr`; removing an absent entry is not an error.
    pub fn remove(&mut self, addr: K::Addr) -> Result<(), NodeMapError> {
        self.remove_key(&K::encode(addr), K::ip(addr))
    }

    /// Removes an entry by its raw key, for keys that do not decode.
    pub fn remove_raw(&mut self, bad: &K::Bad) -> Result<(), NodeMapError> {
        self.remove_key(&K::raw(bad), K::shown(bad))
    }

    fn remove_key(&mut self, key: &K::Raw, ip: IpAddr) -> Result<(), NodeMapError> {
        match K::remove(&mut self.map, key) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(())
            }
            Err(source) => Err(self.write_error(ip, source)),
        }
    }

    fn write_error(&self, ip: IpAddr, source: MapError) -> NodeMapError {
        NodeMapError::Write {
            pin: self.pin.clone(),
            ip,
            source,
        }
    }
}

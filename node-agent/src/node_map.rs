//! The pinned node-ID map and its counters, opened by path.
//!
//! Opening by pin (rather than through a loaded [`crate::datapath::Datapath`]) lets read-only
//! tools such as `node-agent map dump` inspect a running agent's maps without loading anything.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use std::os::fd::AsFd;

use aya::maps::{HashMap, IterableMap, Map, MapData, MapError, PerCpuArray};
use node_agent_common::{FAMILY_V4, FAMILY_V6, NodeKey, NodeStats, NodeValue};
use serde::Serialize;

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

/// One decoded entry of `node_ids`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct NodeEntry {
    pub ip: IpAddr,
    pub node_id: u16,
    pub spi: u8,
    pub flags: u8,
}

/// A key the agent would never write (unknown family, non-zero padding or tail bytes): reported
/// rather than guessed at, and removable by its raw key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadEntry {
    pub key: NodeKey,
    pub value: NodeValue,
}

/// Everything found in `node_ids`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dump {
    /// Sorted by address.
    pub entries: Vec<NodeEntry>,
    pub undecodable: Vec<BadEntry>,
}

/// The address a key stands for, or `None` when the key is not one the agent writes.
pub fn decode_key(key: &NodeKey) -> Option<IpAddr> {
    if key.pad != [0; 3] {
        return None;
    }
    match key.family {
        FAMILY_V4 if key.ip[4..].iter().all(|b| *b == 0) => Some(IpAddr::V4(Ipv4Addr::new(
            key.ip[0], key.ip[1], key.ip[2], key.ip[3],
        ))),
        FAMILY_V6 => Some(IpAddr::V6(Ipv6Addr::from(key.ip))),
        _ => None,
    }
}

/// The key of an address.
pub fn encode_key(ip: IpAddr) -> NodeKey {
    match ip {
        IpAddr::V4(v4) => NodeKey::v4(v4.octets()),
        IpAddr::V6(v6) => NodeKey::v6(v6.octets()),
    }
}

/// `node_ids`, opened from its pin.
pub struct NodeMap {
    pin: PathBuf,
    map: HashMap<MapData, NodeKey, NodeValue>,
}

impl NodeMap {
    pub fn open(pin: &Path) -> Result<Self, NodeMapError> {
        let open = |source| NodeMapError::Open {
            pin: pin.to_owned(),
            source,
        };
        let data = MapData::from_pin(pin).map_err(open)?;
        let map = HashMap::try_from(Map::HashMap(data)).map_err(open)?;
        Ok(Self {
            pin: pin.to_owned(),
            map,
        })
    }

    /// Every entry, read in batches where the kernel can.
    pub fn dump(&self) -> Result<Dump, NodeMapError> {
        let read = |source| NodeMapError::Read {
            pin: self.pin.clone(),
            source,
        };
        let items: Vec<(NodeKey, NodeValue)> =
            match crate::map_batch::lookup_all(self.map.map().fd().as_fd()).map_err(read)? {
                Some(items) => items,
                None => self.map.iter().collect::<Result<_, _>>().map_err(read)?,
            };
        let mut dump = Dump::default();
        for (key, value) in items {
            match decode_key(&key) {
                Some(ip) => dump.entries.push(NodeEntry {
                    ip,
                    node_id: value.id,
                    spi: value.spi,
                    flags: value.flags,
                }),
                None => dump.undecodable.push(BadEntry { key, value }),
            }
        }
        dump.entries.sort();
        Ok(dump)
    }

    /// Inserts or updates the entry for `ip`.
    pub fn upsert(&mut self, ip: IpAddr, value: NodeValue) -> Result<(), NodeMapError> {
        self.map
            .insert(encode_key(ip), value, 0)
            .map_err(|source| NodeMapError::Write {
                pin: self.pin.clone(),
                ip,
                source,
            })
    }

    /// Removes the entry for `ip`; removing an absent entry is not an error.
    pub fn remove(&mut self, ip: IpAddr) -> Result<(), NodeMapError> {
        self.remove_key(&encode_key(ip), ip)
    }

    /// Removes an entry by its raw key, for keys that do not decode to an address.
    pub fn remove_raw(&mut self, key: &NodeKey) -> Result<(), NodeMapError> {
        let shown = decode_key(key).unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        self.remove_key(key, shown)
    }

    fn remove_key(&mut self, key: &NodeKey, ip: IpAddr) -> Result<(), NodeMapError> {
        match self.map.remove(key) {
            Ok(()) => Ok(()),
            Err(MapError::KeyNotFound) => Ok(()),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(())
            }
            Err(source) => Err(NodeMapError::Write {
                pin: self.pin.clone(),
                ip,
                source,
            }),
        }
    }
}

/// `node_stats`, opened from its pin: read-only totals per node ID.
pub struct NodeStatsMap {
    pin: PathBuf,
    map: PerCpuArray<MapData, NodeStats>,
}

impl NodeStatsMap {
    pub fn open(pin: &Path) -> Result<Self, NodeMapError> {
        let open = |source| NodeMapError::Open {
            pin: pin.to_owned(),
            source,
        };
        let data = MapData::from_pin(pin).map_err(open)?;
        let map = PerCpuArray::try_from(Map::PerCpuArray(data)).map_err(open)?;
        Ok(Self {
            pin: pin.to_owned(),
            map,
        })
    }

    /// The counters of `node_id`, summed over all CPUs.
    pub fn get(&self, node_id: u16) -> Result<NodeStats, NodeMapError> {
        let per_cpu =
            self.map
                .get(&u32::from(node_id), 0)
                .map_err(|source| NodeMapError::Read {
                    pin: self.pin.clone(),
                    source,
                })?;
        Ok(per_cpu
            .iter()
            .fold(NodeStats::default(), |acc, s| NodeStats {
                rx_packets: acc.rx_packets + s.rx_packets,
                rx_bytes: acc.rx_bytes + s.rx_bytes,
                tx_packets: acc.tx_packets + s.tx_packets,
                tx_bytes: acc.tx_bytes + s.tx_bytes,
            }))
    }
}

//! The pinned node-ID map (`node_ids`, keyed by address) and its counters (`node_stats`), opened
//! by path.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use std::os::fd::AsFd;

use aya::maps::{HashMap, IterableMap, Map, MapData, MapError, PerCpuArray};
use node_agent_common::{FAMILY_V4, FAMILY_V6, NodeKey, NodeStats, NodeValue};
use serde::Serialize;

use super::{KeyKind, NodeMapError, PinnedMap};

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

/// The key of `node_ids`: a node's address.
pub enum NodeIds {}

/// `node_ids`, opened from its pin.
pub type NodeMap = PinnedMap<NodeIds>;

impl KeyKind for NodeIds {
    type Addr = IpAddr;
    type Raw = NodeKey;
    type Entry = NodeEntry;
    type Bad = BadEntry;
    type Map = HashMap<MapData, NodeKey, NodeValue>;

    fn from_data(data: MapData) -> Result<Self::Map, MapError> {
        HashMap::try_from(Map::HashMap(data))
    }

    /// In batches where the kernel can.
    fn read_all(map: &Self::Map) -> Result<Vec<(NodeKey, NodeValue)>, MapError> {
        match super::batch::lookup_all(map.map().fd().as_fd())? {
            Some(items) => Ok(items),
            None => map.iter().collect(),
        }
    }

    fn insert(map: &mut Self::Map, key: &NodeKey, value: NodeValue) -> Result<(), MapError> {
        map.insert(key, value, 0)
    }

    fn remove(map: &mut Self::Map, key: &NodeKey) -> Result<(), MapError> {
        map.remove(key)
    }

    fn encode(ip: IpAddr) -> NodeKey {
        encode_key(ip)
    }

    fn decode(key: NodeKey, value: NodeValue) -> Result<NodeEntry, BadEntry> {
        match decode_key(&key) {
            Some(ip) => Ok(NodeEntry {
                ip,
                node_id: value.id,
                spi: value.spi,
                flags: value.flags,
            }),
            None => Err(BadEntry { key, value }),
        }
    }

    fn raw(bad: &BadEntry) -> NodeKey {
        bad.key
    }

    fn ip(ip: IpAddr) -> IpAddr {
        ip
    }

    fn shown(bad: &BadEntry) -> IpAddr {
        decode_key(&bad.key).unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
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

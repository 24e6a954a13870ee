//! The pinned pod-CIDR map (`pod_cidrs`, an LPM trie), opened by path.
//!
//! Like [`crate::node_map`], opened by pin so that tools read a running agent's map without
//! loading anything. The key layout is in `node_agent_common` ([`POD_CIDR_HEADER_BITS`]).

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Map, MapData, MapError};
use ipnet::IpNet;
use node_agent_common::{NodeKey, NodeValue, POD_CIDR_HEADER_BITS};
use serde::Serialize;

use crate::node_map::{NodeMapError, decode_key, encode_key};

/// One decoded entry of `pod_cidrs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct PodCidrEntry {
    pub cidr: IpNet,
    pub node_id: u16,
    pub spi: u8,
    pub flags: u8,
}

/// A key the agent would never write (a prefix length shorter than the header or longer than
/// the family allows, an undecodable address, host bits set): reported and removable by its
/// raw key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadCidrEntry {
    pub prefix_len: u32,
    pub key: NodeKey,
    pub value: NodeValue,
}

/// Everything found in `pod_cidrs`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CidrDump {
    /// Sorted by CIDR.
    pub entries: Vec<PodCidrEntry>,
    pub undecodable: Vec<BadCidrEntry>,
}

/// The CIDR a key stands for, or `None` when the key is not one the agent writes.
pub fn decode(prefix_len: u32, key: &NodeKey) -> Option<IpNet> {
    let ip = decode_key(key)?;
    let len = u8::try_from(prefix_len.checked_sub(POD_CIDR_HEADER_BITS)?).ok()?;
    let net = IpNet::new(ip, len).ok()?;
    (net.network() == ip).then_some(net)
}

/// The trie key of a CIDR.
pub fn encode(cidr: IpNet) -> Key<NodeKey> {
    Key::new(
        POD_CIDR_HEADER_BITS + u32::from(cidr.prefix_len()),
        encode_key(cidr.network()),
    )
}

/// `pod_cidrs`, opened from its pin.
pub struct PodCidrMap {
    pin: PathBuf,
    map: LpmTrie<MapData, NodeKey, NodeValue>,
}

impl PodCidrMap {
    pub fn open(pin: &Path) -> Result<Self, NodeMapError> {
        let open = |source| NodeMapError::Open {
            pin: pin.to_owned(),
            source,
        };
        let data = MapData::from_pin(pin).map_err(open)?;
        let map = LpmTrie::try_from(Map::LpmTrie(data)).map_err(open)?;
        Ok(Self {
            pin: pin.to_owned(),
            map,
        })
    }

    pub fn dump(&self) -> Result<CidrDump, NodeMapError> {
        let mut dump = CidrDump::default();
        for item in self.map.iter() {
            let (key, value) = item.map_err(|source| NodeMapError::Read {
                pin: self.pin.clone(),
                source,
            })?;
            let data = key.data();
            match decode(key.prefix_len(), &data) {
                Some(cidr) => dump.entries.push(PodCidrEntry {
                    cidr,
                    node_id: value.id,
                    spi: value.spi,
                    flags: value.flags,
                }),
                None => dump.undecodable.push(BadCidrEntry {
                    prefix_len: key.prefix_len(),
                    key: data,
                    value,
                }),
            }
        }
        dump.entries.sort();
        Ok(dump)
    }

    /// Inserts or updates the entry for `cidr`.
    pub fn upsert(&mut self, cidr: IpNet, value: NodeValue) -> Result<(), NodeMapError> {
        self.map
            .insert(&encode(cidr), value, 0)
            .map_err(|source| self.write_error(cidr.network(), source))
    }

    /// Removes the entry for `cidr`; removing an absent entry is not an error.
    pub fn remove(&mut self, cidr: IpNet) -> Result<(), NodeMapError> {
        self.remove_key(&encode(cidr), cidr.network())
    }

    /// Removes an entry by its raw key, for keys that do not decode to a CIDR.
    pub fn remove_raw(&mut self, bad: &BadCidrEntry) -> Result<(), NodeMapError> {
        let shown = decode_key(&bad.key).unwrap_or(IpAddr::from([0, 0, 0, 0]));
        self.remove_key(&Key::new(bad.prefix_len, bad.key), shown)
    }

    fn remove_key(&mut self, key: &Key<NodeKey>, ip: IpAddr) -> Result<(), NodeMapError> {
        match self.map.remove(key) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_round_trip_and_foreign_keys_do_not_decode() {
        for c in [
            "10.1.2.0/24",
            "0.0.0.0/0",
            "10.1.2.3/32",
            "fd00:1::/64",
            "::/0",
        ] {
            let cidr: IpNet = c.parse().unwrap();
            let key = encode(cidr);
            assert_eq!(decode(key.prefix_len(), &key.data()), Some(cidr), "{c}");
        }
        let v4 = encode_key("10.1.2.0".parse().unwrap());
        assert_eq!(decode(31, &v4), None, "shorter than the header");
        assert_eq!(decode(32 + 33, &v4), None, "longer than IPv4");
        let host = encode_key("10.1.2.1".parse().unwrap());
        assert_eq!(decode(32 + 24, &host), None, "host bits set");
    }
}

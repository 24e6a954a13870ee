//! The pinned pod-CIDR map (`pod_cidrs`, an LPM trie), opened by path.
//!
//! The key layout is in `node_agent_common` ([`POD_CIDR_HEADER_BITS`]).

use std::net::IpAddr;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Map, MapData, MapError};
use ipnet::IpNet;
use node_agent_common::{NodeKey, NodeValue, POD_CIDR_HEADER_BITS};
use serde::Serialize;

use super::node_ids::{decode_key, encode_key};
use super::{KeyKind, PinnedMap};

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

/// The key of `pod_cidrs`: a CIDR, as the trie's prefix length and address.
pub enum PodCidrs {}

/// `pod_cidrs`, opened from its pin.
pub type PodCidrMap = PinnedMap<PodCidrs>;

impl KeyKind for PodCidrs {
    type Addr = IpNet;
    type Raw = Key<NodeKey>;
    type Entry = PodCidrEntry;
    type Bad = BadCidrEntry;
    type Map = LpmTrie<MapData, NodeKey, NodeValue>;

    fn from_data(data: MapData) -> Result<Self::Map, MapError> {
        LpmTrie::try_from(Map::LpmTrie(data))
    }

    /// Walked key by key: the kernel has no batch lookup for LPM tries.
    fn read_all(map: &Self::Map) -> Result<Vec<(Key<NodeKey>, NodeValue)>, MapError> {
        map.iter().collect()
    }

    fn insert(map: &mut Self::Map, key: &Key<NodeKey>, value: NodeValue) -> Result<(), MapError> {
        map.insert(key, value, 0)
    }

    fn remove(map: &mut Self::Map, key: &Key<NodeKey>) -> Result<(), MapError> {
        map.remove(key)
    }

    fn encode(cidr: IpNet) -> Key<NodeKey> {
        encode(cidr)
    }

    fn decode(key: Key<NodeKey>, value: NodeValue) -> Result<PodCidrEntry, BadCidrEntry> {
        let data = key.data();
        match decode(key.prefix_len(), &data) {
            Some(cidr) => Ok(PodCidrEntry {
                cidr,
                node_id: value.id,
                spi: value.spi,
                flags: value.flags,
            }),
            None => Err(BadCidrEntry {
                prefix_len: key.prefix_len(),
                key: data,
                value,
            }),
        }
    }

    fn raw(bad: &BadCidrEntry) -> Key<NodeKey> {
        Key::new(bad.prefix_len, bad.key)
    }

    fn ip(cidr: IpNet) -> IpAddr {
        cidr.network()
    }

    fn shown(bad: &BadCidrEntry) -> IpAddr {
        decode_key(&bad.key).unwrap_or(IpAddr::from([0, 0, 0, 0]))
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

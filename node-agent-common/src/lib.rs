//! The map ABI between the tc datapath (`node-agent-ebpf`) and the agent.
//!
//! Both sides compile these exact types, so a layout change is a change to one file. The tests
//! at the bottom pin every size, alignment and offset: the pinned maps outlive the agent (they
//! survive restarts and upgrades), so a silent layout drift would make a new agent misread the
//! entries an old one wrote.
#![no_std]

/// [`NodeKey::family`] of an IPv4 key. The address sits in the first 4 bytes of `ip`.
pub const FAMILY_V4: u8 = 4;
/// [`NodeKey::family`] of an IPv6 key.
pub const FAMILY_V6: u8 = 6;

/// Node ID 0 stands for the local node and is never written to the map.
pub const LOCAL_NODE_ID: u16 = 0;

/// Sub-directory of the bpffs root that holds our pins.
pub const PIN_DIR: &str = "node-agent";
/// Name of the node-ID map in the object file.
pub const NODE_IDS_MAP: &str = "NODE_IDS";
/// Pin name of the node-ID map under [`PIN_DIR`].
pub const NODE_IDS_PIN: &str = "node_ids";
/// Name of the per-node counters map in the object file.
pub const NODE_STATS_MAP: &str = "NODE_STATS";
/// Pin name of the counters map under [`PIN_DIR`].
pub const NODE_STATS_PIN: &str = "node_stats";

/// Pin name, under [`PIN_DIR`], of the record of freed node IDs: an array of one `u64` per node
/// ID, the second (since the Unix epoch) the ID was last freed, 0 for never. Only the agent
/// uses it; it keeps a freed ID's cool-down when the checkpoint is lost.
pub const FREED_IDS_PIN: &str = "freed_ids";

/// Capacity of `NODE_IDS` unless the agent asks for another at first creation.
pub const DEFAULT_NODE_MAP_MAX: u32 = 16384;
/// `NODE_STATS` is indexed by node ID, so it has one slot per possible ID.
pub const NODE_STATS_ENTRIES: u32 = 1 << 16;

/// Name of the global holding the `skb->mark` bits the ingress program owns.
pub const MARK_MASK_GLOBAL: &str = "MARK_MASK";
/// Name of the global holding the shift that places a node ID under [`MARK_MASK_GLOBAL`].
pub const MARK_SHIFT_GLOBAL: &str = "MARK_SHIFT";
/// The node ID goes into the upper 16 bits of the mark by default.
pub const DEFAULT_MARK_MASK: u32 = 0xFFFF_0000;

/// Name of the ingress classifier in the object file.
pub const INGRESS_PROG: &str = "tc_ingress";
/// Name of the egress classifier in the object file.
pub const EGRESS_PROG: &str = "tc_egress";

/// Key of `NODE_IDS`: one remote node address.
///
/// Padding is explicit and always zero, so that two keys for the same address hash the same
/// whichever side built them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeKey {
    /// [`FAMILY_V4`] or [`FAMILY_V6`].
    pub family: u8,
    /// Always zero.
    pub pad: [u8; 3],
    /// The address in network byte order; IPv4 uses the first 4 bytes, the rest are zero.
    pub ip: [u8; 16],
}

impl NodeKey {
    /// The key of an IPv4 address given as its 4 network-order bytes.
    pub const fn v4(octets: [u8; 4]) -> Self {
        let mut ip = [0u8; 16];
        ip[0] = octets[0];
        ip[1] = octets[1];
        ip[2] = octets[2];
        ip[3] = octets[3];
        Self {
            family: FAMILY_V4,
            pad: [0; 3],
            ip,
        }
    }

    /// The key of an IPv6 address given as its 16 network-order bytes.
    pub const fn v6(octets: [u8; 16]) -> Self {
        Self {
            family: FAMILY_V6,
            pad: [0; 3],
            ip: octets,
        }
    }
}

/// Value of `NODE_IDS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeValue {
    /// The node's ID, 1..=65535.
    pub id: u16,
    /// The IPsec SPI currently used toward the node, 0 when IPsec is off.
    pub spi: u8,
    /// Reserved for per-node datapath flags; written as zero today.
    pub flags: u8,
}

/// Per-node traffic counters: one slot per node ID in the per-CPU `NODE_STATS` array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all three are `repr(C)`, made only of integers, and have no implicit padding (the
    // layout tests below prove it), so every byte pattern is a valid value.
    unsafe impl aya::Pod for super::NodeKey {}
    unsafe impl aya::Pod for super::NodeValue {}
    unsafe impl aya::Pod for super::NodeStats {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, offset_of, size_of};

    #[test]
    fn node_key_layout_is_pinned() {
        assert_eq!(size_of::<NodeKey>(), 20);
        assert_eq!(align_of::<NodeKey>(), 1);
        assert_eq!(offset_of!(NodeKey, family), 0);
        assert_eq!(offset_of!(NodeKey, pad), 1);
        assert_eq!(offset_of!(NodeKey, ip), 4);
    }

    #[test]
    fn node_value_layout_is_pinned() {
        assert_eq!(size_of::<NodeValue>(), 4);
        assert_eq!(align_of::<NodeValue>(), 2);
        assert_eq!(offset_of!(NodeValue, id), 0);
        assert_eq!(offset_of!(NodeValue, spi), 2);
        assert_eq!(offset_of!(NodeValue, flags), 3);
    }

    #[test]
    fn node_stats_layout_is_pinned() {
        assert_eq!(size_of::<NodeStats>(), 32);
        assert_eq!(align_of::<NodeStats>(), 8);
        assert_eq!(offset_of!(NodeStats, rx_packets), 0);
        assert_eq!(offset_of!(NodeStats, rx_bytes), 8);
        assert_eq!(offset_of!(NodeStats, tx_packets), 16);
        assert_eq!(offset_of!(NodeStats, tx_bytes), 24);
    }

    #[test]
    fn ipv4_key_fills_first_four_bytes_and_zeroes_the_rest() {
        let k = NodeKey::v4([10, 0, 0, 3]);
        assert_eq!(k.family, FAMILY_V4);
        assert_eq!(k.pad, [0; 3]);
        assert_eq!(&k.ip[..4], &[10, 0, 0, 3]);
        assert!(k.ip[4..].iter().all(|b| *b == 0));
    }

    #[test]
    fn default_mark_mask_is_the_upper_16_bits() {
        assert_eq!(DEFAULT_MARK_MASK.trailing_zeros(), 16);
        assert_eq!(DEFAULT_MARK_MASK.count_ones(), 16);
    }
}

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

/// Name of the pod-CIDR map in the object file: an LPM trie from remote pod CIDRs to the node
/// (ID and SPI) that owns them, read by [`POD_PROG`] to pick the xfrm OUT policy of a packet.
pub const POD_CIDRS_MAP: &str = "POD_CIDRS";
/// Pin name of the pod-CIDR map under [`PIN_DIR`].
pub const POD_CIDRS_PIN: &str = "pod_cidrs";

/// Pin name, under [`PIN_DIR`], of the record of freed node IDs: an array of one `u64` per node
/// ID, the second (since the Unix epoch) the ID was last freed, 0 for never. Only the agent
/// uses it; it keeps a freed ID's cool-down when the checkpoint is lost. Created mappable
/// (`BPF_F_MMAPABLE`) where the kernel can, so the agent reads it as memory at start.
pub const FREED_IDS_PIN: &str = "freed_ids";

/// Pin name, under [`PIN_DIR`], of the record of the brake's recent removals: an array of
/// `[u64; 2]` slots, each the time of a removal (nanoseconds since the Unix epoch, 0 for an
/// empty slot) and its counts (known nodes in the upper 32 bits, orphan objects in the lower).
/// Only the agent uses it; it keeps the brake's window when the checkpoint is lost.
pub const RECENT_REMOVALS_PIN: &str = "recent_removals";

/// Capacity of `NODE_IDS` (and `POD_CIDRS`) when the agent creates them without being told
/// another: a dual-stack cluster of 65,536 nodes (one entry per address). The maps allocate an
/// entry when it is written (`BPF_F_NO_PREALLOC`), so a small cluster does not pay for it.
pub const DEFAULT_NODE_MAP_MAX: u32 = 131_072;
/// The largest capacity the agent accepts: entries, not IDs (an ID is 16 bits; a node has one
/// entry per mapped address).
pub const MAX_NODE_MAP_MAX: u32 = 1 << 22;
/// `NODE_STATS` is indexed by node ID, so it has one slot per possible ID.
pub const NODE_STATS_ENTRIES: u32 = 1 << 16;

/// Name of the global holding the `skb->mark` bits the ingress program owns.
pub const MARK_MASK_GLOBAL: &str = "MARK_MASK";
/// Name of the global holding the shift that places a node ID under [`MARK_MASK_GLOBAL`].
pub const MARK_SHIFT_GLOBAL: &str = "MARK_SHIFT";
/// The node ID goes into the upper 16 bits of the mark by default.
pub const DEFAULT_MARK_MASK: u32 = 0xFFFF_0000;

/// Name of the global that turns IPsec marking on (non-zero) in the ingress classifier.
pub const IPSEC_GLOBAL: &str = "IPSEC";

/// The xfrm mark layout (Cilium's), shared by the datapath, which writes it, and the agent,
/// whose xfrm states and policies match on it: node ID in bits 16-31, SPI in bits 12-15,
/// direction in bits 8-11. Bits 0-7 are left to other users of the mark.
pub mod xfrm_mark {
    /// Direction bits of traffic toward a remote node (selects our OUT policies and states).
    pub const OUT: u32 = 0x0E00;
    /// Direction bits of ESP traffic from a remote node (selects our IN states).
    pub const IN: u32 = 0x0D00;
    /// The bits that carry the direction.
    pub const DIR_MASK: u32 = 0x0F00;
    /// The bits an xfrm mark of ours occupies: ID, SPI and direction.
    pub const MASK: u32 = 0xFFFF_FF00;
    pub const SPI_SHIFT: u32 = 12;
    pub const ID_SHIFT: u32 = 16;

    /// The mark of traffic toward (`OUT`) or from (`IN`) node `id` under `spi` (0..=15).
    pub const fn encode(id: u16, spi: u8, dir: u32) -> u32 {
        ((id as u32) << ID_SHIFT) | (((spi & 0x0F) as u32) << SPI_SHIFT) | dir
    }
}

/// The ESP SPIs of ours, shared by the datapath, which reads the key's number out of a received
/// packet's SPI into the IN mark, and the agent, which writes the states. The key's number
/// (1..=15, the 4 SPI bits of the mark) is always the low 4 bits. Two layouts:
/// - **key**: the SPI is the key's number. Every IN state a node holds has its own address as
///   destination and that SPI, so the kernel keeps them all in one hash chain.
/// - **per-sender**: a tag of the sending address ([`MIN_TAG`](esp_spi::MIN_TAG) or more, so
///   the SPI is at least 256, the first value RFC 4303 does not reserve) sits above the key's
///   number, and the IN states spread over the chains.
pub mod esp_spi {
    /// The bits of the key's number.
    pub const KEY_MASK: u32 = 0x0F;
    pub const TAG_SHIFT: u32 = 4;
    /// The smallest sender tag.
    pub const MIN_TAG: u32 = 16;
    /// Sender tags are `MIN_TAG..MIN_TAG + TAG_SPAN`: 24 bits.
    pub const TAG_SPAN: u32 = (1 << 24) - MIN_TAG;

    /// The key number an SPI of ours carries, or `None` for an SPI in neither layout.
    pub const fn key_of(spi: u32) -> Option<u8> {
        let key = spi & KEY_MASK;
        let tag = spi >> TAG_SHIFT;
        if key == 0 || (tag != 0 && (tag < MIN_TAG || tag - MIN_TAG >= TAG_SPAN)) {
            None
        } else {
            Some(key as u8)
        }
    }
}

/// Name of the ingress classifier in the object file.
pub const INGRESS_PROG: &str = "tc_ingress";
/// Name of the egress classifier in the object file.
pub const EGRESS_PROG: &str = "tc_egress";
/// Name of the pod-traffic classifier: attached on ingress of the interface pod traffic enters
/// the host through (the CNI's bridge), it marks packets toward remote pod CIDRs for xfrm.
pub const POD_PROG: &str = "tc_pod";

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

/// `POD_CIDRS` is an LPM trie keyed by the kernel's `struct bpf_lpm_trie_key` (a `u32` prefix
/// length in bits) followed by a [`NodeKey`]. The length counts over the whole `NodeKey`: its
/// family byte and padding are the first [`POD_CIDR_HEADER_BITS`], so a `/24` IPv4 CIDR is
/// stored with prefix length 56, and a lookup uses [`POD_CIDR_FULL_BITS`] and the packet's
/// destination. The family byte in front keeps IPv4 and IPv6 CIDRs apart in one trie.
pub const POD_CIDR_HEADER_BITS: u32 = 32;
/// The prefix length of a `POD_CIDRS` lookup: every bit of a [`NodeKey`].
pub const POD_CIDR_FULL_BITS: u32 = POD_CIDR_HEADER_BITS + 128;

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
    fn xfrm_marks_follow_ciliums_layout() {
        assert_eq!(xfrm_mark::encode(7, 3, xfrm_mark::OUT), 0x0007_3E00);
        assert_eq!(xfrm_mark::encode(0xFFFF, 15, xfrm_mark::IN), 0xFFFF_FD00);
        assert_eq!(
            xfrm_mark::encode(1, 0x1F, xfrm_mark::OUT) & !xfrm_mark::MASK,
            0
        );
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

//! The ESP SPI of our xfrm states: the key's number (1..=15) in the low 4 bits and, in the
//! per-sender layout, a tag of the sending address above it (`node_agent_common::esp_spi` holds
//! the bit layout the datapath shares).
//!
//! Why a layout per sender: the kernel finds a received packet's state, and a state being
//! added, deleted or read back, by destination, SPI and protocol, in a hash table whose chains
//! hold every state with the same three. In the key layout every IN state of a node has the
//! node's own address and the key's SPI: one chain, as long as the cluster is large, walked for
//! each of them and for every ESP packet received. With the sender's tag in the SPI the IN
//! states spread over the table. The tag is a function of the address alone, so a sender and
//! its receivers agree on it without talking to each other.

use std::fmt;
use std::net::IpAddr;

use node_agent_common::esp_spi::{KEY_MASK, MIN_TAG, TAG_SHIFT, TAG_SPAN, key_of};
use serde::{Deserialize, Serialize};

/// How a key's states lay out their SPI: chosen per key in the key file.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum SpiLayout {
    /// The SPI is the key's number (1..=15): what every release before the per-sender layout
    /// sends and receives.
    #[default]
    Key,
    /// The sending address's tag above the key's number.
    PerSender,
}

impl SpiLayout {
    /// The name the key file, `ipsec status` and the metrics use: `key` or `per-sender`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Key => "key",
            Self::PerSender => "per-sender",
        }
    }
}

/// An ESP SPI of ours, in either layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Spi(u32);

impl Spi {
    /// The SPI of key `key` (1..=15) in `layout`, for a state whose sending end is `sender`.
    pub fn new(key: u8, layout: SpiLayout, sender: IpAddr) -> Self {
        let key = u32::from(key) & KEY_MASK;
        match layout {
            SpiLayout::Key => Self(key),
            SpiLayout::PerSender => Self((sender_tag(sender) << TAG_SHIFT) | key),
        }
    }

    /// The SPI a state holds in the kernel, or `None` for one in neither layout.
    pub const fn from_wire(spi: u32) -> Option<Self> {
        match key_of(spi) {
            Some(_) => Some(Self(spi)),
            None => None,
        }
    }

    /// The key's number: the SPI bits of the mark.
    pub const fn key(self) -> u8 {
        (self.0 & KEY_MASK) as u8
    }

    /// The SPI on the wire and in the kernel.
    pub const fn wire(self) -> u32 {
        self.0
    }

    pub const fn layout(self) -> SpiLayout {
        match self.0 >> TAG_SHIFT {
            0 => SpiLayout::Key,
            _ => SpiLayout::PerSender,
        }
    }
}

/// The key layout's SPI as its number (`3`), a per-sender one as `ip xfrm state` prints SPIs.
impl fmt::Display for Spi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.layout() {
            SpiLayout::Key => write!(f, "{}", self.0),
            SpiLayout::PerSender => write!(f, "0x{:08x}", self.0),
        }
    }
}

/// The per-sender tag of `sender`: 32-bit FNV-1a over its address bytes (4 or 16), brought
/// into `MIN_TAG..MIN_TAG + TAG_SPAN`. Part of the wire format: every release must compute the
/// same tag for the same address.
pub fn sender_tag(sender: IpAddr) -> u32 {
    let (v4, v6);
    let bytes: &[u8] = match sender {
        IpAddr::V4(a) => {
            v4 = a.octets();
            &v4
        }
        IpAddr::V6(a) => {
            v6 = a.octets();
            &v6
        }
    };
    let hash = bytes.iter().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    });
    MIN_TAG + hash % TAG_SPAN
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    fn senders() -> impl Iterator<Item = IpAddr> {
        let v4 = (0..4096u32).map(|i| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)));
        let v6 = (0..4096u128).map(|i| IpAddr::V6(Ipv6Addr::from((0xfd00_u128 << 112) + i)));
        v4.chain(v6)
            .chain([Ipv4Addr::UNSPECIFIED.into(), Ipv4Addr::BROADCAST.into()])
            .chain([
                Ipv6Addr::UNSPECIFIED.into(),
                Ipv6Addr::from(u128::MAX).into(),
            ])
    }

    /// Every key, both layouts, addresses of both families: the SPI carries the key's number
    /// as the datapath reads it, survives the kernel's round trip, and a per-sender SPI is
    /// outside the reserved 1..=255 and the key layout's range.
    #[test]
    fn every_key_in_both_layouts_reads_back_as_written() {
        let mut checked = 0;
        for sender in senders() {
            for key in 1..=15u8 {
                for layout in [SpiLayout::Key, SpiLayout::PerSender] {
                    let spi = Spi::new(key, layout, sender);
                    assert_eq!(key_of(spi.wire()), Some(key), "{spi} from {sender}");
                    assert_eq!(Spi::from_wire(spi.wire()), Some(spi));
                    assert_eq!((spi.key(), spi.layout()), (key, layout));
                    if layout == SpiLayout::PerSender {
                        assert!(spi.wire() >= 256 && spi.wire() < 1 << 28, "{spi}");
                    } else {
                        assert_eq!(spi.wire(), u32::from(key));
                    }
                    checked += 1;
                }
            }
        }
        println!("spi: {checked} (sender, key, layout) triples read back");
    }

    /// SPIs the agent never writes are not read as ours, at every boundary of the layout.
    #[test]
    fn spis_in_neither_layout_are_not_ours() {
        let outside = [
            0,
            16,
            0x10 << TAG_SHIFT,
            (MIN_TAG - 1) << TAG_SHIFT | 3,
            (MIN_TAG + TAG_SPAN) << TAG_SHIFT | 3,
            u32::MAX,
            MIN_TAG << TAG_SHIFT,
        ];
        for spi in outside {
            assert_eq!(Spi::from_wire(spi), None, "{spi:#x}");
        }
        for spi in [
            1,
            15,
            (MIN_TAG << TAG_SHIFT) | 1,
            ((MIN_TAG + TAG_SPAN - 1) << TAG_SHIFT) | 15,
        ] {
            assert!(Spi::from_wire(spi).is_some(), "{spi:#x}");
        }
    }

    /// The tag is part of the wire format: these values must never change. (Computed apart from
    /// this code: FNV-1a 32 of the packed address, `16 + h % (2**24 - 16)`.)
    #[test]
    fn sender_tags_are_stable() {
        let tags: Vec<u32> = ["10.0.0.1", "10.0.0.2", "fd00::1"]
            .iter()
            .map(|a| sender_tag(a.parse().unwrap()))
            .collect();
        println!("spi: sender tags {tags:?}");
        assert_eq!(tags, STABLE_TAGS);
    }

    const STABLE_TAGS: [u32; 3] = [5_271_804, 5_273_061, 157_211];

    /// 65,000 senders of each family get nearly as many distinct SPIs: the IN states of a node
    /// spread over the kernel's chains (collisions are allowed, the mark tells states apart).
    #[test]
    fn senders_spread_over_distinct_spis() {
        for (family, senders) in [
            (
                "ipv4",
                (0..65_000u32)
                    .map(|i| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + (i << 8) + 1)))
                    .collect::<Vec<_>>(),
            ),
            (
                "ipv6",
                (0..65_000u128)
                    .map(|i| IpAddr::V6(Ipv6Addr::from((0xfd00_u128 << 112) + (i << 64) + 1)))
                    .collect(),
            ),
        ] {
            let distinct: HashSet<u32> = senders
                .iter()
                .map(|s| Spi::new(3, SpiLayout::PerSender, *s).wire())
                .collect();
            println!(
                "spi: {family}: {} senders, {} distinct per-sender SPIs",
                senders.len(),
                distinct.len()
            );
            assert!(distinct.len() >= 64_500, "{family}: {}", distinct.len());
        }
    }
}

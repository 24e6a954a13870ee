//! One address policy for every address-like input: node addresses and pod CIDRs alike
//! (docs/design.md, "The address policy").
//!
//! [`RANGES`] is the whole rule: a node address is refused when it lies in a refused range, a
//! pod CIDR when its prefix length is 0 (a default route) or it overlaps a refused range (lies
//! in one, or holds one: `0.0.0.0/1` holds loopback). Both families are judged by the same
//! table; an IPv4 address written as IPv4-mapped IPv6 is judged as the IPv4 address it is (the
//! node model keeps it that way), and a pod CIDR in the IPv4-mapped block is refused, since it
//! would route an IPv4 destination as IPv6. The usable rows change no verdict: they say which
//! special space is meant to work (private, shared and unique-local space, the documentation
//! ranges clouds and the tests use) and the policy's test holds them usable.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// What the policy says of a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Never routed to a node, never mapped to one.
    Refused,
    /// Special, but meant to be used.
    Usable,
}

/// A row of [`RANGES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecialRange {
    pub name: &'static str,
    pub prefix: IpNet,
    pub verdict: Verdict,
}

const fn v4(name: &'static str, a: [u8; 4], len: u8, verdict: Verdict) -> SpecialRange {
    SpecialRange {
        name,
        prefix: IpNet::new_assert(IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3])), len),
        verdict,
    }
}

const fn v6(name: &'static str, a: [u16; 8], len: u8, verdict: Verdict) -> SpecialRange {
    let [a, b, c, d, e, f, g, h] = a;
    SpecialRange {
        name,
        prefix: IpNet::new_assert(IpAddr::V6(Ipv6Addr::new(a, b, c, d, e, f, g, h)), len),
        verdict,
    }
}

use Verdict::{Refused, Usable};

/// The special ranges of both families and what the policy says of each (RFC 6890's registries,
/// reduced to what matters for routing to a node).
pub const RANGES: &[SpecialRange] = &[
    v4("unspecified (this network)", [0, 0, 0, 0], 8, Refused),
    v4("loopback", [127, 0, 0, 0], 8, Refused),
    v4("link-local", [169, 254, 0, 0], 16, Refused),
    v4("multicast", [224, 0, 0, 0], 4, Refused),
    v4("reserved", [240, 0, 0, 0], 4, Refused),
    v4("broadcast", [255, 255, 255, 255], 32, Refused),
    v4("private", [10, 0, 0, 0], 8, Usable),
    v4("private", [172, 16, 0, 0], 12, Usable),
    v4("private", [192, 168, 0, 0], 16, Usable),
    v4("shared (carrier-grade NAT)", [100, 64, 0, 0], 10, Usable),
    v4("documentation", [192, 0, 2, 0], 24, Usable),
    v4("documentation", [198, 51, 100, 0], 24, Usable),
    v4("documentation", [203, 0, 113, 0], 24, Usable),
    v6("unspecified", [0; 8], 128, Refused),
    v6("loopback", [0, 0, 0, 0, 0, 0, 0, 1], 128, Refused),
    v6("IPv4-mapped", [0, 0, 0, 0, 0, 0xffff, 0, 0], 96, Refused),
    // Forms that embed an IPv4 address: the policy cannot vouch for what they carry
    // (`2002:7f00:1::1` is 6to4 of 127.0.0.1), and no node is addressed in them.
    v6("IPv4-compatible (deprecated)", [0; 8], 96, Refused),
    v6(
        "NAT64 translation",
        [0x64, 0xff9b, 0, 0, 0, 0, 0, 0],
        96,
        Refused,
    ),
    v6(
        "6to4 (deprecated)",
        [0x2002, 0, 0, 0, 0, 0, 0, 0],
        16,
        Refused,
    ),
    v6("link-local", [0xfe80, 0, 0, 0, 0, 0, 0, 0], 10, Refused),
    v6("multicast", [0xff00, 0, 0, 0, 0, 0, 0, 0], 8, Refused),
    v6("unique-local", [0xfc00, 0, 0, 0, 0, 0, 0, 0], 7, Usable),
    v6(
        "documentation",
        [0x2001, 0xdb8, 0, 0, 0, 0, 0, 0],
        32,
        Usable,
    ),
];

/// Why the policy refuses an address or a prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A prefix of length 0: it would be a default route.
    Default,
    /// In (or, for a prefix, overlapping) this refused range.
    Range(&'static SpecialRange),
}

impl Refusal {
    /// What it says of a prefix: `it is a prefix of length 0 ...`, `it overlaps link-local ...`.
    pub fn of_prefix(&self) -> String {
        match self {
            Self::Default => format!("it is {self}"),
            Self::Range(_) => format!("it overlaps {self}"),
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Default => f.write_str("a prefix of length 0 (a default route)"),
            Self::Range(r) => write!(f, "{} space ({})", r.name, r.prefix),
        }
    }
}

/// The most specific refused range holding `ip`, if any (the caller gives IPv4 addresses as
/// IPv4: an IPv4-mapped address is refused here as IPv4-mapped).
pub fn judge_ip(ip: IpAddr) -> Result<(), Refusal> {
    RANGES
        .iter()
        .filter(|r| r.verdict == Refused && r.prefix.contains(&ip))
        .max_by_key(|r| r.prefix.prefix_len())
        .map_or(Ok(()), |r| Err(Refusal::Range(r)))
}

/// Whether a pod CIDR may be routed to a node: not a default route, and overlapping no refused
/// range (the first in the table, if several).
pub fn judge_net(net: IpNet) -> Result<(), Refusal> {
    if net.prefix_len() == 0 {
        return Err(Refusal::Default);
    }
    RANGES
        .iter()
        .find(|r| r.verdict == Refused && overlaps(&r.prefix, &net))
        .map_or(Ok(()), |r| Err(Refusal::Range(r)))
}

/// Whether two prefixes share an address (one holds the other; prefixes never overlap
/// otherwise).
pub fn overlaps(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_canonical_and_its_rows_are_what_they_say() {
        for r in RANGES {
            assert_eq!(r.prefix.trunc(), r.prefix, "{}", r.name);
        }
        let refused = |s: &str| judge_ip(s.parse().unwrap()).is_err();
        for s in [
            "0.0.0.0",
            "127.0.0.1",
            "169.254.169.254",
            "224.0.0.1",
            "240.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "fe80::1",
            "ff02::1",
            "::10.88.5.5",
            "64:ff9b::7f00:1",
            "2002:7f00:1::1",
        ] {
            assert!(refused(s), "{s}");
        }
        for s in [
            "10.0.0.1",
            "172.16.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "192.0.2.1",
            "203.0.113.7",
            "fd00::1",
            "2001:db8::1",
            "8.8.8.8",
            "2600::1",
        ] {
            assert!(!refused(s), "{s}");
        }
        assert_eq!(
            judge_ip("255.255.255.255".parse().unwrap())
                .unwrap_err()
                .to_string(),
            "broadcast space (255.255.255.255/32)"
        );
        let net = |s: &str| judge_net(s.parse().unwrap());
        assert_eq!(net("0.0.0.0/0"), Err(Refusal::Default));
        assert_eq!(net("::/0"), Err(Refusal::Default));
        for s in [
            "169.254.169.0/24",
            "0.0.0.0/1",
            "128.0.0.0/1",
            "127.0.0.0/8",
            "fe80::/64",
            "ff00::/8",
            "8000::/1",
            "::ffff:10.0.0.0/120",
            // Holds the 6to4 block: a near-default route of the whole global unicast space.
            "2000::/3",
            "64:ff9b::/96",
        ] {
            assert!(net(s).is_err(), "{s}");
        }
        for s in [
            "10.0.0.0/8",
            "100.64.0.0/10",
            "fd00::/8",
            "2001:db8::/64",
            "2600:1f00::/40",
        ] {
            assert_eq!(net(s), Ok(()), "{s}");
        }
    }
}

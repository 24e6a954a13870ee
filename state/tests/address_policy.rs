//! The address policy (`state/src/address_policy.rs`, docs/design.md "The address policy")
//! against an oracle of its own: the registry's refused ranges written out again as numbers,
//! judged with integer arithmetic, over addresses and pod CIDRs of both families generated in
//! and around every range of the table. Addresses and CIDRs go through the node model
//! (`Node::from_raw`), as a source's strings do.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicUsize, Ordering};

use ipnet::IpNet;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use state::address_policy::{self, RANGES, Refusal, Verdict};
use state::node::{Node, NodeError, RawNode};

/// The refused ranges, as (is IPv6, first address, prefix length): the registry read again.
const REFUSED: &[(bool, u128, u8)] = &[
    (false, 0x0000_0000, 8),     // this network
    (false, 0x7f00_0000, 8),     // loopback
    (false, 0xa9fe_0000, 16),    // link-local
    (false, 0xe000_0000, 4),     // multicast
    (false, 0xf000_0000, 4),     // reserved
    (false, 0xffff_ffff, 32),    // broadcast
    (true, 0, 128),              // unspecified
    (true, 1, 128),              // loopback
    (true, 0xffff << 32, 96),    // IPv4-mapped
    (true, 0, 96),               // IPv4-compatible
    (true, 0x64_ff9b << 96, 96), // NAT64
    (true, 0x2002 << 112, 16),   // 6to4
    (true, 0xfe80 << 112, 10),   // link-local
    (true, 0xff00 << 112, 8),    // multicast
];

/// Space the policy keeps usable, as above.
const USABLE: &[(bool, u128, u8)] = &[
    (false, 0x0a00_0000, 8),
    (false, 0xac10_0000, 12),
    (false, 0xc0a8_0000, 16),
    (false, 0x6440_0000, 10),
    (false, 0xc000_0200, 24),
    (false, 0xc633_6400, 24),
    (false, 0xcb00_7100, 24),
    (true, 0xfc00 << 112, 7),
    (true, 0x2001_0db8 << 96, 32),
];

fn bits(v6: bool) -> u8 {
    if v6 { 128 } else { 32 }
}

/// The last address of the prefix `(v6, start, len)`.
fn last(v6: bool, start: u128, len: u8) -> u128 {
    let host = bits(v6) - len;
    if host == 128 {
        u128::MAX
    } else {
        start | ((1u128 << host) - 1)
    }
}

fn value(ip: IpAddr) -> (bool, u128) {
    match ip {
        IpAddr::V4(a) => (false, u32::from(a) as u128),
        IpAddr::V6(a) => (true, u128::from(a)),
    }
}

fn ip_of(v6: bool, x: u128) -> IpAddr {
    if v6 {
        IpAddr::V6(Ipv6Addr::from(x))
    } else {
        IpAddr::V4(Ipv4Addr::from(x as u32))
    }
}

/// Whether the oracle refuses the address (as the node model keeps it: IPv4-mapped as IPv4).
fn oracle_refuses_ip(ip: IpAddr) -> bool {
    let (v6, x) = value(ip.to_canonical());
    REFUSED
        .iter()
        .any(|&(f, s, l)| f == v6 && s <= x && x <= last(f, s, l))
}

/// Whether the oracle refuses the (canonical) prefix: length 0, or sharing an address with a
/// refused range.
fn oracle_refuses_net(v6: bool, start: u128, len: u8) -> bool {
    let end = last(v6, start, len);
    len == 0
        || REFUSED
            .iter()
            .any(|&(f, s, l)| f == v6 && s <= end && start <= last(f, s, l))
}

/// An address of a family, near an edge of a range of the table (either family's, so the
/// other family's numbers are tried too) or anywhere.
fn address() -> impl Strategy<Value = (bool, u128)> {
    let rows = REFUSED.len() + USABLE.len();
    (any::<bool>(), 0..rows + 2, 0..3u8, -3i64..=3, any::<u128>()).prop_map(
        move |(v6, row, edge, delta, random)| {
            let max = last(v6, 0, 0);
            let Some(&(_, s, l)) = REFUSED.iter().chain(USABLE).nth(row) else {
                return (v6, random & max);
            };
            let at = match edge {
                0 => s,
                1 => last(v6, s, l.min(bits(v6))),
                // Inside it, anywhere.
                _ => s | (random & last(v6, 0, l.min(bits(v6)))),
            };
            (v6, at.wrapping_add_signed(delta as i128) & max)
        },
    )
}

/// A canonical prefix: an address as above, with a length at, next to or anywhere around the
/// ranges' lengths.
fn prefix() -> impl Strategy<Value = (bool, u128, u8)> {
    (
        address(),
        prop_oneof![Just(0u8), Just(1u8), 2..=32u8, 0..=128u8],
    )
        .prop_map(|((v6, x), len)| {
            let len = len.min(bits(v6));
            let start = if len == 0 { 0 } else { x & !(last(v6, 0, len)) };
            (v6, start, len)
        })
}

fn validated_node(
    addresses: Vec<(String, String)>,
    pod_cidrs: Vec<String>,
) -> Result<Node, NodeError> {
    Node::from_raw(RawNode {
        name: "n".into(),
        uid: "u".into(),
        addresses,
        pod_cidrs,
        boot_id: "b".into(),
    })
}

#[test]
fn the_policy_judges_generated_addresses_and_prefixes_of_both_families_as_the_table_says() {
    // The table the agent reads is the oracle's, row for row.
    let rows = |v: Verdict| -> Vec<(bool, u128, u8)> {
        RANGES
            .iter()
            .filter(|r| r.verdict == v)
            .map(|r| {
                let (v6, s) = value(r.prefix.network());
                (v6, s, r.prefix.prefix_len())
            })
            .collect()
    };
    assert_eq!(rows(Verdict::Refused), REFUSED);
    assert_eq!(rows(Verdict::Usable), USABLE);

    static ADDRESSES: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];
    static PREFIXES: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];
    static REFUSED_SEEN: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];
    let mut runner = TestRunner::new(Config {
        cases: 4096,
        source_file: Some(file!()),
        ..Config::default()
    });
    runner
        .run(&(address(), prefix()), |((v6, x), (pv6, start, len))| {
            // An address, as a source writes it (IPv4-mapped ones included).
            let ip = ip_of(v6, x);
            let refused = oracle_refuses_ip(ip);
            let got = validated_node(vec![("InternalIP".into(), ip.to_string())], vec![]);
            match &got {
                Ok(_) => prop_assert!(!refused, "{ip} passed"),
                Err(NodeError::UnusableAddress { why, .. }) => {
                    prop_assert!(refused, "{ip} refused: {why}");
                    let Refusal::Range(r) = why else {
                        return Err(TestCaseError::fail("an address refused as a default"));
                    };
                    prop_assert!(r.prefix.contains(&ip.to_canonical()), "{ip}: {why}");
                }
                Err(e) => prop_assert!(false, "{ip}: {e}"),
            }
            ADDRESSES[v6 as usize].fetch_add(1, Ordering::Relaxed);
            REFUSED_SEEN[0].fetch_add(refused as usize, Ordering::Relaxed);

            // A pod CIDR, beside a usable address.
            let net = IpNet::new(ip_of(pv6, start), len).unwrap();
            prop_assert_eq!(net.trunc(), net);
            let refused = oracle_refuses_net(pv6, start, len);
            prop_assert_eq!(address_policy::judge_net(net).is_err(), refused, "{}", net);
            let gateway = if pv6 { "fd00::1" } else { "10.0.0.1" };
            let got = validated_node(
                vec![("InternalIP".into(), gateway.into())],
                vec![net.to_string()],
            );
            match &got {
                Ok(_) => prop_assert!(!refused, "{net} passed"),
                Err(NodeError::UnusableCidr { why, .. }) => {
                    prop_assert!(refused, "{net} refused: {why}");
                    match why {
                        Refusal::Default => prop_assert_eq!(len, 0),
                        Refusal::Range(r) => {
                            prop_assert!(address_policy::overlaps(&r.prefix, &net), "{net}")
                        }
                    }
                }
                Err(e) => prop_assert!(false, "{net}: {e}"),
            }
            PREFIXES[pv6 as usize].fetch_add(1, Ordering::Relaxed);
            REFUSED_SEEN[1].fetch_add(refused as usize, Ordering::Relaxed);
            Ok(())
        })
        .unwrap();
    let n = |a: &[AtomicUsize; 2], i: usize| a[i].load(Ordering::Relaxed);
    println!(
        "address policy: {} ranges ({} refused, {} usable) x 2 families; {} addresses \
         ({} IPv4, {} IPv6; {} refused), {} prefixes ({} IPv4, {} IPv6; {} refused)",
        RANGES.len(),
        REFUSED.len(),
        USABLE.len(),
        n(&ADDRESSES, 0) + n(&ADDRESSES, 1),
        n(&ADDRESSES, 0),
        n(&ADDRESSES, 1),
        n(&REFUSED_SEEN, 0),
        n(&PREFIXES, 0) + n(&PREFIXES, 1),
        n(&PREFIXES, 0),
        n(&PREFIXES, 1),
        n(&REFUSED_SEEN, 1),
    );
}

//! Checkpoint compatibility and decoder robustness.
//!
//! The fuzz properties run 1024 cases each by default (`PROPTEST_CASES` overrides); decoding is
//! microseconds, so this costs well under a second.

use std::time::Duration;

use proptest::prelude::*;
use state::checkpoint::{
    BootTime, Checkpoint, DecodeError, FORMAT_VERSION, Held, KeySeen, PendingDelete,
    RecentRemovals, decode, encode,
};
use state::ids::{AllocatorState, FreedId};
use state::node::{Node, RawNode};
use state::objects::NodeId;

const FIXTURE_V1: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/checkpoint-v1.bin"
);
const FIXTURE_V2: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/checkpoint-v2.bin"
);
const FIXTURE_V3: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/checkpoint-v3.bin"
);
const FIXTURE_V4: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/checkpoint-v4.bin"
);

fn fixture_node(name: &str, addrs: &[(&str, &str)], cidrs: &[&str], id: u16) -> Node {
    let mut n = Node::from_raw(RawNode {
        name: name.into(),
        uid: format!("uid-{name}"),
        addresses: addrs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        pod_cidrs: cidrs.iter().map(|s| s.to_string()).collect(),
        boot_id: format!("boot-{name}"),
    })
    .unwrap();
    n.node_id = NodeId::new(id);
    n
}

/// The content of the v1 fixture. Never change it: the fixture file is frozen. One node has
/// UUIDs for UID and boot ID and the others plain text, so both ways of storing them are pinned.
fn v1_content() -> Checkpoint {
    let mut uuids = fixture_node(
        "worker-a",
        &[
            ("InternalIP", "10.0.0.1"),
            ("InternalIP", "fd00::1"),
            ("ExternalIP", "203.0.113.1"),
        ],
        &["10.1.1.0/24", "fd01:1::/64"],
        1,
    );
    uuids.uid = "6f1d2a3b-4c5d-4e6f-8a7b-9c0d1e2f3a4b".into();
    uuids.boot_id = "0b9e8d7c-6b5a-4f3e-9d2c-1b0a9f8e7d6c".into();
    Checkpoint {
        agent_version: "0.1.0".into(),
        written_at: Duration::new(1_750_000_000, 123_456_789),
        boot: None,
        local_node: "local".into(),
        nodes: vec![
            uuids,
            fixture_node(
                "worker-b",
                &[("InternalIP", "10.0.0.2")],
                &["10.1.2.0/24"],
                7,
            ),
        ]
        .into(),
        pending_deletes: vec![PendingDelete {
            node: fixture_node(
                "worker-gone",
                &[("InternalIP", "10.0.0.3")],
                &["10.1.3.0/24"],
                3,
            ),
            attempts: 2,
            held: None,
        }],
        ids: AllocatorState {
            freed: vec![FreedId {
                id: NodeId::new(4).unwrap(),
                freed_at: Duration::from_secs(1_749_999_000),
            }],
        },
        removals: Vec::new(),
        ipsec_keys: Vec::new(),
        orphans_held: None,
    }
}

/// The content of the v2 fixture: the v1 content plus what version 2 added. Never change it.
fn v2_content() -> Checkpoint {
    Checkpoint {
        agent_version: "0.2.0".into(),
        removals: vec![RecentRemovals {
            at: Duration::new(1_750_000_100, 5),
            nodes: 3,
            objects: 7,
        }],
        ipsec_keys: vec![
            KeySeen {
                spi: 3,
                first_seen: Duration::from_secs(1_749_000_000),
            },
            KeySeen {
                spi: 4,
                first_seen: Duration::from_secs(1_750_000_050),
            },
        ],
        ..v1_content()
    }
}

/// The content of the v3 fixture: the v2 content plus the brake's holds (a held pending
/// delete beside the one whose cleanup failed, and held orphans). Never change it.
fn v3_content() -> Checkpoint {
    let mut cp = Checkpoint {
        agent_version: "0.3.0".into(),
        orphans_held: Some(Held {
            at: Duration::new(1_750_000_200, 7),
            wipe: false,
        }),
        ..v2_content()
    };
    cp.pending_deletes.push(PendingDelete {
        node: fixture_node(
            "worker-held",
            &[("InternalIP", "10.0.0.5")],
            &["10.1.5.0/24"],
            5,
        ),
        attempts: 0,
        held: Some(Held {
            at: Duration::from_secs(1_750_000_150),
            wipe: true,
        }),
    });
    cp
}

/// The content of the v4 fixture: the v3 content written with its place on the boot clock.
/// Never change it.
fn v4_content() -> Checkpoint {
    Checkpoint {
        agent_version: "0.4.0".into(),
        boot: Some(BootTime {
            boot_id: *b"\x0b\x9e\x8d\x7c\x6b\x5a\x4f\x3e\x9d\x2c\x1b\x0a\x9f\x8e\x7d\x6c",
            since_boot: Duration::new(86_400, 250_000_000),
        }),
        ..v3_content()
    }
}

/// Writes the fixture of the newest version, with `NODE_AGENT_WRITE_FIXTURE=1`: once, when that
/// version is introduced. Otherwise it only checks that the newest fixture is of the current
/// version, so a checked-in file is never regenerated by accident and a version bump without a
/// fixture fails here.
#[test]
fn generate_newest_fixture() {
    assert_eq!(
        FORMAT_VERSION, 4,
        "add a content function and fixture for the new version"
    );
    if std::env::var_os("NODE_AGENT_WRITE_FIXTURE").is_none() {
        eprintln!(
            "generate_newest_fixture: not writing {FIXTURE_V4} (frozen; NODE_AGENT_WRITE_FIXTURE=1 \
             writes it when a new format version is added)"
        );
        return;
    }
    std::fs::write(FIXTURE_V4, encode(&v4_content()).unwrap()).unwrap();
}

fn fixture(path: &str, version: u32) -> Checkpoint {
    let bytes = std::fs::read(path).expect("checked-in fixture");
    assert_eq!(&bytes[..8], b"NAGCKPT\0");
    assert_eq!(
        u32::from_le_bytes(bytes[8..12].try_into().unwrap()),
        version
    );
    decode(&bytes).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn decodes_the_version_1_fixture_with_neutral_values_for_what_it_lacks() {
    let cp = fixture(FIXTURE_V1, 1);
    assert_eq!(cp, v1_content());
    assert!(cp.removals.is_empty() && cp.ipsec_keys.is_empty());
    assert_eq!(cp.nodes.named("worker-b")[0].node_id, NodeId::new(7));
    assert_eq!(cp.pending_deletes[0].attempts, 2);
}

#[test]
fn decodes_the_version_2_fixture_with_no_holds() {
    let cp = fixture(FIXTURE_V2, 2);
    assert_eq!(cp, v2_content());
    assert!(cp.orphans_held.is_none() && cp.pending_deletes.iter().all(|p| p.held.is_none()));
}

#[test]
fn decodes_the_version_3_fixture_without_a_boot_time() {
    let cp = fixture(FIXTURE_V3, 3);
    assert_eq!(cp, v3_content());
    assert!(cp.boot.is_none());
}

#[test]
fn decodes_the_version_4_fixture_and_writes_it_byte_for_byte() {
    let cp = fixture(FIXTURE_V4, 4);
    assert_eq!(cp, v4_content());
    let bytes = std::fs::read(FIXTURE_V4).unwrap();
    assert_eq!(
        encode(&cp).unwrap(),
        bytes,
        "the encoder no longer writes format version 4: bump the version (see format.rs)"
    );
}

/// A held entry on a removal whose cleanup was attempted is no record the encoder writes.
#[test]
fn a_hold_on_an_attempted_removal_is_refused() {
    let mut cp = v3_content();
    cp.pending_deletes[0].held = Some(Held {
        at: Duration::from_secs(1),
        wipe: false,
    });
    let r = decode(&encode(&cp).unwrap());
    assert!(
        matches!(&r, Err(e) if e.to_string().contains("never attempted")),
        "{r:?}"
    );
}

#[test]
fn older_checkpoints_are_rewritten_as_the_newest_version() {
    for (path, version) in [(FIXTURE_V1, 1), (FIXTURE_V2, 2), (FIXTURE_V3, 3)] {
        let cp = fixture(path, version);
        let bytes = encode(&cp).unwrap();
        assert_eq!(
            u32::from_le_bytes(bytes[8..12].try_into().unwrap()),
            FORMAT_VERSION
        );
        assert_eq!(decode(&bytes).unwrap(), cp);
    }
}

fn all_typed(r: Result<Checkpoint, DecodeError>) {
    // Reaching here without a panic is the property; the error's Display must work too.
    if let Err(e) = r {
        assert!(!e.to_string().is_empty());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1024)
    ))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        all_typed(decode(&bytes));
    }

    #[test]
    fn arbitrary_payload_behind_a_valid_header_never_panics(
        payload in proptest::collection::vec(any::<u8>(), 0..512), version in 1u32..=4
    ) {
        let mut bytes = b"NAGCKPT\0".to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        bytes.extend_from_slice(&payload);
        all_typed(decode(&bytes));
    }

    #[test]
    fn truncations_of_a_valid_checkpoint_are_typed(cut in 0usize..10_000) {
        let good = encode(&v4_content()).unwrap();
        let cut = cut % good.len();
        let r = decode(&good[..cut]);
        prop_assert!(matches!(r, Err(DecodeError::Truncated { .. }) | Err(DecodeError::BadMagic { .. })), "{r:?}");
    }

    #[test]
    fn bit_flips_of_a_valid_checkpoint_are_caught(flips in proptest::collection::vec(0usize..100_000, 1..4)) {
        let good = encode(&v4_content()).unwrap();
        let mut bad = good.clone();
        for f in &flips {
            let bit = f % (bad.len() * 8);
            bad[bit / 8] ^= 1 << (bit % 8);
        }
        let r = decode(&bad);
        if bad != good {
            // CRC-32 detects every burst of up to 32 bits; a flip in the header is caught by the
            // header checks; either way it must be an error, never a different checkpoint.
            prop_assert!(r.is_err() || r.as_ref().ok() == Some(&v4_content()), "{r:?}");
        }
    }

    #[test]
    fn payload_mutations_with_fixed_checksum_never_panic(
        at in 0usize..10_000, byte in any::<u8>(), cut in 0usize..10_000
    ) {
        // Re-checksummed, so the mutation reaches the payload decoder and validation.
        let good = encode(&v4_content()).unwrap();
        let mut payload = good[20..].to_vec();
        let at = at % payload.len();
        payload[at] = byte;
        payload.truncate(payload.len() - cut % payload.len());
        let mut bytes = good[..12].to_vec();
        bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        bytes.extend_from_slice(&payload);
        all_typed(decode(&bytes));
    }
}

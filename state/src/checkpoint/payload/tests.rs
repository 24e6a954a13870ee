//! The payload's wire types against bincode's own encoding, and every version's decoding.

use super::codec::{DECODE_LIMIT, config};
use super::*;
use crate::checkpoint::FORMAT_VERSION;

fn bytes_of(v: &impl Encode) -> Vec<u8> {
    bincode::encode_to_vec(v, config()).unwrap()
}

fn name_round_trip(name: &str, prev: &str) -> (u32, u32, usize) {
    let code = name_code(name, prev);
    let at = At {
        list: "nodes",
        index: 0,
    };
    assert_eq!(code.decode(prev, at, &mut decoder(&[])).unwrap(), name);
    (code.prefix, code.suffix, bytes_of(&code).len())
}

#[test]
fn names_share_prefix_and_suffix_with_the_previous_one() {
    let prev = "ip-10-0-3-16.eu-west-1.compute.internal";
    let name = "ip-10-0-3-17.eu-west-1.compute.internal";
    assert_eq!(name_round_trip(name, prev), (11, 27, 4));
    for (name, prev) in [
        ("a", ""),
        ("", "abc"),
        ("abc", "abc"),
        ("abab", "ab"),
        ("ab", "abab"),
        ("nœud-é", "nœud-è"),
        ("é", "è"),
        // Longer than a word, differing in each byte of one.
        ("abcdefghijklmnopq", "abcdefghijklmnopq"),
        ("abcdefgh-1-ijklmnopq", "abcdefgh-2-ijklmnopq"),
        ("abcdefghijklmnopq", "xbcdefghijklmnopq"),
        ("abcdefghijklmnopq", "abcdefghijklmnopx"),
        ("abcdefghijklmnopq", "abcdefghijklmnop"),
    ] {
        name_round_trip(name, prev);
    }
    for i in 0..20 {
        let (a, b) = ("0123456789abcdefghij", "0123456789abcdefghij");
        let mut b = b.as_bytes().to_vec();
        b[i] = b'-';
        let b = String::from_utf8(b).unwrap();
        assert_eq!(common_prefix(a.as_bytes(), b.as_bytes()), i);
        assert_eq!(common_suffix(a.as_bytes(), b.as_bytes()), 19 - i);
    }
    // Shares 3 + 3 bytes of a 5-byte name.
    let bad = Name {
        prefix: 3,
        suffix: 3,
        rest: "",
    };
    let at = At {
        list: "nodes",
        index: 4,
    };
    let e = bad.decode("abcde", at, &mut decoder(&[])).unwrap_err();
    assert!(e.to_string().starts_with("nodes[4].name:"), "{e}");
}

#[test]
fn uuids_convert_every_byte_and_refuse_every_other_character() {
    for v in 0..=255u8 {
        let mut b = [0u8; 16];
        for (i, x) in b.iter_mut().enumerate() {
            *x = v.wrapping_add(i as u8 * 17);
        }
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        let text = format!(
            "{}-{}-{}-{}-{}",
            &hex[0..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..32]
        );
        assert_eq!(format_uuid(&b).as_str(), text);
        assert_eq!(parse_uuid(&text), Some(b));
    }
    let good = "0a1b2c3d-4e5f-6789-abcd-ef0123456789";
    for at in [0, 7, 9, 12, 14, 17, 19, 22, 24, 27, 28, 35] {
        for c in 0..=255u8 {
            let mut t = good.as_bytes().to_vec();
            t[at] = c;
            let Ok(t) = String::from_utf8(t) else {
                continue;
            };
            let hex = c.is_ascii_digit() || (b'a'..=b'f').contains(&c);
            assert_eq!(parse_uuid(&t).is_some(), hex, "{t}");
        }
    }
}

#[test]
fn only_canonical_uuids_are_stored_as_bytes() {
    let uuid = "0a1b2c3d-4e5f-6789-abcd-ef0123456789";
    let b = parse_uuid(uuid).unwrap();
    assert_eq!(format_uuid(&b).as_str(), uuid);
    assert_eq!(ident(uuid), Ident::Uuid(b));
    for text in [
        "",
        "uid-1",
        "0A1B2C3D-4E5F-6789-ABCD-EF0123456789",
        "0a1b2c3d04e5f-6789-abcd-ef0123456789",
        "0a1b2c3d-4e5f-6789-abcd-ef012345678g",
        "0a1b2c3d-4e5f-6789-abcd-ef01234567890",
        "0a1b2c3d-4e5f-6789-abcd-ef012345678/",
        "0a1b2c3d-4e5f-6789-abcd-ef012345678:",
        "0a1b2c3d-4e5f-6789-abcd-ef012345678`",
        "0a1b2c3d-4e5f-6789-abcd-ef012345678\u{7f}",
    ] {
        assert_eq!(parse_uuid(text), None, "{text}");
        assert_eq!(ident(text), Ident::Text(text));
    }
}

#[test]
fn integers_are_bincode_varints_both_ways() {
    for v in [
        0,
        1,
        250,
        251,
        255,
        256,
        65_535,
        65_536,
        u64::from(u32::MAX),
        u64::from(u32::MAX) + 1,
        u64::MAX,
    ] {
        let mut out = Vec::new();
        encode_uint(v, &mut encoder(&mut out)).unwrap();
        assert_eq!(out, bytes_of(&v), "{v}");
        assert_eq!(decode_uint::<_, u64>(&mut decoder(&out)).unwrap(), v);
        if let Ok(v) = u32::try_from(v) {
            assert_eq!(out, bytes_of(&v), "{v}");
            assert_eq!(decode_uint::<_, u32>(&mut decoder(&out)).unwrap(), v);
        }
    }
    // A longer form than needed is bincode's too, and reads the same.
    assert_eq!(
        decode_uint::<_, u32>(&mut decoder(&[251, 7, 0])).unwrap(),
        7
    );
}

#[test]
fn wire_values_are_bincode_s_encoding_of_the_same_fields() {
    // What bincode writes for each value's fields as a tuple: a tag, the fields, a byte
    // array as a slice (its length, then its bytes).
    let b16 = [7; 16];
    let b4 = [10, 1, 2, 0];
    let name = Name {
        prefix: 300,
        suffix: 2,
        rest: "ab",
    };
    assert_eq!(bytes_of(&name), bytes_of(&(300u32, 2u32, "ab")));
    assert_eq!(bytes_of(&Ident::Uuid(b16)), bytes_of(&(0u32, &b16[..])));
    assert_eq!(bytes_of(&Ident::Text("uid-1")), bytes_of(&(1u32, "uid-1")));
    for (a, tag, bytes) in [
        (Address::InternalV4(b4), 0u32, &b4[..]),
        (Address::InternalV6(b16), 1, &b16[..]),
        (Address::ExternalV4(b4), 2, &b4[..]),
        (Address::ExternalV6(b16), 3, &b16[..]),
    ] {
        assert_eq!(bytes_of(&a), bytes_of(&(tag, bytes)));
        let back: Address = bincode::decode_from_slice(&bytes_of(&a), config())
            .unwrap()
            .0;
        assert_eq!(back, a);
    }
    for (c, tag, len, bytes) in [
        (Cidr::V4(24, b4), 0u32, 24u8, &b4[..]),
        (Cidr::V6(64, b16), 1, 64, &b16[..]),
    ] {
        assert_eq!(bytes_of(&c), bytes_of(&(tag, len, bytes)));
        let back: Cidr = bincode::decode_from_slice(&bytes_of(&c), config())
            .unwrap()
            .0;
        assert_eq!(back, c);
    }
    let t = Time {
        secs: 1_700_000_000,
        nanos: 5,
    };
    assert_eq!(bytes_of(&t), bytes_of(&(1_700_000_000u64, 5u32)));
    let f = Freed { id: 300, at: t };
    assert_eq!(bytes_of(&f), bytes_of(&(300u16, t)));
    for (v, fields) in [
        // 300 takes a marker byte and two.
        (&name as &dyn Ser, 3 + 1 + 1 + 2),
        (&Ident::Uuid(b16), 18),
        (&Ident::Text("uid-1"), 7),
        (&Address::InternalV4(b4), 6),
        (&Address::ExternalV6(b16), 18),
        (&Cidr::V4(24, b4), 7),
        (&Cidr::V6(64, b16), 19),
    ] {
        assert_eq!(v.size(), fields);
    }
    // Borrowed values decode from the bytes they borrow, in their usual form (read at once)
    // and in any other (read field by field).
    let short = Name {
        prefix: 11,
        suffix: 27,
        rest: "7",
    };
    for ident in [Ident::Text("uid-1"), Ident::Uuid(b16)] {
        let bytes = bytes_of(&ident);
        let back: Ident<'_> = bincode::borrow_decode_from_slice(&bytes, config())
            .unwrap()
            .0;
        assert_eq!(back, ident);
    }
    for name in [name, short] {
        let bytes = bytes_of(&name);
        let back: Name<'_> = bincode::borrow_decode_from_slice(&bytes, config())
            .unwrap()
            .0;
        assert_eq!(back, name);
    }
    // A longer form than needed of a tag or a length is still bincode's, and reads the same.
    let long = [251, 2, 0, 251, 4, 0, 203, 0, 113, 1];
    let back: Address = bincode::decode_from_slice(&long, config()).unwrap().0;
    assert_eq!(back, Address::ExternalV4([203, 0, 113, 1]));
    let long = [[251, 1, 0, 64, 251, 16, 0].as_slice(), &b16].concat();
    let back: Cidr = bincode::decode_from_slice(&long, config()).unwrap().0;
    assert_eq!(back, Cidr::V6(64, b16));
    let long = [[251, 0, 0, 16].as_slice(), &b16].concat();
    let back: Ident<'_> = bincode::borrow_decode_from_slice(&long, config())
        .unwrap()
        .0;
    assert_eq!(back, Ident::Uuid(b16));
}

trait Ser {
    fn size(&self) -> usize;
}

impl<T: Encode> Ser for T {
    fn size(&self) -> usize {
        bytes_of(self).len()
    }
}

fn payload(cp: &Checkpoint) -> Vec<u8> {
    let mut out = Vec::new();
    encode(cp, &mut out).unwrap();
    out
}

/// `bytes` with the only occurrence of `from` replaced by `to`.
fn patched(mut bytes: Vec<u8>, from: &[u8], to: &[u8]) -> Vec<u8> {
    let at: Vec<usize> = (0..bytes.len().saturating_sub(from.len() - 1))
        .filter(|&i| bytes[i..].starts_with(from))
        .collect();
    assert_eq!(at.len(), 1, "{from:?} occurs {} times", at.len());
    bytes.splice(at[0]..at[0] + from.len(), to.iter().copied());
    bytes
}

/// The field an invalid payload is refused for.
fn bad_field(bytes: &[u8]) -> String {
    match decode(bytes, FORMAT_VERSION) {
        Err(DecodeError::Payload {
            version: FORMAT_VERSION,
            reason: PayloadError::Invalid { field, .. },
        }) => field,
        other => panic!("{other:?}"),
    }
}

fn bincode_error(bytes: &[u8]) -> WireDecodeError {
    match decode(bytes, FORMAT_VERSION) {
        Err(DecodeError::Payload {
            version: FORMAT_VERSION,
            reason: PayloadError::Bincode(e),
        }) => e,
        other => panic!("{other:?}"),
    }
}

/// A four-byte varint (252 and the value's bytes).
fn u32_varint(v: u32) -> Vec<u8> {
    let mut b = vec![252];
    b.extend_from_slice(&v.to_le_bytes());
    b
}

/// A version 2 record's pending delete that was never attempted was held by the brake:
/// read as held since the record was written, as a wipe's; one attempted was not held.
#[test]
fn a_version_2_removal_never_attempted_is_read_as_held_as_a_wipe() {
    let mut cp = crate::checkpoint::format::tests::sample();
    let mut held = cp.pending_deletes[0].clone();
    held.node.name = "held".into();
    held.attempts = 0;
    cp.pending_deletes.push(held);
    let mut bytes = Vec::new();
    v2::encode(&cp, &mut encoder(&mut bytes)).unwrap();
    let read = decode(&bytes, 2).unwrap();
    assert_eq!(
        read.pending_deletes[0].held, None,
        "attempted: released before"
    );
    assert_eq!(
        read.pending_deletes[1].held,
        Some(crate::checkpoint::Held {
            at: cp.written_at,
            wipe: true
        })
    );
}

#[test]
fn payload_round_trips_and_the_decoder_names_the_bad_field() {
    let cp = crate::checkpoint::format::tests::sample();
    let bytes = payload(&cp);
    assert_eq!(decode(&bytes, FORMAT_VERSION).unwrap(), cp);

    // nodes[1]'s pod CIDR 10.1.2.0/24 as a /33.
    let bad = patched(bytes.clone(), &[24, 4, 10, 1, 2, 0], &[33, 4, 10, 1, 2, 0]);
    assert_eq!(bad_field(&bad), "nodes[1] (\"b\").pod_cidrs[0]");
    // freed[0]: ID 4, freed at 1,699,999,000 s and 0 ns; as ID 0.
    let at = u32_varint(1_699_999_000);
    let bad = patched(
        bytes.clone(),
        &[&[4][..], &at, &[0]].concat(),
        &[&[0][..], &at, &[0]].concat(),
    );
    assert_eq!(bad_field(&bad), "freed[0].id");
    // written at 1,700,000,000 s and 5 ns; with a whole second of nanoseconds.
    let secs = u32_varint(1_700_000_000);
    let bad = patched(
        bytes.clone(),
        &[&secs[..], &[5]].concat(),
        &[secs, u32_varint(1_000_000_000)].concat(),
    );
    assert_eq!(bad_field(&bad), "written_at");
    // The boot time, last: boot ID [7; 16], 3,600 s and 9 ns; with a second of nanoseconds.
    let boot = [&[1, 16][..], &[7; 16], &[251, 0x10, 0x0e]].concat();
    let bad = patched(
        bytes.clone(),
        &[&boot[..], &[9]].concat(),
        &[boot, u32_varint(1_000_000_000)].concat(),
    );
    assert_eq!(bad_field(&bad), "boot.since_boot");
    // pending_deletes[0], "gone", the first of its list: claims to share a byte with the
    // name before it.
    let bad = patched(bytes.clone(), b"\x00\x00\x04gone", b"\x01\x00\x04gone");
    assert_eq!(bad_field(&bad), "pending_deletes[0].name");
    // Values a Checkpoint can hold and the encoder writes as they are.
    let mut odd = cp.clone();
    odd.ipsec_keys.push(crate::checkpoint::KeySeen {
        spi: 16,
        first_seen: Duration::from_secs(1),
    });
    assert_eq!(bad_field(&payload(&odd)), "ipsec_keys[1].spi");
    let mut odd = cp.clone();
    let mut first = odd.nodes.iter().next().expect("a record").clone();
    first.addresses[1] = first.addresses[0];
    odd.nodes.replace(&first.name.clone(), [first]);
    assert!(matches!(
        decode(&payload(&odd), FORMAT_VERSION),
        Err(DecodeError::InvalidNode(_))
    ));

    // bincode's own complaints come through with its text.
    let e = decode(&bytes[..bytes.len() - 1], FORMAT_VERSION).unwrap_err();
    assert!(
        matches!(
            e,
            DecodeError::Payload {
                reason: PayloadError::Bincode(WireDecodeError::UnexpectedEnd { .. }),
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("bincode"), "{e}");
    // nodes[1]'s address 10.0.0.2 with tag 4.
    let bad = patched(bytes.clone(), &[0, 4, 10, 0, 0, 2], &[4, 4, 10, 0, 0, 2]);
    assert!(matches!(
        bincode_error(&bad),
        WireDecodeError::UnexpectedVariant {
            type_name: "Address",
            found: 4,
            ..
        }
    ));
    // ... or 5 bytes long.
    let bad = patched(bytes.clone(), &[0, 4, 10, 0, 0, 2], &[0, 5, 10, 0, 0, 2, 0]);
    assert!(matches!(
        bincode_error(&bad),
        WireDecodeError::ArrayLengthMismatch {
            required: 4,
            found: 5
        }
    ));
    let mut trailing = bytes.clone();
    trailing.push(0);
    assert!(matches!(
        decode(&trailing, FORMAT_VERSION),
        Err(DecodeError::PayloadTrailing { unread: 1 })
    ));
}

/// A payload of `records`, each an encoded record, after an empty header.
fn payload_of_records(records: &[Vec<u8>]) -> Vec<u8> {
    let mut out = bytes_of(&("", 0u64, 0u32, "local", records.len() as u64));
    for r in records {
        out.extend_from_slice(r);
    }
    // No pending deletes, freed IDs, removals or keys; no holds of pending deletes, no
    // orphans' hold.
    out.extend_from_slice(&[0; 6]);
    out
}

/// A record named by `name` (against the previous one), no IDs, addresses or CIDRs.
fn bare_record(name: (u32, u32, &str)) -> Vec<u8> {
    bytes_of(&(name, (1u32, ""), (1u32, ""), 0u64, 0u64, 0u16))
}

#[test]
fn what_the_decoder_allocates_is_limited() {
    // Names that each copy the whole 10,000-byte name before them: 1 byte of payload each,
    // 10,000 bytes of memory.
    let long = "n".repeat(10_000);
    let mut records = vec![bare_record((0, 0, &long))];
    let copies = DECODE_LIMIT / long.len() + 1;
    records.resize(copies + 1, bare_record((10_000, 0, "")));
    let e = bincode_error(&payload_of_records(&records));
    assert!(matches!(e, WireDecodeError::LimitExceeded), "{e:?}");
    // Fewer of them decode.
    records.truncate(10);
    let cp = decode(&payload_of_records(&records), 3).unwrap();
    assert!(cp.nodes.iter().all(|n| n.name == long));
}

#[test]
fn a_huge_length_fails_on_the_missing_bytes_without_reserving_for_it() {
    let mut bytes = bytes_of(&("", 0u64, 0u32, "local", u64::MAX / 2));
    bytes.extend_from_slice(&bare_record((0, 0, "a")));
    let e = bincode_error(&bytes);
    assert!(matches!(e, WireDecodeError::UnexpectedEnd { .. }), "{e:?}");
}

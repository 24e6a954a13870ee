//! The checkpoint payload: the checkpoint in a compact on-disk shape, expressed as serde-derived
//! wire structs and encoded with bincode 2 (`config::standard()`: little-endian, variable-length
//! integers). [`Checkpoint`] and [`Node`] stay the planner's plain model; converting to and from
//! the wire structs happens here, at the edge, with full validation on the way in.
//!
//! Each format version has a top-level struct of its own ([`v1::PayloadV1`], [`v2::PayloadV2`]);
//! the parts they share (records, names, addresses...) live in this module and stay shared until
//! a version changes one of them, at which point the older versions get a frozen copy of the
//! part as it was. Only the newest version is written; every version is read.
//!
//! The wire structs store each field in its compact form rather than as text:
//!
//! - a node name is coded against the previous record's name in the same list ([`Name`]): bytes
//!   shared at the start, bytes shared at the end, and the rest. The planner writes records in
//!   name order, so `ip-10-0-3-17.eu-west-1.compute.internal` after
//!   `ip-10-0-3-16.eu-west-1.compute.internal` costs 4 bytes. Records are stored in the order
//!   given and decode in that order;
//! - a UID or boot ID in canonical (lowercase) UUID form, which is what Kubernetes and the
//!   kernel produce, is its 16 bytes ([`Ident::Uuid`]); anything else is kept as text;
//! - an address is a tag (kind and family) and its 4 or 16 bytes ([`Address`]); a pod CIDR is a
//!   family tag, its prefix length and its address bytes ([`Cidr`]);
//! - a node ID is a `u16`, 0 for none (0 is the local node, never a record's ID); freed IDs are
//!   `u16` too.
//!
//! bincode writes a struct as its fields in order with no names or framing, an enum as its
//! variant index (a varint, one byte here), a sequence or string as a varint length and its
//! elements, and a `[u8; N]` here as serde bytes (`raw`): a one-byte length and the N bytes. Any
//! change to these structs (a field added, removed, reordered or retyped, a variant added
//! anywhere but at the end) changes the format: see `format.rs` for how a version is bumped. The
//! byte-for-byte fixture tests catch it.
//!
//! Decoding borrows strings from the payload (no copy until a [`Node`] is built) and checks
//! everything the encoder guarantees: bincode checks lengths, tags and UTF-8; the conversion
//! checks name codes against the previous name, prefix lengths, nanoseconds, a freed ID 0, and
//! every record through [`Node::validate`]. Any failure is a typed [`DecodeError`] naming the
//! field (`nodes[3].pod_cidrs[0]`) or carrying bincode's error.

pub(super) mod v1;
pub(super) mod v2;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use bincode::config::{Configuration, standard};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::checkpoint::format::{DecodeError, EncodeError, PayloadError};
use crate::checkpoint::{Checkpoint, PendingDelete};
use crate::ids::{AllocatorState, FreedId};
use crate::node::{AddressKind, Node, NodeAddress};
use crate::objects::NodeId;

/// The most a payload may make the decoder allocate for itself; a real 65,535-node checkpoint
/// is under 10 MiB.
pub(super) const DECODE_LIMIT: usize = 64 << 20;

/// Little-endian, variable-length integers, no limit (the decoder adds [`DECODE_LIMIT`]).
fn config() -> Configuration {
    standard()
}

/// A point in time since the Unix epoch, or a duration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Time {
    secs: u64,
    nanos: u32,
}

#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Record<'a> {
    #[serde(borrow)]
    name: Name<'a>,
    #[serde(borrow)]
    uid: Ident<'a>,
    #[serde(borrow)]
    boot_id: Ident<'a>,
    /// Inline up to two (a node has one or two of each, usually): no allocation per record.
    /// On the wire, a sequence like any `Vec`.
    addresses: SmallVec<[Address; 2]>,
    pod_cidrs: SmallVec<[Cidr; 2]>,
    /// 0 for none.
    node_id: u16,
}

#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Pending<'a> {
    #[serde(borrow)]
    record: Record<'a>,
    attempts: u32,
}

/// A name coded against the previous name of its list: `prefix` bytes of it, then `rest`, then
/// its last `suffix` bytes.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Name<'a> {
    prefix: u32,
    suffix: u32,
    rest: &'a str,
}

/// A UID or boot ID.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Ident<'a> {
    /// A canonical lowercase UUID, as its 16 bytes.
    Uuid(#[serde(with = "raw")] [u8; 16]),
    /// Anything else, as it was.
    Text(&'a str),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Address {
    InternalV4(#[serde(with = "raw")] [u8; 4]),
    InternalV6(#[serde(with = "raw")] [u8; 16]),
    ExternalV4(#[serde(with = "raw")] [u8; 4]),
    ExternalV6(#[serde(with = "raw")] [u8; 16]),
}

/// A pod CIDR: prefix length, then the network address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Cidr {
    V4(u8, #[serde(with = "raw")] [u8; 4]),
    V6(u8, #[serde(with = "raw")] [u8; 16]),
}

/// A fixed-size byte array as serde bytes: bincode writes a varint length (one byte) and the
/// bytes in one go, and reads them back as a borrowed slice. serde's own array impl goes through
/// the codec once per byte, which made up most of the payload's encode and decode time.
mod raw {
    use std::fmt;

    use serde::de::{Deserializer, Error, Visitor};
    use serde::ser::Serializer;

    pub(super) fn serialize<S: Serializer, const N: usize>(
        b: &[u8; N],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(b)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>, const N: usize>(
        d: D,
    ) -> Result<[u8; N], D::Error> {
        struct Exactly<const N: usize>;
        impl<const N: usize> Visitor<'_> for Exactly<N> {
            type Value = [u8; N];

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{N} bytes")
            }

            fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<[u8; N], E> {
                v.try_into().map_err(|_| E::invalid_length(v.len(), &self))
            }
        }
        d.deserialize_bytes(Exactly::<N>)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Freed {
    id: u16,
    at: Time,
}

// ---- Checkpoint -> wire ----

impl From<Duration> for Time {
    fn from(d: Duration) -> Self {
        Self {
            secs: d.as_secs(),
            nanos: d.subsec_nanos(),
        }
    }
}

/// `name` coded against `prev`: bytes shared at the start, bytes shared at the end (not
/// overlapping the start), the rest. Cuts fall on character boundaries of both names, so the
/// rest is a `str` and decoding can slice `prev` at the same places.
fn name_code<'a>(name: &'a str, prev: &str) -> Name<'a> {
    let mut p = common(name.bytes(), prev.bytes());
    while !(name.is_char_boundary(p) && prev.is_char_boundary(p)) {
        p -= 1;
    }
    let (n, q) = (&name[p..], &prev[p..]);
    let mut s = common(n.bytes().rev(), q.bytes().rev());
    while !(n.is_char_boundary(n.len() - s) && q.is_char_boundary(q.len() - s)) {
        s -= 1;
    }
    // Names of over 4 GiB cannot reach here (the payload length is a u32), so the casts hold.
    Name {
        prefix: p as u32,
        suffix: s as u32,
        rest: &n[..n.len() - s],
    }
}

fn common(a: impl Iterator<Item = u8>, b: impl Iterator<Item = u8>) -> usize {
    a.zip(b).take_while(|(x, y)| x == y).count()
}

/// Where each byte's two hex digits start in a UUID's text (`8-4-4-4-12` digits).
static UUID_HEX_AT: [usize; 16] = [0, 2, 4, 6, 9, 11, 14, 16, 19, 21, 24, 26, 28, 30, 32, 34];
static UUID_DASH_AT: [usize; 4] = [8, 13, 18, 23];

/// The value of each lowercase hex digit; 0xFF for any other byte.
static HEX_VALUE: [u8; 256] = {
    let mut t = [0xFF; 256];
    let mut i = 0;
    while i < 16 {
        t[b"0123456789abcdef"[i] as usize] = i as u8;
        i += 1;
    }
    t
};

/// The 16 bytes of `s` if it is a UUID in exactly the form [`format_uuid`] writes back
/// (lowercase), so that every UID stored as bytes decodes to the text it came from.
fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let text: &[u8; 36] = s.as_bytes().try_into().ok()?;
    if UUID_DASH_AT.iter().any(|&i| text[i] != b'-') {
        return None;
    }
    let mut out = [0; 16];
    let mut bad = 0;
    for (byte, &at) in out.iter_mut().zip(&UUID_HEX_AT) {
        let (hi, lo) = (
            HEX_VALUE[usize::from(text[at])],
            HEX_VALUE[usize::from(text[at + 1])],
        );
        bad |= hi | lo;
        *byte = hi << 4 | lo;
    }
    (bad & 0xF0 == 0).then_some(out)
}

fn format_uuid(b: &[u8; 16]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut text = [b'-'; 36];
    for (byte, &at) in b.iter().zip(&UUID_HEX_AT) {
        text[at] = HEX[usize::from(byte >> 4)];
        text[at + 1] = HEX[usize::from(byte & 0x0F)];
    }
    // Hex digits and dashes only: ASCII, so the conversion cannot fail.
    std::str::from_utf8(&text)
        .map(str::to_owned)
        .unwrap_or_default()
}

fn ident(s: &str) -> Ident<'_> {
    match parse_uuid(s) {
        Some(b) => Ident::Uuid(b),
        None => Ident::Text(s),
    }
}

fn record<'a>(n: &'a Node, prev: &str) -> Record<'a> {
    Record {
        name: name_code(&n.name, prev),
        uid: ident(&n.uid),
        boot_id: ident(&n.boot_id),
        addresses: n
            .addresses
            .iter()
            .map(|a| match (a.kind, a.ip) {
                (AddressKind::InternalIP, IpAddr::V4(ip)) => Address::InternalV4(ip.octets()),
                (AddressKind::InternalIP, IpAddr::V6(ip)) => Address::InternalV6(ip.octets()),
                (AddressKind::ExternalIP, IpAddr::V4(ip)) => Address::ExternalV4(ip.octets()),
                (AddressKind::ExternalIP, IpAddr::V6(ip)) => Address::ExternalV6(ip.octets()),
            })
            .collect(),
        pod_cidrs: n
            .pod_cidrs
            .iter()
            .map(|c| match c {
                IpNet::V4(c) => Cidr::V4(c.prefix_len(), c.addr().octets()),
                IpNet::V6(c) => Cidr::V6(c.prefix_len(), c.addr().octets()),
            })
            .collect(),
        node_id: n.node_id.map_or(0, NodeId::get),
    }
}

/// Appends bincode's bytes to a `Vec` in place (its `std::io::Write` adapter costs more).
struct Append<'a>(&'a mut Vec<u8>);

impl bincode::enc::write::Writer for Append<'_> {
    fn write(&mut self, bytes: &[u8]) -> Result<(), bincode::error::EncodeError> {
        self.0.extend_from_slice(bytes);
        Ok(())
    }
}

// ---- wire -> Checkpoint ----

/// Where a record is: its list and index.
#[derive(Clone, Copy)]
struct At {
    list: &'static str,
    index: usize,
}

fn invalid(field: String, problem: &'static str) -> PayloadError {
    PayloadError::Invalid { field, problem }
}

impl Time {
    fn duration(self, field: impl FnOnce() -> String) -> Result<Duration, PayloadError> {
        if self.nanos >= 1_000_000_000 {
            return Err(invalid(field(), "a second or more of nanoseconds"));
        }
        Ok(Duration::new(self.secs, self.nanos))
    }
}

impl Name<'_> {
    /// The name, given the previous one of its list.
    fn decode(&self, prev: &str, at: At) -> Result<String, PayloadError> {
        let (p, s) = (self.prefix as usize, self.suffix as usize);
        let head = prev.get(..p);
        let tail = prev
            .len()
            .checked_sub(s)
            .filter(|t| *t >= p)
            .and_then(|t| prev.get(t..));
        let (Some(head), Some(tail)) = (head, tail) else {
            return Err(invalid(
                format!("{}[{}].name", at.list, at.index),
                "shares more with the previous name than it has",
            ));
        };
        let mut name = String::with_capacity(head.len() + self.rest.len() + tail.len());
        name.push_str(head);
        name.push_str(self.rest);
        name.push_str(tail);
        Ok(name)
    }
}

impl Ident<'_> {
    fn decode(&self) -> String {
        match self {
            Ident::Uuid(b) => format_uuid(b),
            Ident::Text(s) => (*s).to_owned(),
        }
    }
}

impl Address {
    fn decode(self) -> NodeAddress {
        let (kind, ip) = match self {
            Address::InternalV4(b) => (AddressKind::InternalIP, Ipv4Addr::from(b).into()),
            Address::InternalV6(b) => (AddressKind::InternalIP, Ipv6Addr::from(b).into()),
            Address::ExternalV4(b) => (AddressKind::ExternalIP, Ipv4Addr::from(b).into()),
            Address::ExternalV6(b) => (AddressKind::ExternalIP, Ipv6Addr::from(b).into()),
        };
        NodeAddress { kind, ip }
    }
}

impl Cidr {
    fn decode(self) -> Option<IpNet> {
        match self {
            Cidr::V4(len, b) => Ipv4Net::new(b.into(), len).ok().map(IpNet::V4),
            Cidr::V6(len, b) => Ipv6Net::new(b.into(), len).ok().map(IpNet::V6),
        }
    }
}

impl Record<'_> {
    fn decode(&self, prev: &str, at: At) -> Result<Node, DecodeError> {
        let name = self.name.decode(prev, at)?;
        let mut pod_cidrs = Vec::with_capacity(self.pod_cidrs.len());
        for (i, c) in self.pod_cidrs.iter().enumerate() {
            let c = c.decode().ok_or_else(|| {
                invalid(
                    format!("{}[{}] ({name:?}).pod_cidrs[{i}]", at.list, at.index),
                    "prefix length longer than the address",
                )
            })?;
            pod_cidrs.push(c);
        }
        let node = Node {
            uid: self.uid.decode(),
            addresses: self.addresses.iter().map(|a| a.decode()).collect(),
            pod_cidrs,
            boot_id: self.boot_id.decode(),
            node_id: NodeId::new(self.node_id),
            name,
        };
        node.validate()?;
        Ok(node)
    }
}

/// The nodes of one list, each checked, in order (a record of the local node included: callers
/// drop it).
fn decode_records<'r, 'a: 'r>(
    list: &'static str,
    records: impl Iterator<Item = &'r Record<'a>>,
) -> Result<Vec<Node>, DecodeError> {
    let mut nodes = Vec::with_capacity(records.size_hint().0);
    let mut prev = String::new();
    for (index, r) in records.enumerate() {
        let node = r.decode(&prev, At { list, index })?;
        prev.clone_from(&node.name);
        nodes.push(node);
    }
    Ok(nodes)
}

/// The live list and pending deletes, checked, records of the local node dropped.
fn decode_lists(
    nodes: &[Record<'_>],
    pending: &[Pending<'_>],
    local_node: &str,
) -> Result<(Vec<Node>, Vec<PendingDelete>), DecodeError> {
    let mut live = decode_records("nodes", nodes.iter())?;
    live.retain(|n| n.name != local_node);
    let pending = decode_records("pending_deletes", pending.iter().map(|p| &p.record))?
        .into_iter()
        .zip(pending)
        .filter(|(n, _)| n.name != local_node)
        .map(|(node, p)| PendingDelete {
            node,
            attempts: p.attempts,
        })
        .collect();
    Ok((live, pending))
}

/// The wire forms of the live list and the pending deletes, without the local node's record.
fn encode_lists<'a>(cp: &'a Checkpoint) -> (Vec<Record<'a>>, Vec<Pending<'a>>) {
    let remote = |n: &Node| n.name != cp.local_node;
    let nodes = encode_records(cp.nodes.iter().filter(|n| remote(n)));
    let pending: Vec<&PendingDelete> = cp
        .pending_deletes
        .iter()
        .filter(|p| remote(&p.node))
        .collect();
    let pending = encode_records(pending.iter().map(|p| &p.node))
        .into_iter()
        .zip(&pending)
        .map(|(record, p)| Pending {
            record,
            attempts: p.attempts,
        })
        .collect();
    (nodes, pending)
}

/// The wire records of `nodes` in order, names coded one against the other.
fn encode_records<'a>(nodes: impl Iterator<Item = &'a Node>) -> Vec<Record<'a>> {
    let mut prev = "";
    nodes
        .map(|n| {
            let r = record(n, prev);
            prev = &n.name;
            r
        })
        .collect()
}

fn decode_freed(freed: &[Freed]) -> Result<AllocatorState, PayloadError> {
    let mut out = Vec::with_capacity(freed.len());
    for (i, f) in freed.iter().enumerate() {
        let id = NodeId::new(f.id)
            .ok_or_else(|| invalid(format!("freed[{i}].id"), "node ID 0 is the local node"))?;
        let freed_at = f.at.duration(|| format!("freed[{i}].at"))?;
        out.push(FreedId { id, freed_at });
    }
    Ok(AllocatorState { freed: out })
}

fn encode_freed(ids: &AllocatorState) -> Vec<Freed> {
    ids.freed
        .iter()
        .map(|f| Freed {
            id: f.id.get(),
            at: f.freed_at.into(),
        })
        .collect()
}

/// Decodes a whole payload of wire type `W` from `body`: all of it, within the decode limit.
fn borrow_decode<'a, W: serde::Deserialize<'a>>(
    body: &'a [u8],
    version: u32,
) -> Result<W, DecodeError> {
    let (wire, read): (W, usize) =
        bincode::serde::borrow_decode_from_slice(body, config().with_limit::<DECODE_LIMIT>())
            .map_err(|e| DecodeError::Payload {
                version,
                reason: PayloadError::Bincode(e),
            })?;
    if read != body.len() {
        return Err(DecodeError::PayloadTrailing {
            unread: body.len() - read,
        });
    }
    Ok(wire)
}

/// Decodes and validates payload `body` of format `version`, dropping a record of the local
/// node. Never panics, whatever the bytes.
pub(super) fn decode(body: &[u8], version: u32) -> Result<Checkpoint, DecodeError> {
    let decoded = match version {
        1 => borrow_decode::<v1::PayloadV1<'_>>(body, version)?.into_checkpoint(),
        _ => borrow_decode::<v2::PayloadV2<'_>>(body, version)?.into_checkpoint(),
    };
    decoded.map_err(|e| match e {
        DecodeError::Payload { reason, .. } => DecodeError::Payload { version, reason },
        e => e,
    })
}

/// Appends the payload of `cp` to `out` in the newest format, without the local node's record.
pub(super) fn encode(cp: &Checkpoint, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    // About 90 bytes per typical record; a guess that saves most reallocations.
    out.reserve(128 + 96 * (cp.nodes.len() + cp.pending_deletes.len()));
    bincode::serde::encode_into_writer(v2::PayloadV2::from_checkpoint(cp), Append(out), config())
        .map_err(EncodeError::Payload)
}

impl From<PayloadError> for DecodeError {
    /// A wire-level problem; [`decode`] sets the version.
    fn from(reason: PayloadError) -> Self {
        DecodeError::Payload { version: 0, reason }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name_round_trip(name: &str, prev: &str) -> (u32, u32, usize) {
        let code = name_code(name, prev);
        let at = At {
            list: "nodes",
            index: 0,
        };
        assert_eq!(code.decode(prev, at).unwrap(), name);
        let bytes = bincode::serde::encode_to_vec(&code, config()).unwrap();
        (code.prefix, code.suffix, bytes.len())
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
        ] {
            name_round_trip(name, prev);
        }
        // Shares 3 + 3 bytes of a 5-byte name.
        let bad = Name {
            prefix: 3,
            suffix: 3,
            rest: "",
        };
        let e = bad
            .decode(
                "abcde",
                At {
                    list: "nodes",
                    index: 4,
                },
            )
            .unwrap_err();
        assert!(e.to_string().starts_with("nodes[4].name:"), "{e}");
    }

    #[test]
    fn only_canonical_uuids_are_stored_as_bytes() {
        let uuid = "0a1b2c3d-4e5f-6789-abcd-ef0123456789";
        let b = parse_uuid(uuid).unwrap();
        assert_eq!(format_uuid(&b), uuid);
        assert_eq!(ident(uuid), Ident::Uuid(b));
        for text in [
            "",
            "uid-1",
            "0A1B2C3D-4E5F-6789-ABCD-EF0123456789",
            "0a1b2c3d04e5f-6789-abcd-ef0123456789",
            "0a1b2c3d-4e5f-6789-abcd-ef012345678g",
            "0a1b2c3d-4e5f-6789-abcd-ef01234567890",
        ] {
            assert_eq!(parse_uuid(text), None, "{text}");
            assert_eq!(ident(text), Ident::Text(text));
        }
    }

    #[test]
    fn fields_take_their_compact_sizes() {
        let size = |v: &dyn erased::Ser| v.size();
        // Tag, length byte, the bytes.
        assert_eq!(size(&Ident::Uuid([7; 16])), 18);
        assert_eq!(size(&Address::InternalV4([10, 0, 0, 1])), 6);
        assert_eq!(size(&Address::ExternalV6([1; 16])), 18);
        // Tag, prefix length, length byte, the bytes.
        assert_eq!(size(&Cidr::V4(24, [10, 1, 2, 0])), 7);
        assert_eq!(size(&Cidr::V6(64, [1; 16])), 19);
        assert_eq!(size(&200u16), 1);
        assert_eq!(size(&65_535u16), 3);
    }

    mod erased {
        pub trait Ser {
            fn size(&self) -> usize;
        }
        impl<T: serde::Serialize> Ser for T {
            fn size(&self) -> usize {
                bincode::serde::encode_to_vec(self, super::config())
                    .unwrap()
                    .len()
            }
        }
    }

    fn payload_of(wire: &v2::PayloadV2<'_>) -> Vec<u8> {
        bincode::serde::encode_to_vec(wire, config()).unwrap()
    }

    #[test]
    fn wire_round_trips_and_the_decoder_names_the_bad_field() {
        let cp = crate::checkpoint::format::tests::sample();
        let wire = v2::PayloadV2::from_checkpoint(&cp);
        let bytes = payload_of(&wire);
        let (back, read): (v2::PayloadV2<'_>, usize) =
            bincode::serde::borrow_decode_from_slice(&bytes, config()).unwrap();
        assert_eq!(read, bytes.len());
        assert_eq!(back, wire);
        assert_eq!(decode(&bytes, 2).unwrap(), cp);

        let reason = |wire: v2::PayloadV2<'_>| match decode(&payload_of(&wire), 2) {
            Err(DecodeError::Payload {
                version: 2,
                reason: PayloadError::Invalid { field, .. },
            }) => field,
            other => panic!("{other:?}"),
        };
        let mut bad = v2::PayloadV2::from_checkpoint(&cp);
        bad.nodes[1].pod_cidrs[0] = Cidr::V4(33, [10, 1, 2, 0]);
        assert_eq!(reason(bad), "nodes[1] (\"b\").pod_cidrs[0]");
        let mut bad = v2::PayloadV2::from_checkpoint(&cp);
        bad.freed[0].id = 0;
        assert_eq!(reason(bad), "freed[0].id");
        let mut bad = v2::PayloadV2::from_checkpoint(&cp);
        bad.written_at.nanos = 1_000_000_000;
        assert_eq!(reason(bad), "written_at");
        let mut bad = v2::PayloadV2::from_checkpoint(&cp);
        bad.ipsec_keys.push(v2::Key {
            spi: 16,
            first_seen: Time { secs: 1, nanos: 0 },
        });
        assert_eq!(reason(bad), "ipsec_keys[1].spi");
        let mut bad = v2::PayloadV2::from_checkpoint(&cp);
        bad.pending_deletes[0].record.name.prefix = 1;
        assert_eq!(reason(bad), "pending_deletes[0].name");
        // A record that decodes but is not a valid node.
        let mut bad = v2::PayloadV2::from_checkpoint(&cp);
        bad.nodes[0].addresses[1] = bad.nodes[0].addresses[0];
        assert!(matches!(
            decode(&payload_of(&bad), 2),
            Err(DecodeError::InvalidNode(_))
        ));
        // bincode's own complaints come through with its text.
        let e = decode(&bytes[..bytes.len() - 1], 2).unwrap_err();
        assert!(
            matches!(
                e,
                DecodeError::Payload {
                    reason: PayloadError::Bincode(_),
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("bincode"), "{e}");
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(matches!(
            decode(&trailing, 2),
            Err(DecodeError::PayloadTrailing { unread: 1 })
        ));
    }
}

//! The checkpoint payload: the checkpoint in a compact on-disk shape, encoded with bincode 2
//! (`config::standard()`: little-endian, variable-length integers). [`Checkpoint`] and [`Node`]
//! stay the planner's plain model; the payload is written straight from them and read straight
//! back into them, record by record, with full validation on the way in.
//!
//! Each format version has a top-level layout of its own, an `encode` and a `decode` function
//! in its module ([`v1`], [`v2`] and [`v3`] are read only, [`v4`] is read and written; each
//! version from 3 on begins with what the one before writes); the parts they share (node
//! lists, records, names, addresses...) live in this module and stay shared until a version
//! changes one of them, at which point the older versions get a frozen copy of the part as it
//! was. Only the newest version is written; every version is read.
//!
//! The payload stores each field in its compact form rather than as text, as small wire types
//! with hand-written [`bincode::Encode`] and [`bincode::BorrowDecode`] impls:
//!
//! - a node name is coded against the previous record's name in the same list ([`Name`]): bytes
//!   shared at the start, bytes shared at the end, and the rest. The planner writes records in
//!   name order, so `ip-10-0-3-17.eu-west-1.compute.internal` after
//!   `ip-10-0-3-16.eu-west-1.compute.internal` costs 4 bytes. Records are stored in the order
//!   given and decode in that order;
//! - a UID or boot ID in canonical (lowercase) UUID form, which is what Kubernetes and the
//!   kernel produce, is its 16 bytes ([`Ident::Uuid`]); anything else is kept as text. Decoded,
//!   a UUID is written straight into the record's inline text ([`crate::text::ShortText`]):
//!   no allocation;
//! - an address is a tag (kind and family) and its 4 or 16 bytes ([`Address`]); a pod CIDR is a
//!   family tag, its prefix length and its address bytes ([`Cidr`]);
//! - a node ID is a `u16`, 0 for none (0 is the local node, never a record's ID); freed IDs are
//!   `u16` too.
//!
//! The bytes are exactly those bincode 2 writes for the equivalent derived structs and enums,
//! which is how versions 1 and 2 were first written (through serde): a struct is its fields in
//! order with no names or framing; an enum is its variant index (a varint `u32`, one byte here)
//! and then its fields; an integer is a varint (one byte up to 250, else a marker byte and 2, 4
//! or 8 bytes); a sequence or string is a varint `u64` length and its elements; a `[u8; N]` is
//! stored as bytes, a one-byte length and the N bytes. A node record is its name, UID, boot ID,
//! addresses, pod CIDRs and node ID in that order ([`encode_record`]); a pending delete is a
//! record followed by its attempts. Any change to this layout (a field added, removed, reordered
//! or retyped, a variant added anywhere but at the end) changes the format: see `format.rs` for
//! how a version is bumped. The byte-for-byte fixture tests catch it, and the unit tests compare
//! each wire type's bytes with what bincode writes for the same fields.
//!
//! Encoding writes each record straight from its [`Node`] into the output, with no intermediate
//! wire copy of the lists. Decoding borrows strings from the payload (no copy until a [`Node`]
//! is built, and no intermediate copy of the lists either) and checks everything the encoder
//! guarantees: bincode's errors for lengths, tags and UTF-8; a sequence's length only reserves
//! what the bytes left could hold, and every string and sequence built counts against
//! [`DECODE_LIMIT`]; the conversion checks name codes against the previous name, prefix
//! lengths, nanoseconds, a freed ID 0, and every record through [`Node::validate`]. Any failure
//! is a typed [`DecodeError`] naming the field (`nodes[3].pod_cidrs[0]`) or carrying bincode's
//! error.
//!
//! The bincode plumbing under all of it (encoder, decoder, allocation budget, varints, reading
//! sequences) is `codec`, and a UUID's text to bytes and back is `uuid`; this module holds the
//! wire types and the node lists and records built of them, and dispatches on the version.

mod codec;
mod uuid;
pub(super) mod v1;
pub(super) mod v2;
pub(super) mod v3;
pub(super) mod v4;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use bincode::de::read::Reader;
use bincode::de::{BorrowDecode, BorrowDecoder, Decode, Decoder};
use bincode::enc::write::Writer;
use bincode::enc::{Encode, Encoder};
use bincode::error::{
    AllowedEnumVariants, DecodeError as WireDecodeError, EncodeError as WireEncodeError,
};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use self::codec::{
    Dec, Enc, MinLen, ONE_BYTE_MAX, claim, decode_len, decode_raw, decode_seq, decode_str,
    decode_uint, decode_variant, decoder, encode_len, encode_raw, encode_uint, encoder, invalid,
    read, reserve, take_str, unread,
};
use self::uuid::format_uuid;
pub(in crate::checkpoint) use self::uuid::parse_uuid;
use crate::checkpoint::error::{DecodeError, EncodeError, PayloadError};
use crate::checkpoint::{Checkpoint, PendingDelete};
use crate::ids::{AllocatorState, FreedId};
use crate::node::{AddressKind, Node, NodeAddress};
use crate::objects::NodeId;
use crate::text::ShortText;

// ---- wire types ----

/// A point in time since the Unix epoch, or a duration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Time {
    secs: u64,
    nanos: u32,
}

/// A name coded against the previous name of its list: `prefix` bytes of it, then `rest`, then
/// its last `suffix` bytes.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Name<'a> {
    prefix: u32,
    suffix: u32,
    rest: &'a str,
}

/// A UID or boot ID.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Ident<'a> {
    /// A canonical lowercase UUID, as its 16 bytes.
    Uuid([u8; 16]),
    /// Anything else, as it was.
    Text(&'a str),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Address {
    InternalV4([u8; 4]),
    InternalV6([u8; 16]),
    ExternalV4([u8; 4]),
    ExternalV6([u8; 16]),
}

/// A pod CIDR: prefix length, then the network address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cidr {
    V4(u8, [u8; 4]),
    V6(u8, [u8; 16]),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Freed {
    id: u16,
    at: Time,
}

impl MinLen for Time {
    /// Two one-byte varints.
    const MIN_LEN: usize = 2;
}

impl MinLen for Address {
    /// Tag, length byte, 4 bytes.
    const MIN_LEN: usize = 6;
}

impl MinLen for Cidr {
    /// Tag, prefix length, length byte, 4 bytes.
    const MIN_LEN: usize = 7;
}

impl MinLen for Freed {
    const MIN_LEN: usize = 1 + Time::MIN_LEN;
}

/// A node record at the least: a name code of three bytes (an empty rest), two empty text
/// idents of two bytes, two empty lists and a one-byte node ID.
const MIN_RECORD_LEN: usize = 3 + 2 + 2 + 1 + 1 + 1;

// ---- bincode impls of the wire types ----
//
// bincode's varint writes any integer up to 250 as that one byte, and every tag and array length
// here, and most lengths, prefixes and IDs, are that small: the impls read and write that form
// in place and leave larger values to bincode's own integer impls. Decoding a name code, UUID,
// address or CIDR also looks at its whole usual form at once (one-byte tag and lengths) and
// reads any other field by field.

impl Encode for Time {
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), WireEncodeError> {
        encode_uint(self.secs, e)?;
        encode_uint(self.nanos, e)
    }
}

impl<C> Decode<C> for Time {
    fn decode<D: Decoder<Context = C>>(d: &mut D) -> Result<Self, WireDecodeError> {
        Ok(Self {
            secs: decode_uint(d)?,
            nanos: decode_uint(d)?,
        })
    }
}
bincode::impl_borrow_decode!(Time);

impl Encode for Name<'_> {
    #[inline]
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), WireEncodeError> {
        encode_uint(self.prefix, e)?;
        encode_uint(self.suffix, e)?;
        encode_len(self.rest.len(), e)?;
        e.writer().write(self.rest.as_bytes())
    }
}

impl<'de, C> BorrowDecode<'de, C> for Name<'de> {
    #[inline]
    fn borrow_decode<D: BorrowDecoder<'de, Context = C>>(
        d: &mut D,
    ) -> Result<Self, WireDecodeError> {
        // The usual form at once: three one-byte varints, then the rest's bytes.
        if let Some(&[prefix, suffix, len]) = d.reader().peek_read(3)
            && prefix.max(suffix).max(len) <= ONE_BYTE_MAX
        {
            d.claim_bytes_read(4 + 4 + 8)?;
            d.reader().consume(3);
            return Ok(Self {
                prefix: prefix.into(),
                suffix: suffix.into(),
                rest: take_str(d, len.into())?,
            });
        }
        Ok(Self {
            prefix: decode_uint(d)?,
            suffix: decode_uint(d)?,
            rest: decode_str(d)?,
        })
    }
}

impl Encode for Ident<'_> {
    #[inline]
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), WireEncodeError> {
        match self {
            Ident::Uuid(b) => encode_raw([0], b, e),
            Ident::Text(s) => {
                encode_uint(1u32, e)?;
                encode_len(s.len(), e)?;
                e.writer().write(s.as_bytes())
            }
        }
    }
}

impl<'de, C> BorrowDecode<'de, C> for Ident<'de> {
    #[inline]
    fn borrow_decode<D: BorrowDecoder<'de, Context = C>>(
        d: &mut D,
    ) -> Result<Self, WireDecodeError> {
        // The usual form at once: a UUID's tag, length and bytes.
        if let Some(bytes) = d.reader().peek_read(2 + 16)
            && let [0, 16, uuid @ ..] = bytes
            && let Ok(uuid) = uuid.try_into()
        {
            d.claim_bytes_read(4 + 8 + 16)?;
            d.reader().consume(2 + 16);
            return Ok(Ident::Uuid(uuid));
        }
        const ALLOWED: AllowedEnumVariants = AllowedEnumVariants::Range { min: 0, max: 1 };
        Ok(match decode_variant(d, "Ident", &ALLOWED)? {
            0 => Ident::Uuid(decode_raw(d)?),
            _ => Ident::Text(decode_str(d)?),
        })
    }
}

impl Encode for Address {
    #[inline]
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), WireEncodeError> {
        match self {
            Address::InternalV4(b) => encode_raw([0], b, e),
            Address::InternalV6(b) => encode_raw([1], b, e),
            Address::ExternalV4(b) => encode_raw([2], b, e),
            Address::ExternalV6(b) => encode_raw([3], b, e),
        }
    }
}

impl<C> Decode<C> for Address {
    #[inline]
    fn decode<D: Decoder<Context = C>>(d: &mut D) -> Result<Self, WireDecodeError> {
        // The usual forms at once: tag, length and bytes.
        if let Some(&[tag @ (0 | 2), 4, a, b, c, e]) = d.reader().peek_read(2 + 4) {
            d.claim_bytes_read(4 + 8 + 4)?;
            d.reader().consume(2 + 4);
            let ip = [a, b, c, e];
            return Ok(match tag {
                0 => Address::InternalV4(ip),
                _ => Address::ExternalV4(ip),
            });
        }
        if let Some(bytes) = d.reader().peek_read(2 + 16)
            && let [tag @ (1 | 3), 16, ip @ ..] = bytes
            && let Ok(ip) = ip.try_into()
        {
            let tag = *tag;
            d.claim_bytes_read(4 + 8 + 16)?;
            d.reader().consume(2 + 16);
            return Ok(match tag {
                1 => Address::InternalV6(ip),
                _ => Address::ExternalV6(ip),
            });
        }
        const ALLOWED: AllowedEnumVariants = AllowedEnumVariants::Range { min: 0, max: 3 };
        Ok(match decode_variant(d, "Address", &ALLOWED)? {
            0 => Address::InternalV4(decode_raw(d)?),
            1 => Address::InternalV6(decode_raw(d)?),
            2 => Address::ExternalV4(decode_raw(d)?),
            _ => Address::ExternalV6(decode_raw(d)?),
        })
    }
}
bincode::impl_borrow_decode!(Address);

impl Encode for Cidr {
    #[inline]
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), WireEncodeError> {
        // The prefix length is a `u8`, which bincode writes as the byte itself.
        match self {
            Cidr::V4(len, b) => encode_raw([0, *len], b, e),
            Cidr::V6(len, b) => encode_raw([1, *len], b, e),
        }
    }
}

impl<C> Decode<C> for Cidr {
    #[inline]
    fn decode<D: Decoder<Context = C>>(d: &mut D) -> Result<Self, WireDecodeError> {
        // The usual forms at once: tag, prefix length, length and bytes.
        if let Some(&[0, len, 4, a, b, c, e]) = d.reader().peek_read(3 + 4) {
            d.claim_bytes_read(4 + 1 + 8 + 4)?;
            d.reader().consume(3 + 4);
            return Ok(Cidr::V4(len, [a, b, c, e]));
        }
        if let Some(bytes) = d.reader().peek_read(3 + 16)
            && let [1, len, 16, ip @ ..] = bytes
            && let Ok(ip) = ip.try_into()
        {
            let len = *len;
            d.claim_bytes_read(4 + 1 + 8 + 16)?;
            d.reader().consume(3 + 16);
            return Ok(Cidr::V6(len, ip));
        }
        const ALLOWED: AllowedEnumVariants = AllowedEnumVariants::Range { min: 0, max: 1 };
        Ok(match decode_variant(d, "Cidr", &ALLOWED)? {
            0 => Cidr::V4(u8::decode(d)?, decode_raw(d)?),
            _ => Cidr::V6(u8::decode(d)?, decode_raw(d)?),
        })
    }
}
bincode::impl_borrow_decode!(Cidr);

impl Encode for Freed {
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), WireEncodeError> {
        encode_uint(self.id, e)?;
        self.at.encode(e)
    }
}

impl<C> Decode<C> for Freed {
    fn decode<D: Decoder<Context = C>>(d: &mut D) -> Result<Self, WireDecodeError> {
        Ok(Self {
            id: decode_uint(d)?,
            at: Time::decode(d)?,
        })
    }
}
bincode::impl_borrow_decode!(Freed);

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
    let mut p = common_prefix(name.as_bytes(), prev.as_bytes());
    while !(name.is_char_boundary(p) && prev.is_char_boundary(p)) {
        p -= 1;
    }
    let (n, q) = (&name[p..], &prev[p..]);
    let mut s = common_suffix(n.as_bytes(), q.as_bytes());
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

/// How many bytes `a` and `b` share at the start; eight at a time.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let (words_a, _) = a.as_chunks::<8>();
    let (words_b, _) = b.as_chunks::<8>();
    let mut n = 0;
    for (x, y) in words_a.iter().zip(words_b) {
        // Little-endian: the first byte that differs is the lowest set bit's byte.
        let diff = u64::from_le_bytes(*x) ^ u64::from_le_bytes(*y);
        if diff != 0 {
            return n + (diff.trailing_zeros() / 8) as usize;
        }
        n += 8;
    }
    n + a[n..]
        .iter()
        .zip(&b[n..])
        .take_while(|(x, y)| x == y)
        .count()
}

/// How many bytes `a` and `b` share at the end; eight at a time.
fn common_suffix(a: &[u8], b: &[u8]) -> usize {
    let (_, words_a) = a.as_rchunks::<8>();
    let (_, words_b) = b.as_rchunks::<8>();
    let mut n = 0;
    for (x, y) in words_a.iter().rev().zip(words_b.iter().rev()) {
        // Big-endian: the last byte that differs is the lowest set bit's byte.
        let diff = u64::from_be_bytes(*x) ^ u64::from_be_bytes(*y);
        if diff != 0 {
            return n + (diff.trailing_zeros() / 8) as usize;
        }
        n += 8;
    }
    n + a[..a.len() - n]
        .iter()
        .rev()
        .zip(b[..b.len() - n].iter().rev())
        .take_while(|(x, y)| x == y)
        .count()
}

fn ident(s: &str) -> Ident<'_> {
    match parse_uuid(s) {
        Some(b) => Ident::Uuid(b),
        None => Ident::Text(s),
    }
}

impl From<NodeAddress> for Address {
    fn from(a: NodeAddress) -> Self {
        match (a.kind, a.ip) {
            (AddressKind::InternalIP, IpAddr::V4(ip)) => Address::InternalV4(ip.octets()),
            (AddressKind::InternalIP, IpAddr::V6(ip)) => Address::InternalV6(ip.octets()),
            (AddressKind::ExternalIP, IpAddr::V4(ip)) => Address::ExternalV4(ip.octets()),
            (AddressKind::ExternalIP, IpAddr::V6(ip)) => Address::ExternalV6(ip.octets()),
        }
    }
}

impl From<IpNet> for Cidr {
    fn from(c: IpNet) -> Self {
        match c {
            IpNet::V4(c) => Cidr::V4(c.prefix_len(), c.addr().octets()),
            IpNet::V6(c) => Cidr::V6(c.prefix_len(), c.addr().octets()),
        }
    }
}

/// A sequence: its length, then each item's wire form.
#[inline]
fn encode_seq<E: Encoder, T, W: Encode>(
    items: &[T],
    wire: impl Fn(&T) -> W,
    e: &mut E,
) -> Result<(), WireEncodeError> {
    encode_len(items.len(), e)?;
    for item in items {
        wire(item).encode(e)?;
    }
    Ok(())
}

/// One node record, its name coded against `prev`.
fn encode_record<E: Encoder>(n: &Node, prev: &str, e: &mut E) -> Result<(), WireEncodeError> {
    name_code(&n.name, prev).encode(e)?;
    ident(&n.uid).encode(e)?;
    ident(&n.boot_id).encode(e)?;
    encode_seq(&n.addresses, |a| Address::from(*a), e)?;
    encode_seq(&n.pod_cidrs, |c| Cidr::from(*c), e)?;
    encode_uint(n.node_id.map_or(0, NodeId::get), e)
}

/// An entry of a node list: a node record, then what follows it on the wire.
trait Entry: Sized {
    /// Bytes that follow the record at the least.
    const TAIL_MIN_LEN: usize;

    fn node(&self) -> &Node;

    fn encode_tail<E: Encoder>(&self, e: &mut E) -> Result<(), WireEncodeError>;

    /// What follows the record, decoded.
    type Tail;

    fn decode_tail(d: &mut Dec<'_>) -> Result<Self::Tail, PayloadError>;

    fn new(node: Node, tail: Self::Tail) -> Self;
}

/// A live node: the record alone.
impl Entry for Node {
    const TAIL_MIN_LEN: usize = 0;

    fn node(&self) -> &Node {
        self
    }

    fn encode_tail<E: Encoder>(&self, _: &mut E) -> Result<(), WireEncodeError> {
        Ok(())
    }

    type Tail = ();

    fn decode_tail(_: &mut Dec<'_>) -> Result<(), PayloadError> {
        Ok(())
    }

    fn new(node: Node, (): ()) -> Self {
        node
    }
}

/// A pending delete: the record, then the attempts (`u32`).
impl Entry for PendingDelete {
    const TAIL_MIN_LEN: usize = 1;

    fn node(&self) -> &Node {
        &self.node
    }

    fn encode_tail<E: Encoder>(&self, e: &mut E) -> Result<(), WireEncodeError> {
        encode_uint(self.attempts, e)
    }

    type Tail = u32;

    fn decode_tail(d: &mut Dec<'_>) -> Result<u32, PayloadError> {
        read(d)
    }

    fn new(node: Node, attempts: u32) -> Self {
        PendingDelete {
            node,
            attempts,
            held: None,
        }
    }
}

/// A node list without the local node's record, names coded one against the other in order.
fn encode_list<'a, T: Entry + 'a>(
    entries: impl IntoIterator<Item = &'a T, IntoIter: Clone>,
    local_node: &str,
    e: &mut Enc<'_>,
) -> Result<(), WireEncodeError> {
    let remote = |t: &&T| t.node().name != local_node;
    let entries = entries.into_iter();
    encode_len(entries.clone().filter(remote).count(), e)?;
    let mut prev = "";
    for t in entries.filter(remote) {
        encode_record(t.node(), prev, e)?;
        t.encode_tail(e)?;
        prev = &t.node().name;
    }
    Ok(())
}

fn encode_freed(ids: &AllocatorState, e: &mut Enc<'_>) -> Result<(), WireEncodeError> {
    encode_seq(
        &ids.freed,
        |f| Freed {
            id: f.id.get(),
            at: f.freed_at.into(),
        },
        e,
    )
}

// ---- wire -> Checkpoint ----

/// Where a record is: its list and index.
#[derive(Clone, Copy)]
struct At {
    list: &'static str,
    index: usize,
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
    #[inline]
    fn decode(&self, prev: &str, at: At, d: &mut Dec<'_>) -> Result<String, PayloadError> {
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
        let len = head.len() + self.rest.len() + tail.len();
        claim(d, len)?;
        let mut name = String::with_capacity(len);
        name.push_str(head);
        name.push_str(self.rest);
        name.push_str(tail);
        Ok(name)
    }
}

impl Ident<'_> {
    #[inline]
    fn decode(&self, d: &mut Dec<'_>) -> Result<ShortText, PayloadError> {
        match self {
            // Inline in the record: nothing to claim beyond the record itself.
            Ident::Uuid(b) => Ok(format_uuid(b)),
            Ident::Text(s) => {
                claim(d, s.len())?;
                Ok(ShortText::new(s))
            }
        }
    }
}

impl Address {
    #[inline]
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
    #[inline]
    fn decode(self) -> Option<IpNet> {
        match self {
            Cidr::V4(len, b) => Ipv4Net::new(b.into(), len).ok().map(IpNet::V4),
            Cidr::V6(len, b) => Ipv6Net::new(b.into(), len).ok().map(IpNet::V6),
        }
    }
}

/// One entry of a list, checked, its name decoded against the one before it, appended to
/// `entries` (and taken out again should it fail [`Node::validate`]). Building the record in its
/// place in the list rather than returning it and moving it in made decoding about a tenth
/// faster.
fn decode_entry<T: Entry>(
    d: &mut Dec<'_>,
    entries: &mut Vec<T>,
    at: At,
) -> Result<(), DecodeError> {
    let prev = entries.last().map_or("", |t| t.node().name.as_str());
    let name = read::<Name<'_>>(d)?.decode(prev, at, d)?;
    let uid = read::<Ident<'_>>(d)?.decode(d)?;
    let boot_id = read::<Ident<'_>>(d)?.decode(d)?;
    let addresses = decode_seq(d, |_, a: Address| Ok::<_, PayloadError>(a.decode()))?;
    let pod_cidrs = decode_seq(d, |i, c: Cidr| {
        c.decode().ok_or_else(|| {
            invalid(
                format!("{}[{}] ({name:?}).pod_cidrs[{i}]", at.list, at.index),
                "prefix length longer than the address",
            )
        })
    })?;
    let node_id = NodeId::new(decode_uint(d).map_err(PayloadError::Bincode)?);
    let tail = T::decode_tail(d)?;
    entries.push(T::new(
        Node {
            name,
            uid,
            addresses,
            pod_cidrs,
            boot_id,
            node_id,
        },
        tail,
    ));
    if let Some(Err(e)) = entries.last().map(|t| t.node().check_shape()) {
        entries.pop();
        return Err(e.into());
    }
    Ok(())
}

/// A node list, each record checked, in order, records of the local node dropped.
fn decode_list<T: Entry>(
    list: &'static str,
    local_node: &str,
    d: &mut Dec<'_>,
) -> Result<Vec<T>, DecodeError> {
    let len = decode_len(d).map_err(PayloadError::Bincode)?;
    let mut entries: Vec<T> = reserve(d, len, MIN_RECORD_LEN + T::TAIL_MIN_LEN)?;
    let mut saw_local = false;
    for index in 0..len {
        decode_entry(d, &mut entries, At { list, index })?;
        saw_local |= entries.last().is_some_and(|t| t.node().name == local_node);
    }
    // The encoder never writes the local node's record; should one be there, it goes only now,
    // since the next record's name is coded against it.
    if saw_local {
        entries.retain(|t| t.node().name != local_node);
    }
    Ok(entries)
}

fn decode_freed(d: &mut Dec<'_>) -> Result<AllocatorState, PayloadError> {
    let freed = decode_seq(d, |i, f: Freed| {
        let id = NodeId::new(f.id)
            .ok_or_else(|| invalid(format!("freed[{i}].id"), "node ID 0 is the local node"))?;
        let freed_at = f.at.duration(|| format!("freed[{i}].at"))?;
        Ok::<_, PayloadError>(FreedId { id, freed_at })
    })?;
    Ok(AllocatorState { freed })
}

/// Decodes and validates payload `body` of format `version`, dropping a record of the local
/// node. Never panics, whatever the bytes.
pub(super) fn decode(body: &[u8], version: u32) -> Result<Checkpoint, DecodeError> {
    let mut d = decoder(body);
    let decoded = match version {
        1 => v1::decode(&mut d).map(held_before_v3),
        2 => v2::decode(&mut d).map(held_before_v3),
        3 => v3::decode(&mut d),
        _ => v4::decode(&mut d),
    };
    let cp = decoded.map_err(|e| match e {
        DecodeError::Payload { reason, .. } => DecodeError::Payload { version, reason },
        e => e,
    })?;
    match unread(&mut d) {
        0 => Ok(cp),
        unread => Err(DecodeError::PayloadTrailing { unread }),
    }
}

/// The holds a record of version 1 or 2 implies: a pending delete never attempted is one the
/// brake held. When its hold began and whether as a wipe's were not kept, so it is held since
/// the record was written, as a wipe's: only an operator releases it (a restart must release
/// nothing, and the strictest hold is the one that cannot be wrong about that).
fn held_before_v3(mut cp: Checkpoint) -> Checkpoint {
    let held = crate::checkpoint::Held {
        at: cp.written_at,
        wipe: true,
    };
    for p in cp.pending_deletes.iter_mut().filter(|p| p.attempts == 0) {
        p.held = Some(held);
    }
    cp
}

/// Appends the payload of `cp` to `out` in the newest format, without the local node's record.
pub(super) fn encode(cp: &Checkpoint, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    // About 95 bytes per typical record; a guess that saves reallocations.
    out.reserve(128 + 112 * (cp.nodes.len() + cp.pending_deletes.len()));
    v4::encode(cp, &mut encoder(out)).map_err(EncodeError::Payload)
}

impl From<PayloadError> for DecodeError {
    /// A wire-level problem; [`decode`] sets the version.
    fn from(reason: PayloadError) -> Self {
        DecodeError::Payload { version: 0, reason }
    }
}

#[cfg(test)]
mod tests;

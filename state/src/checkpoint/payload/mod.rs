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

pub(super) mod v1;
pub(super) mod v2;
pub(super) mod v3;
pub(super) mod v4;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use bincode::config::{Configuration, standard};
use bincode::de::read::{BorrowReader, Reader};
use bincode::de::{BorrowDecode, BorrowDecoder, Decode, Decoder, DecoderImpl};
use bincode::enc::write::Writer;
use bincode::enc::{Encode, Encoder, EncoderImpl};
use bincode::error::{
    AllowedEnumVariants, DecodeError as WireDecodeError, EncodeError as WireEncodeError,
};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::checkpoint::error::{DecodeError, EncodeError, PayloadError};
use crate::checkpoint::{Checkpoint, PendingDelete};
use crate::ids::{AllocatorState, FreedId};
use crate::node::{AddressKind, Node, NodeAddress};
use crate::objects::NodeId;
use crate::text::ShortText;

/// The most the decoder allocates for one payload: every string and sequence it builds counts
/// against it. A real 65,535-node checkpoint takes under 16 MiB.
pub(super) const DECODE_LIMIT: usize = 64 << 20;

/// Little-endian, variable-length integers, no limit of bincode's own: the decoder counts what
/// it allocates against [`DECODE_LIMIT`] itself ([`Budget`]).
fn config() -> Configuration {
    standard()
}

/// The encoder: bincode writing into the output `Vec`.
pub(super) type Enc<'o> = EncoderImpl<Append<'o>, Configuration>;

/// The decoder: bincode reading the payload, with what may still be allocated.
pub(super) type Dec<'a> = DecoderImpl<Body<'a>, Configuration, Budget>;

/// Appends bincode's bytes to a `Vec` in place (its `std::io::Write` adapter costs more).
pub(super) struct Append<'o>(&'o mut Vec<u8>);

impl Writer for Append<'_> {
    #[inline]
    fn write(&mut self, bytes: &[u8]) -> Result<(), WireEncodeError> {
        self.0.extend_from_slice(bytes);
        Ok(())
    }
}

/// The payload bytes not read yet: bincode's slice reader, but one that can tell how many are
/// left, so that a sequence's length never reserves more than the rest could hold.
pub(super) struct Body<'a> {
    rest: &'a [u8],
}

impl Reader for Body<'_> {
    #[inline]
    fn read(&mut self, bytes: &mut [u8]) -> Result<(), WireDecodeError> {
        bytes.copy_from_slice(self.take_bytes(bytes.len())?);
        Ok(())
    }

    #[inline]
    fn peek_read(&mut self, n: usize) -> Option<&[u8]> {
        self.rest.get(..n)
    }

    #[inline]
    fn consume(&mut self, n: usize) {
        self.rest = self.rest.get(n..).unwrap_or_default();
    }
}

impl<'a> BorrowReader<'a> for Body<'a> {
    #[inline]
    fn take_bytes(&mut self, n: usize) -> Result<&'a [u8], WireDecodeError> {
        let Some((taken, rest)) = self.rest.split_at_checked(n) else {
            return Err(WireDecodeError::UnexpectedEnd {
                additional: n - self.rest.len(),
            });
        };
        self.rest = rest;
        Ok(taken)
    }
}

/// What the decoder may still allocate, out of [`DECODE_LIMIT`].
pub(super) struct Budget {
    left: usize,
}

impl Budget {
    /// Takes `n` bytes out of the budget, or fails with bincode's limit error.
    #[inline]
    fn claim(&mut self, n: usize) -> Result<(), PayloadError> {
        match self.left.checked_sub(n) {
            Some(left) => {
                self.left = left;
                Ok(())
            }
            None => Err(PayloadError::Bincode(WireDecodeError::LimitExceeded)),
        }
    }
}

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

/// Bytes a wire value takes at the least, so that a sequence's length can be checked against
/// the bytes left before anything is reserved for it. A bound too low only reserves more than
/// needed; one too high only reallocates.
pub(super) trait MinLen {
    const MIN_LEN: usize;
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

/// Values up to this are one byte in bincode's varint encoding.
const ONE_BYTE_MAX: u8 = 250;

/// An unsigned integer field as bincode's varint.
#[inline(always)]
pub(super) fn encode_uint<E: Encoder, T: Encode + Copy + Into<u64>>(
    v: T,
    e: &mut E,
) -> Result<(), WireEncodeError> {
    match u8::try_from(v.into()) {
        Ok(b) if b <= ONE_BYTE_MAX => e.writer().write(&[b]),
        _ => v.encode(e),
    }
}

#[inline(always)]
pub(super) fn decode_uint<D: Decoder, T: Decode<D::Context> + From<u8>>(
    d: &mut D,
) -> Result<T, WireDecodeError> {
    if let Some(&[b]) = d.reader().peek_read(1)
        && b <= ONE_BYTE_MAX
    {
        d.claim_bytes_read(size_of::<T>())?;
        d.reader().consume(1);
        return Ok(T::from(b));
    }
    T::decode(d)
}

/// A sequence's or string's length, as bincode writes it.
#[inline(always)]
fn encode_len<E: Encoder>(len: usize, e: &mut E) -> Result<(), WireEncodeError> {
    encode_uint(len as u64, e)
}

#[inline(always)]
fn decode_len<D: Decoder>(d: &mut D) -> Result<usize, WireDecodeError> {
    let len: u64 = decode_uint(d)?;
    usize::try_from(len).map_err(|_| WireDecodeError::OutsideUsizeRange(len))
}

/// A string borrowed from the payload: its length, then its bytes, which must be UTF-8.
#[inline(always)]
fn decode_str<'de, D: BorrowDecoder<'de>>(d: &mut D) -> Result<&'de str, WireDecodeError> {
    let len = decode_len(d)?;
    take_str(d, len)
}

/// A string's `len` bytes, its length read.
#[inline(always)]
fn take_str<'de, D: BorrowDecoder<'de>>(
    d: &mut D,
    len: usize,
) -> Result<&'de str, WireDecodeError> {
    d.claim_bytes_read(len)?;
    let bytes = d.borrow_reader().take_bytes(len)?;
    std::str::from_utf8(bytes).map_err(|inner| WireDecodeError::Utf8 { inner })
}

/// A `[u8; N]` as bincode's bytes, after the `head` bytes of its value (an enum tag, a prefix
/// length): a varint length, N (one byte), and the N bytes, which is what serde's
/// `serialize_bytes` wrote, rather than bincode's own array form without the length.
#[inline(always)]
fn encode_raw<E: Encoder, const H: usize, const N: usize>(
    head: [u8; H],
    bytes: &[u8; N],
    e: &mut E,
) -> Result<(), WireEncodeError> {
    const { assert!(N <= ONE_BYTE_MAX as usize) };
    e.writer().write(&head)?;
    e.writer().write(&[N as u8])?;
    e.writer().write(bytes)
}

#[inline(always)]
fn decode_raw<D: Decoder, const N: usize>(d: &mut D) -> Result<[u8; N], WireDecodeError> {
    let len = decode_len(d)?;
    if len != N {
        return Err(WireDecodeError::ArrayLengthMismatch {
            required: N,
            found: len,
        });
    }
    d.claim_bytes_read(N)?;
    let mut bytes = [0; N];
    d.reader().read(&mut bytes)?;
    Ok(bytes)
}

/// An enum's variant index, in `0..=max`.
#[inline(always)]
fn decode_variant<D: Decoder>(
    d: &mut D,
    type_name: &'static str,
    allowed: &'static AllowedEnumVariants,
) -> Result<u32, WireDecodeError> {
    let found = decode_uint(d)?;
    match allowed {
        AllowedEnumVariants::Range { min, max } if (*min..=*max).contains(&found) => Ok(found),
        _ => Err(WireDecodeError::UnexpectedVariant {
            type_name,
            allowed,
            found,
        }),
    }
}

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

// A UUID's text is 8-4-4-4-12 lowercase hex digits: four groups of eight digits (the middle
// two split by a dash), each the text of four of its bytes. Parsing checks and converts eight
// digits at a time in a `u64`, the first digit in the lowest byte.

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGH: u64 = 0x8080_8080_8080_8080;

/// The first up to eight bytes of `b` as a little-endian `u64`.
#[inline(always)]
fn le_u64(b: &[u8]) -> u64 {
    let mut w = [0; 8];
    w[..b.len()].copy_from_slice(b);
    u64::from_le_bytes(w)
}

/// The four bytes eight lowercase hex digits spell (in a `u64`, first digit lowest), or `None`
/// if one is anything else.
#[inline(always)]
fn unhex8(x: u64) -> Option<[u8; 4]> {
    if x & HIGH != 0 {
        return None;
    }
    // Every byte is below 0x80, so adding 0x80 - c (at most 0x50) carries into no other byte,
    // and sets a byte's high bit exactly when it is at least c.
    let at_least = |c: u8| x + ONES * u64::from(0x80 - c);
    let digit = at_least(b'0') & !at_least(b'9' + 1) & HIGH;
    let letter = at_least(b'a') & !at_least(b'f' + 1) & HIGH;
    if digit | letter != HIGH {
        return None;
    }
    // '0'..='9' is its low nibble, 'a'..='f' its low nibble plus 9.
    let v = (x & (ONES * 0x0F)) + (letter >> 7) * 9;
    // Each pair of nibbles to a byte, first one high; then the four bytes together.
    let v = (v << 4 | v >> 8) & 0x00FF_00FF_00FF_00FF;
    let v = (v | v >> 8) & 0x0000_FFFF_0000_FFFF;
    Some(((v | v >> 16) as u32).to_le_bytes())
}

/// The 16 bytes of `s` if it is a UUID in exactly the form [`format_uuid`] writes back
/// (lowercase), so that every UID stored as bytes decodes to the text it came from.
pub(in crate::checkpoint) fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let t: &[u8; 36] = s.as_bytes().try_into().ok()?;
    if [t[8], t[13], t[18], t[23]] != [b'-'; 4] {
        return None;
    }
    let groups = [
        le_u64(&t[0..8]),
        le_u64(&t[9..13]) | le_u64(&t[14..18]) << 32,
        le_u64(&t[19..23]) | le_u64(&t[24..28]) << 32,
        le_u64(&t[28..36]),
    ];
    let mut out = [0; 16];
    for (bytes, g) in out.chunks_exact_mut(4).zip(groups) {
        bytes.copy_from_slice(&unhex8(g)?);
    }
    Some(out)
}

/// Where each byte's two hex digits start in a UUID's text.
const UUID_HEX_AT: [usize; 16] = [0, 2, 4, 6, 9, 11, 14, 16, 19, 21, 24, 26, 28, 30, 32, 34];

/// Each byte's two lowercase hex digits.
static HEX_PAIR: [[u8; 2]; 256] = {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut t = [[0; 2]; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = [HEX[i >> 4], HEX[i & 0x0F]];
        i += 1;
    }
    t
};

fn format_uuid(b: &[u8; 16]) -> ShortText {
    let mut text = [b'-'; 36];
    for (byte, &at) in b.iter().zip(&UUID_HEX_AT) {
        text[at..at + 2].copy_from_slice(&HEX_PAIR[usize::from(*byte)]);
    }
    // Hex digits and dashes only: ASCII, so the conversion cannot fail.
    std::str::from_utf8(&text).map_or_else(|_| ShortText::default(), ShortText::new)
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
fn encode_list<T: Entry>(
    entries: &[T],
    local_node: &str,
    e: &mut Enc<'_>,
) -> Result<(), WireEncodeError> {
    let remote = |t: &&T| t.node().name != local_node;
    encode_len(entries.iter().filter(remote).count(), e)?;
    let mut prev = "";
    for t in entries.iter().filter(remote) {
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

fn invalid(field: String, problem: &'static str) -> PayloadError {
    PayloadError::Invalid { field, problem }
}

/// The next wire value.
#[inline]
fn read<'a, W: BorrowDecode<'a, Budget>>(d: &mut Dec<'a>) -> Result<W, PayloadError> {
    W::borrow_decode(d).map_err(PayloadError::Bincode)
}

/// Takes `n` bytes out of the allocation budget.
#[inline]
fn claim(d: &mut Dec<'_>, n: usize) -> Result<(), PayloadError> {
    d.context().claim(n)
}

/// An owned copy of a string read from the payload.
fn owned(d: &mut Dec<'_>, s: &str) -> Result<String, PayloadError> {
    claim(d, s.len())?;
    Ok(s.to_owned())
}

/// Room for a sequence of `T` announced `len` long: no more items than the bytes left could hold
/// at `min_len` bytes each, so a corrupt length fails on the missing bytes instead of reserving
/// memory first; and within the budget.
#[inline]
fn reserve<T, C: Seq<T>>(d: &mut Dec<'_>, len: usize, min_len: usize) -> Result<C, PayloadError> {
    let n = len.min(d.borrow_reader().rest.len() / min_len);
    claim(d, n.saturating_mul(size_of::<T>()))?;
    Ok(C::with_capacity(n))
}

/// What a sequence decodes into: a vector, or a node's inline list.
trait Seq<T> {
    fn with_capacity(n: usize) -> Self;
    fn push(&mut self, item: T);
}

impl<T> Seq<T> for Vec<T> {
    fn with_capacity(n: usize) -> Self {
        Vec::with_capacity(n)
    }
    fn push(&mut self, item: T) {
        Vec::push(self, item);
    }
}

impl<A: smallvec::Array> Seq<A::Item> for smallvec::SmallVec<A> {
    fn with_capacity(n: usize) -> Self {
        smallvec::SmallVec::with_capacity(n)
    }
    fn push(&mut self, item: A::Item) {
        smallvec::SmallVec::push(self, item);
    }
}

/// A sequence of wire values `W`, each checked and converted by `item` (given its index).
#[inline]
fn decode_seq<'a, W: BorrowDecode<'a, Budget> + MinLen, T, C: Seq<T>, E: From<PayloadError>>(
    d: &mut Dec<'a>,
    mut item: impl FnMut(usize, W) -> Result<T, E>,
) -> Result<C, E> {
    let len = decode_len(d).map_err(PayloadError::Bincode)?;
    let mut out: C = reserve::<T, C>(d, len, W::MIN_LEN)?;
    for i in 0..len {
        out.push(item(i, read(d)?)?);
    }
    Ok(out)
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
    let budget = Budget { left: DECODE_LIMIT };
    let mut d = DecoderImpl::new(Body { rest: body }, config(), budget);
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
    match d.borrow_reader().rest.len() {
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
    v4::encode(cp, &mut EncoderImpl::new(Append(out), config())).map_err(EncodeError::Payload)
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
    use crate::checkpoint::FORMAT_VERSION;

    /// A decoder over `body` with the whole budget.
    fn decoder(body: &[u8]) -> Dec<'_> {
        DecoderImpl::new(Body { rest: body }, config(), Budget { left: DECODE_LIMIT })
    }

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
            encode_uint(v, &mut EncoderImpl::new(Append(&mut out), config())).unwrap();
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
        v2::encode(&cp, &mut EncoderImpl::new(Append(&mut bytes), config())).unwrap();
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
        odd.nodes[0].addresses[1] = odd.nodes[0].addresses[0];
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
}

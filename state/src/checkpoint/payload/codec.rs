//! The bincode plumbing of the payload, beneath its wire types and versions: the encoder and
//! the decoder (with its allocation budget), varint fields written and read in place, and the
//! reading of values and sequences with every allocation counted and checked.

use bincode::config::{Configuration, standard};
use bincode::de::read::{BorrowReader, Reader};
use bincode::de::{BorrowDecode, BorrowDecoder, Decode, Decoder, DecoderImpl};
use bincode::enc::write::Writer;
use bincode::enc::{Encode, Encoder, EncoderImpl};
use bincode::error::{
    AllowedEnumVariants, DecodeError as WireDecodeError, EncodeError as WireEncodeError,
};

use crate::checkpoint::error::PayloadError;

/// The most the decoder allocates for one payload: every string and sequence it builds counts
/// against it. A real 65,535-node checkpoint takes under 16 MiB.
pub(super) const DECODE_LIMIT: usize = 64 << 20;

/// Little-endian, variable-length integers, no limit of bincode's own: the decoder counts what
/// it allocates against [`DECODE_LIMIT`] itself ([`Budget`]).
pub(super) fn config() -> Configuration {
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

/// An encoder appending to `out`.
pub(super) fn encoder(out: &mut Vec<u8>) -> Enc<'_> {
    EncoderImpl::new(Append(out), config())
}

/// A decoder over `body` with the whole budget.
pub(super) fn decoder(body: &[u8]) -> Dec<'_> {
    DecoderImpl::new(Body { rest: body }, config(), Budget { left: DECODE_LIMIT })
}

/// How many bytes of the payload `d` has not read.
pub(super) fn unread(d: &mut Dec<'_>) -> usize {
    d.borrow_reader().rest.len()
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

/// Bytes a wire value takes at the least, so that a sequence's length can be checked against
/// the bytes left before anything is reserved for it. A bound too low only reserves more than
/// needed; one too high only reallocates.
pub(super) trait MinLen {
    const MIN_LEN: usize;
}

/// Values up to this are one byte in bincode's varint encoding.
pub(super) const ONE_BYTE_MAX: u8 = 250;

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
pub(super) fn encode_len<E: Encoder>(len: usize, e: &mut E) -> Result<(), WireEncodeError> {
    encode_uint(len as u64, e)
}

#[inline(always)]
pub(super) fn decode_len<D: Decoder>(d: &mut D) -> Result<usize, WireDecodeError> {
    let len: u64 = decode_uint(d)?;
    usize::try_from(len).map_err(|_| WireDecodeError::OutsideUsizeRange(len))
}

/// A string borrowed from the payload: its length, then its bytes, which must be UTF-8.
#[inline(always)]
pub(super) fn decode_str<'de, D: BorrowDecoder<'de>>(
    d: &mut D,
) -> Result<&'de str, WireDecodeError> {
    let len = decode_len(d)?;
    take_str(d, len)
}

/// A string's `len` bytes, its length read.
#[inline(always)]
pub(super) fn take_str<'de, D: BorrowDecoder<'de>>(
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
pub(super) fn encode_raw<E: Encoder, const H: usize, const N: usize>(
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
pub(super) fn decode_raw<D: Decoder, const N: usize>(
    d: &mut D,
) -> Result<[u8; N], WireDecodeError> {
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
pub(super) fn decode_variant<D: Decoder>(
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

pub(super) fn invalid(field: String, problem: &'static str) -> PayloadError {
    PayloadError::Invalid { field, problem }
}

/// The next wire value.
#[inline]
pub(super) fn read<'a, W: BorrowDecode<'a, Budget>>(d: &mut Dec<'a>) -> Result<W, PayloadError> {
    W::borrow_decode(d).map_err(PayloadError::Bincode)
}

/// Takes `n` bytes out of the allocation budget.
#[inline]
pub(super) fn claim(d: &mut Dec<'_>, n: usize) -> Result<(), PayloadError> {
    d.context().claim(n)
}

/// An owned copy of a string read from the payload.
pub(super) fn owned(d: &mut Dec<'_>, s: &str) -> Result<String, PayloadError> {
    claim(d, s.len())?;
    Ok(s.to_owned())
}

/// Room for a sequence of `T` announced `len` long: no more items than the bytes left could hold
/// at `min_len` bytes each, so a corrupt length fails on the missing bytes instead of reserving
/// memory first; and within the budget.
#[inline]
pub(super) fn reserve<T, C: Seq<T>>(
    d: &mut Dec<'_>,
    len: usize,
    min_len: usize,
) -> Result<C, PayloadError> {
    let n = len.min(d.borrow_reader().rest.len() / min_len);
    claim(d, n.saturating_mul(size_of::<T>()))?;
    Ok(C::with_capacity(n))
}

/// What a sequence decodes into: a vector, or a node's inline list.
pub(super) trait Seq<T> {
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
pub(super) fn decode_seq<
    'a,
    W: BorrowDecode<'a, Budget> + MinLen,
    T,
    C: Seq<T>,
    E: From<PayloadError>,
>(
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

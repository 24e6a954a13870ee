//! UUIDs as the payload stores them: 16 bytes for the canonical lowercase text, and back.

use crate::text::ShortText;

// A UUID's text is 8-4-4-4-12 lowercase hex digits: four groups of eight digits (the middle
// two split by a dash), each the text of four of its bytes. Parsing checks and converts eight
// digits at a time in a `u64`, the first digit in the lowest byte.

pub(super) const ONES: u64 = 0x0101_0101_0101_0101;
pub(super) const HIGH: u64 = 0x8080_8080_8080_8080;

/// The first up to eight bytes of `b` as a little-endian `u64`.
#[inline(always)]
pub(super) fn le_u64(b: &[u8]) -> u64 {
    let mut w = [0; 8];
    w[..b.len()].copy_from_slice(b);
    u64::from_le_bytes(w)
}

/// The four bytes eight lowercase hex digits spell (in a `u64`, first digit lowest), or `None`
/// if one is anything else.
#[inline(always)]
pub(super) fn unhex8(x: u64) -> Option<[u8; 4]> {
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
pub(super) const UUID_HEX_AT: [usize; 16] =
    [0, 2, 4, 6, 9, 11, 14, 16, 19, 21, 24, 26, 28, 30, 32, 34];

/// Each byte's two lowercase hex digits.
pub(super) static HEX_PAIR: [[u8; 2]; 256] = {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut t = [[0; 2]; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = [HEX[i >> 4], HEX[i & 0x0F]];
        i += 1;
    }
    t
};

pub(super) fn format_uuid(b: &[u8; 16]) -> ShortText {
    let mut text = [b'-'; 36];
    for (byte, &at) in b.iter().zip(&UUID_HEX_AT) {
        text[at..at + 2].copy_from_slice(&HEX_PAIR[usize::from(*byte)]);
    }
    // Hex digits and dashes only: ASCII, so the conversion cannot fail.
    std::str::from_utf8(&text).map_or_else(|_| ShortText::default(), ShortText::new)
}

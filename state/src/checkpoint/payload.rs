//! The payload of format version 1: the checkpoint in a compact on-disk shape, written and read
//! by hand, so that [`Checkpoint`] and [`Node`] stay the planner's plain model and the codec
//! stays several times faster than JSON (`cargo bench -p state`).
//!
//! A derived encoding of [`Checkpoint`] spends most bytes and time on strings and on
//! per-field codec calls. Here:
//!
//! - a node name is coded against the previous record's name in the same list: bytes shared at
//!   the start, bytes shared at the end, and the rest. The planner writes records in name order,
//!   so `ip-10-0-3-17.eu-west-1.compute.internal` after `ip-10-0-3-16.eu-west-1.compute.internal`
//!   costs 4 bytes. Records are stored in the order given and decode in that order;
//! - a UID or boot ID in canonical (lowercase) UUID form, which is what Kubernetes and the
//!   kernel produce, is its 16 bytes; anything else is kept as text;
//! - an address is one tag byte (kind and family) and its 4 or 16 bytes; a pod CIDR is a family
//!   byte, its prefix length and its address bytes;
//! - a node ID is a varint, 0 for none (0 is the local node, never a record's ID).
//!
//! ```text
//! payload = str agent_version, duration written_at, str local_node,
//!           varint n, record × n,                       (live records)
//!           varint n, (record, varint attempts) × n,    (pending deletes)
//!           varint n, (varint id, duration freed_at) × n (freed node IDs)
//! record  = name, ident uid, ident boot_id, varint n, address × n, varint n, cidr × n,
//!           varint node_id
//! name    = varint shared_prefix, varint shared_suffix, str rest
//! ident   = 0x00 [16 bytes] | 0x01 str
//! address = 0x00 [4] InternalIP v4 | 0x01 [16] InternalIP v6 | 0x02 [4] ExternalIP v4
//!         | 0x03 [16] ExternalIP v6
//! cidr    = 0x00 prefix_len [4] | 0x01 prefix_len [16]
//! duration = varint secs, varint nanos
//! str     = varint length, UTF-8 bytes
//! varint  = unsigned LEB128, at most 10 bytes
//! ```
//!
//! Decoding checks everything the encoder guarantees: lengths within the payload, tags, UTF-8,
//! name codes within the previous name, prefix lengths, nanoseconds, a freed ID 0, and every
//! record through [`Node::validate`]. Any failure is a [`DecodeError`] naming the byte offset.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::checkpoint::format::DecodeError;
use crate::checkpoint::{Checkpoint, PendingDelete};
use crate::ids::{AllocatorState, FreedId};
use crate::node::{AddressKind, Node, NodeAddress};
use crate::objects::NodeId;

const IDENT_UUID: u8 = 0;
const IDENT_TEXT: u8 = 1;
const ADDR_INTERNAL_V4: u8 = 0;
const ADDR_INTERNAL_V6: u8 = 1;
const ADDR_EXTERNAL_V4: u8 = 2;
const ADDR_EXTERNAL_V6: u8 = 3;
const NET_V4: u8 = 0;
const NET_V6: u8 = 1;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn put_duration(out: &mut Vec<u8>, d: Duration) {
    put_varint(out, d.as_secs());
    put_varint(out, d.subsec_nanos().into());
}

/// Appends `name` coded against `prev`: bytes shared at the start, bytes shared at the end
/// (not overlapping the start), the rest. Cuts fall on character boundaries of both names, so
/// the rest is a `str` and decoding can slice `prev` at the same places.
fn put_name(out: &mut Vec<u8>, name: &str, prev: &str) {
    let mut p = common(name.bytes(), prev.bytes());
    while !(name.is_char_boundary(p) && prev.is_char_boundary(p)) {
        p -= 1;
    }
    let (n, q) = (&name[p..], &prev[p..]);
    let mut s = common(n.bytes().rev(), q.bytes().rev());
    while !(n.is_char_boundary(n.len() - s) && q.is_char_boundary(q.len() - s)) {
        s -= 1;
    }
    put_varint(out, p as u64);
    put_varint(out, s as u64);
    put_str(out, &n[..n.len() - s]);
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

fn put_ident(out: &mut Vec<u8>, s: &str) {
    match parse_uuid(s) {
        Some(b) => {
            out.push(IDENT_UUID);
            out.extend_from_slice(&b);
        }
        None => {
            out.push(IDENT_TEXT);
            put_str(out, s);
        }
    }
}

fn put_record(out: &mut Vec<u8>, n: &Node, prev: &str) {
    put_name(out, &n.name, prev);
    put_ident(out, &n.uid);
    put_ident(out, &n.boot_id);
    put_varint(out, n.addresses.len() as u64);
    for a in &n.addresses {
        match (a.kind, a.ip) {
            (AddressKind::InternalIP, IpAddr::V4(ip)) => {
                out.push(ADDR_INTERNAL_V4);
                out.extend_from_slice(&ip.octets());
            }
            (AddressKind::InternalIP, IpAddr::V6(ip)) => {
                out.push(ADDR_INTERNAL_V6);
                out.extend_from_slice(&ip.octets());
            }
            (AddressKind::ExternalIP, IpAddr::V4(ip)) => {
                out.push(ADDR_EXTERNAL_V4);
                out.extend_from_slice(&ip.octets());
            }
            (AddressKind::ExternalIP, IpAddr::V6(ip)) => {
                out.push(ADDR_EXTERNAL_V6);
                out.extend_from_slice(&ip.octets());
            }
        }
    }
    put_varint(out, n.pod_cidrs.len() as u64);
    for c in &n.pod_cidrs {
        match c {
            IpNet::V4(c) => {
                out.extend_from_slice(&[NET_V4, c.prefix_len()]);
                out.extend_from_slice(&c.addr().octets());
            }
            IpNet::V6(c) => {
                out.extend_from_slice(&[NET_V6, c.prefix_len()]);
                out.extend_from_slice(&c.addr().octets());
            }
        }
    }
    put_varint(out, n.node_id.map_or(0, NodeId::get).into());
}

/// Appends the payload of `cp` to `out`, without the local node's record.
pub(super) fn encode(cp: &Checkpoint, out: &mut Vec<u8>) {
    let remote = |n: &Node| n.name != cp.local_node;
    // About 90 bytes per typical record; a guess that saves most reallocations.
    out.reserve(128 + 96 * (cp.nodes.len() + cp.pending_deletes.len()));
    put_str(out, &cp.agent_version);
    put_duration(out, cp.written_at);
    put_str(out, &cp.local_node);
    put_varint(out, cp.nodes.iter().filter(|n| remote(n)).count() as u64);
    let mut prev = "";
    for n in cp.nodes.iter().filter(|n| remote(n)) {
        put_record(out, n, prev);
        prev = &n.name;
    }
    let pending = || cp.pending_deletes.iter().filter(|p| remote(&p.node));
    put_varint(out, pending().count() as u64);
    let mut prev = "";
    for p in pending() {
        put_record(out, &p.node, prev);
        put_varint(out, p.attempts.into());
        prev = &p.node.name;
    }
    put_varint(out, cp.ids.freed.len() as u64);
    for f in &cp.ids.freed {
        put_varint(out, f.id.get().into());
        put_duration(out, f.freed_at);
    }
}

/// A cursor over the payload; every read is bounds-checked and fails with its offset.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    version: u32,
}

impl<'a> Reader<'a> {
    fn fail(&self, reason: &'static str) -> DecodeError {
        DecodeError::Payload {
            version: self.version,
            offset: self.pos,
            reason,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        match self.buf.get(self.pos..).and_then(|rest| rest.get(..n)) {
            Some(b) => {
                self.pos += n;
                Ok(b)
            }
            None => Err(self.fail("the payload ends inside a field")),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn varint(&mut self) -> Result<u64, DecodeError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            if shift == 63 && b > 1 {
                return Err(self.fail("a number does not fit in 64 bits"));
            }
            v |= u64::from(b & 0x7F) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.fail("a number does not fit in 64 bits"))
    }

    fn number<T: TryFrom<u64>>(&mut self) -> Result<T, DecodeError> {
        let v = self.varint()?;
        T::try_from(v).map_err(|_| self.fail("a number is out of range"))
    }

    /// A count or length: each element takes at least a byte, so it cannot exceed the bytes
    /// left, which bounds what a corrupt length can make the decoder reserve.
    fn len(&mut self) -> Result<usize, DecodeError> {
        let n = self.varint()?;
        match usize::try_from(n) {
            Ok(n) if n <= self.buf.len() - self.pos => Ok(n),
            _ => Err(self.fail("a length runs past the end of the payload")),
        }
    }

    fn str(&mut self) -> Result<&'a str, DecodeError> {
        let n = self.len()?;
        let at = self.pos;
        std::str::from_utf8(self.take(n)?).map_err(|_| DecodeError::Payload {
            version: self.version,
            offset: at,
            reason: "a string is not UTF-8",
        })
    }

    fn duration(&mut self) -> Result<Duration, DecodeError> {
        let secs = self.varint()?;
        let nanos: u32 = self.number()?;
        if nanos >= 1_000_000_000 {
            return Err(self.fail("a duration has a second or more of nanoseconds"));
        }
        Ok(Duration::new(secs, nanos))
    }

    fn name(&mut self, prev: &str) -> Result<String, DecodeError> {
        let p: usize = self.number()?;
        let s: usize = self.number()?;
        let rest = self.str()?;
        let head = prev.get(..p);
        let tail = prev
            .len()
            .checked_sub(s)
            .filter(|t| *t >= p)
            .and_then(|t| prev.get(t..));
        let (Some(head), Some(tail)) = (head, tail) else {
            return Err(self.fail("a node name shares more with the previous name than it has"));
        };
        let mut name = String::with_capacity(head.len() + rest.len() + tail.len());
        name.push_str(head);
        name.push_str(rest);
        name.push_str(tail);
        Ok(name)
    }

    fn ident(&mut self) -> Result<String, DecodeError> {
        match self.u8()? {
            IDENT_UUID => Ok(format_uuid(&self.array()?)),
            IDENT_TEXT => Ok(self.str()?.to_owned()),
            _ => Err(self.fail("unknown identifier tag")),
        }
    }

    fn address(&mut self) -> Result<NodeAddress, DecodeError> {
        let (kind, ip) = match self.u8()? {
            ADDR_INTERNAL_V4 => (
                AddressKind::InternalIP,
                Ipv4Addr::from(self.array::<4>()?).into(),
            ),
            ADDR_INTERNAL_V6 => (
                AddressKind::InternalIP,
                Ipv6Addr::from(self.array::<16>()?).into(),
            ),
            ADDR_EXTERNAL_V4 => (
                AddressKind::ExternalIP,
                Ipv4Addr::from(self.array::<4>()?).into(),
            ),
            ADDR_EXTERNAL_V6 => (
                AddressKind::ExternalIP,
                Ipv6Addr::from(self.array::<16>()?).into(),
            ),
            _ => return Err(self.fail("unknown address tag")),
        };
        Ok(NodeAddress { kind, ip })
    }

    fn cidr(&mut self) -> Result<IpNet, DecodeError> {
        let net = match self.u8()? {
            NET_V4 => {
                let len = self.u8()?;
                Ipv4Net::new(self.array::<4>()?.into(), len).map(IpNet::V4)
            }
            NET_V6 => {
                let len = self.u8()?;
                Ipv6Net::new(self.array::<16>()?.into(), len).map(IpNet::V6)
            }
            _ => return Err(self.fail("unknown CIDR tag")),
        };
        net.map_err(|_| self.fail("a pod CIDR's prefix is longer than its address"))
    }

    fn record(&mut self, prev: &str) -> Result<Node, DecodeError> {
        let name = self.name(prev)?;
        let uid = self.ident()?;
        let boot_id = self.ident()?;
        let n = self.len()?;
        let mut addresses = Vec::with_capacity(n);
        for _ in 0..n {
            addresses.push(self.address()?);
        }
        let n = self.len()?;
        let mut pod_cidrs = Vec::with_capacity(n);
        for _ in 0..n {
            pod_cidrs.push(self.cidr()?);
        }
        let node = Node {
            name,
            uid,
            addresses,
            pod_cidrs,
            boot_id,
            node_id: NodeId::new(self.number()?),
        };
        node.validate()?;
        Ok(node)
    }
}

/// Decodes and validates payload `body` of format `version`, dropping a record of the local
/// node. Never panics, whatever the bytes.
pub(super) fn decode(body: &[u8], version: u32) -> Result<Checkpoint, DecodeError> {
    let mut r = Reader {
        buf: body,
        pos: 0,
        version,
    };
    let agent_version = r.str()?.to_owned();
    let written_at = r.duration()?;
    let local_node = r.str()?.to_owned();
    let n = r.len()?;
    let mut nodes: Vec<Node> = Vec::with_capacity(n);
    let mut prev = String::new();
    for _ in 0..n {
        let node = r.record(&prev)?;
        prev.clone_from(&node.name);
        if node.name != local_node {
            nodes.push(node);
        }
    }
    let n = r.len()?;
    let mut pending_deletes = Vec::with_capacity(n);
    prev.clear();
    for _ in 0..n {
        let node = r.record(&prev)?;
        let attempts = r.number()?;
        prev.clone_from(&node.name);
        if node.name != local_node {
            pending_deletes.push(PendingDelete { node, attempts });
        }
    }
    let n = r.len()?;
    let mut freed = Vec::with_capacity(n);
    for _ in 0..n {
        let id = NodeId::new(r.number()?).ok_or_else(|| r.fail("freed node ID 0"))?;
        freed.push(FreedId {
            id,
            freed_at: r.duration()?,
        });
    }
    if r.pos != body.len() {
        return Err(DecodeError::PayloadTrailing {
            unread: body.len() - r.pos,
        });
    }
    Ok(Checkpoint {
        agent_version,
        written_at,
        local_node,
        nodes,
        pending_deletes,
        ids: AllocatorState { freed },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name_round_trip(name: &str, prev: &str) -> (u64, u64, usize) {
        let mut out = Vec::new();
        put_name(&mut out, name, prev);
        let mut r = Reader {
            buf: &out,
            pos: 0,
            version: 1,
        };
        assert_eq!(r.name(prev).unwrap(), name);
        assert_eq!(r.pos, out.len());
        let mut r = Reader {
            buf: &out,
            pos: 0,
            version: 1,
        };
        (r.varint().unwrap(), r.varint().unwrap(), out.len())
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
        let bad = [3, 3, 0];
        let mut r = Reader {
            buf: &bad,
            pos: 0,
            version: 1,
        };
        assert!(matches!(
            r.name("abcde"),
            Err(DecodeError::Payload { offset: 3, .. })
        ));
    }

    #[test]
    fn only_canonical_uuids_are_stored_as_bytes() {
        let uuid = "0a1b2c3d-4e5f-6789-abcd-ef0123456789";
        let b = parse_uuid(uuid).unwrap();
        assert_eq!(format_uuid(&b), uuid);
        for text in [
            "",
            "uid-1",
            "0A1B2C3D-4E5F-6789-ABCD-EF0123456789",
            "0a1b2c3d04e5f-6789-abcd-ef0123456789",
            "0a1b2c3d-4e5f-6789-abcd-ef012345678g",
            "0a1b2c3d-4e5f-6789-abcd-ef01234567890",
        ] {
            assert_eq!(parse_uuid(text), None, "{text}");
        }
    }

    #[test]
    fn varints_round_trip_and_overlong_ones_are_refused() {
        for v in [
            0,
            1,
            127,
            128,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            let mut r = Reader {
                buf: &out,
                pos: 0,
                version: 1,
            };
            assert_eq!(r.varint().unwrap(), v);
        }
        let mut r = Reader {
            buf: &[0xFF; 11],
            pos: 0,
            version: 1,
        };
        assert!(r.varint().is_err());
        let mut r = Reader {
            buf: &[0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x02],
            pos: 0,
            version: 1,
        };
        assert!(r.varint().is_err());
    }
}

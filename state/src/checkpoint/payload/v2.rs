//! Format version 2: read, and written as the start of version 3 ([`super::v3`]), so frozen as
//! it is. Version 1 plus the brake's window (removals carried out recently) and the IPsec keys
//! seen, with when each was first seen.
//!
//! The payload, in order: agent version (string), written at ([`Time`]), local node (string),
//! live records (local node excluded), pending deletes (local node excluded; names coded
//! against the previous pending one), freed IDs ([`super::Freed`]), removals ([`Removals`]), IPsec
//! keys ([`Key`]).

use bincode::de::{Decode, Decoder};
use bincode::enc::{Encode, Encoder};
use bincode::error::{DecodeError as WireDecodeError, EncodeError as WireEncodeError};

use super::codec::{Dec, Enc, MinLen, decode_seq, decode_uint, encode_uint, invalid, owned, read};
use super::{Time, decode_freed, decode_list, encode_freed, encode_list, encode_seq};
use crate::checkpoint::error::DecodeError;
use crate::checkpoint::{Checkpoint, KeySeen, RecentRemovals};

/// Removals the brake let through at one time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Removals {
    pub(super) at: Time,
    pub(super) nodes: u32,
    pub(super) objects: u32,
}

/// An IPsec key seen: its SPI (1..=15) and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Key {
    pub(super) spi: u8,
    pub(super) first_seen: Time,
}

impl MinLen for Removals {
    const MIN_LEN: usize = Time::MIN_LEN + 1 + 1;
}

impl MinLen for Key {
    const MIN_LEN: usize = 1 + Time::MIN_LEN;
}

impl Encode for Removals {
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), WireEncodeError> {
        self.at.encode(e)?;
        encode_uint(self.nodes, e)?;
        encode_uint(self.objects, e)
    }
}

impl<C> Decode<C> for Removals {
    fn decode<D: Decoder<Context = C>>(d: &mut D) -> Result<Self, WireDecodeError> {
        Ok(Self {
            at: Time::decode(d)?,
            nodes: decode_uint(d)?,
            objects: decode_uint(d)?,
        })
    }
}
bincode::impl_borrow_decode!(Removals);

impl Encode for Key {
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), WireEncodeError> {
        self.spi.encode(e)?;
        self.first_seen.encode(e)
    }
}

impl<C> Decode<C> for Key {
    fn decode<D: Decoder<Context = C>>(d: &mut D) -> Result<Self, WireDecodeError> {
        Ok(Self {
            spi: u8::decode(d)?,
            first_seen: Time::decode(d)?,
        })
    }
}
bincode::impl_borrow_decode!(Key);

/// Writes `cp`, without the local node's record.
pub(super) fn encode(cp: &Checkpoint, e: &mut Enc<'_>) -> Result<(), WireEncodeError> {
    cp.agent_version.encode(e)?;
    Time::from(cp.written_at).encode(e)?;
    cp.local_node.encode(e)?;
    encode_list(cp.nodes.iter(), &cp.local_node, e)?;
    encode_list(&cp.pending_deletes, &cp.local_node, e)?;
    encode_freed(&cp.ids, e)?;
    encode_seq(
        &cp.removals,
        |r| Removals {
            at: r.at.into(),
            nodes: r.nodes,
            objects: r.objects,
        },
        e,
    )?;
    encode_seq(
        &cp.ipsec_keys,
        |k| Key {
            spi: k.spi,
            first_seen: k.first_seen.into(),
        },
        e,
    )
}

/// The checkpoint, every field checked, a record of the local node dropped.
pub(super) fn decode(d: &mut Dec<'_>) -> Result<Checkpoint, DecodeError> {
    let agent_version: &str = read(d)?;
    let written_at = read::<Time>(d)?.duration(|| "written_at".into())?;
    let local_node: &str = read(d)?;
    let nodes = decode_list("nodes", local_node, d)?;
    let pending_deletes = decode_list("pending_deletes", local_node, d)?;
    let ids = decode_freed(d)?;
    let removals = decode_seq(d, |i, r: Removals| {
        Ok::<_, DecodeError>(RecentRemovals {
            at: r.at.duration(|| format!("removals[{i}].at"))?,
            nodes: r.nodes,
            objects: r.objects,
        })
    })?;
    let ipsec_keys = decode_seq(d, |i, k: Key| {
        if !(1..=15).contains(&k.spi) {
            return Err(invalid(format!("ipsec_keys[{i}].spi"), "an SPI is 1 to 15"));
        }
        Ok(KeySeen {
            spi: k.spi,
            first_seen: k
                .first_seen
                .duration(|| format!("ipsec_keys[{i}].first_seen"))?,
        })
    })?;
    Ok(Checkpoint {
        agent_version: owned(d, agent_version)?,
        written_at,
        boot: None,
        local_node: owned(d, local_node)?,
        nodes: nodes.into(),
        pending_deletes,
        ids,
        removals,
        ipsec_keys,
        orphans_held: None,
    })
}

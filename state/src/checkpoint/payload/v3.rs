//! Format version 3: version 2 and then the brake's holds, so that a
//! restart never releases what the brake held (a ratio diluted by nodes that joined since the
//! hold began would have let a mass deletion through at the first plan after it).
//!
//! The payload, in order: version 2's ([`super::v2`]), then one entry per pending delete
//! written, in the same order ([`Held`] or none: a removal held, or one released whose cleanup
//! failed), then the orphans' hold ([`Held`] or none).

use bincode::de::{Decode, Decoder};
use bincode::enc::{Encode, Encoder};
use bincode::error::{DecodeError as WireDecodeError, EncodeError as WireEncodeError};

use super::codec::{Dec, Enc, MinLen, decode_seq, encode_len, invalid, read};
use super::{Time, v2};
use crate::checkpoint::error::DecodeError;
use crate::checkpoint::{self, Checkpoint};

/// A hold: when it began, and whether as part of a near-total wipe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Held {
    pub(super) at: Time,
    pub(super) wipe: bool,
}

impl MinLen for Held {
    const MIN_LEN: usize = Time::MIN_LEN + 1;
}

impl MinLen for Option<Held> {
    const MIN_LEN: usize = 1;
}

impl Encode for Held {
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), WireEncodeError> {
        self.at.encode(e)?;
        self.wipe.encode(e)
    }
}

impl<C> Decode<C> for Held {
    fn decode<D: Decoder<Context = C>>(d: &mut D) -> Result<Self, WireDecodeError> {
        Ok(Self {
            at: Time::decode(d)?,
            wipe: bool::decode(d)?,
        })
    }
}
bincode::impl_borrow_decode!(Held);

fn wire(h: &checkpoint::Held) -> Held {
    Held {
        at: h.at.into(),
        wipe: h.wipe,
    }
}

fn model(h: Held, field: impl FnOnce() -> String) -> Result<checkpoint::Held, DecodeError> {
    Ok(checkpoint::Held {
        at: h.at.duration(field)?,
        wipe: h.wipe,
    })
}

/// Writes `cp`, without the local node's record.
pub(super) fn encode(cp: &Checkpoint, e: &mut Enc<'_>) -> Result<(), WireEncodeError> {
    v2::encode(cp, e)?;
    // Aligned with the pending deletes version 2 wrote: every one but the local node's.
    let written = || {
        cp.pending_deletes
            .iter()
            .filter(|p| p.node.name != cp.local_node)
    };
    encode_len(written().count(), e)?;
    for p in written() {
        p.held.as_ref().map(wire).encode(e)?;
    }
    cp.orphans_held.as_ref().map(wire).encode(e)
}

/// The checkpoint, every field checked, a record of the local node dropped.
pub(super) fn decode(d: &mut Dec<'_>) -> Result<Checkpoint, DecodeError> {
    let mut cp = v2::decode(d)?;
    let held: Vec<Option<Held>> = decode_seq(d, |_, h| Ok::<_, DecodeError>(h))?;
    if held.len() != cp.pending_deletes.len() {
        return Err(invalid(
            format!("held ({} entries)", held.len()),
            "one entry per pending delete",
        )
        .into());
    }
    for (i, (p, h)) in cp.pending_deletes.iter_mut().zip(held).enumerate() {
        p.held = h
            .map(|h| model(h, || format!("held[{i}].at")))
            .transpose()?;
        if p.held.is_some() && p.attempts > 0 {
            return Err(invalid(
                format!("held[{i}]"),
                "a removal held is one never attempted",
            )
            .into());
        }
    }
    cp.orphans_held = read::<Option<Held>>(d)?
        .map(|h| model(h, || "orphans_held.at".into()))
        .transpose()?;
    Ok(cp)
}

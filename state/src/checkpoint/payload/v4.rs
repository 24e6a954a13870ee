//! Format version 4, the one written now: version 3 and then where the record's `written_at`
//! sat on the kernel's boot clock, so that an agent restarted on the same boot continues its
//! clock from the boot clock and a wall-clock step releases nothing ([`crate::checkpoint::clock`]).
//!
//! The payload, in order: version 3's ([`super::v3`]), then the boot time ([`Boot`] or none:
//! the boot clock could not be read).

use bincode::de::{Decode, Decoder};
use bincode::enc::{Encode, Encoder};
use bincode::error::{DecodeError as WireDecodeError, EncodeError as WireEncodeError};

use super::codec::{Dec, Enc, MinLen, decode_raw, encode_raw, read};
use super::{Time, v3};
use crate::checkpoint::error::DecodeError;
use crate::checkpoint::{BootTime, Checkpoint};

/// A point on the boot clock: the boot ID's 16 bytes (as bytes, with their length, the way
/// the payload stores every byte array), then the time since that boot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Boot {
    id: [u8; 16],
    since: Time,
}

impl MinLen for Option<Boot> {
    const MIN_LEN: usize = 1;
}

impl Encode for Boot {
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), WireEncodeError> {
        encode_raw([], &self.id, e)?;
        self.since.encode(e)
    }
}

impl<C> Decode<C> for Boot {
    fn decode<D: Decoder<Context = C>>(d: &mut D) -> Result<Self, WireDecodeError> {
        Ok(Self {
            id: decode_raw(d)?,
            since: Time::decode(d)?,
        })
    }
}
bincode::impl_borrow_decode!(Boot);

/// Writes `cp`, without the local node's record.
pub(super) fn encode(cp: &Checkpoint, e: &mut Enc<'_>) -> Result<(), WireEncodeError> {
    v3::encode(cp, e)?;
    cp.boot
        .map(|b| Boot {
            id: b.boot_id,
            since: b.since_boot.into(),
        })
        .encode(e)
}

/// The checkpoint, every field checked, a record of the local node dropped.
pub(super) fn decode(d: &mut Dec<'_>) -> Result<Checkpoint, DecodeError> {
    let mut cp = v3::decode(d)?;
    cp.boot = read::<Option<Boot>>(d)?
        .map(|b| {
            Ok::<_, DecodeError>(BootTime {
                boot_id: b.id,
                since_boot: b.since.duration(|| "boot.since_boot".into())?,
            })
        })
        .transpose()?;
    Ok(cp)
}

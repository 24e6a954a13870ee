//! Format version 1: read only. Written by node-agent 0.1.0; `tests/fixtures/checkpoint-v1.bin`
//! pins it. A version-1 checkpoint has no brake window and no IPsec key memory: they start
//! empty, which only makes the brake and a key rotation start afresh.
//!
//! The payload, in order: agent version (string), written at ([`Time`]), local node (string),
//! live records, pending deletes, freed IDs ([`super::Freed`]).

use super::codec::{Dec, owned, read};
use super::{Time, decode_freed, decode_list};
use crate::checkpoint::Checkpoint;
use crate::checkpoint::error::DecodeError;

/// The checkpoint, every field checked, a record of the local node dropped.
pub(super) fn decode(d: &mut Dec<'_>) -> Result<Checkpoint, DecodeError> {
    let agent_version: &str = read(d)?;
    let written_at = read::<Time>(d)?.duration(|| "written_at".into())?;
    let local_node: &str = read(d)?;
    Ok(Checkpoint {
        agent_version: owned(d, agent_version)?,
        written_at,
        boot: None,
        local_node: owned(d, local_node)?,
        nodes: decode_list("nodes", local_node, d)?.into(),
        pending_deletes: decode_list("pending_deletes", local_node, d)?,
        ids: decode_freed(d)?,
        removals: Vec::new(),
        ipsec_keys: Vec::new(),
        orphans_held: None,
    })
}

//! Format version 1: read only. Written by node-agent 0.1.0; `tests/fixtures/checkpoint-v1.bin`
//! pins it. A version-1 checkpoint has no brake window and no IPsec key memory: they start
//! empty, which only makes the brake and a key rotation start afresh.

use serde::Deserialize;

use super::{Freed, Pending, Record, Time, decode_freed, decode_lists};
use crate::checkpoint::Checkpoint;
use crate::checkpoint::format::DecodeError;

/// The whole payload of version 1.
#[derive(Debug, PartialEq, Eq, Deserialize)]
pub(in crate::checkpoint) struct PayloadV1<'a> {
    agent_version: &'a str,
    written_at: Time,
    local_node: &'a str,
    #[serde(borrow)]
    nodes: Vec<Record<'a>>,
    #[serde(borrow)]
    pending_deletes: Vec<Pending<'a>>,
    freed: Vec<Freed>,
}

impl PayloadV1<'_> {
    /// The checkpoint, every field checked, a record of the local node dropped.
    pub(super) fn into_checkpoint(self) -> Result<Checkpoint, DecodeError> {
        let (nodes, pending_deletes) =
            decode_lists(&self.nodes, &self.pending_deletes, self.local_node)?;
        Ok(Checkpoint {
            agent_version: self.agent_version.to_owned(),
            written_at: self.written_at.duration(|| "written_at".into())?,
            local_node: self.local_node.to_owned(),
            nodes,
            pending_deletes,
            ids: decode_freed(&self.freed)?,
            removals: Vec::new(),
            ipsec_keys: Vec::new(),
        })
    }
}

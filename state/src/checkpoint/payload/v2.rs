//! Format version 2, the one written now: version 1 plus the brake's window (removals carried
//! out recently) and the IPsec keys seen, with when each was first seen.

use serde::{Deserialize, Serialize};

use super::{
    Freed, Pending, Record, Time, decode_freed, decode_lists, encode_freed, encode_lists, invalid,
};
use crate::checkpoint::format::DecodeError;
use crate::checkpoint::{Checkpoint, KeySeen, RecentRemovals};

/// The whole payload of version 2.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(in crate::checkpoint) struct PayloadV2<'a> {
    pub(super) agent_version: &'a str,
    pub(super) written_at: Time,
    pub(super) local_node: &'a str,
    /// The live records, local node excluded.
    #[serde(borrow)]
    pub(super) nodes: Vec<Record<'a>>,
    /// Pending deletes, local node excluded; names are coded against the previous pending one.
    #[serde(borrow)]
    pub(super) pending_deletes: Vec<Pending<'a>>,
    pub(super) freed: Vec<Freed>,
    pub(super) removals: Vec<Removals>,
    pub(super) ipsec_keys: Vec<Key>,
}

/// Removals the brake let through at one time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Removals {
    pub(super) at: Time,
    pub(super) nodes: u32,
    pub(super) objects: u32,
}

/// An IPsec key seen: its SPI (1..=15) and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Key {
    pub(super) spi: u8,
    pub(super) first_seen: Time,
}

impl<'a> PayloadV2<'a> {
    /// The wire form of `cp`, borrowing its strings, without the local node's record.
    pub(super) fn from_checkpoint(cp: &'a Checkpoint) -> Self {
        let (nodes, pending_deletes) = encode_lists(cp);
        Self {
            agent_version: &cp.agent_version,
            written_at: cp.written_at.into(),
            local_node: &cp.local_node,
            nodes,
            pending_deletes,
            freed: encode_freed(&cp.ids),
            removals: cp
                .removals
                .iter()
                .map(|r| Removals {
                    at: r.at.into(),
                    nodes: r.nodes,
                    objects: r.objects,
                })
                .collect(),
            ipsec_keys: cp
                .ipsec_keys
                .iter()
                .map(|k| Key {
                    spi: k.spi,
                    first_seen: k.first_seen.into(),
                })
                .collect(),
        }
    }

    /// The checkpoint, every field checked, a record of the local node dropped.
    pub(super) fn into_checkpoint(self) -> Result<Checkpoint, DecodeError> {
        let (nodes, pending_deletes) =
            decode_lists(&self.nodes, &self.pending_deletes, self.local_node)?;
        let mut removals = Vec::with_capacity(self.removals.len());
        for (i, r) in self.removals.iter().enumerate() {
            removals.push(RecentRemovals {
                at: r.at.duration(|| format!("removals[{i}].at"))?,
                nodes: r.nodes,
                objects: r.objects,
            });
        }
        let mut ipsec_keys = Vec::with_capacity(self.ipsec_keys.len());
        for (i, k) in self.ipsec_keys.iter().enumerate() {
            if !(1..=15).contains(&k.spi) {
                return Err(invalid(format!("ipsec_keys[{i}].spi"), "an SPI is 1 to 15").into());
            }
            ipsec_keys.push(KeySeen {
                spi: k.spi,
                first_seen: k
                    .first_seen
                    .duration(|| format!("ipsec_keys[{i}].first_seen"))?,
            });
        }
        Ok(Checkpoint {
            agent_version: self.agent_version.to_owned(),
            written_at: self.written_at.duration(|| "written_at".into())?,
            local_node: self.local_node.to_owned(),
            nodes,
            pending_deletes,
            ids: decode_freed(&self.freed)?,
            removals,
            ipsec_keys,
        })
    }
}

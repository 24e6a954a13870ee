//! Step 1: the agent's record of remote nodes, one per name.
//!
//! The record is the checkpoint's live nodes and pending deletes. In a running daemon it is the
//! checkpoint the last reconcile implied, so it is also "the live view before this change": what
//! makes a node the incumbent of its addresses (invariant 14) and what a restart diffs against
//! (invariant 4).

use super::nodes::Record;
use crate::checkpoint::Checkpoint;

/// The records in name order, one per node (by name and UID: a live record before a pending
/// delete of the same node; a node replaced under its name has two records, the new node's and
/// the old one's pending delete), the local node excluded.
pub(super) fn collect<'a>(cp: Option<&'a Checkpoint>, local: &str) -> Vec<Record<'a>> {
    let Some(cp) = cp else {
        return Vec::new();
    };
    let mut records = Vec::with_capacity(cp.nodes.len() + cp.pending_deletes.len());
    let listed = cp.nodes.iter().map(|n| (n, 0, true));
    let pending = cp
        .pending_deletes
        .iter()
        .map(|p| (&p.node, p.attempts, false));
    records.extend(listed.chain(pending).filter(|(n, ..)| n.name != local).map(
        |(node, attempts, listed)| Record {
            node,
            attempts,
            listed,
            live: None,
        },
    ));
    // Stable, so the first record of a node stays first. Checkpoints are written in name order,
    // which makes this one linear pass in the common case.
    records.sort_by(|a, b| a.node.name.cmp(&b.node.name));
    let mut out: Vec<Record<'a>> = Vec::with_capacity(records.len());
    for r in records {
        let run = out.iter().rev().take_while(|o| o.node.name == r.node.name);
        if !run.clone().any(|o| o.node.uid == r.node.uid) {
            out.push(r);
        }
    }
    out
}

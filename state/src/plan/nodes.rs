//! The planner's two views of a remote node: the agent's record of it ([`Record`], step 1) and
//! the live node with what the plan makes of it ([`Live`], step 2). Every later step reads both.

use crate::checkpoint::PendingDelete;
use crate::node::Node;
use crate::objects::NodeId;

/// One remote node the agent knows.
pub(super) struct Record<'a> {
    pub node: &'a Node,
    /// From its pending delete: cleanups tried and failed so far; 0 for a record of the
    /// checkpoint's live list, or a removal the brake held and never released.
    pub attempts: u32,
    /// From the checkpoint's live list rather than its pending deletes: before sync, an unseen
    /// record is carried over as it came.
    pub listed: bool,
    /// The live node that is the same node (same name and, where both have one, same UID).
    pub live: Option<usize>,
}

impl Record<'_> {
    pub fn pending(&self) -> PendingDelete {
        PendingDelete {
            node: self.node.clone(),
            attempts: self.attempts,
            held: None,
        }
    }

    /// A removal the brake let through before, whose cleanup failed: retried without being
    /// counted again.
    pub fn released_before(&self) -> bool {
        self.attempts > 0
    }
}

/// Why a live node is held: it keeps whatever it had and gets nothing new.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HeldWhy {
    /// No addresses yet (invariant 8).
    Registering,
    /// Its latest record does not validate; the agent's record stands in (invariant 8).
    Malformed,
    /// It claims what another node keeps (invariant 14).
    Conflict,
    /// Its new map entries do not fit (invariant 17).
    MapFull,
    /// No node ID is free.
    NoId,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LiveClass {
    /// Not decided yet: [`super::assign`] programs it or holds it.
    Candidate,
    Held(HeldWhy),
    Programmed(NodeId),
}

/// A live remote node.
pub(super) struct Live<'a> {
    /// Its record as the source has it; for a malformed node, the agent's record of it.
    pub node: &'a Node,
    /// Its record (index into the records), when the record is of the same node.
    pub record: Option<usize>,
    pub class: LiveClass,
}

impl Live<'_> {
    pub fn is_held(&self) -> bool {
        matches!(self.class, LiveClass::Held(_))
    }
}

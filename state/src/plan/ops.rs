//! What a plan asks of the kernel: the objects to delete (with their reasons), to create or
//! replace, and the node IDs handed out.

use std::fmt;
use std::time::Duration;

use crate::objects::{KernelObject, NodeId, Op};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeleteReason {
    /// The node is in the record but no longer live (deleted, or replaced under its name).
    StaleNode,
    /// The node is live but its addresses or CIDRs changed since the record.
    ChangedWhileDown,
    /// Ours (marked) but belonging to no live node and no record.
    Orphan,
    /// A live node's object replaced by one with a different identity (new node ID or SPI).
    Superseded,
    /// One of the agent's own objects for a feature that is off now (the IPsec guards).
    Disabled,
}

impl DeleteReason {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::StaleNode => "stale node",
            Self::ChangedWhileDown => "changed while down",
            Self::Orphan => "orphan",
            Self::Superseded => "superseded",
            Self::Disabled => "disabled",
        }
    }
}

impl fmt::Display for DeleteReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delete {
    pub object: KernelObject,
    pub reason: DeleteReason,
    /// The node the object was reached through; `None` for orphans.
    pub node: Option<String>,
}

/// The owner named for objects that belong to no node (the IPsec guards). Node names cannot
/// contain parentheses, so it never collides with one.
pub const AGENT_OWNED: &str = "(agent)";

/// The owner named for objects of ours that belong to no node or record (orphans).
pub const ORPHANS: &str = "(orphan)";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upsert {
    pub object: KernelObject,
    pub node: String,
    /// An object of ours with this identity exists with other content: replace it. Otherwise
    /// nothing has the identity and the object is created exclusively.
    pub update: bool,
}

impl Upsert {
    pub fn op(&self) -> Op {
        if self.update {
            Op::Replace(self.object.clone())
        } else {
            Op::Create(self.object.clone())
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub node: String,
    pub id: NodeId,
    /// When the ID was freed, if it had been used before (worth a warning: every never-used ID
    /// is taken).
    pub reused_after: Option<Duration>,
    /// Reused before its cool-down had passed, past the floor.
    pub early: bool,
}

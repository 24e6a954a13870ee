//! Writing and deleting policies: a node's OUT policies and the guards.
//!
//! A new policy is created exclusively (`XFRM_MSG_NEWPOLICY`): if something appeared at its
//! selector, direction and mark since the dump, the kernel refuses and nothing is replaced. One
//! of ours that changed is replaced in place (`XFRM_MSG_UPDPOLICY`, which keeps the kernel's
//! index). Deletes name the selector, direction and mark, which the kernel matches exactly
//! (value and mask, since Linux 5.10), so only ours can go.

use netlink_packet_xfrm::{XfrmMessage, policy};
use state::objects::{Op, XfrmPolicy};

use super::Ctx;
use super::message::{del_policy_message, policy_mark, policy_message};
use crate::kernel::OpError;

impl Ctx {
    /// The request that creates, replaces or deletes `p`.
    pub(super) fn policy_request(&self, op: &Op, p: &XfrmPolicy) -> Result<XfrmMessage, OpError> {
        let msg = policy_message(p).map_err(|source| OpError::Kernel {
            what: format!("{} {}", op.verb(), describe(p)),
            source,
        })?;
        Ok(policy_request(op, msg))
    }
}

/// The request `op` makes of a policy or guard message.
pub(super) fn policy_request(op: &Op, msg: policy::ModifyMessage) -> XfrmMessage {
    match op {
        Op::Create(_) => XfrmMessage::AddPolicy(msg),
        Op::Replace(_) => XfrmMessage::UpdatePolicy(msg),
        Op::Delete(_) => del_policy_message(&msg),
    }
}

pub(super) fn describe(p: &XfrmPolicy) -> String {
    format!(
        "xfrm policy {} -> {} dir {:?} mark {:#x} (node {}, tmpl {} -> {} spi {})",
        p.src,
        p.dst,
        p.dir,
        policy_mark(p).value,
        p.node_id,
        p.tmpl_src,
        p.tmpl_dst,
        p.spi
    )
}

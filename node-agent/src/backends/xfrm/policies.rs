//! Writing and deleting policies: a node's OUT policies and the guards.
//!
//! A new policy is created exclusively (`XFRM_MSG_NEWPOLICY`): if something appeared at its
//! selector, direction and mark since the dump, the kernel refuses and nothing is replaced. One
//! of ours that changed is replaced in place (`XFRM_MSG_UPDPOLICY`, which keeps the kernel's
//! index). Deletes name the selector, direction and mark, which the kernel matches exactly
//! (value and mask, since Linux 5.10), so only ours can go.

use netlink_packet_xfrm::{XfrmMessage, policy};
use state::objects::{Op, XfrmGuard, XfrmPolicy};

use super::Ctx;
use super::message::{del_policy_message, guard_message, policy_mark, policy_message};
use crate::backends::netlink::outcome;
use crate::kernel::OpError;

impl Ctx {
    pub(super) async fn apply_policy(&self, op: &Op, p: &XfrmPolicy) -> Result<(), OpError> {
        let what = || describe(p);
        let msg = policy_message(p).map_err(|source| OpError::Kernel {
            what: format!("{} {}", op.verb(), what()),
            source,
        })?;
        self.apply_policy_message(op, msg, what).await
    }

    pub(super) async fn apply_guard(&self, op: &Op, g: &XfrmGuard) -> Result<(), OpError> {
        let what = || op.object().to_string();
        self.apply_policy_message(op, guard_message(g), what).await
    }

    async fn apply_policy_message(
        &self,
        op: &Op,
        msg: policy::ModifyMessage,
        what: impl FnOnce() -> String,
    ) -> Result<(), OpError> {
        let request = match op {
            Op::Create(_) => XfrmMessage::AddPolicy(msg),
            Op::Replace(_) => XfrmMessage::UpdatePolicy(msg),
            Op::Delete(_) => del_policy_message(&msg),
        };
        outcome(op, self.write(request).await, what)
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

//! Writing and deleting states. A state is keyed by destination, SPI, protocol and mark; the
//! kernel's lookup matches a request mark `m` against a state with `(m & state.mask) ==
//! state.value`, so an *unmarked* foreign state at the same destination and SPI would match our
//! requests too. Every write that finds something there and every delete therefore reads the
//! state back (`GETSA`) and acts only on one that carries exactly our mark; a foreign state is
//! reported as a conflict and left alone.

use std::io;

use netlink_packet_xfrm::{Address, IPPROTO_ESP, Mark, XfrmMessage, state as sa};
use state::objects::XfrmState;

use super::message::{del_state_message, get_state_message, state_mark, state_message};
use super::parse::{find_aead, find_mark};
use super::{Ctx, Next};
use crate::backends::netlink::KernelError;
use crate::backends::netlink::batch::Answer;
use crate::backends::netlink::request::request;
use crate::kernel::OpError;

impl Ctx {
    /// The add (`XFRM_MSG_NEWSA`) that creates `s` where nothing has its identity.
    pub(super) fn add_state_request(&self, s: &XfrmState) -> Result<XfrmMessage, OpError> {
        self.state_message(s).map(XfrmMessage::AddSa)
    }

    fn state_message(&self, s: &XfrmState) -> Result<sa::ModifyMessage, OpError> {
        let what = || format!("adding {}", describe(s));
        let key = self
            .keys
            .state_key(s.spi.key(), s.key)
            .map_err(|why| invalid(what(), why))?;
        state_message(s, &key).map_err(|source| OpError::Kernel {
            what: what(),
            source,
        })
    }

    /// After the read a delete of `s` opens with: nothing there, or ours from another source
    /// (the node's new address, added first, has the identity now) -> done; foreign -> refused;
    /// ours -> delete it.
    pub(super) fn after_read(&self, s: &XfrmState, answer: Answer<XfrmMessage>) -> Next {
        let what = || format!("deleting {}", describe(s));
        let found = match found_state(answer) {
            Ok(found) => found,
            Err(e) => return Next::Done(Err(e.into_op(what()))),
        };
        match found {
            None => Next::Done(Ok(())),
            Some(found) if !carries_our_mark(&found, s) => {
                Next::Done(Err(foreign_conflict(what(), s, &found)))
            }
            Some(found) if found.user_sa_info.saddr != Address::from_ip(&s.src) => {
                Next::Done(Ok(()))
            }
            Some(_) => Next::Delete,
        }
    }

    /// An add of `s` found a state at its identity: identical -> nothing to do; ours but
    /// different (source, reqid, algorithm, key) -> delete and re-add, because
    /// `XFRM_MSG_UPDSA` does not replace the algorithms or key of a valid state; foreign ->
    /// error. So re-applying the same upserts writes nothing.
    pub(super) async fn upsert_found(&self, s: &XfrmState) -> Result<(), OpError> {
        let what = || format!("adding {}", describe(s));
        let msg = self.state_message(s)?;
        let found = self.get_state(s).await.map_err(|e| e.into_op(what()))?;
        match found {
            Some(found) if !carries_our_mark(&found, s) => Err(foreign_conflict(what(), s, &found)),
            Some(found) if same_state(&found, &msg) => Ok(()),
            _ => {
                tracing::info!(
                    state = %describe(s),
                    "replacing an xfrm state of ours whose source, reqid or algorithm/key differs"
                );
                match self.write(del_state_message(s)).await {
                    Err(e) if e.errno() != Some(libc::ESRCH) => {
                        return Err(e.into_op(what()));
                    }
                    _ => {}
                }
                self.write(XfrmMessage::AddSa(msg))
                    .await
                    .map_err(|e| e.into_op(what()))
            }
        }
    }

    /// The state the kernel resolves for `s`'s daddr/SPI/proto and our mark, if any.
    async fn get_state(&self, s: &XfrmState) -> Result<Option<sa::ModifyMessage>, KernelError> {
        found_state(request(&self.handle, get_state_message(s), 0).await)
    }
}

/// The state a read (`GETSA`) answered with, if any.
fn found_state(answer: Answer<XfrmMessage>) -> Result<Option<sa::ModifyMessage>, KernelError> {
    match answer {
        Ok(msgs) => Ok(msgs.into_iter().find_map(|m| match m {
            XfrmMessage::AddSa(m) | XfrmMessage::UpdateSa(m) => Some(m),
            _ => None,
        })),
        Err(e) if matches!(e.errno(), Some(libc::ESRCH | libc::ENOENT)) => Ok(None),
        Err(e) => Err(e),
    }
}

pub(super) fn describe(s: &XfrmState) -> String {
    format!(
        "xfrm state {} -> {} spi {} dir {:?} mark {:#x} (node {}, key {})",
        s.src,
        s.dst,
        s.spi,
        s.dir,
        state_mark(s).value,
        s.node_id,
        s.key
    )
}

fn invalid(what: String, why: String) -> OpError {
    OpError::Kernel {
        what,
        source: io::Error::new(io::ErrorKind::InvalidInput, why),
    }
}

fn foreign_conflict(what: String, s: &XfrmState, found: &sa::ModifyMessage) -> OpError {
    let m = find_mark(&found.nlas).unwrap_or(Mark { value: 0, mask: 0 });
    OpError::Kernel {
        what: format!(
            "{what}: the kernel resolves dst {} spi {} to a state that is not ours (mark {:#x}/{:#x}); \
             leaving it alone",
            s.dst, s.spi, m.value, m.mask
        ),
        source: io::Error::from_raw_os_error(libc::EEXIST),
    }
}

fn carries_our_mark(found: &sa::ModifyMessage, s: &XfrmState) -> bool {
    find_mark(&found.nlas) == Some(state_mark(s)) && found.user_sa_info.id.proto == IPPROTO_ESP
}

/// Whether the kernel's state is what `want` would create (source, mode, reqid, AEAD and key).
fn same_state(found: &sa::ModifyMessage, want: &sa::ModifyMessage) -> bool {
    let (f, w) = (&found.user_sa_info, &want.user_sa_info);
    let aead_eq = match (find_aead(&found.nlas), find_aead(&want.nlas)) {
        (Some(a), Some(b)) => {
            a.alg_name == b.alg_name
                && a.alg_icv_len == b.alg_icv_len
                && a.alg_key_len == b.alg_key_len
                && a.alg_key.get(..b.alg_key.len()) == Some(&b.alg_key[..])
        }
        _ => false,
    };
    f.saddr == w.saddr && f.family == w.family && f.mode == w.mode && f.reqid == w.reqid && aead_eq
}

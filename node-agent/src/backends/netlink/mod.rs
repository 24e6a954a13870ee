//! The netlink transport the backends of routes, nexthops and xfrm objects share, apart from
//! those object kinds: [`batch`] many rtnetlink requests to a system call, [`request`] one
//! request over a connection whose codec never logs, and here what the kernel's answers mean
//! for an operation: one error type carrying the errno and the kernel's own words, and one
//! mapping from an answer to the operation's outcome.

pub mod batch;
pub mod request;

use std::fmt;
use std::io;

use netlink_packet_core::{NLM_F_ACK_TLVS, NLM_F_CAPPED, NlasIterator};
use state::objects::Op;

use crate::kernel::OpError;

/// An error the kernel (or the netlink connection) returned for one request, with the
/// kernel's extended-ack message when it gave one.
#[derive(Debug)]
pub struct KernelError {
    pub source: io::Error,
    /// The kernel's own words (`NLMSGERR_ATTR_MSG`), e.g. "Requested type not found".
    pub message: Option<String>,
}

impl KernelError {
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }

    /// The connection itself failed (closed, not the kernel's answer).
    pub fn connection(e: impl fmt::Display) -> Self {
        Self {
            source: io::Error::other(format!("netlink connection closed: {e}")),
            message: None,
        }
    }

    /// As an operation's error: `what` was being done, and the kernel's words if any.
    pub fn into_op(self, what: String) -> OpError {
        OpError::Kernel {
            what: match self.message {
                Some(m) => format!("{what} (kernel: {m})"),
                None => what,
            },
            source: self.source,
        }
    }

    /// As an `io::Error` that keeps the errno and carries the kernel's words.
    pub fn into_io(self) -> io::Error {
        match self.message {
            Some(m) => io::Error::new(self.source.kind(), format!("{m}: {}", self.source)),
            None => self.source,
        }
    }
}

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.message {
            Some(m) => write!(f, "{m} ({})", self.source),
            None => write!(f, "{}", self.source),
        }
    }
}

impl std::error::Error for KernelError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// The main routing table (`RT_TABLE_MAIN`): where the host's own routes are, and ours unless
/// `--route-table` says otherwise.
pub const MAIN_TABLE: u32 = 254;

/// The outcome of one operation from the kernel's answer, the same for every netlink backend:
/// deleting what is already gone is done (`ENOENT`, `ESRCH`); an exclusive create that finds
/// something at the identity is [`OpError::Occupied`] (it appeared since the dump and is left
/// alone, invariant 6); anything else is the kernel's error, saying what was being done.
pub fn outcome(
    op: &Op,
    answer: Result<(), KernelError>,
    what: impl FnOnce() -> String,
) -> Result<(), OpError> {
    let Err(e) = answer else {
        return Ok(());
    };
    match (op, e.errno()) {
        (Op::Delete(_), Some(libc::ENOENT | libc::ESRCH)) => Ok(()),
        (Op::Create(o), Some(libc::EEXIST)) => Err(OpError::Occupied {
            what: o.to_string(),
        }),
        _ => Err(e.into_op(format!("{} {}", op.verb(), what()))),
    }
}

/// The `NLMSGERR_ATTR_MSG` of an error reply: after the echoed request (capped to its header
/// under `NETLINK_CAP_ACK`) come the extended-ack attributes.
pub fn ext_ack_message(flags: u16, payload: &[u8]) -> Option<String> {
    const NLMSGERR_ATTR_MSG: u16 = 1;
    if flags & NLM_F_ACK_TLVS == 0 {
        return None;
    }
    let echoed = if flags & NLM_F_CAPPED != 0 {
        16
    } else {
        u32::from_ne_bytes(payload.get(..4)?.try_into().ok()?) as usize
    };
    let tlvs = payload.get(echoed.next_multiple_of(4)..)?;
    for nla in NlasIterator::new(tlvs) {
        let nla = nla.ok()?;
        if nla.kind() & 0x3fff == NLMSGERR_ATTR_MSG {
            let v = nla.value();
            let v = v.strip_suffix(&[0]).unwrap_or(v);
            return Some(String::from_utf8_lossy(v).trim().to_owned());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use state::objects::{KernelObject, MapEntry, NodeId};

    #[test]
    fn ext_ack_message_is_read_after_a_capped_header() {
        let mut payload = vec![0u8; 16];
        let text = b"Requested type not found\0";
        let len = 4 + text.len();
        payload.extend_from_slice(&(len as u16).to_ne_bytes());
        payload.extend_from_slice(&1u16.to_ne_bytes());
        payload.extend_from_slice(text);
        payload.resize(payload.len().next_multiple_of(4), 0);
        assert_eq!(
            ext_ack_message(NLM_F_CAPPED | NLM_F_ACK_TLVS, &payload).as_deref(),
            Some("Requested type not found")
        );
        assert_eq!(ext_ack_message(NLM_F_CAPPED, &payload), None);
    }

    #[test]
    fn the_same_errno_means_what_the_operation_makes_it_mean() {
        let o = KernelObject::MapEntry(MapEntry {
            ip: "10.0.0.1".parse().unwrap(),
            node_id: NodeId::new(1).unwrap(),
            spi: 0,
        });
        let err = |errno| {
            Err(KernelError {
                source: io::Error::from_raw_os_error(errno),
                message: Some("words".into()),
            })
        };
        let what = || "it".to_string();
        assert!(outcome(&Op::Delete(o.clone()), err(libc::ENOENT), what).is_ok());
        assert!(outcome(&Op::Delete(o.clone()), err(libc::ESRCH), what).is_ok());
        assert!(matches!(
            outcome(&Op::Create(o.clone()), err(libc::EEXIST), what),
            Err(OpError::Occupied { .. })
        ));
        let e = outcome(&Op::Replace(o.clone()), err(libc::EEXIST), what).unwrap_err();
        assert_eq!(
            e.to_string(),
            "replace it (kernel: words): File exists (os error 17)"
        );
        assert!(outcome(&Op::Delete(o), err(libc::EPERM), what).is_err());
    }
}

//! Whether this kernel can create the ESP states IPsec needs, found out by creating one, and
//! whether it tells policies apart by their marks exactly, found out by trying to delete one.
//!
//! Kernels built without ESP (`CONFIG_INET_ESP`) accept policies but never a state, so IPsec
//! could never encrypt anything there: [`XfrmBackend::probe_esp`] tells at start-up, and the
//! agent refuses to start rather than run without the encryption the operator asked for.
//!
//! Kernels before Linux 5.10 (without that release's fix backported) match the mark of a
//! policy delete or update loosely, `(mark & policy's mask) == policy's value`, so a delete of
//! one of ours at a selector also matches someone else's unmarked policy there, and deletes it.
//! [`XfrmBackend::probe_policy_marks`] tries exactly that on a throwaway policy of its own, and
//! the agent refuses IPsec where it happens rather than risk anyone else's policies.

use std::net::{IpAddr, Ipv4Addr};

use netlink_packet_core::NLM_F_ACK;

use netlink_packet_xfrm::{
    Alg, IPPROTO_ESP, Mark, UserPolicyInfo, UserSaInfo, XFRM_MODE_TUNNEL, XFRM_POLICY_ALLOW,
    XFRM_POLICY_OUT, XfrmAttrs, XfrmMessage, policy, state as sa,
};

use super::XfrmBackend;
use super::keys::RFC4106_GCM_AES;
use super::message::{REQID, aead, del_policy_message, name, sa_id, set_selector};
use crate::backends::netlink::KernelError;
use crate::backends::netlink::request::request;

/// The throwaway state: TEST-NET-1 addresses (RFC 5737, never routed), an SPI no node uses, and
/// a mark whose direction bits (0xA) are not ours, so our dumps never list it, under a full mask
/// so it never matches traffic.
const PROBE_SRC: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
const PROBE_DST: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 254);
const PROBE_SPI: u32 = 0x4e41_5052;
const PROBE_PORT: u16 = 0x4e41;
const PROBE_MARK: Mark = Mark {
    value: 0x4e41_0a00,
    mask: u32::MAX,
};

/// Why [`XfrmBackend::probe_esp`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The kernel has no ESP at all: no xfrm state can be created, IPsec cannot work.
    #[error("this kernel has no ESP support (CONFIG_INET_ESP): {0}")]
    NoEsp(KernelError),
    /// ESP exists but the key's AEAD algorithm cannot be instantiated.
    #[error("this kernel has ESP but cannot use the AEAD algorithm {algorithm}: {source}")]
    NoAead {
        algorithm: String,
        source: KernelError,
    },
    #[error("probing ESP support: {0}")]
    Kernel(KernelError),
    /// A delete with our mark removed a policy without one: a cleanup of ours could remove
    /// someone else's policies.
    #[error(
        "this kernel matches xfrm policy marks loosely (Linux before 5.10, without its fix): a \
         delete of one of our policies would also delete someone else's unmarked policy at the \
         same selector, so IPsec is refused"
    )]
    LooseMarks,
    #[error("probing how xfrm policy marks are matched: {0}")]
    Marks(KernelError),
}

impl XfrmBackend {
    /// Whether this kernel can create ESP states with the newest key's algorithm (or
    /// `rfc4106(gcm(aes))` without keys): creates a throwaway state and deletes it.
    pub async fn probe_esp(&self) -> Result<(), ProbeError> {
        let (algorithm, key, icv) = match self.keys.newest() {
            Some(k) => (
                k.algorithm().to_owned(),
                k.key_bytes().to_vec(),
                k.icv_bits(),
            ),
            None => (RFC4106_GCM_AES.to_owned(), vec![0; 20], 128),
        };
        let aead = XfrmAttrs::EncryptionAlgAead(aead(&algorithm, &key, icv));
        match self.probe_with(aead).await {
            Ok(()) => Ok(()),
            Err(e) if e.errno() == Some(libc::EPROTONOSUPPORT) => Err(ProbeError::NoEsp(e)),
            Err(first) => {
                // Is it the algorithm or ESP itself? A null cipher needs no crypto module.
                let null = XfrmAttrs::EncryptionAlg(Alg {
                    alg_name: name::<64>("ecb(cipher_null)"),
                    alg_key_len: 0,
                    alg_key: Vec::new(),
                });
                match self.probe_with(null).await {
                    Ok(()) => Err(ProbeError::NoAead {
                        algorithm,
                        source: first,
                    }),
                    Err(e) if e.errno() == Some(libc::EPROTONOSUPPORT) => Err(ProbeError::NoEsp(e)),
                    Err(_) => Err(ProbeError::Kernel(first)),
                }
            }
        }
    }

    /// Whether a policy delete carrying our mark leaves an unmarked policy at its selector
    /// alone: adds an unmarked throwaway policy, deletes with a mark, then removes it.
    pub async fn probe_policy_marks(&self) -> Result<(), ProbeError> {
        let mut info = UserPolicyInfo::default();
        set_selector(
            &mut info,
            IpAddr::V4(PROBE_SRC).into(),
            IpAddr::V4(PROBE_DST).into(),
        );
        // UDP from and to port 0x4e41 between TEST-NET addresses: a selector no one else's
        // policy has, so one found there is a probe's that died half-way.
        info.selector.proto = libc::IPPROTO_UDP as u8;
        info.selector.sport = PROBE_PORT.to_be();
        info.selector.dport = PROBE_PORT.to_be();
        info.selector.sport_mask = u16::MAX;
        info.selector.dport_mask = u16::MAX;
        info.direction = XFRM_POLICY_OUT;
        info.action = XFRM_POLICY_ALLOW;
        let unmarked = policy::ModifyMessage {
            user_policy_info: info,
            nlas: Vec::new(),
        };
        let marked = policy::ModifyMessage {
            user_policy_info: info,
            nlas: vec![XfrmAttrs::Mark(PROBE_MARK)],
        };
        let add = XfrmMessage::AddPolicy(unmarked.clone());
        let mut added = request(&self.handle, add.clone(), NLM_F_ACK).await;
        if matches!(&added, Err(e) if e.errno() == Some(libc::EEXIST)) {
            // Left over by a probe that died half-way: remove it and try again.
            let _ = request(&self.handle, del_policy_message(&unmarked), NLM_F_ACK).await;
            added = request(&self.handle, add, NLM_F_ACK).await;
        }
        added.map_err(ProbeError::Marks)?;
        let verdict = marks_verdict(
            request(&self.handle, del_policy_message(&marked), NLM_F_ACK)
                .await
                .map(drop),
        );
        if matches!(verdict, Err(ProbeError::LooseMarks)) {
            // The marked delete took it.
            return verdict;
        }
        // Whatever the answer, the probe's policy goes.
        match request(&self.handle, del_policy_message(&unmarked), NLM_F_ACK).await {
            Err(e) if e.errno() != Some(libc::ENOENT) && verdict.is_ok() => {
                Err(ProbeError::Marks(e))
            }
            _ => verdict,
        }
    }

    async fn probe_with(&self, alg: XfrmAttrs) -> Result<(), KernelError> {
        let mut info = UserSaInfo::default();
        info.source(&IpAddr::V4(PROBE_SRC));
        info.destination(&IpAddr::V4(PROBE_DST));
        info.selector.family = info.family;
        info.id.spi = PROBE_SPI;
        info.id.proto = IPPROTO_ESP;
        info.mode = XFRM_MODE_TUNNEL;
        info.reqid = REQID;
        let add = XfrmMessage::AddSa(sa::ModifyMessage {
            user_sa_info: info,
            nlas: vec![alg, XfrmAttrs::Mark(PROBE_MARK)],
        });
        let del = || {
            XfrmMessage::DeleteSa(sa::DelGetMessage {
                user_sa_id: sa_id(IpAddr::V4(PROBE_DST), PROBE_SPI),
                nlas: vec![XfrmAttrs::Mark(PROBE_MARK)],
            })
        };
        let mut result = request(&self.handle, add.clone(), NLM_F_ACK).await;
        if matches!(&result, Err(e) if e.errno() == Some(libc::EEXIST)) {
            // Left over by a probe that died half-way: remove it and try again.
            let _ = request(&self.handle, del(), NLM_F_ACK).await;
            result = request(&self.handle, add, NLM_F_ACK).await;
        }
        result?;
        request(&self.handle, del(), NLM_F_ACK).await.map(drop)
    }
}

/// What a delete carrying our mark did to the unmarked probe policy: not found is exact
/// matching; deleted is loose.
fn marks_verdict(deleted: Result<(), KernelError>) -> Result<(), ProbeError> {
    match deleted {
        Err(e) if e.errno() == Some(libc::ENOENT) => Ok(()),
        Ok(()) => Err(ProbeError::LooseMarks),
        Err(e) => Err(ProbeError::Marks(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marked_delete_that_finds_no_unmarked_policy_is_exact_and_one_that_deletes_it_is_not() {
        let enoent = KernelError {
            source: std::io::Error::from_raw_os_error(libc::ENOENT),
            message: None,
        };
        assert!(matches!(marks_verdict(Err(enoent)), Ok(())));
        assert!(matches!(marks_verdict(Ok(())), Err(ProbeError::LooseMarks)));
        let e = marks_verdict(Ok(())).unwrap_err().to_string();
        assert!(e.contains("IPsec is refused"), "{e}");
    }
}

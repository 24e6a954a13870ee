//! Whether this kernel can create the ESP states IPsec needs, found out by creating one.
//!
//! Kernels built without ESP (`CONFIG_INET_ESP`) accept policies but never a state, so IPsec
//! could never encrypt anything there: [`XfrmBackend::probe_esp`] tells at start-up, and the
//! agent refuses to start rather than run without the encryption the operator asked for.

use std::net::{IpAddr, Ipv4Addr};

use netlink_packet_core::NLM_F_ACK;

use netlink_packet_xfrm::{
    Alg, IPPROTO_ESP, Mark, UserSaInfo, XFRM_MODE_TUNNEL, XfrmAttrs, XfrmMessage, state as sa,
};

use super::XfrmBackend;
use super::keys::RFC4106_GCM_AES;
use super::message::{REQID, aead, name, sa_id};
use crate::backends::netlink::KernelError;
use crate::backends::request::request;

/// The throwaway state: TEST-NET-1 addresses (RFC 5737, never routed), an SPI no node uses, and
/// a mark whose direction bits (0xA) are not ours, so our dumps never list it, under a full mask
/// so it never matches traffic.
const PROBE_SRC: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
const PROBE_DST: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 254);
const PROBE_SPI: u32 = 0x4e41_5052;
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

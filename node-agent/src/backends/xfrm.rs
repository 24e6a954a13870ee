//! The xfrm backend: ESP tunnel-mode states and OUT policies toward every remote node.
//!
//! # What it creates
//!
//! Per remote node and address family:
//! - an **OUT state** `local -> remote` and an **IN state** `remote -> local`: ESP, tunnel mode,
//!   reqid [`REQID`], AEAD from the [`IpsecKey`], kernel SPI = the key's SPI number (1..=15, the
//!   same number as the SPI bits of the mark; SPIs below 256 are "reserved" by RFC 4303 but the
//!   kernel accepts them, and Cilium uses them the same way), mark
//!   `mark::encode(node, spi, dir)` / [`mark::MASK`];
//! - an **OUT policy** per remote pod CIDR: selector `0.0.0.0/0` (or `::/0`) -> CIDR, mark
//!   `mark::encode(node, spi, Out)` / [`mark::MASK`], one template: ESP tunnel
//!   `tmpl_src -> tmpl_dst`, reqid [`REQID`], SPI.
//!
//! # Ownership
//!
//! The mark is the only thing that makes an xfrm object ours (docs/design.md, invariant 6). Dumps
//! cannot be filtered by mark in the kernel, so [`XfrmBackend::dump`] reads the whole SAD and SPD
//! and keeps only objects whose mark value decodes with [`mark::decode`] (our direction bits,
//! node ID != 0) under exactly our mask [`mark::MASK`]. Nothing else is ever listed, so nothing
//! else can reach a delete.
//!
//! Deletes name the exact kernel identity *and* our mark:
//! - a policy by selector + direction + mark (the kernel matches policy marks exactly, value and
//!   mask, since Linux 5.10);
//! - a state by daddr + SPI + proto + mark. The kernel's state lookup matches a request mark `m`
//!   against a state with `(m & state.mask) == state.value`, so an *unmarked* foreign state with
//!   the same daddr/SPI/proto would match too. Deletes therefore `GETSA` first and delete only if
//!   the state the kernel resolves carries exactly our mark and the expected source; a foreign
//!   state found there is reported as a conflict and left alone.
//!
//! # Writes
//!
//! - Policies: `XFRM_MSG_UPDPOLICY` (create or replace in place; the kernel keeps the index).
//! - States: `XFRM_MSG_NEWSA`; on `EEXIST` the state is read back (`GETSA`): identical -> no
//!   write; ours but different (source, reqid, algorithm, key) -> delete and re-add, because
//!   `XFRM_MSG_UPDSA` does not replace the algorithms or key of a valid state; foreign -> error.
//!   So re-applying the same upserts writes nothing ([`XfrmBackend::writes`] counts writes).
//!
//! Requests are pipelined ([`PIPELINE`] in flight) on one socket; ops that touch the same kernel
//! identity are never in flight together (the batch is cut into waves at a repeat), so the
//! planner's order (delete before an upsert reusing the identity) holds.
//!
//! # Netlink
//!
//! `netlink-packet-xfrm` messages over `netlink-proto` (the same stack as rtnetlink), not the
//! `xfrmnetlink` crate (unmaintained, brings a second netlink-proto, and its `output_mark(0, …)`
//! sends nothing). The connection uses its own codec, [`QuietCodec`]: netlink-proto's default
//! codec `trace!`s every message with `Debug`, and our state messages (and the kernel's dump and
//! `GETSA` answers) carry the key. The socket sets `NETLINK_CAP_ACK`, so the kernel's error
//! replies do not echo the request (and its key) back, and `NETLINK_EXT_ACK`, so errors carry
//! the kernel's own message (e.g. "Requested type not found"), which [`KernelError`] keeps.
//!
//! # Missing kernel support
//!
//! [`XfrmBackend::probe_esp`] creates and deletes a throwaway ESP state and returns
//! [`ProbeError::NoEsp`] ("this kernel has no ESP support (CONFIG_INET_ESP): …") on kernels
//! built without ESP, where no state can ever be created. Call it at start-up when IPsec is on.

use std::collections::HashSet;
use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{BufMut, BytesMut};
use futures::StreamExt;
use ipnet::IpNet;
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_ACK_TLVS, NLM_F_CAPPED, NLM_F_DUMP, NLM_F_REQUEST, NetlinkBuffer,
    NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable,
    NlasIterator,
};
use netlink_packet_xfrm::{
    Address, Alg, AlgAead, IPPROTO_ESP, Mark, UserPolicyId, UserPolicyInfo, UserSaId, UserSaInfo,
    UserTemplate, XFRM_MODE_TUNNEL, XFRM_POLICY_ALLOW, XFRM_POLICY_IN, XFRM_POLICY_OUT, XfrmAttrs,
    XfrmMessage, policy, state as sa,
};
use netlink_proto::sys::{AsyncSocket, SocketAddr, TokioSocket, protocols::NETLINK_XFRM};
use netlink_proto::{ConnectionHandle, NetlinkMessageCodec};
use state::inventory::Inventory;
use state::objects::{KernelObject, ObjectKind, Op, XfrmDir, XfrmPolicy, XfrmState, mark};

use super::{Backend, DumpError, OpError};
use crate::ipsec_key::IpsecKey;

/// The reqid of every state and policy template we create.
pub const REQID: u32 = 1;
/// Requests in flight on the netlink socket at once.
pub const PIPELINE: usize = 128;
/// Anti-replay window of our states, in packets.
const REPLAY_WINDOW: u8 = 32;

/// The throwaway state of [`XfrmBackend::probe_esp`]: TEST-NET-1 addresses (RFC 5737, never
/// routed), an SPI no node uses, and a mark whose direction bits (0xA) are not ours, so our dumps
/// never list it, under a full mask so it never matches traffic.
const PROBE_SRC: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
const PROBE_DST: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 254);
const PROBE_SPI: u32 = 0x4e41_5052;
const PROBE_MARK: Mark = Mark {
    value: 0x4e41_0a00,
    mask: u32::MAX,
};

/// The xfrm backend. Owns **both** [`ObjectKind::XfrmState`] and [`ObjectKind::XfrmPolicy`]
/// ([`XfrmBackend::kinds`]): `Backends::apply` must route ops of either kind here.
pub struct XfrmBackend {
    handle: ConnectionHandle<XfrmMessage>,
    key: Option<Arc<IpsecKey>>,
    writes: Arc<AtomicU64>,
}

impl XfrmBackend {
    /// Opens an xfrm netlink socket in the current network namespace; needs a tokio runtime.
    ///
    /// `key` is the active IPsec key: state upserts need it (and only states of its SPI can be
    /// created); policies, dumps and deletes do not. Replace it with [`Self::set_key`].
    pub fn new(key: Option<IpsecKey>) -> io::Result<Self> {
        let (mut conn, handle, _unsolicited) =
            netlink_proto::new_connection_with_codec::<XfrmMessage, TokioSocket, QuietCodec>(
                NETLINK_XFRM,
            )?;
        let socket = conn.socket_mut().socket_mut();
        socket.set_cap_ack(true)?;
        socket.set_ext_ack(true)?;
        tokio::spawn(conn);
        Ok(Self {
            handle,
            key: key.map(Arc::new),
            writes: Arc::new(AtomicU64::new(0)),
        })
    }

    /// The kinds this backend owns: both xfrm kinds.
    pub const fn kinds() -> [ObjectKind; 2] {
        [ObjectKind::XfrmState, ObjectKind::XfrmPolicy]
    }

    /// Replaces the active key (after a key file reload).
    pub fn set_key(&mut self, key: Option<IpsecKey>) {
        self.key = key.map(Arc::new);
    }

    pub fn key(&self) -> Option<&IpsecKey> {
        self.key.as_deref()
    }

    /// Kernel writes that succeeded so far (adds, replaces, deletes), for tests and metrics.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Whether this kernel can create ESP states with the active key's algorithm (or
    /// `rfc4106(gcm(aes))` without a key): creates a throwaway state and deletes it.
    pub async fn probe_esp(&self) -> Result<(), ProbeError> {
        let (algorithm, key, icv) = match &self.key {
            Some(k) => (
                k.algorithm().to_owned(),
                k.key_bytes().to_vec(),
                k.icv_bits(),
            ),
            None => (
                crate::ipsec_key::RFC4106_GCM_AES.to_owned(),
                vec![0; 20],
                128,
            ),
        };
        let aead = XfrmAttrs::EncryptionAlgAead(aead(&algorithm, &key, icv));
        match self.probe_with(aead.clone()).await {
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

    /// Our policies (mark decodes as ours under exactly our mask), as the kernel has them.
    pub async fn dump_policies(&self) -> Result<Vec<XfrmPolicy>, DumpError> {
        let msgs = request(
            &self.handle,
            XfrmMessage::GetPolicy(policy::DelGetMessage::default()),
            NLM_F_DUMP,
        )
        .await
        .map_err(|e| dump_error(ObjectKind::XfrmPolicy, e))?;
        Ok(msgs
            .iter()
            .filter_map(|m| match m {
                XfrmMessage::AddPolicy(p) | XfrmMessage::UpdatePolicy(p) => parse_policy(p),
                _ => None,
            })
            .collect())
    }

    /// Our states (mark decodes as ours under exactly our mask), as the kernel has them.
    pub async fn dump_states(&self) -> Result<Vec<XfrmState>, DumpError> {
        let msgs = request(
            &self.handle,
            XfrmMessage::GetDumpSa(sa::GetDumpMessage::default()),
            NLM_F_DUMP,
        )
        .await
        .map_err(|e| dump_error(ObjectKind::XfrmState, e))?;
        Ok(msgs
            .iter()
            .filter_map(|m| match m {
                XfrmMessage::AddSa(s) | XfrmMessage::UpdateSa(s) => parse_state(s),
                _ => None,
            })
            .collect())
    }

    fn ctx(&self) -> Ctx {
        Ctx {
            handle: self.handle.clone(),
            key: self.key.clone(),
            writes: self.writes.clone(),
        }
    }
}

impl Backend for XfrmBackend {
    async fn dump_into(&mut self, inv: &mut Inventory) -> Result<(), DumpError> {
        for s in self.dump_states().await? {
            inv.insert(KernelObject::XfrmState(s));
        }
        for p in self.dump_policies().await? {
            inv.insert(KernelObject::XfrmPolicy(p));
        }
        Ok(())
    }

    async fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        let ctx = self.ctx();
        let mut results = Vec::with_capacity(ops.len());
        for wave in waves(ops) {
            let done: Vec<_> = futures::stream::iter(wave.iter().cloned())
                .map(|op| ctx.clone().apply_one(op))
                .buffered(PIPELINE)
                .collect()
                .await;
            results.extend(done);
        }
        results
    }
}

/// What the kernel keys an object by: ops on the same key must not be in flight together.
#[derive(PartialEq, Eq, Hash)]
enum KernelKey {
    State {
        dst: IpAddr,
        spi: u8,
        mark: u32,
    },
    Policy {
        src: IpNet,
        dst: IpNet,
        dir: XfrmDir,
        mark: u32,
    },
    Other,
}

fn kernel_key(op: &Op) -> KernelKey {
    match op.object() {
        KernelObject::XfrmState(s) => KernelKey::State {
            dst: s.dst,
            spi: s.spi,
            mark: mark::encode(s.node_id, s.spi, s.dir),
        },
        KernelObject::XfrmPolicy(p) => KernelKey::Policy {
            src: p.src,
            dst: p.dst,
            dir: p.dir,
            mark: mark::encode(p.node_id, p.spi, p.dir),
        },
        _ => KernelKey::Other,
    }
}

/// Cuts `ops` into consecutive runs in which no kernel identity appears twice.
fn waves(ops: &[Op]) -> Vec<&[Op]> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut start = 0;
    for (i, op) in ops.iter().enumerate() {
        let key = kernel_key(op);
        if key != KernelKey::Other && !seen.insert(key) {
            out.push(&ops[start..i]);
            start = i;
            seen.clear();
            seen.insert(kernel_key(op));
        }
    }
    if start < ops.len() {
        out.push(&ops[start..]);
    }
    out
}

/// What one in-flight op needs.
#[derive(Clone)]
struct Ctx {
    handle: ConnectionHandle<XfrmMessage>,
    key: Option<Arc<IpsecKey>>,
    writes: Arc<AtomicU64>,
}

impl Ctx {
    async fn apply_one(self, op: Op) -> Result<(), OpError> {
        match op {
            Op::Create(KernelObject::XfrmPolicy(p)) => self.upsert_policy(&p, false).await,
            Op::Replace(KernelObject::XfrmPolicy(p)) => self.upsert_policy(&p, true).await,
            Op::Delete(KernelObject::XfrmPolicy(p)) => self.delete_policy(&p).await,
            Op::Create(KernelObject::XfrmState(s)) | Op::Replace(KernelObject::XfrmState(s)) => {
                self.upsert_state(&s).await
            }
            Op::Delete(KernelObject::XfrmState(s)) => self.delete_state(&s).await,
            Op::Create(o) | Op::Replace(o) | Op::Delete(o) => {
                Err(OpError::Disabled { kind: o.kind() })
            }
        }
    }

    /// Sends one mutating request; counts it when the kernel accepted it.
    async fn write(&self, msg: XfrmMessage) -> Result<(), KernelError> {
        request(&self.handle, msg, NLM_F_ACK).await?;
        self.writes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Creates a policy exclusively (`XFRM_MSG_NEWPOLICY`), or replaces ours in place
    /// (`XFRM_MSG_UPDPOLICY`, which keeps the kernel's index).
    async fn upsert_policy(&self, p: &XfrmPolicy, replace: bool) -> Result<(), OpError> {
        let verb = if replace { "updating" } else { "adding" };
        let what = || format!("{verb} {}", describe_policy(p));
        let msg = policy_message(p).map_err(|source| OpError::Kernel {
            what: what(),
            source,
        })?;
        let msg = if replace {
            XfrmMessage::UpdatePolicy(msg)
        } else {
            XfrmMessage::AddPolicy(msg)
        };
        match self.write(msg).await {
            Err(e) if !replace && e.errno() == Some(libc::EEXIST) => Err(OpError::Occupied {
                what: describe_policy(p),
            }),
            other => other.map_err(|e| e.into_op(what())),
        }
    }

    async fn delete_policy(&self, p: &XfrmPolicy) -> Result<(), OpError> {
        let what = || format!("deleting {}", describe_policy(p));
        let msg = policy_message(p).map_err(|source| OpError::Kernel {
            what: what(),
            source,
        })?;
        let info = msg.user_policy_info;
        let del = XfrmMessage::DeletePolicy(policy::DelGetMessage {
            user_policy_id: UserPolicyId {
                selector: info.selector,
                index: 0,
                direction: info.direction,
            },
            nlas: vec![XfrmAttrs::Mark(policy_mark(p))],
        });
        match self.write(del).await {
            Err(e) if e.errno() == Some(libc::ENOENT) => Ok(()),
            other => other.map_err(|e| e.into_op(what())),
        }
    }

    async fn upsert_state(&self, s: &XfrmState) -> Result<(), OpError> {
        let what = || format!("adding {}", describe_state(s));
        let key = match &self.key {
            Some(k) if k.spi() == s.spi => k.clone(),
            Some(k) => {
                return Err(invalid(
                    what(),
                    format!("the active IPsec key has SPI {}, not {}", k.spi(), s.spi),
                ));
            }
            None => return Err(invalid(what(), "no IPsec key is configured".into())),
        };
        let msg = state_message(s, &key).map_err(|source| OpError::Kernel {
            what: what(),
            source,
        })?;
        match self.write(XfrmMessage::AddSa(msg.clone())).await {
            Ok(()) => return Ok(()),
            Err(e) if e.errno() == Some(libc::EEXIST) => {}
            Err(e) => return Err(e.into_op(what())),
        }
        // Something holds this daddr/SPI/mark already: ours and identical, ours and stale, or
        // a foreign unmarked state that our mark matches.
        let found = self.get_state(s).await.map_err(|e| e.into_op(what()))?;
        match found {
            Some(found) if !carries_our_mark(&found, s) => Err(foreign_conflict(what(), s, &found)),
            Some(found) if same_state(&found, &msg) => Ok(()),
            _ => {
                tracing::info!(
                    state = %describe_state(s),
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

    async fn delete_state(&self, s: &XfrmState) -> Result<(), OpError> {
        let what = || format!("deleting {}", describe_state(s));
        let Some(found) = self.get_state(s).await.map_err(|e| e.into_op(what()))? else {
            return Ok(());
        };
        if !carries_our_mark(&found, s) {
            return Err(foreign_conflict(what(), s, &found));
        }
        if found.user_sa_info.saddr != Address::from_ip(&s.src) {
            // Ours, same daddr/SPI/mark, but another source: a different object (the node's
            // new address, upserted first); the one to delete is already gone.
            return Ok(());
        }
        match self.write(del_state_message(s)).await {
            Err(e) if e.errno() == Some(libc::ESRCH) => Ok(()),
            other => other.map_err(|e| e.into_op(what())),
        }
    }

    /// The state the kernel resolves for `s`'s daddr/SPI/proto and our mark, if any.
    async fn get_state(&self, s: &XfrmState) -> Result<Option<sa::ModifyMessage>, KernelError> {
        let get = XfrmMessage::GetSa(sa::DelGetMessage {
            user_sa_id: sa_id(s.dst, u32::from(s.spi)),
            nlas: vec![XfrmAttrs::Mark(state_mark(s))],
        });
        match request(&self.handle, get, 0).await {
            Ok(msgs) => Ok(msgs.into_iter().find_map(|m| match m {
                XfrmMessage::AddSa(m) | XfrmMessage::UpdateSa(m) => Some(m),
                _ => None,
            })),
            Err(e) if matches!(e.errno(), Some(libc::ESRCH | libc::ENOENT)) => Ok(None),
            Err(e) => Err(e),
        }
    }
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

fn describe_policy(p: &XfrmPolicy) -> String {
    format!(
        "xfrm policy {} -> {} dir {:?} mark {:#x} (node {}, tmpl {} -> {} spi {})",
        p.src,
        p.dst,
        p.dir,
        mark::encode(p.node_id, p.spi, p.dir),
        p.node_id,
        p.tmpl_src,
        p.tmpl_dst,
        p.spi
    )
}

fn describe_state(s: &XfrmState) -> String {
    format!(
        "xfrm state {} -> {} spi {} dir {:?} mark {:#x} (node {})",
        s.src,
        s.dst,
        s.spi,
        s.dir,
        mark::encode(s.node_id, s.spi, s.dir),
        s.node_id
    )
}

fn policy_mark(p: &XfrmPolicy) -> Mark {
    Mark {
        value: mark::encode(p.node_id, p.spi, p.dir),
        mask: mark::MASK,
    }
}

fn state_mark(s: &XfrmState) -> Mark {
    Mark {
        value: mark::encode(s.node_id, s.spi, s.dir),
        mask: mark::MASK,
    }
}

fn family_mismatch(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{what} are of different address families"),
    )
}

fn policy_message(p: &XfrmPolicy) -> io::Result<policy::ModifyMessage> {
    if p.src.addr().is_ipv4() != p.dst.addr().is_ipv4() {
        return Err(family_mismatch("selector source and destination"));
    }
    if p.tmpl_src.is_ipv4() != p.tmpl_dst.is_ipv4() {
        return Err(family_mismatch("template source and destination"));
    }
    let mut info = UserPolicyInfo::default();
    info.selector.saddr = Address::from_ip(&p.src.network());
    info.selector.prefixlen_s = p.src.prefix_len();
    info.selector.daddr = Address::from_ip(&p.dst.network());
    info.selector.prefixlen_d = p.dst.prefix_len();
    info.selector.family = family(&p.dst.addr());
    info.direction = match p.dir {
        XfrmDir::Out => XFRM_POLICY_OUT,
        XfrmDir::In => XFRM_POLICY_IN,
    };
    info.action = XFRM_POLICY_ALLOW;
    let mut tmpl = UserTemplate::default();
    tmpl.source(&p.tmpl_src);
    tmpl.destination(&p.tmpl_dst);
    tmpl.protocol(IPPROTO_ESP);
    tmpl.mode(XFRM_MODE_TUNNEL);
    tmpl.reqid(REQID);
    tmpl.spi(u32::from(p.spi));
    Ok(policy::ModifyMessage {
        user_policy_info: info,
        nlas: vec![
            XfrmAttrs::Template(vec![tmpl]),
            XfrmAttrs::Mark(policy_mark(p)),
        ],
    })
}

fn state_message(s: &XfrmState, key: &IpsecKey) -> io::Result<sa::ModifyMessage> {
    if s.src.is_ipv4() != s.dst.is_ipv4() {
        return Err(family_mismatch("state source and destination"));
    }
    let mut info = UserSaInfo::default();
    info.source(&s.src);
    info.destination(&s.dst);
    info.selector.family = info.family;
    info.id.spi = u32::from(s.spi);
    info.id.proto = IPPROTO_ESP;
    info.mode = XFRM_MODE_TUNNEL;
    info.reqid = REQID;
    info.replay_window = REPLAY_WINDOW;
    Ok(sa::ModifyMessage {
        user_sa_info: info,
        nlas: vec![
            XfrmAttrs::EncryptionAlgAead(aead(key.algorithm(), key.key_bytes(), key.icv_bits())),
            XfrmAttrs::Mark(state_mark(s)),
        ],
    })
}

fn del_state_message(s: &XfrmState) -> XfrmMessage {
    XfrmMessage::DeleteSa(sa::DelGetMessage {
        user_sa_id: sa_id(s.dst, u32::from(s.spi)),
        nlas: vec![XfrmAttrs::Mark(state_mark(s))],
    })
}

fn sa_id(dst: IpAddr, spi: u32) -> UserSaId {
    UserSaId {
        daddr: Address::from_ip(&dst),
        spi,
        family: family(&dst),
        proto: IPPROTO_ESP,
    }
}

fn aead(algorithm: &str, key: &[u8], icv_bits: u32) -> AlgAead {
    AlgAead {
        alg_name: name::<64>(algorithm),
        alg_key_len: (key.len() * 8) as u32,
        alg_icv_len: icv_bits,
        alg_key: key.to_vec(),
    }
}

fn name<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0; N];
    let n = s.len().min(N - 1);
    out[..n].copy_from_slice(&s.as_bytes()[..n]);
    out
}

fn family(a: &IpAddr) -> u16 {
    match a {
        IpAddr::V4(_) => libc::AF_INET as u16,
        IpAddr::V6(_) => libc::AF_INET6 as u16,
    }
}

fn ip_of(a: &Address, family: u16) -> Option<IpAddr> {
    match i32::from(family) {
        libc::AF_INET => Some(IpAddr::V4(a.to_ipv4())),
        libc::AF_INET6 => Some(IpAddr::V6(a.to_ipv6())),
        _ => None,
    }
}

fn find_mark(nlas: &[XfrmAttrs]) -> Option<Mark> {
    nlas.iter().find_map(|a| match a {
        XfrmAttrs::Mark(m) => Some(*m),
        _ => None,
    })
}

/// The node, SPI and direction of a mark that is ours: decodes and has exactly our mask.
fn our_mark(nlas: &[XfrmAttrs]) -> Option<(state::objects::NodeId, u8, XfrmDir)> {
    let m = find_mark(nlas)?;
    if m.mask != mark::MASK {
        return None;
    }
    mark::decode(m.value)
}

fn carries_our_mark(found: &sa::ModifyMessage, s: &XfrmState) -> bool {
    find_mark(&found.nlas) == Some(state_mark(s)) && found.user_sa_info.id.proto == IPPROTO_ESP
}

fn find_aead(nlas: &[XfrmAttrs]) -> Option<&AlgAead> {
    nlas.iter().find_map(|a| match a {
        XfrmAttrs::EncryptionAlgAead(x) => Some(x),
        _ => None,
    })
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

fn parse_policy(m: &policy::ModifyMessage) -> Option<XfrmPolicy> {
    let (node_id, spi, dir) = our_mark(&m.nlas)?;
    let info = &m.user_policy_info;
    let policy_dir = match info.direction {
        XFRM_POLICY_OUT => XfrmDir::Out,
        XFRM_POLICY_IN => XfrmDir::In,
        _ => return None, // forward and socket policies are never ours
    };
    let sel = &info.selector;
    let src = IpNet::new(ip_of(&sel.saddr, sel.family)?, sel.prefixlen_s).ok()?;
    let dst = IpNet::new(ip_of(&sel.daddr, sel.family)?, sel.prefixlen_d).ok()?;
    if policy_dir != dir {
        tracing::warn!(%src, %dst, "xfrm policy with our mark but the other direction's bits; leaving it alone");
        return None;
    }
    let tmpl = m.nlas.iter().find_map(|a| match a {
        XfrmAttrs::Template(t) => t.first().copied(),
        _ => None,
    });
    // A policy of ours without a usable template still carries our mark: list it (with
    // unspecified endpoints) so the planner replaces or removes it.
    let unspecified = || match sel.family as i32 {
        libc::AF_INET6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    let (tmpl_src, tmpl_dst) = tmpl
        .and_then(|t| Some((ip_of(&t.saddr, t.family)?, ip_of(&t.id.daddr, t.family)?)))
        .unwrap_or_else(|| (unspecified(), unspecified()));
    Some(XfrmPolicy {
        src,
        dst,
        dir,
        node_id,
        tmpl_src,
        tmpl_dst,
        spi,
    })
}

fn parse_state(m: &sa::ModifyMessage) -> Option<XfrmState> {
    let (node_id, spi, dir) = our_mark(&m.nlas)?;
    let info = &m.user_sa_info;
    let src = ip_of(&info.saddr, info.family)?;
    let dst = ip_of(&info.id.daddr, info.family)?;
    if info.id.proto != IPPROTO_ESP || info.id.spi != u32::from(spi) {
        tracing::warn!(
            %src, %dst, kernel_spi = info.id.spi, mark_spi = spi, proto = info.id.proto,
            "xfrm state with our mark that node-agent never creates (SPI or protocol differs from the mark); leaving it alone"
        );
        return None;
    }
    Some(XfrmState {
        src,
        dst,
        spi,
        dir,
        node_id,
    })
}

fn dump_error(kind: ObjectKind, e: KernelError) -> DumpError {
    DumpError::Kernel {
        kind,
        source: match e.message {
            Some(m) => io::Error::new(e.source.kind(), format!("{m}: {}", e.source)),
            None => e.source,
        },
    }
}

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

    fn into_op(self, what: String) -> OpError {
        OpError::Kernel {
            what: match self.message {
                Some(m) => format!("{what} (kernel: {m})"),
                None => what,
            },
            source: self.source,
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

/// Sends one request and collects its answers; a NACK becomes a [`KernelError`].
async fn request(
    handle: &ConnectionHandle<XfrmMessage>,
    msg: XfrmMessage,
    flags: u16,
) -> Result<Vec<XfrmMessage>, KernelError> {
    let mut nl = NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::InnerMessage(msg));
    nl.header.flags = NLM_F_REQUEST | flags;
    nl.finalize();
    let mut answers = handle
        .request(nl, SocketAddr::new(0, 0))
        .map_err(|e| KernelError {
            source: io::Error::other(format!("netlink connection closed: {e}")),
            message: None,
        })?;
    let mut out = Vec::new();
    while let Some(answer) = answers.next().await {
        match answer.payload {
            NetlinkPayload::InnerMessage(m) => out.push(m),
            NetlinkPayload::Error(e) if e.code.is_some() => {
                return Err(KernelError {
                    source: e.to_io(),
                    message: ext_ack_message(answer.header.flags, &e.header),
                });
            }
            _ => {}
        }
    }
    Ok(out)
}

/// The `NLMSGERR_ATTR_MSG` of an error reply: after the echoed request (capped to its header
/// under `NETLINK_CAP_ACK`) come the extended-ack attributes.
fn ext_ack_message(flags: u16, payload: &[u8]) -> Option<String> {
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

/// netlink-proto's codec without its logging: the default codec `trace!`s every message it
/// encodes or decodes with `Debug`, which would print the key of our state messages and of the
/// kernel's answers. Otherwise the same framing.
pub struct QuietCodec;

impl NetlinkMessageCodec for QuietCodec {
    fn decode<T>(src: &mut BytesMut) -> io::Result<Option<NetlinkMessage<T>>>
    where
        T: NetlinkDeserializable + fmt::Debug,
    {
        loop {
            if src.is_empty() {
                return Ok(None);
            }
            let len = match NetlinkBuffer::new_checked(src.as_ref()) {
                Ok(buf) => buf.length() as usize,
                Err(_) => {
                    tracing::error!(
                        bytes = src.len(),
                        "truncated or malformed xfrm netlink datagram; dropped"
                    );
                    src.clear();
                    return Ok(None);
                }
            };
            let bytes = src.split_to(len);
            match NetlinkMessage::<T>::deserialize(&bytes) {
                Ok(packet) => return Ok(Some(packet)),
                Err(e) => {
                    // The error names what failed to parse, never the bytes.
                    tracing::error!(error = %e, "undecodable xfrm netlink message; skipped");
                }
            }
        }
    }

    fn encode<T>(msg: NetlinkMessage<T>, buf: &mut BytesMut) -> io::Result<()>
    where
        T: NetlinkSerializable + fmt::Debug,
    {
        let len = msg.buffer_len();
        if buf.remaining_mut() < len {
            return Err(io::Error::other(format!(
                "message is {len} bytes, but only {} bytes left in the buffer",
                buf.remaining_mut()
            )));
        }
        let old = buf.len();
        buf.resize(old + len, 0);
        msg.serialize(&mut buf[old..][..len]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use state::objects::NodeId;

    fn pol(node: u16, dst: &str) -> XfrmPolicy {
        XfrmPolicy {
            src: "0.0.0.0/0".parse().unwrap(),
            dst: dst.parse().unwrap(),
            dir: XfrmDir::Out,
            node_id: NodeId::new(node).unwrap(),
            tmpl_src: "10.0.0.1".parse().unwrap(),
            tmpl_dst: "10.0.0.2".parse().unwrap(),
            spi: 3,
        }
    }

    #[test]
    fn policy_message_round_trips_through_the_dump_parser() {
        let p = pol(7, "10.7.0.0/24");
        let m = policy_message(&p).unwrap();
        assert_eq!(parse_policy(&m), Some(p));
    }

    #[test]
    fn foreign_marks_are_not_ours() {
        let p = pol(7, "10.7.0.0/24");
        let mut m = policy_message(&p).unwrap();
        m.nlas = vec![XfrmAttrs::Mark(Mark {
            value: 0x1234,
            mask: 0xffff,
        })];
        assert_eq!(parse_policy(&m), None);
        m.nlas = vec![XfrmAttrs::Mark(Mark {
            value: mark::encode(NodeId::new(7).unwrap(), 3, XfrmDir::Out),
            mask: 0xffff_ffff,
        })];
        assert_eq!(parse_policy(&m), None, "our value under another mask");
        m.nlas.clear();
        assert_eq!(parse_policy(&m), None, "no mark at all");
    }

    #[test]
    fn waves_split_at_a_repeated_identity() {
        let a = KernelObject::XfrmPolicy(pol(1, "10.1.0.0/24"));
        let b = KernelObject::XfrmPolicy(pol(2, "10.2.0.0/24"));
        let ops = vec![
            Op::Delete(a.clone()),
            Op::Create(b.clone()),
            Op::Create(a.clone()),
            Op::Delete(b),
        ];
        let w = waves(&ops);
        assert_eq!(w.iter().map(|w| w.len()).collect::<Vec<_>>(), vec![2, 2]);
    }

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
}

//! The xfrm backend: ESP tunnel-mode states and OUT policies toward every remote node, and the
//! guards that make IPsec fail closed.
//!
//! # What it creates
//!
//! Per remote node and address family, for every key in use (the one sent with and, during a
//! rotation, the one rotated in or out):
//! - an **OUT state** `local -> remote` and an **IN state** `remote -> local`: ESP, tunnel mode,
//!   reqid [`REQID`], AEAD from the key, kernel SPI = the key's SPI number (1..=15, the same
//!   number as the SPI bits of the mark; SPIs below 256 are "reserved" by RFC 4303 but the kernel
//!   accepts them, and Cilium uses them the same way), mark `mark::encode(node, spi, dir)` /
//!   [`mark::MASK`];
//! - an **OUT policy** per remote pod CIDR: selector `0.0.0.0/0` (or `::/0`) -> CIDR, the same
//!   mark, one template: ESP tunnel `local -> remote`, reqid [`REQID`], the SPI.
//!
//! Per address family, belonging to no node, the **guards** ([`state::objects::XfrmGuard`]): an
//! OUT block policy for traffic marked for encryption that no node's policy takes, and a FWD
//! policy that lets through what our IN states decrypted.
//!
//! The datapath writes the marks on packets: the pod classifier the OUT mark of traffic toward a
//! remote pod CIDR, the uplink classifier the IN mark of ESP packets from a known node.
//!
//! # Ownership
//!
//! The mark is the only thing that makes an xfrm object ours (docs/design.md, invariant 6). Dumps
//! cannot be filtered by mark in the kernel, so the dump reads the whole SAD and SPD and keeps
//! only objects whose mark is ours ([`parse`]). Nothing else is ever listed, so nothing else can
//! reach a delete; writes and deletes that could touch a foreign object check first ([`states`],
//! [`policies`]).
//!
//! # The files
//!
//! [`keys`] the key file, [`message`] the messages we send, [`parse`] the dumps we read back,
//! [`states`] and [`policies`] the operations, [`probe`] the ESP check, [`stats`] the kernel's
//! counters. Writes go out as the route backends' do, many to a system call
//! ([`super::netlink::batch`]); dumps and the rare read-back of a state an add found go through
//! [`super::netlink::request`], whose quiet codec never logs a message (netlink-proto's default
//! codec logs every message, keys included). Netlink errors mean the same here as for routes
//! ([`crate::backends::netlink`]).

pub mod key_file;
pub mod keys;
pub mod message;
pub mod parse;
mod policies;
pub mod probe;
mod states;
pub mod stats;

use std::collections::HashSet;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP};
use netlink_packet_xfrm::{XfrmMessage, policy as xpolicy, state as sa};
use netlink_proto::ConnectionHandle;
use state::inventory::Inventory;
use state::objects::{KernelObject, ObjectKind, Op, XfrmGuard, XfrmPolicy, XfrmState};

pub use self::key_file::KeyFileState;
pub use self::keys::{IpsecKey, KeyBook, KeyFile};
pub use self::message::REQID;
use self::message::{del_state_message, get_state_message, guard_message};
use self::parse::{ParsedPolicy, parse_policy, parse_state};
use self::policies::policy_request;
pub use self::probe::ProbeError;
use super::Backend;
use super::netlink::batch::{Answer, Batcher, unanswered};
use super::netlink::request::{self, request};
use super::netlink::{KernelError, outcome};
use crate::kernel::{DumpError, OpError};

/// The xfrm backend. Owns the three xfrm kinds ([`XfrmBackend::kinds`]): `Backends::apply`
/// must route ops of any of them here.
pub struct XfrmBackend {
    handle: ConnectionHandle<XfrmMessage>,
    /// The writes, and the reads that decide them, a batch to a system call.
    batch: Batcher,
    keys: Arc<KeyBook>,
    writes: Arc<AtomicU64>,
}

/// Our policies as the kernel has them: the nodes' and the guards.
#[derive(Debug, Default)]
pub struct PolicyDump {
    pub policies: Vec<XfrmPolicy>,
    pub guards: Vec<XfrmGuard>,
}

impl XfrmBackend {
    /// Opens an xfrm netlink socket in the current network namespace; needs a tokio runtime.
    ///
    /// `keys` are the keys states are written with (by SPI and tag); policies, guards, dumps
    /// and deletes need none. Replace them with [`Self::set_keys`].
    pub fn new(keys: KeyBook) -> io::Result<Self> {
        Ok(Self {
            handle: request::connect(netlink_proto::sys::protocols::NETLINK_XFRM)?,
            batch: Batcher::open(netlink_proto::sys::protocols::NETLINK_XFRM)?,
            keys: Arc::new(keys),
            writes: Arc::new(AtomicU64::new(0)),
        })
    }

    /// The key book, shared with the planner, which asks it for the tags of states.
    pub fn book(&self) -> Arc<KeyBook> {
        self.keys.clone()
    }

    /// The kinds this backend owns.
    pub const fn kinds() -> [ObjectKind; 3] {
        [
            ObjectKind::XfrmState,
            ObjectKind::XfrmPolicy,
            ObjectKind::XfrmGuard,
        ]
    }

    /// Replaces the keys (after a key file reload).
    pub fn set_keys(&mut self, keys: Arc<KeyBook>) {
        self.keys = keys;
    }

    pub fn keys(&self) -> &KeyBook {
        &self.keys
    }

    /// Batches of requests sent so far (system calls; [`Batcher::batches_sent`]), and the most
    /// requests one carried.
    pub fn batches_sent(&self) -> (u64, usize) {
        (self.batch.batches_sent(), self.batch.largest_batch())
    }

    /// Kernel writes that succeeded so far (adds, replaces, deletes), for tests and metrics.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Our policies and guards (mark ours under exactly our mask), as the kernel has them.
    pub async fn dump_policies(&self) -> Result<PolicyDump, DumpError> {
        let msgs = request(
            &self.handle,
            XfrmMessage::GetPolicy(xpolicy::DelGetMessage::default()),
            NLM_F_DUMP,
        )
        .await
        .map_err(|e| dump_error(ObjectKind::XfrmPolicy, e))?;
        let mut out = PolicyDump::default();
        for m in &msgs {
            let (XfrmMessage::AddPolicy(p) | XfrmMessage::UpdatePolicy(p)) = m else {
                continue;
            };
            match parse_policy(p) {
                Some(ParsedPolicy::Node(p)) => out.policies.push(p),
                Some(ParsedPolicy::Guard(g)) => out.guards.push(g),
                None => {}
            }
        }
        Ok(out)
    }

    /// Our states (mark ours under exactly our mask), as the kernel has them.
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
            keys: self.keys.clone(),
            writes: self.writes.clone(),
        }
    }
}

impl Backend for XfrmBackend {
    async fn dump_into(&mut self, inv: &mut Inventory) -> Result<(), DumpError> {
        for s in self.dump_states().await? {
            inv.insert(KernelObject::XfrmState(s));
        }
        let policies = self.dump_policies().await?;
        for p in policies.policies {
            inv.insert(KernelObject::XfrmPolicy(p));
        }
        for g in policies.guards {
            inv.insert(KernelObject::XfrmGuard(g));
        }
        Ok(())
    }

    /// Each wave in two exchanges (each as many batches as the kernel's pace asks): first
    /// every op's opening request (a policy's or guard's
    /// write, a state's add, the read a state's delete starts with), then the deletes those
    /// reads allow. A state add the kernel refuses because one is there (`EEXIST`) is settled
    /// apart, through the connection ([`Ctx::upsert_found`]).
    async fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        let ctx = self.ctx();
        let mut results = Vec::with_capacity(ops.len());
        for wave in waves(ops) {
            let opening: Vec<Result<XfrmMessage, OpError>> =
                wave.iter().map(|op| ctx.opening(op)).collect();
            let requests = opening.iter().flatten().map(|m| (m.clone(), 0)).collect();
            let mut answers = self.batch.exchange(requests).await.into_iter();
            let mut outcomes = Vec::with_capacity(wave.len());
            for (op, opening) in wave.iter().zip(opening) {
                outcomes.push(match opening {
                    Ok(_) => ctx.next(op, answers.next().unwrap_or_else(unanswered)),
                    Err(e) => Next::Done(Err(e)),
                });
            }
            let deletes = wave
                .iter()
                .zip(&outcomes)
                .filter_map(|(op, next)| match (op.object(), next) {
                    (KernelObject::XfrmState(s), Next::Delete) => Some((del_state_message(s), 0)),
                    _ => None,
                })
                .collect();
            let mut answers = self.batch.exchange(deletes).await.into_iter();
            for (op, next) in wave.iter().zip(outcomes) {
                results.push(match next {
                    Next::Done(r) => r,
                    Next::Delete => ctx.settle(op, answers.next().unwrap_or_else(unanswered)),
                    Next::Found(s) => ctx.upsert_found(&s).await,
                });
            }
        }
        results
    }
}

/// Cuts `ops` into consecutive runs in which no kernel identity appears twice, so that the
/// planner's order (a delete before an upsert reusing the identity) holds although a state's
/// delete goes out in a wave's second exchange, after the wave's adds.
fn waves(ops: &[Op]) -> Vec<&[Op]> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut start = 0;
    for (i, op) in ops.iter().enumerate() {
        // The kernel's identity of the object: ops on the same one must not be in flight
        // together.
        let key = op.object().id();
        if seen.contains(&key) {
            out.push(&ops[start..i]);
            start = i;
            seen.clear();
        }
        seen.insert(key);
    }
    if start < ops.len() {
        out.push(&ops[start..]);
    }
    out
}

/// What applying an op needs: the connection (for the rare read-back), the keys, the count of
/// writes.
struct Ctx {
    handle: ConnectionHandle<XfrmMessage>,
    keys: Arc<KeyBook>,
    writes: Arc<AtomicU64>,
}

/// What an op's opening request left to do.
enum Next {
    Done(Result<(), OpError>),
    /// The read found our state: delete it.
    Delete,
    /// The add found a state there: read it, and keep, replace or refuse it.
    Found(XfrmState),
}

impl Ctx {
    /// The request `op` opens with.
    fn opening(&self, op: &Op) -> Result<XfrmMessage, OpError> {
        match op.object() {
            KernelObject::XfrmPolicy(p) => self.policy_request(op, p),
            KernelObject::XfrmGuard(g) => Ok(policy_request(op, guard_message(g))),
            KernelObject::XfrmState(s) => match op {
                Op::Delete(_) => Ok(get_state_message(s)),
                Op::Create(_) | Op::Replace(_) => self.add_state_request(s),
            },
            o => Err(OpError::Disabled { kind: o.kind() }),
        }
    }

    /// What the kernel's answer to `op`'s opening request decides.
    fn next(&self, op: &Op, answer: Answer<XfrmMessage>) -> Next {
        match (op.object(), op) {
            (KernelObject::XfrmState(s), Op::Delete(_)) => self.after_read(s, answer),
            (KernelObject::XfrmState(s), _) => match answer {
                Err(e) if e.errno() == Some(libc::EEXIST) => Next::Found(s.clone()),
                Err(e) => Next::Done(Err(e.into_op(format!("adding {}", states::describe(s))))),
                Ok(_) => Next::Done(self.settle(op, Ok(Vec::new()))),
            },
            _ => Next::Done(self.settle(op, answer)),
        }
    }

    /// A write's outcome from the kernel's answer, counted when the kernel accepted it.
    fn settle(&self, op: &Op, answer: Answer<XfrmMessage>) -> Result<(), OpError> {
        if answer.is_ok() {
            self.writes.fetch_add(1, Ordering::Relaxed);
        }
        outcome(op, answer.map(drop), || match op.object() {
            KernelObject::XfrmPolicy(p) => policies::describe(p),
            KernelObject::XfrmState(s) => states::describe(s),
            o => o.to_string(),
        })
    }

    /// Sends one mutating request; counts it when the kernel accepted it.
    async fn write(&self, msg: XfrmMessage) -> Result<(), KernelError> {
        request(&self.handle, msg, NLM_F_ACK).await?;
        self.writes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn dump_error(kind: ObjectKind, e: KernelError) -> DumpError {
    DumpError::Kernel {
        kind,
        source: e.into_io(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use state::objects::{NodeId, Spi, XfrmDir};

    fn pol(node: u16, dst: &str) -> KernelObject {
        KernelObject::XfrmPolicy(XfrmPolicy {
            src: "0.0.0.0/0".parse().unwrap(),
            dst: dst.parse().unwrap(),
            dir: XfrmDir::Out,
            node_id: NodeId::new(node).unwrap(),
            tmpl_src: "10.0.0.1".parse().unwrap(),
            tmpl_dst: "10.0.0.2".parse().unwrap(),
            spi: Spi::from_wire(3).unwrap(),
        })
    }

    #[test]
    fn waves_split_at_a_repeated_identity() {
        let a = pol(1, "10.1.0.0/24");
        let b = pol(2, "10.2.0.0/24");
        let ops = vec![
            Op::Delete(a.clone()),
            Op::Create(b.clone()),
            Op::Create(a),
            Op::Delete(b),
        ];
        let w = waves(&ops);
        assert_eq!(w.iter().map(|w| w.len()).collect::<Vec<_>>(), vec![2, 2]);
    }
}

//! Many netlink requests in one system call, and back only what the kernel has to say.
//!
//! The kernel handles the requests of a `NETLINK_ROUTE` or `NETLINK_XFRM` datagram inside the
//! `sendmsg` that carries it (`netlink_rcv_skb`): one after another, in order, each queueing its answer on the sender's socket
//! before the next begins. So a batch of requests costs one `sendmsg`, and when it returns every
//! answer is already waiting. A write asks for no acknowledgement: one the kernel accepts says
//! nothing, one it refuses gets an error reply carrying its sequence number. A read gets its
//! answer. One non-blocking drain of the socket then gives the outcome of the whole batch.
//! Against a request and an acknowledgement each (what `ip -batch` and a pipelined connection
//! do), that saves two system calls and an answer the kernel builds, per request: at 65,000
//! dual-stack nodes, 390,000 requests on a cold start; in an emulated guest, most of an IPsec
//! event's time beyond the kernel's own work.
//!
//! If answers were lost (the receive buffer overflowed: `ENOBUFS`), silence no longer means
//! success: every request of the batch without an answer is reported failed, and the next
//! reconcile reads the kernel again.

use std::fmt;
use std::io;
use std::time::{Duration, Instant};

use netlink_packet_core::{
    NLM_F_REQUEST, NetlinkBuffer, NetlinkDeserializable, NetlinkHeader, NetlinkMessage,
    NetlinkPayload, NetlinkSerializable,
};
use netlink_sys::{Socket, SocketAddr};

use super::{KernelError, ext_ack_message};

/// The most requests in one `sendmsg` ([`XFRM_BATCH`] for xfrm). The datagram (about 100 bytes a request) stays far below the
/// socket's send limit. Each answer (a refusal, or a read's reply) takes about 830 bytes of
/// receive buffer, so even if every request answers, a batch's answers fill half of the buffer
/// a machine whose `net.core.rmem_max` is the kernel's default gives (twice 208 KiB, 512
/// answers): the test on the real kernel measures both.
pub const BATCH: usize = 256;
/// About how long one batch may keep the agent's single-threaded runtime (its health endpoint,
/// its metrics, the watch) waiting, since the kernel does a batch's work inside one `sendmsg`:
/// each batch's size follows the pace of the last, so that slow requests (an xfrm policy among
/// 20,000 takes milliseconds in an emulated guest) go a few to a call, and cheap ones (a route,
/// microseconds) still go [`BATCH`] to a call.
const BATCH_TIME: Duration = Duration::from_millis(20);
/// The first batch's size, before the pace is known.
const FIRST_BATCH: usize = 16;
/// The most xfrm requests in one call. An xfrm write's cost varies a hundredfold within one
/// apply (a state or an IPv4 policy: about 0.2 ms in an emulated guest; an IPv6 policy, which
/// makes the kernel walk every IPv6 route: 3.4 ms at 20,000 nodes), so the pace of one batch
/// says little about the next: the first batch of IPv6 policies after a run of states holds the
/// runtime for at most this many of them (about 0.1 s at 20,000 nodes).
const XFRM_BATCH: usize = 32;
/// The receive buffer asked for, past `net.core.rmem_max` where the agent may
/// (`SO_RCVBUFFORCE`, with `CAP_NET_ADMIN`).
const RECEIVE_BUFFER: usize = 4 << 20;

/// Errors other than "nothing more to read" a drain tolerates before it gives up on a batch.
const MAX_FAILED_READS: usize = 8;

/// One request: the message, and its flags beyond `NLM_F_REQUEST`.
pub type Request<T> = (T, u16);

/// What the kernel answered one request: a read's messages (none for an accepted write).
pub type Answer<T> = Result<Vec<T>, KernelError>;

/// Stands in for an answer missing from an exchange's: there is none, as
/// [`Batcher::exchange`] gives one per request, but an iterator over them cannot know that.
pub fn unanswered<T>() -> Answer<T> {
    Err(KernelError::connection("no answer to the request"))
}

pub struct Batcher {
    socket: Socket,
    seq: u32,
    out: Vec<u8>,
    answers: Vec<u8>,
    /// Requests in the next batch ([`next_size`]), and the most in any.
    size: usize,
    max: usize,
    /// Batches sent so far, and the most requests one carried.
    sent: u64,
    largest: usize,
}

impl Batcher {
    /// A netlink socket of `protocol` (`NETLINK_ROUTE`, `NETLINK_XFRM`) in the current
    /// network namespace, whose error replies do not echo the request (`NETLINK_CAP_ACK`) and
    /// carry the kernel's words (`NETLINK_EXT_ACK`).
    pub fn open(protocol: isize) -> io::Result<Self> {
        Self::with_receive_buffer(protocol, RECEIVE_BUFFER)
    }

    /// [`Self::open`], asking for a receive buffer of `bytes` (the kernel clamps it).
    pub fn with_receive_buffer(protocol: isize, bytes: usize) -> io::Result<Self> {
        let mut socket = Socket::new(protocol)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        socket.set_cap_ack(true)?;
        socket.set_ext_ack(true)?;
        // Best effort: a smaller buffer still holds a batch's answers (see [`BATCH`]).
        if force_receive_buffer(&socket, bytes).is_err() {
            let _ = socket.set_rx_buf_sz(bytes);
        }
        Ok(Self {
            socket,
            seq: 0,
            out: Vec::new(),
            answers: Vec::with_capacity(64 << 10),
            size: FIRST_BATCH,
            max: match protocol {
                netlink_sys::protocols::NETLINK_XFRM => XFRM_BATCH,
                _ => BATCH,
            },
            sent: 0,
            largest: 0,
        })
    }

    /// Starts with batches of `size` (at most the protocol's most) until the pace is known:
    /// where a caller knows its requests are cheap, or a test needs a full batch.
    pub fn first_batch(mut self, size: usize) -> Self {
        self.size = size.clamp(1, self.max);
        self
    }

    /// Batches (system calls carrying requests) sent so far.
    pub fn batches_sent(&self) -> u64 {
        self.sent
    }

    /// The most requests any one batch carried so far.
    pub fn largest_batch(&self) -> usize {
        self.largest
    }

    /// Sends `requests`, up to [`BATCH`] ([`XFRM_BATCH`]) to a system call as the kernel's pace
    /// allows ([`BATCH_TIME`]), and gives each one's answer, in order. Before each batch the task
    /// yields, so that a long apply, or several exchanges in a row, never hold the runtime for
    /// more than a batch.
    pub async fn exchange<T>(&mut self, requests: Vec<Request<T>>) -> Vec<Answer<T>>
    where
        T: fmt::Debug + NetlinkSerializable + NetlinkDeserializable,
    {
        let mut out = Vec::with_capacity(requests.len());
        let mut requests = requests.into_iter().peekable();
        while requests.peek().is_some() {
            tokio::task::yield_now().await;
            let batch: Vec<Request<T>> = requests.by_ref().take(self.size).collect();
            let (n, started) = (batch.len(), Instant::now());
            self.largest = self.largest.max(n);
            out.extend(self.one_batch(batch));
            self.size = next_size(n, started.elapsed(), self.max);
        }
        out
    }

    fn one_batch<T>(&mut self, batch: Vec<Request<T>>) -> Vec<Answer<T>>
    where
        T: fmt::Debug + NetlinkSerializable + NetlinkDeserializable,
    {
        let n = batch.len();
        let started = Instant::now();
        self.sent += 1;
        let first = self.seq.wrapping_add(1);
        self.out.clear();
        for (i, (msg, flags)) in batch.into_iter().enumerate() {
            let mut nl =
                NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::InnerMessage(msg));
            nl.header.flags = NLM_F_REQUEST | flags;
            nl.header.sequence_number = first.wrapping_add(i as u32);
            nl.finalize();
            let at = self.out.len();
            // Each message starts 4-aligned (its length is, but pad anyway).
            self.out.resize(at + nl.buffer_len().next_multiple_of(4), 0);
            nl.serialize(&mut self.out[at..]);
        }
        self.seq = first.wrapping_add(n as u32).wrapping_sub(1);
        let sent = self.socket.send(&self.out, 0);
        // The requests may carry keys (xfrm states): the batcher's own buffer does not keep them
        // (the messages they were built from are the caller's).
        self.out.fill(0);
        if let Err(e) = sent {
            return (0..n)
                .map(|_| {
                    Err(KernelError::connection(format!(
                        "sending {n} requests: {e}"
                    )))
                })
                .collect();
        }
        let mut answers: Vec<Answer<T>> = (0..n).map(|_| Ok(Vec::new())).collect();
        let mut lost = None;
        let mut failures = 0;
        loop {
            self.answers.clear();
            match self.socket.recv(&mut self.answers, libc::MSG_DONTWAIT) {
                Ok(_) => {
                    self.sort(first, &mut answers);
                    // A read's answer may carry a key (an xfrm state's).
                    self.answers.fill(0);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Lost answers (ENOBUFS, reported once, ahead of what is still queued): read on
                // until the queue is empty, which is also what lifts the socket's congestion
                // (while congested, the kernel drops answers without saying so). An error that
                // keeps coming is a broken socket: give up on this batch.
                Err(e) => {
                    lost = Some(e);
                    failures += 1;
                    if failures > MAX_FAILED_READS {
                        break;
                    }
                }
            }
        }
        tracing::debug!(
            requests = n,
            us = started.elapsed().as_micros() as u64,
            "netlink batch"
        );
        if let Some(e) = lost {
            for a in answers
                .iter_mut()
                .filter(|a| matches!(a, Ok(m) if m.is_empty()))
            {
                *a = Err(KernelError::connection(format!(
                    "answers lost ({e}); the kernel is read again at the next reconcile"
                )));
            }
        }
        answers
    }

    /// Files each message of the datagram just received under the request it answers.
    fn sort<T>(&self, first: u32, answers: &mut [Answer<T>])
    where
        T: fmt::Debug + NetlinkDeserializable,
    {
        let mut rest = &self.answers[..];
        while let Ok(buf) = NetlinkBuffer::new_checked(rest) {
            let len = (buf.length() as usize).min(rest.len());
            let i = buf.sequence_number().wrapping_sub(first) as usize;
            let msg = NetlinkMessage::<T>::deserialize(&rest[..len]);
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
            let Some(answer) = answers.get_mut(i) else {
                continue;
            };
            let Ok(msg) = msg else {
                // Whatever it said is unknown: never success. The error names what failed to
                // parse, never the bytes.
                tracing::error!("undecodable netlink answer");
                *answer = Err(KernelError::connection(
                    "the kernel's answer could not be decoded",
                ));
                continue;
            };
            match msg.payload {
                NetlinkPayload::InnerMessage(m) => {
                    if let Ok(found) = answer {
                        found.push(m);
                    }
                }
                NetlinkPayload::Error(e) if e.code.is_some() => {
                    *answer = Err(KernelError {
                        source: e.to_io(),
                        message: ext_ack_message(msg.header.flags, &e.header),
                    });
                }
                _ => {}
            }
        }
    }
}

/// The size of the batch after one of `requests` that took `took`: as many as fit in
/// [`BATCH_TIME`] at that pace, at least one, at most `max`.
fn next_size(requests: usize, took: Duration, max: usize) -> usize {
    let per_request = took.as_nanos() / requests.max(1) as u128;
    match BATCH_TIME.as_nanos().checked_div(per_request) {
        Some(fit) => usize::try_from(fit).unwrap_or(max).clamp(1, max),
        None => max,
    }
}

/// `SO_RCVBUFFORCE`: the receive buffer past `net.core.rmem_max`, for a process with
/// `CAP_NET_ADMIN`.
fn force_receive_buffer(socket: &Socket, bytes: usize) -> io::Result<()> {
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: setsockopt(2) on a socket this process owns, with a pointer to a c_int and its size.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(socket),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            std::ptr::from_ref(&value).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    match rc {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batch follows the kernel's pace: cheap requests go [`BATCH`] to a call, slow ones a
    /// few, never none; a batch too quick to time does not stall the next.
    #[test]
    fn a_batch_holds_the_runtime_about_batch_time_whatever_a_request_costs() {
        let ms = Duration::from_millis;
        let us = Duration::from_micros;
        let cases = [
            (256, us(2_500), BATCH, BATCH),  // routes: 10 µs each
            (16, us(0), BATCH, BATCH),       // too quick to time
            (32, us(3_200), XFRM_BATCH, 32), // xfrm states: 100 µs each, capped
            (32, ms(109), XFRM_BATCH, 5),    // IPv6 policies among 20,000: 3.4 ms each
            (5, ms(100), XFRM_BATCH, 1),     // slower than the whole budget: one at a time
        ];
        for (requests, took, max, want) in cases {
            assert_eq!(
                next_size(requests, took, max),
                want,
                "{requests} in {took:?}"
            );
            if want < max {
                let held = took / requests as u32 * want as u32;
                assert!(held <= BATCH_TIME, "{requests} in {took:?}: {held:?}");
            }
        }
        println!(
            "batch sizes: {:?}",
            cases.map(|(r, t, max, _)| next_size(r, t, max))
        );
    }
}

//! The one way the xfrm and nexthop backends talk to the kernel (netlink-proto connections of
//! message types rtnetlink does not carry): a request over a connection whose codec never logs,
//! answered by messages or a [`KernelError`].

use std::fmt;
use std::io;

use bytes::{BufMut, BytesMut};
use futures::StreamExt;
use netlink_packet_core::{
    NLM_F_REQUEST, NetlinkBuffer, NetlinkDeserializable, NetlinkHeader, NetlinkMessage,
    NetlinkPayload, NetlinkSerializable,
};
use netlink_proto::sys::{AsyncSocket, SocketAddr, TokioSocket};
use netlink_proto::{ConnectionHandle, NetlinkMessageCodec};

use super::{KernelError, ext_ack_message};

/// Opens a netlink connection of `protocol` for messages `T` in the current network namespace
/// and spawns its driver on the current tokio runtime.
///
/// The socket sets `NETLINK_CAP_ACK`, so the kernel's error replies do not echo the request (and
/// the key an xfrm state may carry) back, and `NETLINK_EXT_ACK`, so errors carry the kernel's
/// own message.
pub fn connect<T>(protocol: isize) -> io::Result<ConnectionHandle<T>>
where
    T: fmt::Debug + NetlinkSerializable + NetlinkDeserializable + Unpin + Send + 'static,
{
    let (mut conn, handle, _unsolicited) =
        netlink_proto::new_connection_with_codec::<T, TokioSocket, QuietCodec>(protocol)?;
    let socket = conn.socket_mut().socket_mut();
    socket.set_cap_ack(true)?;
    socket.set_ext_ack(true)?;
    tokio::spawn(conn);
    Ok(handle)
}

/// Sends one request and collects its answers; a NACK becomes a [`KernelError`].
pub async fn request<T>(
    handle: &ConnectionHandle<T>,
    msg: T,
    flags: u16,
) -> Result<Vec<T>, KernelError>
where
    T: fmt::Debug + NetlinkSerializable + NetlinkDeserializable,
{
    let mut nl = NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::InnerMessage(msg));
    nl.header.flags = NLM_F_REQUEST | flags;
    nl.finalize();
    let mut answers = handle
        .request(nl, SocketAddr::new(0, 0))
        .map_err(KernelError::connection)?;
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
                        "truncated or malformed netlink datagram; dropped"
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
                    tracing::error!(error = %e, "undecodable netlink message; skipped");
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

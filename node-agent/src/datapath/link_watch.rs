//! Link notifications (`RTNLGRP_LINK`): a device made or deleted wakes the attach check at once
//! (see [`super::attachments`]). What a notification says is not read: any of them, and any
//! loss of them (`ENOBUFS`), means "look now". The periodic check stays behind it.

use std::io;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// `RTMGRP_LINK`: the link group's bit in the legacy group mask.
const LINK_GROUP: u32 = 1;

/// A socket joined to the link group of the current network namespace.
pub struct LinkWatch {
    socket: AsyncFd<Socket>,
    buf: Vec<u8>,
}

impl LinkWatch {
    /// Joins the link notifications; must run inside a tokio runtime.
    pub fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind(&SocketAddr::new(0, LINK_GROUP))?;
        socket.set_non_blocking(true)?;
        // SAFETY: the socket owns its descriptor, which stays open, and the same one, for as long
        // as the AsyncFd that owns the socket.
        let socket = unsafe { AsyncFd::register_with_interest(socket, Interest::READABLE) }
            .map_err(io::Error::from)?;
        Ok(Self {
            socket,
            buf: vec![0; 32 << 10],
        })
    }

    /// Waits until a link changed (or notifications were lost), then drains every one queued:
    /// a burst is one wake-up.
    pub async fn changed(&mut self) -> io::Result<()> {
        loop {
            let mut guard = self.socket.readable().await?;
            let mut heard = false;
            loop {
                let mut buf = &mut self.buf[..];
                match guard.get_inner().recv(&mut buf, 0) {
                    Ok(_) => heard = true,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        guard.clear_ready();
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    // Notifications were lost: something may have changed.
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => heard = true,
                    Err(e) => return Err(e),
                }
            }
            if heard {
                return Ok(());
            }
        }
    }
}

//! Forwards the datapath's aya-log records to `tracing`.
//!
//! aya-log hands records to the `log` facade; the tracing subscriber picks them up through its
//! `log` bridge. A small thread waits on the ring buffer's fd and drains it, so records reach the
//! log even when the agent's async runtime is busy or not running (one-shot commands). It also
//! waits on an eventfd that stopping it writes, so a stop (every one-shot run's exit) is
//! immediate rather than at the next poll timeout.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::thread::JoinHandle;

use aya::Ebpf;
use aya_log::EbpfLogger;

/// Owns the log ring buffer and its draining thread; dropping it stops the thread.
pub struct LogForwarder {
    /// Written once to stop the thread.
    stop: OwnedFd,
    thread: Option<JoinHandle<()>>,
}

impl LogForwarder {
    pub fn start(ebpf: &mut Ebpf) -> Result<Self, aya_log::Error> {
        let io = |e| aya_log::Error::MapError(aya::maps::MapError::IoError(e));
        let mut logger = EbpfLogger::init(ebpf)?;
        // SAFETY: eventfd has no memory preconditions; a non-negative result is a new fd we own.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        // SAFETY: `raw` was just returned by eventfd and nothing else owns it.
        let stop = unsafe { OwnedFd::from_raw_fd(raw) };
        let stop_fd = stop.as_raw_fd();
        let thread = std::thread::Builder::new()
            .name("ebpf-log".into())
            .spawn(move || {
                let fd = logger.as_raw_fd();
                loop {
                    let (records, stopped) = wait(fd, stop_fd);
                    if records {
                        logger.flush();
                    }
                    if stopped {
                        break;
                    }
                }
                logger.flush();
            })
            .map_err(io)?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for LogForwarder {
    fn drop(&mut self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), (&raw const one).cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits until the ring buffer has records or the stop eventfd was written: (records, stopped).
/// A poll error other than an interruption reads as stopped, so the thread never spins.
fn wait(ring: RawFd, stop: RawFd) -> (bool, bool) {
    let mut pfds = [ring, stop].map(|fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    });
    // SAFETY: two valid pollfds; both fds stay open while the thread runs (the logger owns the
    // ring's, and the forwarder joins the thread before it closes the eventfd).
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), 2, -1) };
    if n < 0 {
        let interrupted = std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted;
        return (false, !interrupted);
    }
    (pfds[0].revents != 0, pfds[1].revents != 0)
}

//! Forwards the datapath's aya-log records to `tracing`.
//!
//! aya-log hands records to the `log` facade; the tracing subscriber picks them up through its
//! `log` bridge. A small thread waits on the ring buffer's fd and drains it, so records reach the
//! log even when the agent's async runtime is busy or not running (one-shot commands).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use aya::Ebpf;
use aya_log::EbpfLogger;

/// Owns the log ring buffer and its draining thread; dropping it stops the thread.
pub struct LogForwarder {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl LogForwarder {
    pub fn start(ebpf: &mut Ebpf) -> Result<Self, aya_log::Error> {
        let mut logger = EbpfLogger::init(ebpf)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ebpf-log".into())
            .spawn(move || {
                let fd = logger.as_raw_fd();
                while !flag.load(Ordering::Relaxed) {
                    if wait_readable(fd, 200) {
                        logger.flush();
                    }
                }
                logger.flush();
            })
            .map_err(|e| aya_log::Error::MapError(aya::maps::MapError::IoError(e)))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for LogForwarder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn wait_readable(fd: RawFd, timeout_ms: i32) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, and `fd` stays open: the logger owning it outlives this call.
    unsafe { libc::poll(&mut pfd, 1, timeout_ms) > 0 }
}

//! Facts about the machine and the tools on it that the tasks and the tests both need.

use std::io;
use std::path::{Path, PathBuf};

/// The workspace root (the parent of `xtask/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace root")
        .to_owned()
}

/// Where `bin` is on `PATH`, if anywhere.
pub fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(bin))
        .find(|p| p.is_file())
}

/// Runs `f` on a thread of its own in the network namespace `ns` (`/run/netns/<ns>`): sockets
/// belong to the namespace of the thread that makes them, and the caller's thread stays where it
/// is. A panic in `f` goes on in the caller.
pub fn in_netns<R: Send>(ns: &str, f: impl FnOnce() -> R + Send) -> io::Result<R> {
    use std::os::fd::AsRawFd as _;
    let path = Path::new("/run/netns").join(ns);
    let file = std::fs::File::open(&path)
        .map_err(|e| io::Error::new(e.kind(), format!("opening {}: {e}", path.display())))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns(2) on a namespace file we hold open; it moves only this thread.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                let e = io::Error::last_os_error();
                return Err(io::Error::new(e.kind(), format!("setns {ns}: {e}")));
            }
            Ok(f())
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// `N packets transmitted, M (packets) received` from a ping summary (iputils' or busybox's).
pub fn parse_ping(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().find(|l| l.contains("transmitted"))?;
    let mut nums = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok());
    Some((nums.next()?, nums.next()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_summaries() {
        let iputils = "3 packets transmitted, 2 received, 33% packet loss, time 405ms\n";
        assert_eq!(parse_ping(iputils), Some((3, 2)));
        assert_eq!(parse_ping("ping: connect: Network is unreachable\n"), None);
    }
}

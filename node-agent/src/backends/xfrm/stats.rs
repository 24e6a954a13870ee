//! The kernel's xfrm error counters (`/proc/net/xfrm_stat`), for metrics and `ipsec status`.
//!
//! They are per network namespace and exist only with `CONFIG_XFRM_STATISTICS`. The ones that
//! matter most here: `XfrmOutPolBlock` counts packets the block guard dropped (marked for
//! encryption, no node policy took them), `XfrmOutNoStates` packets whose policy found no state,
//! `XfrmInNoStates` ESP packets no IN state matched, `XfrmInStateProtoError` packets that failed
//! to decrypt (a key mismatch), `XfrmInNoPols` decrypted packets no policy accepted.

use std::io;
use std::path::Path;

/// The counters, in the kernel's order, by the kernel's names.
pub type XfrmStats = Vec<(String, u64)>;

/// Where the calling thread's network namespace shows its counters.
const STAT_FILE: &str = "/proc/thread-self/net/xfrm_stat";

/// The counters of the calling thread's network namespace; `Ok(None)` when the kernel keeps
/// none (no `CONFIG_XFRM_STATISTICS`).
pub fn read() -> io::Result<Option<XfrmStats>> {
    read_from(Path::new(STAT_FILE))
}

fn read_from(path: &Path) -> io::Result<Option<XfrmStats>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(parse(&text))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// `Name<whitespace>value` per line; lines that do not parse are skipped.
pub fn parse(text: &str) -> XfrmStats {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let name = f.next()?;
            let value = f.next()?.parse().ok()?;
            Some((name.to_owned(), value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernels_layout() {
        let text = "XfrmInError             \t0\nXfrmOutPolBlock         \t12\nbroken\n";
        assert_eq!(
            parse(text),
            vec![
                ("XfrmInError".to_owned(), 0),
                ("XfrmOutPolBlock".to_owned(), 12)
            ]
        );
    }

    #[test]
    fn a_missing_file_means_no_counters() {
        assert!(
            read_from(Path::new("/nonexistent/xfrm_stat"))
                .unwrap()
                .is_none()
        );
    }
}

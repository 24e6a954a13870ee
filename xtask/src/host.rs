//! Facts about the machine and the tools on it that the tasks and the tests both need.

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

//! The operator's side of a held prune, through the state directory.
//!
//! A running daemon publishes what its brake holds in `<state-dir>/hold.json` (the same report
//! `node-agent plan --output json` prints, with the hold's ID) and removes the file when nothing
//! is held. `node-agent prune confirm <ID>` writes the ID to `<state-dir>/prune-confirm`
//! (aside, then renamed into place, as the daemon takes it by renaming it away) and sends the
//! daemon (the PID in the state directory's lock) `SIGUSR1`; the daemon takes the file
//! at once (or at its next heartbeat, should the signal be lost) and releases the hold only if
//! it is still exactly the hold of that ID (invariant 16). Only someone who can write the state
//! directory (root in the agent's pod) can confirm.

use std::io;
use std::path::{Path, PathBuf};

use state::input::{self, Input, InputError};

use super::report::BrakeReport;

pub const HOLD_FILE: &str = "hold.json";
pub const CONFIRM_FILE: &str = "prune-confirm";
/// Where the daemon moves a confirmation it takes, before reading it.
const TAKEN_FILE: &str = ".prune-confirm.taken";

#[derive(Debug, thiserror::Error)]
pub enum HoldFileError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{} names no hold: ignored; confirm again with the ID `node-agent prune status` prints", path.display())]
    NoHoldId { path: PathBuf },
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("{} is not a hold report: {source}", path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> HoldFileError {
    let path = path.to_owned();
    move |source| HoldFileError::Io { what, path, source }
}

/// Writes (atomically) or removes the published hold.
pub fn publish(dir: &Path, hold: Option<&BrakeReport>) -> Result<(), HoldFileError> {
    let path = dir.join(HOLD_FILE);
    match hold {
        None => match std::fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("removing", &path)(e)),
            _ => Ok(()),
        },
        Some(report) => {
            let text = serde_json::to_vec_pretty(report).expect("a report serializes");
            Ok(input::replace(&path, Input::HoldFile, &text)?)
        }
    }
}

/// The hold a running daemon published, if any.
pub fn read(dir: &Path) -> Result<Option<BrakeReport>, HoldFileError> {
    let path = dir.join(HOLD_FILE);
    match input::read(&path, Input::HoldFile) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| HoldFileError::Parse { path, source }),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Takes an operator's confirmation, if one is waiting: the hold ID it confirms.
///
/// The file is taken by renaming it aside first: a confirmation written while this runs is
/// either taken whole or left for the next turn, never read half-written and never removed
/// unread. One taken by a daemon that died before reading it is read first: confirming the same
/// ID twice is harmless, as only the hold of that ID is released. A taken file that names no
/// hold is an error, so that it is reported, not dropped.
pub fn take_confirmation(dir: &Path) -> Result<Option<String>, HoldFileError> {
    let path = dir.join(CONFIRM_FILE);
    let taken = dir.join(TAKEN_FILE);
    if !taken.exists() {
        // Looked at before it is taken: what is not a confirmation (a directory, a FIFO, a file
        // over the cap) stays where the operator put it, reported, and nothing is renamed.
        match input::open(&path, Input::Confirmation) {
            Err(e) if !e.is_not_found() => return Err(e.into()),
            _ => {}
        }
        match std::fs::rename(&path, &taken) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("taking", &path)(e)),
        }
    }
    let read = input::read(&taken, Input::Confirmation);
    // Removed whatever it held: one that cannot be read, or is no text, is reported once and
    // dropped (to be given again), never left to block every confirmation after it. One that
    // cannot be removed (immutable, a read-only mount) is not used: it would confirm again at
    // every turn of the daemon, each a reconcile, back to back.
    std::fs::remove_file(&taken).map_err(io_err(
        "removing the taken confirmation (not used until it can be removed)",
        &taken,
    ))?;
    let bytes = read?;
    let text =
        String::from_utf8(bytes).map_err(|_| HoldFileError::NoHoldId { path: path.clone() })?;
    let id = text.trim();
    if id.is_empty() {
        return Err(HoldFileError::NoHoldId { path });
    }
    Ok(Some(id.to_owned()))
}

/// Leaves a confirmation of hold `id` for the daemon: written aside (a file of this process's
/// own, readable by the owner only), then renamed into place, so the daemon never sees it
/// half-written (it looks at every turn, signalled or not). Not synced: the state directory is
/// the node's runtime directory, and a confirmation a crash empties is reported as naming no
/// hold, to be given again.
pub fn write_confirmation(dir: &Path, id: &str) -> Result<(), HoldFileError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(CONFIRM_FILE);
    // One name per writer: two operators confirming at once (even from two PID namespaces)
    // never write into one file.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = dir.join(format!(
        ".{CONFIRM_FILE}.{}.{nanos}.tmp",
        std::process::id()
    ));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| f.write_all(format!("{id}\n").as_bytes()));
    let placed = written
        .map_err(io_err("writing", &tmp))
        .and_then(|()| std::fs::rename(&tmp, &path).map_err(io_err("renaming into place", &path)));
    if placed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    placed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(id: &str) -> BrakeReport {
        BrakeReport {
            kind: "wipe".into(),
            id: id.into(),
            nodes: vec!["a".into(), "b".into()],
            ..BrakeReport::default()
        }
    }

    #[test]
    fn a_published_hold_reads_back_and_goes_away() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
        publish(dir.path(), Some(&report("abc"))).unwrap();
        assert_eq!(read(dir.path()).unwrap().unwrap().id, "abc");
        publish(dir.path(), None).unwrap();
        publish(dir.path(), None).unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
    }

    /// `prune status` after an upgrade reads the hold the previous agent published.
    #[test]
    fn a_hold_published_before_the_window_count_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let old = r#"{"kind":"ratio","id":"h1","nodes":["n2"],"stale_nodes":1,"orphans":0,"removed_nodes":1,"known_nodes":2,"ratio":0.5,"node_ratio":0.5,"orphan_ratio":0.0,"max_ratio":0.3,"held_deletes":3,"confirmable_at_unix":null,"message":"held"}"#;
        std::fs::write(dir.path().join(HOLD_FILE), old).unwrap();
        let hold = read(dir.path()).unwrap().unwrap();
        assert_eq!((hold.id.as_str(), hold.window_nodes), ("h1", 0));
    }

    #[test]
    fn a_confirmation_is_taken_once() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(take_confirmation(dir.path()).unwrap(), None);
        write_confirmation(dir.path(), "0123456789ab").unwrap();
        assert_eq!(
            take_confirmation(dir.path()).unwrap().as_deref(),
            Some("0123456789ab")
        );
        assert_eq!(take_confirmation(dir.path()).unwrap(), None);
    }

    /// The daemon looks for a confirmation at every turn, while the operator's CLI may be
    /// writing one: every confirmation written is taken exactly once and whole, never read
    /// empty and dropped (which lost an operator's confirmation once).
    #[test]
    fn a_confirmation_written_while_the_daemon_looks_is_never_lost() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let rounds = 2_000;
        let done = Arc::new(AtomicBool::new(false));
        let taker = {
            let (dir, done) = (dir.path().to_owned(), done.clone());
            std::thread::spawn(move || {
                let mut taken = Vec::new();
                loop {
                    let finished = done.load(Ordering::Acquire);
                    match take_confirmation(&dir) {
                        Ok(Some(id)) => taken.push(id),
                        Ok(None) if finished => return taken,
                        Ok(None) => std::thread::yield_now(),
                        Err(e) => panic!("after {} confirmations: {e}", taken.len()),
                    }
                }
            })
        };
        for i in 0..rounds {
            write_confirmation(dir.path(), &format!("{i:012x}")).unwrap();
            // The next one only once this one is gone.
            while dir.path().join(CONFIRM_FILE).exists() && !taker.is_finished() {
                std::thread::yield_now();
            }
        }
        done.store(true, Ordering::Release);
        let taken = taker.join().unwrap();
        let expected: Vec<String> = (0..rounds).map(|i| format!("{i:012x}")).collect();
        assert_eq!(taken, expected);
    }

    #[test]
    fn a_confirmation_taken_by_a_daemon_that_died_before_reading_it_is_read_next_time() {
        let dir = tempfile::tempdir().unwrap();
        write_confirmation(dir.path(), "0123456789ab").unwrap();
        // What a daemon killed between taking the file and reading it leaves.
        std::fs::rename(dir.path().join(CONFIRM_FILE), dir.path().join(TAKEN_FILE)).unwrap();
        assert_eq!(
            take_confirmation(dir.path()).unwrap().as_deref(),
            Some("0123456789ab")
        );
        assert_eq!(take_confirmation(dir.path()).unwrap(), None);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_confirmation_that_names_no_hold_is_reported_and_taken() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CONFIRM_FILE), "\n").unwrap();
        let err = take_confirmation(dir.path()).unwrap_err();
        assert!(err.to_string().contains("names no hold"), "{err}");
        assert_eq!(take_confirmation(dir.path()).unwrap(), None);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    /// A taken confirmation that cannot be removed is reported and not used: used, it
    /// confirmed again at every turn, each a reconcile.
    #[test]
    fn a_confirmation_that_cannot_be_removed_is_not_used() {
        let dir = tempfile::tempdir().unwrap();
        write_confirmation(dir.path(), "abc123").unwrap();
        std::fs::rename(dir.path().join(CONFIRM_FILE), dir.path().join(TAKEN_FILE)).unwrap();
        let taken = dir.path().join(TAKEN_FILE);
        let chattr = |flag: &str| {
            std::process::Command::new("chattr")
                .arg(flag)
                .arg(&taken)
                .status()
                .is_ok_and(|s| s.success())
        };
        if !chattr("+i") {
            eprintln!(
                "SKIPPED a_confirmation_that_cannot_be_removed_is_not_used: chattr +i failed here \
                 (not root, or a file system without the immutable flag)"
            );
            return;
        }
        let twice = [take_confirmation(dir.path()), take_confirmation(dir.path())];
        assert!(chattr("-i"));
        for r in twice {
            let err = r.unwrap_err();
            assert!(err.to_string().contains("not used"), "{err}");
        }
        assert_eq!(
            take_confirmation(dir.path()).unwrap().as_deref(),
            Some("abc123"),
            "removable again: used"
        );
    }

    /// Bytes that are no text are reported once and dropped: the confirmation after them is
    /// taken (left in place, they blocked every later one and were reported at every turn).
    #[test]
    fn a_confirmation_that_is_no_text_is_reported_once_and_blocks_nothing() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CONFIRM_FILE), [0xff, 0xfe, b'\n']).unwrap();
        let err = take_confirmation(dir.path()).unwrap_err();
        assert!(err.to_string().contains("names no hold"), "{err}");
        write_confirmation(dir.path(), "abc123").unwrap();
        assert_eq!(
            take_confirmation(dir.path()).unwrap().as_deref(),
            Some("abc123")
        );
    }
}

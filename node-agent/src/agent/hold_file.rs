//! The operator's side of a held prune, through the state directory.
//!
//! A running daemon publishes what its brake holds in `<state-dir>/hold.json` (the same report
//! `node-agent plan --output json` prints, with the hold's ID) and removes the file when nothing
//! is held. `node-agent prune confirm <ID>` writes the ID to `<state-dir>/prune-confirm` and
//! sends the daemon (the PID in the state directory's lock) `SIGUSR1`; the daemon takes the file
//! at once (or at its next heartbeat, should the signal be lost) and releases the hold only if
//! it is still exactly the hold of that ID (invariant 16). Only someone who can write the state
//! directory (root in the agent's pod) can confirm.

use std::io;
use std::path::{Path, PathBuf};

use super::report::BrakeReport;

pub const HOLD_FILE: &str = "hold.json";
pub const CONFIRM_FILE: &str = "prune-confirm";

#[derive(Debug, thiserror::Error)]
pub enum HoldFileError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
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
            let tmp = dir.join(".hold.json.tmp");
            let text = serde_json::to_vec_pretty(report).expect("a report serializes");
            std::fs::write(&tmp, text).map_err(io_err("writing", &tmp))?;
            std::fs::rename(&tmp, &path).map_err(io_err("renaming into place", &path))
        }
    }
}

/// The hold a running daemon published, if any.
pub fn read(dir: &Path) -> Result<Option<BrakeReport>, HoldFileError> {
    let path = dir.join(HOLD_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| HoldFileError::Parse { path, source }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err("reading", &path)(e)),
    }
}

/// Takes an operator's confirmation, if one is waiting: the hold ID it confirms.
pub fn take_confirmation(dir: &Path) -> Result<Option<String>, HoldFileError> {
    let path = dir.join(CONFIRM_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err("reading", &path)(e)),
    };
    std::fs::remove_file(&path).map_err(io_err("removing", &path))?;
    Ok(Some(text.trim().to_owned()).filter(|id| !id.is_empty()))
}

/// Leaves a confirmation of hold `id` for the daemon.
pub fn write_confirmation(dir: &Path, id: &str) -> Result<(), HoldFileError> {
    let path = dir.join(CONFIRM_FILE);
    std::fs::write(&path, format!("{id}\n")).map_err(io_err("writing", &path))
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
}

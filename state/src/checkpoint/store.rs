//! The checkpoint file: one agent per state directory, atomic replacement, corrupt files kept.
//!
//! Layout of `<state-dir>` (mode 0700; an existing one that is a symlink, someone else's,
//! world-writable or sticky is refused, see [`input::private_dir`]):
//!
//! - `lock`: held with an exclusive `flock` for the life of the [`CheckpointStore`], holding the
//!   holder's PID so a second instance can say who it lost to (invariant 11). `flock` locks
//!   belong to the open file description, so a second open in the same process conflicts too.
//!   The lock file is opened without following a symlink and refused unless it is a regular
//!   file with one name, so the PID written into it lands in no other file.
//! - `nodes.ckpt` (mode 0600): the checkpoint, only ever replaced by rename.
//! - `.nodes.ckpt.tmp`: the next checkpoint while it is being written; a leftover from a crash is
//!   removed on open.
//! - `nodes.ckpt.corrupt-<secs>.<nanos>`: checkpoints that failed to decode, moved aside for a
//!   human to inspect; the newest [`KEEP_CORRUPT`] are kept.
//!
//! The daemon and `node-agent prune` also keep files here (`node-agent/src/agent/hold_file.rs`):
//! `hold.json` (what the brake holds), `prune-confirm` (an operator's confirmation, written as
//! `.prune-confirm.<pid>.<nanos>.tmp` and renamed into place) and `.prune-confirm.taken` (a
//! confirmation the daemon has taken and not yet read).
//!
//! The node's pins have a lock of their own ([`lock_pin_dir`]): an exclusive `flock` on the pin
//! directory `<bpffs>/node-agent` itself, held by every agent that writes to the kernel, so that
//! a second agent with another state directory cannot take the node's objects from the first.

use std::fs::{self, File};
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::checkpoint::Checkpoint;
use crate::checkpoint::error::{DecodeError, EncodeError};
use crate::checkpoint::format;
use crate::input::{self, DirError, Input, InputError, Problem};

pub const FILE_NAME: &str = "nodes.ckpt";
const TMP_NAME: &str = ".nodes.ckpt.tmp";
const LOCK_NAME: &str = "lock";
const CORRUPT_PREFIX: &str = "nodes.ckpt.corrupt-";
/// How many moved-aside files are kept; enough to compare, few enough not to fill a disk when
/// something rewrites garbage in a loop.
pub const KEEP_CORRUPT: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "another node-agent (pid {}) holds the lock on state directory {}",
        pid.map_or_else(|| "unknown".to_string(), |p| p.to_string()),
        dir.display()
    )]
    AlreadyRunning { pid: Option<u32>, dir: PathBuf },
    /// The node's pin directory is locked by another agent (one per node, whatever its state
    /// directory).
    #[error(
        "another node-agent ({}) holds the lock on pin directory {}: one agent per node writes \
         the node's pins, routes and xfrm state",
        pid.map_or_else(
            || "pid unknown: a directory's lock records none, and /proc/locks did not show it"
                .to_string(),
            |p| format!("pid {p}")
        ),
        dir.display()
    )]
    PinsHeld { pid: Option<u32>, dir: PathBuf },
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("writing checkpoint {}: {source}", path.display())]
    Encode {
        path: PathBuf,
        #[source]
        source: EncodeError,
    },
    #[error(transparent)]
    Input(#[from] InputError),
    #[error(transparent)]
    Dir(#[from] DirError),
}

/// Why a checkpoint file was not used: the input gate refused it (a FIFO, a directory, over its
/// cap, ...) or it did not decode.
#[derive(Debug, thiserror::Error)]
pub enum Unusable {
    #[error(transparent)]
    Refused(#[from] InputError),
    #[error(transparent)]
    Undecodable(#[from] DecodeError),
}

/// The checkpoint at `path`, read through the input gate and decoded; `None` when there is none.
pub fn read(path: &Path) -> Result<Option<Checkpoint>, Unusable> {
    let bytes = match input::read(path, Input::Checkpoint) {
        Ok(bytes) => bytes,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    Ok(Some(format::decode(&bytes)?))
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io { what, path, source }
}

/// What [`CheckpointStore::load`] found.
#[derive(Debug)]
pub enum LoadOutcome {
    Loaded(Checkpoint),
    /// No checkpoint: a first start, or one lost. The agent goes on with the kernel sweep.
    NotFound,
    /// The file was refused or failed to decode, and was renamed to `moved_to`; the agent logs
    /// `reason` and goes on with the kernel sweep alone.
    MovedAside {
        reason: Unusable,
        moved_to: PathBuf,
    },
}

/// The PID of the agent that holds the lock on `dir`, or `None` when no agent runs there.
pub fn lock_holder(dir: &Path) -> Result<Option<u32>, StoreError> {
    let lock_path = dir.join(LOCK_NAME);
    if !lock_path.exists() {
        return Ok(None);
    }
    let mut lock = input::open(&lock_path, Input::Lock)?;
    // SAFETY: flock only reads the fd, which `lock` owns and keeps open for this call.
    let rc = unsafe { libc::flock(lock.file().as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
    if rc == 0 {
        // Nobody holds it; dropping the file releases our shared lock at once.
        return Ok(None);
    }
    let mut s = String::new();
    lock.read_to_string(&mut s).map_err(|e| lock.error(e))?;
    Ok(s.trim().parse().ok())
}

/// Whether process `pid`, as this process's PID namespace numbers processes, is the one
/// holding `dir`'s lock: it has the lock file open. The PID in the lock file is the agent's in
/// its own namespace; from another one (the host looking into a pod's state directory) it may
/// name some other process, which a signal meant for the agent would hit.
pub fn lock_held_by(dir: &Path, pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(lock) = std::fs::metadata(dir.join(LOCK_NAME)) else {
        return false;
    };
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::metadata(fd.path()).is_ok_and(|m| m.dev() == lock.dev() && m.ino() == lock.ino())
    })
}

/// The holder of the exclusive `flock` on `file`, as `/proc/locks` names it (in the PID
/// namespace of this process's `/proc`); `None` when it is not listed there or shows as 0 (a
/// holder in a PID namespace this one cannot see).
fn flock_holder(file: &File) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata().ok()?;
    let (major, minor) = (libc::major(meta.dev()), libc::minor(meta.dev()));
    let want = format!("{major:02x}:{minor:02x}:{}", meta.ino());
    let locks = fs::read_to_string("/proc/locks").ok()?;
    // `1: FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF`; a waiter's line has `->` after the id.
    locks.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            [_, "FLOCK", _, "WRITE", pid, id, ..] if *id == want => {
                pid.parse().ok().filter(|&p| p != 0)
            }
            _ => None,
        }
    })
}

/// Takes the node's pin lock: an exclusive `flock` on the pin directory `dir`
/// (`<bpffs>/node-agent`) itself, created 0700 if missing and otherwise checked like the state
/// directory ([`input::private_dir`]: never a symlink, someone else's or a shared one). Kept for
/// the life of the returned descriptor, which is close-on-exec: it dies with the process, so a
/// restarted daemon never waits on its predecessor. A directory holds no PID file (bpffs holds
/// only pins), so the holder is looked up in `/proc/locks`.
pub fn lock_pin_dir(dir: &Path) -> Result<File, StoreError> {
    let file = input::private_dir(dir, "pin directory")?;
    // SAFETY: flock only reads the fd, which `file` owns and keeps open for this call.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(StoreError::PinsHeld {
                pid: flock_holder(&file),
                dir: dir.to_owned(),
            });
        }
        return Err(StoreError::Io {
            what: "locking",
            path: dir.to_owned(),
            source: err,
        });
    }
    Ok(file)
}

/// The locked state directory.
#[derive(Debug)]
pub struct CheckpointStore {
    dir: PathBuf,
    /// Kept open: closing it releases the lock.
    _lock: File,
}

impl CheckpointStore {
    /// Creates `dir` (0700), or checks and tightens it ([`input::private_dir`]), and takes its
    /// lock.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let dir = dir.into();
        input::private_dir(&dir, "state directory")?;
        let lock_path = dir.join(LOCK_NAME);
        let mut gated = input::open(&lock_path, Input::Lock)?;
        // SAFETY: flock only reads the fd, which `gated` owns and keeps open for this call.
        let rc = unsafe { libc::flock(gated.file().as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut s = String::new();
                let _ = gated.read_to_string(&mut s);
                return Err(StoreError::AlreadyRunning {
                    pid: s.trim().parse().ok(),
                    dir,
                });
            }
            return Err(StoreError::Io {
                what: "locking",
                path: lock_path,
                source: err,
            });
        }
        let write_pid = |lock: &mut File| -> io::Result<()> {
            lock.set_len(0)?;
            lock.rewind()?;
            writeln!(lock, "{}", std::process::id())?;
            lock.sync_all()
        };
        let mut lock = gated.into_file();
        write_pid(&mut lock).map_err(io_err("writing our PID into lock file", &lock_path))?;
        let tmp = dir.join(TMP_NAME);
        match fs::remove_file(&tmp) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("removing leftover temp checkpoint", &tmp)(e)),
        }
        Ok(Self { dir, _lock: lock })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join(FILE_NAME)
    }

    /// Reads the checkpoint. A file the input gate refuses (the wrong kind of file, over its
    /// cap) or that fails to decode is moved aside, never deleted nor opened again. An I/O error
    /// reading a regular file stops the start: the file may be fine, and the record in it is not
    /// to be lost by going on without it.
    pub fn load(&self) -> Result<LoadOutcome, StoreError> {
        match read(&self.path()) {
            Ok(Some(cp)) => Ok(LoadOutcome::Loaded(cp)),
            Ok(None) => Ok(LoadOutcome::NotFound),
            Err(Unusable::Refused(e)) if matches!(e.problem, Problem::Io(_)) => Err(e.into()),
            Err(reason) => {
                let moved_to = self.move_aside()?;
                Ok(LoadOutcome::MovedAside { reason, moved_to })
            }
        }
    }

    fn move_aside(&self) -> Result<PathBuf, StoreError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let mut target = self.dir.join(format!(
            "{CORRUPT_PREFIX}{}.{:09}",
            now.as_secs(),
            now.subsec_nanos()
        ));
        let mut n = 0;
        while target.exists() {
            n += 1;
            target = self.dir.join(format!(
                "{CORRUPT_PREFIX}{}.{:09}-{n}",
                now.as_secs(),
                now.subsec_nanos()
            ));
        }
        let path = self.path();
        fs::rename(&path, &target).map_err(io_err("moving corrupt checkpoint aside", &path))?;
        self.sync_dir()?;
        self.prune_corrupt()?;
        Ok(target)
    }

    fn prune_corrupt(&self) -> Result<(), StoreError> {
        let entries =
            fs::read_dir(&self.dir).map_err(io_err("listing state directory", &self.dir))?;
        let mut corrupt: Vec<(Vec<u64>, PathBuf)> = Vec::new();
        for e in entries {
            let e = e.map_err(io_err("listing state directory", &self.dir))?;
            let name = e.file_name();
            let Some(stamp) = name.to_str().and_then(|n| n.strip_prefix(CORRUPT_PREFIX)) else {
                continue;
            };
            // Sort by the numbers in the stamp (secs, nanos, collision counter).
            let key = stamp
                .split(['.', '-'])
                .map(|p| p.parse().unwrap_or(0))
                .collect();
            corrupt.push((key, e.path()));
        }
        corrupt.sort();
        let excess = corrupt.len().saturating_sub(KEEP_CORRUPT);
        for (_, p) in corrupt.into_iter().take(excess) {
            fs::remove_file(&p).map_err(io_err("removing old corrupt checkpoint", &p))?;
        }
        Ok(())
    }

    fn sync_dir(&self) -> Result<(), StoreError> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err("syncing state directory", &self.dir))
    }

    /// Replaces the checkpoint atomically through the input gate ([`input::replace`]: a new temp
    /// file of mode 0600, fsync, rename, directory fsync). A crash at any point leaves either the
    /// old or the new checkpoint. Returns the bytes written.
    pub fn write(&self, cp: &Checkpoint) -> Result<usize, StoreError> {
        let path = self.path();
        let bytes = format::encode(cp).map_err(|source| StoreError::Encode {
            path: path.clone(),
            source,
        })?;
        input::replace(&path, Input::Checkpoint, &bytes)?;
        Ok(bytes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::format::tests::sample;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn creates_private_dir_and_file_and_leaves_no_temp() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("state");
        let store = CheckpointStore::open(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert!(matches!(store.load().unwrap(), LoadOutcome::NotFound));
        let cp = sample();
        store.write(&cp).unwrap();
        store.write(&cp).unwrap();
        assert_eq!(mode(&store.path()), 0o600);
        let mut names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["lock", "nodes.ckpt"]);
        match store.load().unwrap() {
            LoadOutcome::Loaded(back) => assert_eq!(back, cp),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn loose_existing_dir_is_tightened_and_leftover_temp_removed() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("state");
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        fs::write(dir.join(TMP_NAME), b"half a checkpoint").unwrap();
        let _store = CheckpointStore::open(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert!(!dir.join(TMP_NAME).exists());
    }

    #[test]
    fn second_open_names_the_holder_pid_until_the_first_is_dropped() {
        let t = tempfile::tempdir().unwrap();
        let first = CheckpointStore::open(t.path()).unwrap();
        match CheckpointStore::open(t.path()) {
            Err(e @ StoreError::AlreadyRunning { pid, .. }) => {
                assert_eq!(pid, Some(std::process::id()));
                assert!(e.to_string().contains(&std::process::id().to_string()));
            }
            other => panic!("{other:?}"),
        }
        drop(first);
        CheckpointStore::open(t.path()).unwrap();
    }

    /// The holder is the process with the lock file open, as this namespace numbers it; a
    /// PID that names another process (the lock file's PID read from another PID namespace)
    /// is not, and is not signalled.
    #[test]
    fn the_lock_holder_is_the_process_with_the_lock_open() {
        let t = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(t.path()).unwrap();
        assert!(lock_held_by(t.path(), std::process::id()));
        let mut other = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        assert!(!lock_held_by(t.path(), other.id()));
        other.kill().unwrap();
        other.wait().unwrap();
        drop(store);
        assert!(!lock_held_by(t.path(), std::process::id()), "released");
    }

    #[test]
    fn a_crash_mid_write_leaves_the_previous_checkpoint_and_its_temp_file_goes() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("state");
        let cp = sample();
        {
            let store = CheckpointStore::open(&dir).unwrap();
            store.write(&cp).unwrap();
            // The next write died halfway: half the new bytes in the temp file, no rename.
            let next = crate::checkpoint::encode(&cp).unwrap();
            fs::write(dir.join(TMP_NAME), &next[..next.len() / 2]).unwrap();
        }
        let store = CheckpointStore::open(&dir).unwrap();
        assert!(!dir.join(TMP_NAME).exists());
        match store.load().unwrap() {
            LoadOutcome::Loaded(back) => assert_eq!(back, cp),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_torn_checkpoint_is_moved_aside_at_every_length() {
        let t = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(t.path()).unwrap();
        let bytes = crate::checkpoint::encode(&sample()).unwrap();
        for cut in [1, 8, 19, 20, bytes.len() / 2, bytes.len() - 1] {
            fs::write(store.path(), &bytes[..cut]).unwrap();
            match store.load().unwrap() {
                LoadOutcome::MovedAside { reason, .. } => {
                    assert!(
                        matches!(
                            reason,
                            Unusable::Undecodable(
                                DecodeError::Truncated { .. } | DecodeError::BadMagic { .. }
                            )
                        ),
                        "{cut}: {reason}"
                    );
                }
                other => panic!("{cut}: {other:?}"),
            }
        }
    }

    #[test]
    fn corrupt_checkpoint_is_moved_aside_and_only_three_are_kept() {
        let t = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(t.path()).unwrap();
        let mut moved = Vec::new();
        for i in 0..5u8 {
            fs::write(store.path(), [b'x', i]).unwrap();
            match store.load().unwrap() {
                LoadOutcome::MovedAside { reason, moved_to } => {
                    assert!(matches!(
                        reason,
                        Unusable::Undecodable(DecodeError::Truncated { .. })
                    ));
                    assert_eq!(fs::read(&moved_to).unwrap(), [b'x', i]);
                    moved.push(moved_to);
                }
                other => panic!("{other:?}"),
            }
            assert!(!store.path().exists());
        }
        let kept: Vec<_> = moved.iter().filter(|p| p.exists()).collect();
        assert_eq!(kept, moved[2..].iter().collect::<Vec<_>>());
        assert!(matches!(store.load().unwrap(), LoadOutcome::NotFound));
    }

    /// An existing state directory that is a symlink, a shared (world-writable, sticky) one or
    /// someone else's is refused by name and left as it was; nothing is created in it.
    #[test]
    fn a_state_directory_not_our_own_is_refused_and_left_alone() {
        use std::os::unix::fs::MetadataExt;
        let t = tempfile::tempdir().unwrap();
        let real = t.path().join("real");
        fs::create_dir(&real).unwrap();
        fs::set_permissions(&real, fs::Permissions::from_mode(0o755)).unwrap();
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let shared = t.path().join("shared");
        fs::create_dir(&shared).unwrap();
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o1777)).unwrap();
        let sticky = t.path().join("sticky");
        fs::create_dir(&sticky).unwrap();
        fs::set_permissions(&sticky, fs::Permissions::from_mode(0o1750)).unwrap();
        let file = t.path().join("file");
        fs::write(&file, "x").unwrap();
        let mut cases = vec![
            (&link, "is a symbolic link", 0o755, &real),
            (&shared, "world-writable", 0o1777, &shared),
            (&sticky, "sticky", 0o1750, &sticky),
        ];
        let foreign = t.path().join("foreign");
        fs::create_dir(&foreign).unwrap();
        fs::set_permissions(&foreign, fs::Permissions::from_mode(0o755)).unwrap();
        // SAFETY: geteuid cannot fail. Only root can give a directory away.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&foreign, Some(65534), None).unwrap();
            cases.push((&foreign, "owned by uid 65534", 0o755, &foreign));
        }
        for (dir, says, mode_before, target) in cases {
            let e = CheckpointStore::open(dir).unwrap_err().to_string();
            assert!(
                e.contains(says) && e.contains(&*dir.to_string_lossy()),
                "{e}"
            );
            assert_eq!(
                fs::metadata(target).unwrap().mode() & 0o7777,
                mode_before,
                "{e}"
            );
            assert_eq!(fs::read_dir(target).unwrap().count(), 0, "{e}");
        }
        let e = CheckpointStore::open(&file).unwrap_err().to_string();
        assert!(e.contains("is not a directory"), "{e}");
    }

    /// The lock file is written in place (the PID), so what sits at its path is never
    /// followed: a symlink (to a file, or dangling), a second hard link, a FIFO are refused by
    /// name, the file a link points at keeps its bytes and a dangling link creates nothing.
    #[test]
    fn the_lock_is_never_written_through_a_link() {
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        let dir = t.path().join("state");
        fs::create_dir(&dir).unwrap();
        let lock = dir.join(LOCK_NAME);
        let dangling = t.path().join("nothing-here");
        let plant: [(&str, &str, &dyn Fn()); 4] = [
            ("symlink", "is a symbolic link", &|| {
                std::os::unix::fs::symlink(&victim, &lock).unwrap()
            }),
            ("dangling symlink", "is a symbolic link", &|| {
                std::os::unix::fs::symlink(&dangling, &lock).unwrap()
            }),
            ("hard link", "has 2 hard links", &|| {
                fs::hard_link(&victim, &lock).unwrap()
            }),
            ("FIFO", "is a FIFO", &|| {
                let c = std::ffi::CString::new(lock.as_os_str().as_encoded_bytes()).unwrap();
                // SAFETY: a valid NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            }),
        ];
        for (what, says, plant) in plant {
            fs::write(&victim, "precious\n").unwrap();
            plant();
            let e = CheckpointStore::open(&dir).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("lock"), "{what}: {e}");
            assert_eq!(fs::read_to_string(&victim).unwrap(), "precious\n", "{what}");
            assert!(!dangling.exists(), "{what}");
            fs::remove_file(&lock).unwrap();
        }
        CheckpointStore::open(&dir).unwrap();
    }

    /// The pin directory's lock: a second taker (another open of it, as another agent would)
    /// is refused naming the holder's PID from /proc/locks; released when the first goes.
    #[test]
    fn the_pin_directory_is_locked_by_one_holder_named_in_the_refusal() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("node-agent");
        let first = lock_pin_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        match lock_pin_dir(&dir) {
            Err(e @ StoreError::PinsHeld { pid, .. }) => {
                let s = e.to_string();
                assert!(
                    s.contains("pin directory") && s.contains("node-agent"),
                    "{s}"
                );
                if let Some(pid) = pid {
                    assert_eq!(pid, std::process::id(), "{s}");
                }
            }
            other => panic!("{other:?}"),
        }
        drop(first);
        let _again = lock_pin_dir(&dir).unwrap();
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let e = lock_pin_dir(&link).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
    }
}

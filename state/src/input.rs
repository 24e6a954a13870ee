//! The input gate: every file the agent reads is opened here, and nowhere else.
//!
//! What an operator, a volume mount or a hostile neighbour puts at one of the agent's paths is
//! input, and any of it can be the wrong kind of file: a FIFO (an `open` or a `read` that
//! blocks for ever), a device, a socket, a directory, or a regular file far larger than anything
//! the agent writes or a cluster produces (read whole, an OOM loop under the DaemonSet's memory
//! limit). So every [`Input`] is
//!
//! 1. looked at before it is opened (symlinks followed: a Secret or ConfigMap mount is a chain
//!    of them) and refused unless it is a regular file, so no device is ever opened. The agent's
//!    own files in its state directory ([`Input::own`]: the lock, the checkpoint, the hold and
//!    the confirmation) are never followed through a symlink (`O_NOFOLLOW`): a symlink there is
//!    refused, and the lock, the one file written in place, is refused with a second hard link
//!    too, so that a write lands in no other file;
//! 2. opened with `O_NONBLOCK` (a FIFO swapped in after that look cannot block the open) and
//!    looked at again through the descriptor, which is what is read;
//! 3. read through [`Gated`], which fails once more than the kind's [`Input::cap`] has come
//!    (a file that grows while it is read, or lied about its size);
//! 4. parsed by its reader with limits of its own: the nodes file's YAML and JSON parsers have
//!    depth and event budgets (`node-agent/src/source/file.rs`), the checkpoint's decoder a
//!    memory budget (`checkpoint/payload`).
//!
//! The directories the agent writes in (the state directory, the pin directory and its link
//! directory) go through [`private_dir`]: created 0700 when missing; when present, refused if
//! a symlink, not a directory, someone else's, world-writable or sticky (a shared `/tmp`),
//! otherwise tightened to 0700.
//!
//! Every refusal names the file's kind, its path, and what was wrong with it (the kind of file
//! found, or its size against the cap), and leaves the agent's last good state alone. The kernel's
//! pseudo-files (`/proc`, `/sys`) are not inputs in this sense: the agent reads a few fixed ones
//! of its own process and kernel, whose kind and size no one else chooses.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// One kind of file the agent reads. Its cap is what it can legitimately hold, with room to spare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// `--nodes-file`: a NodeList, as `kubectl get nodes -o yaml|json` prints it.
    NodeList,
    /// `--kubeconfig`.
    Kubeconfig,
    /// A bearer token the Kubernetes client sends: a kubeconfig user's `tokenFile`, or the
    /// pod's service-account token.
    Token,
    /// The certificate authorities the Kubernetes client trusts: a kubeconfig cluster's
    /// `certificate-authority`, or the service account's `ca.crt`.
    CaBundle,
    /// A kubeconfig user's `client-certificate`: a certificate and its chain.
    ClientCertificate,
    /// A kubeconfig user's `client-key`.
    ClientKey,
    /// The service account's `namespace`, read by the in-cluster configuration.
    Namespace,
    /// The checkpoint in the state directory.
    Checkpoint,
    /// The state directory's lock file (the holder's PID); opened to be locked and written too.
    Lock,
    /// `--ipsec-key-file`.
    KeyFile,
    /// The brake's hold, published by the daemon for `node-agent prune status`.
    HoldFile,
    /// An operator's confirmation of a hold (`node-agent prune confirm`).
    Confirmation,
}

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// The most nodes the agent programs: one node ID each, 16 bits.
const MAX_NODES: u64 = 65_536;

impl Input {
    /// Every kind, for the tests that walk them.
    pub const ALL: [Input; 12] = [
        Input::NodeList,
        Input::Kubeconfig,
        Input::Token,
        Input::CaBundle,
        Input::ClientCertificate,
        Input::ClientKey,
        Input::Namespace,
        Input::Checkpoint,
        Input::Lock,
        Input::KeyFile,
        Input::HoldFile,
        Input::Confirmation,
    ];

    /// Whether this is one of the agent's own files in its state directory, which it writes
    /// (or replaces, or takes by rename): never opened through a symlink.
    pub const fn own(self) -> bool {
        matches!(
            self,
            Input::Checkpoint | Input::Lock | Input::HoldFile | Input::Confirmation
        )
    }

    /// What the file is, for messages.
    pub fn what(self) -> &'static str {
        match self {
            Input::NodeList => "nodes file",
            Input::Kubeconfig => "kubeconfig",
            Input::Token => "token file",
            Input::CaBundle => "CA bundle",
            Input::ClientCertificate => "client certificate",
            Input::ClientKey => "client key",
            Input::Namespace => "namespace file",
            Input::Checkpoint => "checkpoint",
            Input::Lock => "lock file",
            Input::KeyFile => "IPsec key file",
            Input::HoldFile => "hold file",
            Input::Confirmation => "prune confirmation",
        }
    }

    /// The most bytes the file can legitimately hold.
    pub const fn cap(self) -> u64 {
        match self {
            // Every node of the largest cluster as the API server prints it, managed fields,
            // images and conditions included: 64 KiB a node is several times a real one. The
            // list is parsed as it is read (only what the agent keeps of each node stays), so
            // the cap bounds the time a read takes, not its memory.
            Input::NodeList => MAX_NODES * 64 * KIB,
            // Many clusters' contexts with their certificates inline.
            Input::Kubeconfig => 4 * MIB,
            // A projected service-account token is about 1 KiB; an OIDC ID token with many group
            // claims some KiB: 64 KiB.
            Input::Token => 64 * KIB,
            // A whole system trust store is a few hundred KiB of PEM: 4 MiB.
            Input::CaBundle => 4 * MIB,
            // A certificate is 1 to 2 KiB of PEM, with its chain a few: 1 MiB.
            Input::ClientCertificate => MIB,
            // An RSA-16384 key, the largest anyone uses, is about 13 KiB of PEM: 64 KiB.
            Input::ClientKey => 64 * KIB,
            // A namespace name is at most 63 bytes.
            Input::Namespace => 4 * KIB,
            // A record per node ID of at most 1 KiB (a 253-byte name, UID and boot ID, a dozen
            // addresses, two pod CIDRs, a pending delete), several times a real record. The
            // decoder allocates within a budget of its own.
            Input::Checkpoint => MAX_NODES * KIB,
            // A PID and a newline.
            Input::Lock => 64,
            // At most 15 keys (SPIs 1 to 15), a line of about 100 bytes each, and comments.
            Input::KeyFile => 64 * KIB,
            // The held nodes' names (253 bytes at most, quoted) and a few fixed fields.
            Input::HoldFile => MAX_NODES * 256 + 64 * KIB,
            // A hold ID.
            Input::Confirmation => 4 * KIB,
        }
    }
}

/// Why an input was refused: which file, and its [`Problem`].
#[derive(Debug, thiserror::Error)]
#[error("{} {}: {problem}", what.what(), path.display())]
pub struct InputError {
    pub what: Input,
    pub path: PathBuf,
    #[source]
    pub problem: Problem,
}

/// What was wrong with an input.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    #[error("not found")]
    NotFound,
    #[error("is {0}, not a regular file")]
    NotRegular(&'static str),
    /// The lock, written in place, with another name elsewhere.
    #[error("has {0} hard links: a file the agent writes in place must have only its own name")]
    HardLinked(u64),
    #[error("{size} bytes or more, over the {cap} bytes such a file can hold")]
    TooLarge { size: u64, cap: u64 },
    #[error("{0}")]
    Io(#[source] io::Error),
    /// A step of [`replace`] failed.
    #[error("{step}: {source}")]
    Write {
        step: &'static str,
        #[source]
        source: io::Error,
    },
}

impl InputError {
    fn new(what: Input, path: &Path, problem: Problem) -> Self {
        Self {
            what,
            path: path.to_owned(),
            problem,
        }
    }

    /// No file at the path: for most inputs an ordinary state (no checkpoint yet, no hold).
    pub fn is_not_found(&self) -> bool {
        matches!(self.problem, Problem::NotFound)
    }
}

/// An input that passed the gate: read it through [`Read`], which enforces its cap.
#[derive(Debug)]
pub struct Gated {
    file: File,
    what: Input,
    path: PathBuf,
    /// The length the descriptor had when it was opened.
    len: u64,
    read: u64,
}

/// The kind of a file that is not a regular one, in words.
fn kind_of(meta: &Metadata) -> Option<&'static str> {
    let t = meta.file_type();
    let found = if t.is_file() {
        return None;
    } else if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a file"
    };
    Some(found)
}

/// Opens `path` as input `what`: refused unless it is a regular file no larger than the kind's
/// cap; symlinks are followed, except to the agent's own files ([`Input::own`]), where a symlink
/// is refused (`O_NOFOLLOW`: a dangling one creates nothing either). The lock file is created
/// (0600) when missing, and refused with more than one hard link; every other input that is
/// missing is [`InputError::NotFound`].
pub fn open(path: &Path, what: Input) -> Result<Gated, InputError> {
    use std::os::unix::fs::MetadataExt;
    let err = |source: io::Error| {
        let problem = match source.raw_os_error() {
            _ if source.kind() == io::ErrorKind::NotFound => Problem::NotFound,
            // O_NOFOLLOW met a symlink swapped in after the look.
            Some(libc::ELOOP) if what.own() => Problem::NotRegular("a symbolic link"),
            _ => Problem::Io(source),
        };
        InputError::new(what, path, problem)
    };
    let check = |meta: &Metadata| {
        if let Some(found) = kind_of(meta) {
            return Err(InputError::new(what, path, Problem::NotRegular(found)));
        }
        if meta.len() > what.cap() {
            let (size, cap) = (meta.len(), what.cap());
            return Err(InputError::new(what, path, Problem::TooLarge { size, cap }));
        }
        if what == Input::Lock && meta.nlink() > 1 {
            return Err(InputError::new(
                what,
                path,
                Problem::HardLinked(meta.nlink()),
            ));
        }
        Ok(())
    };
    let look = match what.own() {
        true => std::fs::symlink_metadata(path),
        false => std::fs::metadata(path),
    };
    match look {
        Ok(meta) => check(&meta)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound && what == Input::Lock => {}
        Err(e) => return Err(err(e)),
    }
    let mut flags = libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
    if what.own() {
        flags |= libc::O_NOFOLLOW;
    }
    let mut options = OpenOptions::new();
    options.read(true).custom_flags(flags);
    if what == Input::Lock {
        options.write(true).create(true).truncate(false).mode(0o600);
    }
    let file = options.open(path).map_err(err)?;
    let meta = file.metadata().map_err(err)?;
    check(&meta)?;
    Ok(Gated {
        file,
        what,
        path: path.to_owned(),
        len: meta.len(),
        read: 0,
    })
}

/// The whole of input `what` at `path`, within its cap. The buffer is sized once from the file's
/// length, so that key material is not left behind in the freed buffers of a growing one.
pub fn read(path: &Path, what: Input) -> Result<Vec<u8>, InputError> {
    open(path, what)?.read_all()
}

/// Replaces the agent's file `what` at `path` with `bytes`: written to a temporary file beside
/// it (`.NAME.tmp`; whatever was left there is removed first, not opened), created new with
/// mode 0600 and `O_NOFOLLOW` (never through a symlink, nor into a FIFO someone put there),
/// synced, renamed over `path`, and the directory synced. A crash at any point leaves the old
/// file or the new one. Refused over the kind's cap: what the agent writes, it must read back.
pub fn replace(path: &Path, what: Input, bytes: &[u8]) -> Result<(), InputError> {
    use std::io::Write;
    if bytes.len() as u64 > what.cap() {
        let (size, cap) = (bytes.len() as u64, what.cap());
        return Err(InputError::new(what, path, Problem::TooLarge { size, cap }));
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut name = std::ffi::OsString::from(".");
    name.push(path.file_name().unwrap_or_default());
    name.push(".tmp");
    let tmp = dir.join(name);
    let fail = |at: &Path, step, source| InputError::new(what, at, Problem::Write { step, source });
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(fail(&tmp, "removing a leftover", e));
        }
        _ => {}
    }
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&tmp)
            .map_err(|e| fail(&tmp, "creating", e))?;
        f.write_all(bytes).map_err(|e| fail(&tmp, "writing", e))?;
        f.sync_all().map_err(|e| fail(&tmp, "syncing", e))?;
        std::fs::rename(&tmp, path).map_err(|e| fail(path, "renaming into place", e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| fail(dir, "syncing the directory", e))
}

/// Why a directory the agent writes in was refused: which one, where, and what was wrong.
#[derive(Debug, thiserror::Error)]
#[error("{what} {}: {problem}", path.display())]
pub struct DirError {
    pub what: &'static str,
    pub path: PathBuf,
    #[source]
    pub problem: DirProblem,
}

/// What was wrong with a directory the agent writes in.
#[derive(Debug, thiserror::Error)]
pub enum DirProblem {
    #[error(
        "is a symbolic link; the agent writes only in a directory of its own, never through a link"
    )]
    Symlink,
    #[error("is not a directory")]
    NotDirectory,
    #[error(
        "is owned by uid {owner}, not by this agent's uid {ours}; refusing to write in someone else's directory"
    )]
    Foreign { owner: u32, ours: u32 },
    #[error(
        "is world-writable (mode {0:04o}); refusing a shared directory: give the agent one of its own"
    )]
    WorldWritable(u32),
    #[error("is sticky (mode {0:04o}), a shared directory; give the agent one of its own")]
    Sticky(u32),
    #[error("{step}: {source}")]
    Io {
        step: &'static str,
        #[source]
        source: io::Error,
    },
}

/// The directory `what` at `path`, opened (`O_DIRECTORY | O_NOFOLLOW`, so that the checks and
/// the chmod are of the directory itself, never of a link's target) as one the agent may write
/// in: created 0700 (with its missing parents) when
/// missing; when present, refused if it is a symlink, not a directory, not owned by this
/// process's effective uid, world-writable or sticky, and otherwise tightened to 0700 (a
/// hostPath the kubelet made 0755, say). Never chmods what it refuses.
pub fn private_dir(path: &Path, what: &'static str) -> Result<File, DirError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let fail = |problem| DirError {
        what,
        path: path.to_owned(),
        problem,
    };
    let io = |step| move |source| fail(DirProblem::Io { step, source });
    match std::fs::symlink_metadata(path) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(path)
                .map_err(io("creating"))?;
        }
        Err(e) => return Err(io("looking at")(e)),
    }
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            // `O_DIRECTORY` on a symlink says ENOTDIR: which it was is looked at again.
            Some(libc::ELOOP | libc::ENOTDIR) => match std::fs::symlink_metadata(path) {
                Ok(m) if m.file_type().is_symlink() => fail(DirProblem::Symlink),
                _ => fail(DirProblem::NotDirectory),
            },
            _ => fail(DirProblem::Io {
                step: "opening",
                source: e,
            }),
        })?;
    let meta = dir.metadata().map_err(io("looking at"))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let ours = unsafe { libc::geteuid() };
    let mode = meta.mode() & 0o7777;
    if meta.uid() != ours {
        return Err(fail(DirProblem::Foreign {
            owner: meta.uid(),
            ours,
        }));
    }
    if mode & 0o002 != 0 {
        return Err(fail(DirProblem::WorldWritable(mode)));
    }
    if mode & 0o1000 != 0 {
        return Err(fail(DirProblem::Sticky(mode)));
    }
    if mode & 0o077 != 0 {
        // Through the descriptor: the directory checked, not whatever the path names now.
        dir.set_permissions(std::fs::Permissions::from_mode(0o700))
            .map_err(io("restricting to 0700"))?;
    }
    Ok(dir)
}

impl Gated {
    /// The open file, for what is done to it besides reading (the lock's `flock`, writes).
    pub fn file(&mut self) -> &mut File {
        &mut self.file
    }

    pub fn into_file(self) -> File {
        self.file
    }

    /// The rest of the file, within its cap.
    pub fn read_all(mut self) -> Result<Vec<u8>, InputError> {
        let mut bytes = Vec::with_capacity(usize::try_from(self.len).unwrap_or(0) + 1);
        self.read_to_end(&mut bytes).map_err(|e| self.error(e))?;
        Ok(bytes)
    }

    /// The error a failed read of this input is reported as: over the cap, or the I/O error.
    pub fn error(&self, e: io::Error) -> InputError {
        let problem = if e.kind() == io::ErrorKind::FileTooLarge {
            Problem::TooLarge {
                size: self.read,
                cap: self.what.cap(),
            }
        } else {
            Problem::Io(e)
        };
        InputError::new(self.what, &self.path, problem)
    }
}

impl Read for Gated {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read(buf)?;
        self.read += n as u64;
        if self.read > self.what.cap() {
            return Err(io::Error::new(
                io::ErrorKind::FileTooLarge,
                format!(
                    "{} {}: grew past the {} bytes such a file can hold while it was read",
                    self.what.what(),
                    self.path.display(),
                    self.what.cap()
                ),
            ));
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever sits at the temporary path (a FIFO that would block the write, a symlink that
    /// would send it elsewhere, a stale file) is removed, never written through; a directory
    /// there is an error naming it. Over the cap, nothing is written.
    #[test]
    fn replace_never_writes_through_what_sits_at_its_temporary_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hold.json");
        let tmp = dir.path().join(".hold.json.tmp");
        let elsewhere = dir.path().join("elsewhere");
        std::fs::write(&elsewhere, "untouched").unwrap();
        let plant: [(&str, &dyn Fn()); 3] = [
            ("a FIFO", &|| {
                let c = std::ffi::CString::new(tmp.as_os_str().as_encoded_bytes()).unwrap();
                // SAFETY: a valid NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            }),
            ("a symlink", &|| {
                std::os::unix::fs::symlink(&elsewhere, &tmp).unwrap()
            }),
            ("a stale file", &|| std::fs::write(&tmp, "stale").unwrap()),
        ];
        for (what, plant) in plant {
            plant();
            replace(&path, Input::HoldFile, b"{}").unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(std::fs::read(&path).unwrap(), b"{}", "{what}");
            assert!(std::fs::symlink_metadata(&tmp).is_err(), "{what}");
            assert_eq!(
                std::fs::read_to_string(&elsewhere).unwrap(),
                "untouched",
                "{what}"
            );
        }
        std::fs::create_dir(&tmp).unwrap();
        let e = replace(&path, Input::HoldFile, b"{}")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(".hold.json.tmp") && e.contains("removing a leftover"),
            "{e}"
        );
        std::fs::remove_dir(&tmp).unwrap();
        let big = vec![b'x'; Input::Confirmation.cap() as usize + 1];
        let e = replace(&path, Input::Confirmation, &big)
            .unwrap_err()
            .to_string();
        assert!(e.contains("over the 4096 bytes"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"{}");
    }

    #[test]
    fn caps_hold_what_each_file_legitimately_holds() {
        // A hold of every node of the largest cluster, under the longest names.
        assert!(Input::Checkpoint.cap() >= 64 * MIB);
        assert!(Input::HoldFile.cap() >= 65_536 * (253 + 3));
        assert!(Input::NodeList.cap() >= 4 * 1024 * MIB);
        for what in Input::ALL {
            assert!(what.cap() > 0, "{what:?}");
        }
    }
}

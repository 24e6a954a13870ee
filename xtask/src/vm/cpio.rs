//! A minimal writer for the `newc` cpio format the kernel unpacks as its initramfs.
//!
//! Written here rather than piping `find | cpio` so the archive can take files straight from
//! their host paths (the real `ip`, the libraries `ldd` names) under the paths the guest needs,
//! without copying them into a staging tree first. Archives are left uncompressed: under TCG
//! the kernel's decompressor is slow, while unpacking a plain archive is a copy.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::Context;

#[derive(Default)]
pub struct Archive {
    buf: Vec<u8>,
    ino: u32,
    dirs: BTreeSet<String>,
    entries: BTreeSet<String>,
}

impl Archive {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a directory (and its parents) once.
    pub fn dir(&mut self, path: &str) {
        let path = path.trim_matches('/');
        if path.is_empty() || self.dirs.contains(path) {
            return;
        }
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent);
        }
        self.dirs.insert(path.to_owned());
        self.entry(path, 0o040755, b"");
    }

    /// Adds a regular file; a path added twice keeps its first content.
    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) {
        self.leaf(path, 0o100000 | (mode & 0o7777), data);
    }

    pub fn symlink(&mut self, path: &str, target: &str) {
        self.leaf(path, 0o120777, target.as_bytes());
    }

    /// Whether `path` is already in the archive.
    pub fn contains(&self, path: &str) -> bool {
        self.entries.contains(path.trim_matches('/'))
    }

    /// Copies a host file (following symlinks) to `path`, keeping its permission bits.
    pub fn host_file(&mut self, host: &Path, path: &str) -> anyhow::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        if self.contains(path) {
            return Ok(());
        }
        let data = std::fs::read(host).with_context(|| format!("reading {}", host.display()))?;
        let mode = std::fs::metadata(host)
            .with_context(|| format!("stat {}", host.display()))?
            .permissions()
            .mode();
        self.file(path, mode, &data);
        Ok(())
    }

    /// Adds everything below the host directory `host` under `prefix`.
    pub fn host_tree(&mut self, host: &Path, prefix: &str) -> anyhow::Result<()> {
        self.dir(prefix);
        let mut entries: Vec<_> = std::fs::read_dir(host)
            .with_context(|| format!("listing {}", host.display()))?
            .collect::<Result<_, _>>()
            .with_context(|| format!("listing {}", host.display()))?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name();
            let path = format!("{prefix}/{}", name.to_string_lossy());
            let ty = e.file_type()?;
            if ty.is_dir() {
                self.host_tree(&e.path(), &path)?;
            } else if ty.is_symlink() {
                let target = std::fs::read_link(e.path())?;
                self.symlink(&path, &target.to_string_lossy());
            } else {
                self.host_file(&e.path(), &path)?;
            }
        }
        Ok(())
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, b"");
        self.buf
    }

    fn leaf(&mut self, path: &str, mode: u32, data: &[u8]) {
        let path = path.trim_matches('/');
        if self.contains(path) {
            return;
        }
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent);
        }
        self.entries.insert(path.to_owned());
        self.entry(path, mode, data);
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.ino += 1;
        let nlink = if mode & 0o170000 == 0o040000 { 2 } else { 1 };
        let fields = [
            self.ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            data.len() as u32,
            0, // dev major
            0, // dev minor
            0, // rdev major
            0, // rdev minor
            name.len() as u32 + 1,
            0, // check
        ];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08X}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }
}

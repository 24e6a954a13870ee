//! The IPsec key file as the agent follows it: where it is, what the last good read found, and
//! reading it again. Reading a file is no kernel operation: the xfrm backend only receives the
//! keys a read produced.

use std::path::PathBuf;
use std::sync::Arc;

use state::rotation::FileKey;

use super::keys::{KeyBook, KeyFile};
use crate::kernel::KeyRead;

/// The IPsec key file: where it is, and what the last good read found (never the key material,
/// which only the xfrm backend holds).
pub struct KeyFileState {
    path: PathBuf,
    keys: Vec<FileKey>,
    digest: [u8; 32],
    /// The last error, so it is logged once, not at every read.
    error: Option<String>,
    /// The keys, shared with the xfrm backend.
    book: Arc<KeyBook>,
}

impl KeyFileState {
    pub(crate) fn new(path: PathBuf, file: &KeyFile) -> Self {
        Self {
            path,
            keys: file_keys(file),
            digest: file.digest,
            error: None,
            book: Arc::default(),
        }
    }

    /// What the last good read found, as the planner sees it.
    pub fn read(&self) -> KeyRead {
        KeyRead {
            keys: self.keys.clone(),
            digest: self.digest,
            error: self.error.clone(),
            tags: self.book.clone(),
        }
    }

    /// The keys shared with the xfrm backend, which holds their material.
    pub(crate) fn set_book(&mut self, book: Arc<KeyBook>) {
        self.book = book;
    }

    /// Reads the key file again; returns the new keys when it changed, for the xfrm backend. A
    /// file that cannot be used keeps the previous keys, and says why once.
    pub fn reload(&mut self) -> Option<Arc<KeyBook>> {
        match KeyFile::load(&self.path) {
            Ok(file) if file.digest == self.digest => self.error = None,
            Ok(file) => {
                warn_about(&file);
                self.keys = file_keys(&file);
                self.digest = file.digest;
                self.error = None;
                let spis: Vec<u8> = self.keys.iter().map(|k| k.spi).collect();
                tracing::info!(path = %self.path.display(), ?spis, "IPsec key file changed");
                self.book = Arc::new(KeyBook::new(file.keys));
                return Some(self.book.clone());
            }
            Err(e) => {
                let e = e.to_string();
                if self.error.as_ref() != Some(&e) {
                    tracing::error!("{e}; keeping the keys read before");
                }
                self.error = Some(e);
            }
        }
        None
    }
}

/// Logs what is worth knowing about a key file just read: its permissions, global keys.
pub(crate) fn warn_about(file: &KeyFile) {
    for w in &file.warnings {
        tracing::warn!(path = %file.path.display(), "{w}");
    }
    for k in file.keys.iter().filter(|k| !k.per_pair()) {
        tracing::warn!(
            spi = k.spi(),
            "IPsec key SPI {} is one key for every node pair: their GCM nonces overlap, and a \
             rebooted node's traffic is dropped by its peers' anti-replay windows until the key \
             is rotated; write it as `{}+` for per-pair keys",
            k.spi(),
            k.spi()
        );
    }
}

fn file_keys(file: &KeyFile) -> Vec<FileKey> {
    file.keys
        .iter()
        .map(|k| FileKey {
            spi: k.spi(),
            tag: k.tag(),
            layout: k.layout(),
        })
        .collect()
}

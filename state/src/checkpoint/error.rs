//! What can go wrong writing or reading the checkpoint's bytes.
//!
//! Apart from [`super::format`], which dispatches to each version's payload module: those
//! modules report these errors too, and would otherwise import the module that calls them.

#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("encoding the checkpoint: payload of {len} bytes exceeds the format's 4 GiB limit")]
    TooLarge { len: usize },
    #[error("encoding the checkpoint payload: bincode: {0}")]
    Payload(bincode::error::EncodeError),
}

/// Why a payload that passed the header checks is not a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    /// bincode could not read the wire structs: the bytes end early, a tag or length is out of
    /// range, a string is not UTF-8, the decode limit was hit...
    #[error("bincode: {0}")]
    Bincode(bincode::error::DecodeError),
    /// The wire structs decoded, but a field holds what the encoder never writes.
    #[error("{field}: {problem}")]
    Invalid {
        /// Which field, as a path: `nodes[3] ("worker-b").pod_cidrs[0]`, `freed[0].id`.
        field: String,
        problem: &'static str,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("decoding the checkpoint: truncated, {found} bytes where at least {needed} are needed")]
    Truncated { needed: usize, found: usize },
    #[error("decoding the checkpoint: bad magic {found:02x?}, not a node-agent checkpoint")]
    BadMagic { found: [u8; 8] },
    #[error(
        "decoding the checkpoint: format version {found} is newer than the newest supported, {supported}"
    )]
    VersionTooNew { found: u32, supported: u32 },
    #[error("decoding the checkpoint: format version {found} was never written")]
    VersionUnknown { found: u32 },
    #[error("decoding the checkpoint: {extra} bytes after the declared payload")]
    TrailingBytes { extra: usize },
    #[error(
        "decoding the checkpoint: payload checksum mismatch, header says {expected:#010x}, payload has {actual:#010x}"
    )]
    ChecksumMismatch { expected: u32, actual: u32 },
    #[error("decoding the checkpoint payload (format version {version}): {reason}")]
    Payload { version: u32, reason: PayloadError },
    #[error("decoding the checkpoint payload: {unread} bytes left unread")]
    PayloadTrailing { unread: usize },
    #[error("decoding the checkpoint: invalid node record: {0}")]
    InvalidNode(#[from] crate::node::NodeError),
}

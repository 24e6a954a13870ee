//! The IPsec key file: the SPI and AEAD key every node uses for its ESP states.
//!
//! # Format
//!
//! One key per line, four whitespace-separated fields (Cilium's format), and a fifth that
//! chooses the SPI layout:
//!
//! ```text
//! # <spi> <aead-algorithm> <hex-key> <icv-bits> [per-sender-spi]
//! 3 rfc4106(gcm(aes)) 0x0102030405060708090a0b0c0d0e0f1011121314 128
//! ```
//!
//! - `spi`: 1..=15, decimal, each SPI on one line at most. It must fit the 4 SPI bits of the
//!   xfrm mark ([`state::objects::mark`]); the kernel SPI of our states is the same number.
//!   A `+` right after it (`3+`, Cilium's notation) asks for **per-pair keys**: each state
//!   gets its own key, derived from this one ([`derive`]).
//! - `aead-algorithm`: `rfc4106(gcm(aes))` (AES-GCM for ESP), the only one accepted.
//! - `hex-key`: the key followed by the 4-byte salt, hex, with or without `0x`: 16, 24 or 32 key
//!   bytes + 4 salt bytes (20, 28 or 36 bytes, 40, 56 or 72 hex digits).
//! - `icv-bits`: the ICV (tag) length, 64, 96 or 128.
//! - `per-sender-spi`: the key's states put a tag of the sending address above the key's number
//!   in their SPI ([`state::spi`]). Every node must run a release that receives that layout
//!   before a key asks for it: releases before it refuse the whole file (a five-field line): a
//!   running one keeps its keys and says so, one that starts fails to.
//!
//! `#` starts a comment (whole line or trailing); blank lines are ignored.
//!
//! # Per-pair keys
//!
//! With one key for every node pair, every OUT state in the cluster encrypts under the same
//! AES-GCM key, and their sequence numbers (hence the GCM nonces) overlap: nonce reuse. And a
//! rebooted node's states start their sequence numbers over, which its peers' anti-replay
//! windows drop. A per-pair key is derived for each state from the file's key, both ends'
//! addresses and both ends' boot IDs ([`derive`]): no two states share a key, and a reboot
//! changes the keys of every state toward and from the node, so both sides replace them.
//! Global keys still work, with a warning at start-up; per-pair keys are what to use.
//!
//! **Several lines**: every key line must be valid (a typo in a newly appended key is an error,
//! never silently skipped in favour of the older key), and the **last** line is the newest key.
//! Rotation means appending a line with a new SPI; `state::rotation` decides from the order of
//! the lines and from when the agent first saw each key which keys have states and which one
//! traffic is sent with.
//!
//! # Secrecy
//!
//! Key material never leaves [`IpsecKey`] except through [`IpsecKey::key_bytes`], which only the
//! xfrm backend calls to build its netlink messages, and [`IpsecKey::tag`], a fingerprint that
//! reveals nothing usable about it. `IpsecKey`'s `Debug` redacts the key, it
//! implements neither `Display` nor `Serialize`, errors never quote the line they complain about
//! (only its number and what is wrong), and the key bytes are overwritten when the key is
//! dropped. A key file readable by group or others draws a warning naming the path and the mode.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use state::objects::{KeyTag, SpiLayout};
use state::plan::{KeyInUse, KeyTags, Pair};

/// The only AEAD algorithm accepted.
pub const RFC4106_GCM_AES: &str = "rfc4106(gcm(aes))";
/// Bytes of salt that follow the key for `rfc4106(gcm(aes))`.
pub const RFC4106_SALT_LEN: usize = 4;

/// One ESP key: SPI, AEAD algorithm, key material (key + salt) and ICV length.
pub struct IpsecKey {
    spi: u8,
    /// States get keys derived per node pair (`<spi>+`).
    per_pair: bool,
    /// How the key's states lay out their SPI (`per-sender-spi`).
    layout: SpiLayout,
    /// Its fingerprint, computed once: a plan asks for it for every state.
    tag: KeyTag,
    algorithm: String,
    key: Vec<u8>,
    icv_bits: u32,
}

impl IpsecKey {
    /// The SPI, 1..=15: the kernel SPI of our states and the SPI bits of our marks.
    pub fn spi(&self) -> u8 {
        self.spi
    }

    /// The AEAD algorithm name as the kernel's crypto API knows it.
    pub fn algorithm(&self) -> &str {
        &self.algorithm
    }

    /// Whether states get keys derived per node pair from this one.
    pub fn per_pair(&self) -> bool {
        self.per_pair
    }

    /// How the key's states lay out their SPI.
    pub fn layout(&self) -> SpiLayout {
        self.layout
    }

    /// The ICV length in bits.
    pub fn icv_bits(&self) -> u32 {
        self.icv_bits
    }

    /// Length of the key material (key + salt) in bytes.
    pub fn key_len(&self) -> usize {
        self.key.len()
    }

    /// The key material (key + salt). Secret: for building kernel messages only.
    pub fn key_bytes(&self) -> &[u8] {
        &self.key
    }

    /// The fingerprint of the states this key makes (see [`tag`]).
    pub fn tag(&self) -> KeyTag {
        self.tag
    }

    /// Parses a key file's text and returns its newest (last) key. `path` only labels errors.
    pub fn parse(text: &str, path: Option<&Path>) -> Result<Self, KeyError> {
        let mut keys = parse_keys(text, path)?;
        Ok(keys.pop().expect("parse_keys returns at least one key"))
    }
}

/// The fingerprint of a state's key: the first 8 bytes of SHA-256 over the algorithm name, a
/// zero byte, the ICV length (32 bits, big-endian) and the key material. The agent computes it
/// for the keys it installs and for the states it dumps, and compares the two.
pub fn tag(algorithm: &str, icv_bits: u32, key: &[u8]) -> KeyTag {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(algorithm.as_bytes());
    ctx.update(&[0]);
    ctx.update(&icv_bits.to_be_bytes());
    ctx.update(key);
    let digest = ctx.finish();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_ref()[..8]);
    KeyTag(u64::from_be_bytes(first))
}

/// Parses a key file's text: every key, in file order (the last is the newest). Fails on the
/// first invalid line, on an SPI used twice, and on a file without keys.
pub fn parse_keys(text: &str, path: Option<&Path>) -> Result<Vec<IpsecKey>, KeyError> {
    let err = |line: usize, kind: KeyErrorKind| KeyError {
        path: path.map(Path::to_path_buf),
        line: Some(line),
        kind,
    };
    let mut keys: Vec<(usize, IpsecKey)> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let content = raw.split('#').next().unwrap_or("").trim();
        if content.is_empty() {
            continue;
        }
        let key = parse_line(content).map_err(|k| err(n, k))?;
        if let Some((first_line, _)) = keys.iter().find(|(_, k)| k.spi == key.spi) {
            let (spi, first_line) = (key.spi, *first_line);
            return Err(err(n, KeyErrorKind::SpiTwice { spi, first_line }));
        }
        keys.push((n, key));
    }
    if keys.is_empty() {
        return Err(KeyError {
            path: path.map(Path::to_path_buf),
            line: None,
            kind: KeyErrorKind::NoKey,
        });
    }
    Ok(keys.into_iter().map(|(_, k)| k).collect())
}

/// One key line, comments and surrounding blanks removed.
fn parse_line(content: &str) -> Result<IpsecKey, KeyErrorKind> {
    let fields: Vec<&str> = content.split_whitespace().collect();
    let layout = match fields.get(4) {
        _ if !(4..=5).contains(&fields.len()) => {
            return Err(KeyErrorKind::FieldCount(fields.len()));
        }
        None => SpiLayout::Key,
        Some(&"per-sender-spi") => SpiLayout::PerSender,
        // Never quoted: a five-field line of another format may hold key material there.
        Some(_) => return Err(KeyErrorKind::UnknownOption),
    };
    let (spi, per_pair) = match fields[0].strip_suffix('+') {
        Some(spi) => (spi, true),
        None => (fields[0], false),
    };
    let spi = match spi.parse::<u8>() {
        Ok(s @ 1..=15) => s,
        _ => return Err(KeyErrorKind::BadSpi),
    };
    let algorithm = fields[1];
    if algorithm != RFC4106_GCM_AES {
        return Err(KeyErrorKind::UnknownAlgorithm(sanitize(algorithm)));
    }
    let icv_bits = match fields[3].parse::<u32>() {
        Ok(b @ (64 | 96 | 128)) => b,
        _ => return Err(KeyErrorKind::BadIcv),
    };
    let key = Secret(decode_hex(fields[2])?);
    if !matches!(
        key.0.len().checked_sub(RFC4106_SALT_LEN),
        Some(16 | 24 | 32)
    ) {
        return Err(KeyErrorKind::KeyLength(key.0.len()));
    }
    let key = key.take();
    Ok(IpsecKey {
        spi,
        per_pair,
        layout,
        tag: tag(algorithm, icv_bits, &key),
        algorithm: algorithm.to_owned(),
        key,
        icv_bits,
    })
}

impl fmt::Debug for IpsecKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpsecKey")
            .field("spi", &self.spi)
            .field("per_pair", &self.per_pair)
            .field("layout", &self.layout)
            .field("algorithm", &self.algorithm)
            .field("key", &format_args!("<redacted {} bytes>", self.key.len()))
            .field("icv_bits", &self.icv_bits)
            .finish()
    }
}

impl Drop for IpsecKey {
    fn drop(&mut self) {
        wipe(&mut self.key);
    }
}

/// Key bytes on their way into an [`IpsecKey`] or out of a failed parse: wiped on drop.
struct Secret(Vec<u8>);

impl Secret {
    /// The bytes, handed over without a copy (nothing is left to wipe).
    fn take(mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        wipe(&mut self.0);
    }
}

fn wipe(bytes: &mut [u8]) {
    for b in bytes.iter_mut() {
        // SAFETY: `b` is a valid, aligned, exclusive reference. Volatile so the store survives
        // optimisation although the memory is freed right after.
        unsafe { std::ptr::write_volatile(b, 0) };
    }
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
}

fn decode_hex(field: &str) -> Result<Vec<u8>, KeyErrorKind> {
    let digits = field
        .strip_prefix("0x")
        .or_else(|| field.strip_prefix("0X"))
        .unwrap_or(field);
    if digits.is_empty() {
        return Err(KeyErrorKind::EmptyKey);
    }
    if let Some(pos) = digits.bytes().position(|c| !c.is_ascii_hexdigit()) {
        return Err(KeyErrorKind::BadHex { position: pos + 1 });
    }
    if !digits.len().is_multiple_of(2) {
        return Err(KeyErrorKind::OddLength(digits.len()));
    }
    let nibble = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
    Ok(digits
        .as_bytes()
        .chunks_exact(2)
        .map(|p| (nibble(p[0]) << 4) | nibble(p[1]))
        .collect())
}

/// Quotes at most a short, printable prefix of a non-secret field (the algorithm name).
fn sanitize(s: &str) -> String {
    let mut out: String = s
        .chars()
        .take(40)
        .map(|c| if c.is_ascii_graphic() { c } else { '?' })
        .collect();
    if s.chars().count() > 40 {
        out.push('…');
    }
    out
}

/// The label of per-pair key derivation: HKDF's `info` starts with it, so the derived keys
/// can never be those of another use of the same secret.
pub const PAIR_KEY_LABEL: &[u8] = b"node-agent ipsec pair key v1\0";

/// The key of the state `pair.src -> pair.dst` from `global` (key + salt, as in the file):
/// HKDF-SHA256 (RFC 5869) with `global` as input key material, an empty salt, and as `info`
/// [`PAIR_KEY_LABEL`], the source address (4 bytes for IPv4, 16 for IPv6), the destination
/// address, the source's boot ID, a zero byte, and the destination's boot ID; as long as
/// `global`. Node A's OUT state toward B and B's IN state from A derive the same key; the two
/// directions, and every other pair, derive different ones.
pub fn derive(global: &[u8], pair: &Pair<'_>) -> Vec<u8> {
    struct Len(usize);
    impl ring::hkdf::KeyType for Len {
        fn len(&self) -> usize {
            self.0
        }
    }
    let ip = |a: &IpAddr| match a {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    };
    let (src, dst) = (ip(&pair.src), ip(&pair.dst));
    let info: [&[u8]; 6] = [
        PAIR_KEY_LABEL,
        &src,
        &dst,
        pair.src_boot.as_bytes(),
        &[0],
        pair.dst_boot.as_bytes(),
    ];
    let prk = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, &[]).extract(global);
    let mut out = vec![0u8; global.len()];
    // Fails only for an output longer than 255 hashes; keys are at most 36 bytes.
    if let Ok(okm) = prk.expand(&info, Len(global.len())) {
        let _ = okm.fill(&mut out);
    }
    out
}

/// The keys states are written with: the key file's, and the per-pair keys derived from them.
///
/// It is the planner's [`KeyTags`]: asking for a state's tag derives the state's key (once,
/// then remembered) and files it under the tag, where the backend finds it when it writes the
/// state. Derived keys nobody asked for during a whole plan are forgotten
/// ([`KeyBook::next_plan`]).
#[derive(Default)]
pub struct KeyBook {
    keys: Vec<IpsecKey>,
    derived: Mutex<Derived>,
}

#[derive(Default)]
struct Derived {
    /// The plan being made; entries older than the previous one are dropped.
    generation: u64,
    by_pair: HashMap<PairKey, (KeyTag, u64)>,
    by_tag: HashMap<(u8, KeyTag), Arc<DerivedKey>>,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct PairKey {
    spi: u8,
    src: IpAddr,
    dst: IpAddr,
    src_boot: Box<str>,
    dst_boot: Box<str>,
}

/// A derived key: secret, wiped on drop.
pub struct DerivedKey(Vec<u8>);

impl Drop for DerivedKey {
    fn drop(&mut self) {
        wipe(&mut self.0);
    }
}

impl fmt::Debug for KeyBook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let derived = self.lock().by_tag.len();
        f.debug_struct("KeyBook")
            .field("keys", &self.keys)
            .field("derived", &format_args!("<{derived} derived keys>"))
            .finish()
    }
}

/// What a state is written with: the algorithm and ICV of its key file line, and the key.
pub struct StateKey<'a> {
    pub key: &'a IpsecKey,
    /// The derived key, for a per-pair key; the key file's own otherwise.
    pub derived: Option<Arc<DerivedKey>>,
}

impl StateKey<'_> {
    pub fn bytes(&self) -> &[u8] {
        match &self.derived {
            Some(d) => &d.0,
            None => self.key.key_bytes(),
        }
    }
}

impl KeyBook {
    /// `keys` in file order (the last is the newest).
    pub fn new(keys: Vec<IpsecKey>) -> Self {
        Self {
            keys,
            derived: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Derived> {
        self.derived.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn key(&self, spi: u8) -> Result<&IpsecKey, String> {
        if self.keys.is_empty() {
            return Err("no IPsec key is configured".into());
        }
        self.keys
            .iter()
            .find(|k| k.spi == spi)
            .ok_or_else(|| format!("the IPsec key file has no key with SPI {spi}"))
    }

    /// The key a state of `spi` whose tag is `tag` is written with, or why there is none (no
    /// such key; a tag no plan asked for, or the key file's key changed since).
    pub fn state_key(&self, spi: u8, tag: KeyTag) -> Result<StateKey<'_>, String> {
        let key = self.key(spi)?;
        if !key.per_pair {
            return match key.tag() == tag {
                true => Ok(StateKey { key, derived: None }),
                false => Err(format!(
                    "the key file's key for SPI {spi} is {}, not the planned {tag}",
                    key.tag()
                )),
            };
        }
        match self.lock().by_tag.get(&(spi, tag)) {
            Some(d) => Ok(StateKey {
                key,
                derived: Some(d.clone()),
            }),
            None => Err(format!(
                "no key derived for SPI {spi} with tag {tag}; it is not the planned one"
            )),
        }
    }

    /// A plan begins: derived keys the plan before last asked for, and the last did not, go.
    pub fn next_plan(&self) {
        let mut d = self.lock();
        let keep_from = d.generation;
        d.by_pair.retain(|_, (_, g)| *g >= keep_from);
        let tags: std::collections::HashSet<(u8, KeyTag)> =
            d.by_pair.iter().map(|(p, (t, _))| (p.spi, *t)).collect();
        d.by_tag.retain(|k, _| tags.contains(k));
        d.generation += 1;
    }

    pub fn newest(&self) -> Option<&IpsecKey> {
        self.keys.last()
    }

    pub fn keys(&self) -> &[IpsecKey] {
        &self.keys
    }
}

impl KeyTags for KeyBook {
    fn tag(&self, k: &KeyInUse, pair: &Pair<'_>) -> KeyTag {
        let Ok(key) = self.key(k.spi) else {
            return KeyTag::default();
        };
        if !key.per_pair {
            return key.tag();
        }
        let id = PairKey {
            spi: k.spi,
            src: pair.src,
            dst: pair.dst,
            src_boot: pair.src_boot.into(),
            dst_boot: pair.dst_boot.into(),
        };
        let mut d = self.lock();
        let generation = d.generation;
        if let Some((tag, g)) = d.by_pair.get_mut(&id) {
            *g = generation;
            return *tag;
        }
        let derived = DerivedKey(derive(&key.key, pair));
        let tag = tag(&key.algorithm, key.icv_bits, &derived.0);
        d.by_tag.insert((k.spi, tag), Arc::new(derived));
        d.by_pair.insert(id, (tag, generation));
        tag
    }

    fn plan_begins(&self) {
        self.next_plan();
    }
}

/// A key file loaded from disk, with what was worth warning about.
#[derive(Debug)]
pub struct KeyFile {
    pub path: PathBuf,
    /// Every key, in file order: the last is the newest.
    pub keys: Vec<IpsecKey>,
    /// A SHA-256 of the file's bytes, to tell whether a later read found something new.
    pub digest: [u8; 32],
    /// What is worth warning about (a group- or world-readable file); the caller logs it.
    pub warnings: Vec<String>,
}

impl KeyFile {
    /// Reads and validates the key file at `path`; [`KeyFile::warnings`] says when group or
    /// others can read it.
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        use std::os::unix::fs::PermissionsExt;
        let io = |source: std::io::Error| KeyError {
            path: Some(path.to_path_buf()),
            line: None,
            kind: KeyErrorKind::Io(source),
        };
        let refused = |e: state::input::InputError| KeyError {
            path: Some(path.to_path_buf()),
            line: None,
            kind: KeyErrorKind::Refused(e.problem),
        };
        let mut file = state::input::open(path, state::input::Input::KeyFile).map_err(refused)?;
        let mode = file.file().metadata().map_err(io)?.permissions().mode() & 0o7777;
        let mut warnings = Vec::new();
        if mode & 0o044 != 0 {
            let w = format!(
                "IPsec key file {} is readable by group or others (mode {mode:04o}); \
                 make it 0400 or 0600",
                path.display()
            );
            warnings.push(w);
        }
        let text = Secret(file.read_all().map_err(refused)?);
        let text = std::str::from_utf8(&text.0).map_err(|_| KeyError {
            path: Some(path.to_path_buf()),
            line: None,
            kind: KeyErrorKind::NotUtf8,
        })?;
        let keys = parse_keys(text, Some(path))?;
        let mut digest = [0u8; 32];
        digest
            .copy_from_slice(ring::digest::digest(&ring::digest::SHA256, text.as_bytes()).as_ref());
        Ok(Self {
            path: path.to_path_buf(),
            keys,
            digest,
            warnings,
        })
    }

    /// The newest key: the last line.
    pub fn newest(&self) -> &IpsecKey {
        self.keys.last().expect("a key file has at least one key")
    }
}

/// Why a key file was rejected: where (path, line) and what is wrong, never the key itself.
#[derive(Debug)]
pub struct KeyError {
    pub path: Option<PathBuf>,
    /// 1-based line number, when the problem is on one line.
    pub line: Option<usize>,
    pub kind: KeyErrorKind,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyErrorKind {
    #[error(
        "expected 4 fields `<spi> <aead-algorithm> <hex-key> <icv-bits>` and optionally \
         `per-sender-spi`, found {0}"
    )]
    FieldCount(usize),
    #[error("the fifth field is not `per-sender-spi`, the only one there is")]
    UnknownOption,
    #[error(
        "SPI must be a decimal number 1..=15, optionally followed by `+` for per-pair keys (it fills the 4 SPI bits of the xfrm mark)"
    )]
    BadSpi,
    #[error("unknown AEAD algorithm `{0}`; supported: rfc4106(gcm(aes))")]
    UnknownAlgorithm(String),
    #[error("empty key")]
    EmptyKey,
    #[error("key is not hex: character {position} of the key is not a hex digit")]
    BadHex { position: usize },
    #[error("key has an odd number of hex digits ({0})")]
    OddLength(usize),
    #[error(
        "key is {0} bytes; rfc4106(gcm(aes)) needs 16, 24 or 32 key bytes plus 4 salt bytes \
         (20, 28 or 36 bytes)"
    )]
    KeyLength(usize),
    #[error("ICV length must be 64, 96 or 128 bits")]
    BadIcv,
    #[error(
        "SPI {spi} is already used by the key on line {first_line}; every key needs its own SPI"
    )]
    SpiTwice { spi: u8, first_line: usize },
    #[error("no key line (only comments or blank lines)")]
    NoKey,
    #[error("not valid UTF-8")]
    NotUtf8,
    #[error("{0}")]
    Io(std::io::Error),
    #[error("{0}")]
    Refused(state::input::Problem),
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("IPsec key file")?;
        if let Some(p) = &self.path {
            write!(f, " {}", p.display())?;
        }
        if let Some(n) = self.line {
            write!(f, " line {n}")?;
        }
        write!(f, ": {}", self.kind)
    }
}

impl std::error::Error for KeyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            KeyErrorKind::Io(e) => Some(e),
            KeyErrorKind::Refused(p) => Some(p),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "0102030405060708090a0b0c0d0e0f1011121314";
    const TAG_OF_HEX: &str = "162b8789fce5e3bd";

    #[test]
    fn parses_a_valid_key_and_the_last_line_wins() {
        let text = format!(
            "# comment\n\n2 rfc4106(gcm(aes)) 0x{HEX} 96\n  3 rfc4106(gcm(aes)) {HEX} 128 # new\n"
        );
        let k = IpsecKey::parse(&text, None).unwrap();
        assert_eq!(k.spi(), 3);
        assert_eq!(k.algorithm(), RFC4106_GCM_AES);
        assert_eq!(k.icv_bits(), 128);
        assert_eq!(k.key_len(), 20);
        assert_eq!(k.key_bytes()[0], 1);
        assert_eq!(k.key_bytes()[19], 0x14);
    }

    #[test]
    fn every_invalid_case_names_its_line_and_never_the_key() {
        let good = format!("1 rfc4106(gcm(aes)) 0x{HEX} 128\n");
        let cases: Vec<(String, &str)> = vec![
            (format!("0 rfc4106(gcm(aes)) 0x{HEX} 128"), "SPI"),
            (format!("16 rfc4106(gcm(aes)) 0x{HEX} 128"), "SPI"),
            (format!("x rfc4106(gcm(aes)) 0x{HEX} 128"), "SPI"),
            (format!("3 cbc(aes) 0x{HEX} 128"), "unknown AEAD algorithm"),
            (format!("3 0x{HEX} 128"), "expected 4 fields"),
            (format!("3 rfc4106(gcm(aes)) 0x{HEX}zz 128"), "not hex"),
            (format!("3 rfc4106(gcm(aes)) 0x{HEX}1 128"), "odd number"),
            (
                format!("3 rfc4106(gcm(aes)) 0x{} 128", &HEX[..32]),
                "16 bytes",
            ),
            ("3 rfc4106(gcm(aes)) 0x 128".to_string(), "empty key"),
            (format!("3 rfc4106(gcm(aes)) 0x{HEX} 100"), "ICV"),
            (
                format!("3 rfc4106(gcm(aes)) 0x{HEX} 128 extra"),
                "the fifth field is not `per-sender-spi`",
            ),
            // Cilium's non-AEAD line has its encryption key in the fifth field: never quoted.
            (
                format!("3+ hmac(sha256) 0x{HEX} cbc(aes) 0x{HEX}"),
                "the fifth field is not `per-sender-spi`",
            ),
            (
                format!("3 rfc4106(gcm(aes)) 0x{HEX} 128 per-sender-spi x"),
                "found 6",
            ),
        ];
        for (line, want) in cases {
            let text = format!("# header\n{good}\n{line}\n");
            let e = IpsecKey::parse(&text, Some(Path::new("/k"))).unwrap_err();
            let msg = e.to_string();
            let dbg = format!("{e:?}");
            assert!(msg.starts_with("IPsec key file /k line 4: "), "{msg}");
            assert!(msg.contains(want), "{line}: {msg}");
            for s in [&msg, &dbg] {
                assert!(
                    !s.contains(HEX) && !s.contains(&HEX[..16]),
                    "key leaked: {s}"
                );
            }
        }
        let e = IpsecKey::parse("# only a comment\n", None).unwrap_err();
        assert!(e.to_string().contains("no key line"), "{e}");
    }

    #[test]
    fn every_key_is_kept_in_file_order_and_an_spi_is_used_once() {
        let other = "0f0e0d0c0b0a09080706050403020100aabbccdd";
        let text = format!("2 rfc4106(gcm(aes)) 0x{HEX} 128\n3 rfc4106(gcm(aes)) 0x{other} 128\n");
        let keys = parse_keys(&text, None).unwrap();
        assert_eq!(keys.iter().map(IpsecKey::spi).collect::<Vec<_>>(), [2, 3]);
        assert_ne!(keys[0].tag(), keys[1].tag());
        let twice = format!("{text}2 rfc4106(gcm(aes)) 0x{other} 128\n");
        let e = parse_keys(&twice, None).unwrap_err().to_string();
        assert!(
            e.contains("line 3") && e.contains("SPI 2") && e.contains("line 1"),
            "{e}"
        );
        assert!(!e.contains(other) && !e.contains(HEX), "{e}");
    }

    #[test]
    fn the_tag_is_sha256_over_algorithm_icv_and_key() {
        // Computed independently: printf 'rfc4106(gcm(aes))\0\0\0\0\x80' followed by the 20 key
        // bytes, through `sha256sum`, first 16 hex digits.
        let k = IpsecKey::parse(&format!("5 rfc4106(gcm(aes)) {HEX} 128"), None).unwrap();
        assert_eq!(k.tag().to_string(), TAG_OF_HEX);
        let k96 = IpsecKey::parse(&format!("5 rfc4106(gcm(aes)) {HEX} 96"), None).unwrap();
        assert_ne!(k96.tag(), k.tag(), "the ICV length is part of it");
    }

    #[test]
    fn a_plus_after_the_spi_asks_for_per_pair_keys() {
        let k = IpsecKey::parse(&format!("3+ rfc4106(gcm(aes)) 0x{HEX} 128"), None).unwrap();
        assert!(k.per_pair() && k.spi() == 3);
        assert!(
            !IpsecKey::parse(&format!("3 rfc4106(gcm(aes)) 0x{HEX} 128"), None)
                .unwrap()
                .per_pair()
        );
        assert!(IpsecKey::parse(&format!("3++ rfc4106(gcm(aes)) 0x{HEX} 128"), None).is_err());
    }

    #[test]
    fn a_fifth_field_asks_for_the_per_sender_spi_layout() {
        let text = format!(
            "3+ rfc4106(gcm(aes)) 0x{HEX} 128\n4+ rfc4106(gcm(aes)) 0x{HEX} 128 per-sender-spi\n"
        );
        let keys = parse_keys(&text, None).unwrap();
        let layouts: Vec<_> = keys.iter().map(|k| (k.spi(), k.layout())).collect();
        assert_eq!(layouts, [(3, SpiLayout::Key), (4, SpiLayout::PerSender)]);
        assert_eq!(keys[0].tag(), keys[1].tag(), "the layout is not the key");
    }

    /// The vectors were computed independently, with Python's `hmac` and `hashlib` following
    /// RFC 5869 step by step (extract with a zero salt, then expand).
    #[test]
    fn per_pair_keys_match_hkdf_vectors_computed_by_hand() {
        let a = |s: &str| s.parse::<IpAddr>().unwrap();
        let global = decode_hex(HEX).unwrap();
        let v4 = Pair {
            src: a("192.168.77.1"),
            dst: a("192.168.77.2"),
            src_boot: "boot-a",
            dst_boot: "boot-b",
        };
        let key = derive(&global, &v4);
        assert_eq!(hex(&key), "549e3743886fd3fa3c3c2669ad46bc7e8ec68409");
        assert_eq!(
            tag(RFC4106_GCM_AES, 128, &key).to_string(),
            "b0be03304f6acab7"
        );
        let global36 = decode_hex(&format!("{HEX}15161718191a1b1c1d1e1f2021222324")).unwrap();
        let v6 = Pair {
            src: a("fd00:77::2"),
            dst: a("fd00:77::1"),
            src_boot: "b",
            dst_boot: "a",
        };
        assert_eq!(
            hex(&derive(&global36, &v6)),
            "71abc7dcb75310638d05d5e1b4da958280681f2973bcb9a8938e9c71b07696c52d69204d"
        );
        // The other direction, and another boot, derive other keys.
        let back = Pair {
            src: v4.dst,
            dst: v4.src,
            src_boot: "boot-b",
            dst_boot: "boot-a",
        };
        assert_ne!(derive(&global, &back), key);
        assert_ne!(
            derive(
                &global,
                &Pair {
                    src_boot: "boot-a2",
                    ..v4
                }
            ),
            key
        );
    }

    #[test]
    fn the_key_book_derives_once_files_by_tag_and_forgets_what_no_plan_asks_for() {
        let book =
            KeyBook::new(parse_keys(&format!("3+ rfc4106(gcm(aes)) 0x{HEX} 128"), None).unwrap());
        let k = KeyInUse {
            spi: 3,
            tag: book.keys()[0].tag(),
            layout: SpiLayout::Key,
        };
        let pair = Pair {
            src: "10.0.0.1".parse().unwrap(),
            dst: "10.0.0.2".parse().unwrap(),
            src_boot: "x",
            dst_boot: "y",
        };
        book.next_plan();
        let t = book.tag(&k, &pair);
        assert_eq!(book.tag(&k, &pair), t);
        assert_ne!(t, k.tag, "per pair, not the file's key");
        let sk = book.state_key(3, t).unwrap();
        assert_eq!(sk.bytes(), derive(&decode_hex(HEX).unwrap(), &pair));
        assert!(book.state_key(3, KeyTag(1)).is_err());
        assert!(!format!("{book:?}").contains(HEX));
        book.next_plan();
        assert!(book.state_key(3, t).is_ok(), "kept through the next plan");
        book.next_plan();
        assert!(
            book.state_key(3, t).is_err(),
            "forgotten once a whole plan did not ask"
        );
        assert_eq!(book.tag(&k, &pair), t, "derived again, the same");
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn debug_redacts_the_key() {
        let k = IpsecKey::parse(&format!("5 rfc4106(gcm(aes)) {HEX} 64"), None).unwrap();
        let dbg = format!("{k:?} {k:#?}");
        assert!(!dbg.contains(HEX) && !dbg.contains("[1, 2, 3"), "{dbg}");
        assert!(dbg.contains("redacted 20 bytes"), "{dbg}");
    }
}

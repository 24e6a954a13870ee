//! Pin transactions: one crash-safe way to make a change that takes more than one pin operation
//! (today the map growth, [`super::grow`]).
//!
//! Before its first step a transaction pins its *intent*, a one-slot BPF array at
//! `<bpffs>/node-agent/pin_txn`: `[magic, kind, phase, capacity]`. It lives in the bpffs, beside
//! the pins it is about, so it goes with them at a reboot (a file in the state directory would
//! outlive them, and a later boot would act on pins that are gone). It is filled before it is
//! pinned, so its pin always names a whole intent, and a slot write is one syscall: a crash
//! leaves the old phase or the new one.
//!
//! A transaction of kind `K` creates new maps under staging pins only (`<live>_grow`), records
//! the phase `filled` once they are complete (and read by the datapath), then renames each
//! staging pin over its live pin and unpins the intent. The live pins change only after
//! `filled`. So one rule, [`recover`], is right from every step boundary, and from a failed
//! step too; the next start runs it before anything else, and a failed step runs it at once:
//!
//! * no intent: staging pins are leftovers; they are unpinned (roll back);
//! * intent `begun`: the staging pins are unpinned, then the intent (roll back);
//! * intent `filled`: every staging pin still there is renamed over its live pin, in the
//!   transaction's order, then the intent is unpinned (roll forward).
//!
//! Each step of the rule is idempotent (a rename of a staging pin already renamed, or an unpin
//! of a pin already gone, is skipped), so a crash within the recovery is recovered the same way.
//!
//! A test cuts step `<step>` (from 1) of a transaction, or of a recovery, with
//! `NODE_AGENT_TEST_CUT=<kind>:<step>:<kill|fail>` or `recovery:<step>:...`
//! ([`crate::runtime::cut`]); the kernel tier enumerates every step with it.

use std::io;
use std::path::{Path, PathBuf};

use aya::maps::{Array, MapData, MapError, MapType};

use super::pins::{MapLayout, RecordError, open_record};
use super::{node_ids_pin, pin_dir, pod_cidrs_pin};
use crate::runtime::cut::Counted;

const RECORD: &str = "the pin transaction's intent";
/// `NATX`.
const MAGIC: u32 = 0x4e41_5458;
/// `[magic, kind, phase, capacity]`.
type Intent = [u32; 4];

/// The intent's pin.
pub fn intent_pin(bpffs: &Path) -> PathBuf {
    pin_dir(bpffs).join("pin_txn")
}

/// The layout of the intent's pin.
pub fn intent_layout() -> MapLayout {
    MapLayout {
        map_type: MapType::Array,
        key_size: size_of::<u32>() as u32,
        value_size: size_of::<Intent>() as u32,
        max_entries: 1,
    }
}

/// What a transaction changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The node-ID and pod-CIDR maps replaced by larger ones ([`super::grow`]).
    Growth,
}

impl Kind {
    const ALL: [Kind; 1] = [Kind::Growth];

    fn code(self) -> u32 {
        match self {
            Kind::Growth => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Growth => "growth",
        }
    }

    /// Its staging pins and the live pin each is renamed over, in the order of the renames,
    /// with the name of the step.
    pub fn renames(self, bpffs: &Path) -> Vec<(PathBuf, PathBuf, &'static str)> {
        match self {
            // The node-ID map's last: it is what the capacity is read from.
            Kind::Growth => vec![
                (
                    staging(&pod_cidrs_pin(bpffs)),
                    pod_cidrs_pin(bpffs),
                    "rename the staging pod-CIDR pin over the live one",
                ),
                (
                    staging(&node_ids_pin(bpffs)),
                    node_ids_pin(bpffs),
                    "rename the staging node-ID pin over the live one",
                ),
            ],
        }
    }
}

/// `node_ids` -> `node_ids_grow` (bpffs refuses dots in names).
pub fn staging(pin: &Path) -> PathBuf {
    let mut name = pin.file_name().unwrap_or_default().to_owned();
    name.push("_grow");
    pin.with_file_name(name)
}

const BEGUN: u32 = 1;
const FILLED: u32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum TxnError {
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error(
        "{pin} holds an intent this agent does not know ({found:#x?}), left by another agent; \
         nothing was changed"
    )]
    Unknown { pin: PathBuf, found: Intent },
    #[error("step {step} of the {kind} ({name}): {what}")]
    Step {
        kind: &'static str,
        step: u32,
        name: &'static str,
        what: String,
    },
}

/// What [`recover`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// No intent and no staging pin: nothing to do.
    Nothing,
    /// The staging pins were unpinned; the live pins are as before the transaction.
    RolledBack(Option<Kind>),
    /// The staging pins were renamed over the live pins.
    RolledForward(Kind),
}

/// A transaction under way. Dropped without [`Txn::commit`], it leaves its intent for
/// [`recover`].
pub struct Txn {
    kind: Kind,
    bpffs: PathBuf,
    capacity: u32,
    record: Option<Array<MapData, Intent>>,
    steps: Steps,
}

impl Txn {
    /// Pins the intent of a `kind` transaction toward `capacity` (its first step).
    pub fn begin(kind: Kind, bpffs: &Path, capacity: u32) -> Result<Self, TxnError> {
        let mut txn = Self {
            kind,
            bpffs: bpffs.to_owned(),
            capacity,
            record: None,
            steps: Steps::new(kind.name()),
        };
        let pin = intent_pin(bpffs);
        txn.step("pin the intent", || {
            let mut map = Array::<MapData, Intent>::create(1, 0).map_err(map_err)?;
            map.set(0, [MAGIC, kind.code(), BEGUN, capacity], 0)
                .map_err(map_err)?;
            map.pin(&pin).map_err(|e| e.to_string())?;
            open_record::<Intent>(&pin, RECORD).map_err(|e| e.to_string())
        })
        .map(|map| txn.record = Some(map))?;
        Ok(txn)
    }

    /// Runs `op` as the transaction's next step, named `name`.
    pub fn step<T>(
        &mut self,
        name: &'static str,
        op: impl FnOnce() -> Result<T, String>,
    ) -> Result<T, TxnError> {
        self.steps.run(name, op)
    }

    /// Records that the new pins are complete: from here on, the transaction rolls forward.
    pub fn filled(&mut self) -> Result<(), TxnError> {
        let value = [MAGIC, self.kind.code(), FILLED, self.capacity];
        let mut record = self.record.take();
        let result = self.step("record the new pins complete", || match &mut record {
            Some(map) => map.set(0, value, 0).map_err(map_err),
            None => Err("the intent is not open".into()),
        });
        self.record = record;
        result
    }

    /// Renames each staging pin over its live pin, then unpins the intent.
    pub fn commit(mut self) -> Result<(), TxnError> {
        for (staged, live, name) in self.kind.renames(&self.bpffs) {
            self.step(name, || {
                std::fs::rename(&staged, &live).map_err(|e| {
                    format!("renaming {} over {}: {e}", staged.display(), live.display())
                })
            })?;
        }
        let pin = intent_pin(&self.bpffs);
        self.step("unpin the intent", || unpin(&pin))
    }
}

fn map_err(e: MapError) -> String {
    e.to_string()
}

fn unpin(pin: &Path) -> Result<(), String> {
    match std::fs::remove_file(pin) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(format!("unpinning {}: {e}", pin.display()))
        }
        _ => Ok(()),
    }
}

/// The intent pinned under `bpffs`, if any: its kind, whether it is filled, its capacity.
fn intent(bpffs: &Path) -> Result<Option<(Kind, bool, u32)>, TxnError> {
    let pin = intent_pin(bpffs);
    if !intent_layout().pinned_at(&pin, RECORD)? {
        return Ok(None);
    }
    let found = open_record::<Intent>(&pin, RECORD)?
        .get(&0, 0)
        .map_err(|source| RecordError::Map {
            record: RECORD,
            pin: pin.clone(),
            source,
        })?;
    let [magic, kind, phase, capacity] = found;
    let kind = Kind::ALL.into_iter().find(|k| k.code() == kind);
    match (magic, kind, phase) {
        (MAGIC, Some(kind), BEGUN | FILLED) => Ok(Some((kind, phase == FILLED, capacity))),
        _ => Err(TxnError::Unknown { pin, found }),
    }
}

/// The capacity the live maps will have once a transaction the next start rolls forward is
/// finished (`None`: no such transaction; the live pins stay as they are).
pub fn forward_capacity(bpffs: &Path) -> Result<Option<u32>, TxnError> {
    Ok(match intent(bpffs)? {
        Some((Kind::Growth, true, capacity)) => Some(capacity),
        _ => None,
    })
}

/// Finishes or undoes what a transaction cut short left (see the module's rule). Run by the
/// start before the pins are checked, and by a transaction whose step failed.
pub fn recover(bpffs: &Path) -> Result<Recovery, TxnError> {
    let found = intent(bpffs)?;
    let pin = intent_pin(bpffs);
    let mut steps = Steps::new("recovery");
    match found {
        Some((kind, true, _)) => {
            for (staged, live, name) in kind.renames(bpffs) {
                steps.run(name, || {
                    if !staged.exists() {
                        return Ok(());
                    }
                    std::fs::rename(&staged, &live).map_err(|e| {
                        format!("renaming {} over {}: {e}", staged.display(), live.display())
                    })
                })?;
            }
            steps.run("unpin the intent", || unpin(&pin))?;
            tracing::warn!(
                kind = kind.name(),
                "a pin transaction was cut short after its new maps were complete; finished it"
            );
            Ok(Recovery::RolledForward(kind))
        }
        Some((kind, false, _)) => {
            for (staged, _, _) in kind.renames(bpffs) {
                steps.run("unpin a staging pin", || unpin(&staged))?;
            }
            steps.run("unpin the intent", || unpin(&pin))?;
            tracing::warn!(
                kind = kind.name(),
                "a pin transaction was cut short before its new maps were complete; undid it"
            );
            Ok(Recovery::RolledBack(Some(kind)))
        }
        None => {
            let left: Vec<PathBuf> = Kind::ALL
                .into_iter()
                .flat_map(|k| k.renames(bpffs))
                .map(|(staged, _, _)| staged)
                .filter(|staged| staged.exists())
                .collect();
            if left.is_empty() {
                return Ok(Recovery::Nothing);
            }
            for staged in &left {
                steps.run("unpin a staging pin left without an intent", || {
                    unpin(staged)
                })?;
            }
            tracing::warn!("staging pins without an intent were left; unpinned them");
            Ok(Recovery::RolledBack(None))
        }
    }
}

/// The steps of a transaction (or of a recovery), counted from 1, where a test may cut one
/// ([`crate::runtime::cut`]).
struct Steps(Counted);

impl Steps {
    fn new(what: &'static str) -> Self {
        Self(Counted::new(what))
    }

    /// Runs `op` as the next step, named `name`.
    fn run<T>(
        &mut self,
        name: &'static str,
        op: impl FnOnce() -> Result<T, String>,
    ) -> Result<T, TxnError> {
        let cut = self.0.next(name);
        let err = |what: String| TxnError::Step {
            kind: self.0.sequence(),
            step: self.0.done() as u32,
            name,
            what,
        };
        cut.map_err(err)?;
        op().map_err(err)
    }
}

//! The pinned record of freed node IDs, `<bpffs>/node-agent/freed_ids`.
//!
//! A freed node ID waits out a cool-down before it is handed out again, because stale copies of
//! it may still be around (peers' maps, xfrm states). The checkpoint records when each ID was
//! freed; but a checkpoint can be lost or corrupt while the kernel state it describes lives on,
//! and then a minutes-old ID would look never used. This map lives exactly as long as that
//! kernel state (a reboot ends both), so the agent merges it into the checkpoint's record at
//! start (invariant 5). One `u64` per node ID: the second, since the Unix epoch, the ID was last
//! freed; 0 for never. The datapath does not read it.
//!
//! The record is read at every start, and the kernel copies an array out slot by slot even in a
//! batch: 65,536 slots were a quarter of a run without nodes. So the record is created mappable
//! (`BPF_F_MMAPABLE`, Linux 5.5) and read as memory. A record pinned by an agent before this one
//! (or on an older kernel) is read slot by slot once, copied into a mappable record and replaced
//! by it with one rename; where the kernel cannot map it, it is kept and read as before.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::time::Duration;

use aya::maps::{Array, IterableMap, MapData, MapError, MapInfo, MapType};
use node_agent_common as abi;
use state::ids::FreedId;
use state::objects::NodeId;

use crate::datapath::pins::{MapLayout, RecordError, open_record, pin_record};

/// One slot per possible node ID.
const ENTRIES: u32 = 1 << 16;
/// `BPF_F_MMAPABLE` in the kernel's map flags: the map's values can be mapped into memory.
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// Names the record in errors.
const RECORD: &str = "the freed-ID record";

/// The layout of the record. Whether it is mappable is not part of it: both kinds hold the same
/// slots, and the agent replaces a record that is not.
pub fn layout() -> MapLayout {
    MapLayout {
        map_type: MapType::Array,
        key_size: 4,
        value_size: 8,
        max_entries: ENTRIES,
    }
}

/// `<bpffs>/node-agent/freed_ids`.
pub fn pin(bpffs: &Path) -> PathBuf {
    crate::datapath::pin_dir(bpffs).join(abi::FREED_IDS_PIN)
}

/// Whether the record pinned at `pin` can be mapped into memory (what this agent creates).
pub fn is_mappable(pin: &Path) -> Result<bool, MapError> {
    Ok(MapInfo::from_pin(pin)?.map_flags() & BPF_F_MMAPABLE != 0)
}

pub struct FreedIds {
    pin: PathBuf,
    map: Array<MapData, u64>,
    /// The slots as memory, when the record is mappable.
    slots: Option<Slots>,
}

impl FreedIds {
    /// Opens the record, creating and pinning it if there is none (the pin directory must
    /// exist), and replacing one that cannot be mapped with one that can. A pin of another
    /// layout is refused, and left as it is.
    pub fn open_or_create(pin: &Path) -> Result<Self, RecordError> {
        if layout().pinned_at(pin, RECORD)? {
            // A pin from before the record was made mappable is replaced by a copy that is; a
            // fresh one is already as mappable as this kernel makes it.
            let record = Self::open(pin)?;
            return match record.slots {
                Some(_) => Ok(record),
                None => record.made_mappable(),
            };
        }
        pin_record(create(), pin, RECORD)?;
        Self::open(pin)
    }

    /// Opens an existing record, changing nothing.
    pub fn open(pin: &Path) -> Result<Self, RecordError> {
        let map = open_record(pin, RECORD)?;
        let slots = match is_mappable(pin).map_err(|source| RecordError::Map {
            record: RECORD,
            pin: pin.to_owned(),
            source,
        })? {
            true => Some(
                Slots::map(map.map().fd().as_fd()).map_err(|source| RecordError::Io {
                    what: "mapping",
                    record: RECORD,
                    pin: pin.to_owned(),
                    source,
                })?,
            ),
            false => None,
        };
        Ok(Self {
            pin: pin.to_owned(),
            map,
            slots,
        })
    }

    /// Every ID freed so far, with when.
    pub fn read(&self) -> Result<Vec<FreedId>, RecordError> {
        let slots = match &self.slots {
            Some(slots) => slots.read(),
            None => self.read_slot_by_slot()?,
        };
        Ok(slots
            .into_iter()
            .filter_map(|(i, secs)| {
                Some(FreedId {
                    id: NodeId::new(u16::try_from(i).ok()?)?,
                    freed_at: Duration::from_secs(secs),
                })
            })
            .collect())
    }

    /// Records that each of `freed` was freed when it says (rounded up to the second, so a
    /// cool-down never comes out shorter).
    pub fn write(&mut self, freed: &[FreedId]) -> Result<(), RecordError> {
        set(&mut self.map, freed).map_err(|source| RecordError::Map {
            record: RECORD,
            pin: self.pin.clone(),
            source,
        })
    }

    /// A record that cannot be mapped, read through syscalls: in batches where the kernel can
    /// (Linux 5.6), else two syscalls a slot. Only the slots ever written (not 0), as
    /// [`Slots::read`].
    fn read_slot_by_slot(&self) -> Result<Vec<(u32, u64)>, RecordError> {
        let err = |source| RecordError::Map {
            record: RECORD,
            pin: self.pin.clone(),
            source,
        };
        let slots: Vec<(u32, u64)> =
            match crate::datapath::maps::batch::lookup_all(self.map.map().fd().as_fd())
                .map_err(err)?
            {
                Some(slots) => slots,
                None => (0..)
                    .zip(self.map.iter())
                    .map(|(i, secs)| secs.map(|s| (i, s)))
                    .collect::<Result<_, _>>()
                    .map_err(err)?,
            };
        Ok(slots.into_iter().filter(|(_, secs)| *secs > 0).collect())
    }

    /// This record, replaced by a mappable copy: filled, pinned beside it and renamed over it,
    /// so its pin always names a whole record. Where the kernel cannot map one, or the copy
    /// fails, the record is kept as it is (it only reads slower).
    fn made_mappable(self) -> Result<Self, RecordError> {
        let mut copy = match Array::<MapData, u64>::create(ENTRIES, BPF_F_MMAPABLE) {
            Ok(copy) => copy,
            Err(e) => {
                tracing::info!(
                    pin = %self.pin.display(),
                    "the freed-ID record is read slot by slot: this kernel cannot map it \
                     into memory (Linux 5.5 can): {e}"
                );
                return Ok(self);
            }
        };
        let staged = staging(&self.pin);
        let copied = remove_stale(&staged)
            .and_then(|()| {
                set(&mut copy, &self.read()?).map_err(|source| RecordError::Map {
                    record: RECORD,
                    pin: staged.clone(),
                    source,
                })
            })
            .and_then(|()| {
                copy.pin(&staged).map_err(|source| RecordError::Pin {
                    record: RECORD,
                    pin: staged.clone(),
                    source,
                })
            })
            .and_then(|()| {
                std::fs::rename(&staged, &self.pin).map_err(|source| RecordError::Io {
                    what: "renaming a mappable copy over",
                    record: RECORD,
                    pin: self.pin.clone(),
                    source,
                })
            });
        match copied {
            Ok(()) => Self::open(&self.pin),
            Err(e) => {
                let _ = remove_stale(&staged);
                tracing::warn!("{e}; the record is kept as it is and read slot by slot");
                Ok(self)
            }
        }
    }
}

/// A new record, mappable where the kernel can map one.
fn create() -> Result<Array<MapData, u64>, MapError> {
    Array::create(ENTRIES, BPF_F_MMAPABLE).or_else(|e| {
        tracing::info!(
            "the freed-ID record is created unmappable and read slot by slot: this kernel \
             cannot map it into memory (Linux 5.5 can): {e}"
        );
        Array::create(ENTRIES, 0)
    })
}

fn set(map: &mut Array<MapData, u64>, freed: &[FreedId]) -> Result<(), MapError> {
    for f in freed {
        let secs = f
            .freed_at
            .as_secs()
            .saturating_add(u64::from(f.freed_at.subsec_nanos() > 0));
        map.set(u32::from(f.id.get()), secs.max(1), 0)?;
    }
    Ok(())
}

/// `freed_ids` -> `freed_ids_next` (bpffs refuses dots in names).
fn staging(pin: &Path) -> PathBuf {
    let mut name = pin.file_name().unwrap_or_default().to_owned();
    name.push("_next");
    pin.with_file_name(name)
}

/// Removes a staging pin an interrupted replacement left behind.
fn remove_stale(staged: &Path) -> Result<(), RecordError> {
    match std::fs::remove_file(staged) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(RecordError::Io {
            what: "removing a stale copy of",
            record: RECORD,
            pin: staged.to_owned(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// A mappable record's slots, mapped read-only into this process. The agent writes through
/// the map (syscalls), so the memory is only read here, and volatile reads see every write.
struct Slots(NonNull<u64>);

// SAFETY: the mapping is plain shared memory owned by this value alone; nothing about it is
// tied to the thread that made it.
unsafe impl Send for Slots {}

impl Slots {
    const LEN: usize = ENTRIES as usize * size_of::<u64>();

    fn map(fd: BorrowedFd<'_>) -> io::Result<Self> {
        // SAFETY: a fresh mapping of the map's fd, at an address the kernel picks; the kernel
        // checks the length against the map's size.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                Self::LEN,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        NonNull::new(at.cast())
            .map(Self)
            .ok_or_else(|| io::Error::other("mmap returned a null address"))
    }

    /// Every slot ever written (not 0), with its index.
    fn read(&self) -> Vec<(u32, u64)> {
        (0..ENTRIES)
            .map(|i| {
                // SAFETY: `i` < ENTRIES, inside the mapping, which lives as long as `self`;
                // slots are u64-aligned (the mapping is page-aligned).
                (i, unsafe {
                    self.0.as_ptr().add(i as usize).read_volatile()
                })
            })
            .filter(|(_, secs)| *secs > 0)
            .collect()
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.0.as_ptr().cast(), Self::LEN) };
    }
}

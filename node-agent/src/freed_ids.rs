//! The pinned record of freed node IDs, `<bpffs>/node-agent/freed_ids`.
//!
//! A freed node ID waits out a cool-down before it is handed out again, because stale copies of
//! it may still be around (peers' maps, xfrm states). The checkpoint records when each ID was
//! freed; but a checkpoint can be lost or corrupt while the kernel state it describes lives on,
//! and then a minutes-old ID would look never used. This map lives exactly as long as that
//! kernel state (a reboot ends both), so the agent merges it into the checkpoint's record at
//! start (invariant 5). One `u64` per node ID: the second, since the Unix epoch, the ID was last
//! freed; 0 for never. The datapath does not read it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use std::os::fd::AsFd;

use aya::maps::{Array, IterableMap, Map, MapData, MapError, MapType};
use node_agent_common as abi;
use state::ids::FreedId;
use state::objects::NodeId;

use crate::datapath::pins::MapLayout;

/// One slot per possible node ID.
const ENTRIES: u32 = 1 << 16;

#[derive(Debug, thiserror::Error)]
pub enum FreedIdsError {
    #[error("the freed-ID record {pin}: {source}")]
    Map { pin: PathBuf, source: MapError },
    #[error("pinning the freed-ID record at {pin}: {source}")]
    Pin {
        pin: PathBuf,
        source: aya::pin::PinError,
    },
    #[error(
        "the pinned map {pin} is not a freed-ID record ({found}; expected {expected}); nothing was changed"
    )]
    Layout {
        pin: PathBuf,
        found: MapLayout,
        expected: MapLayout,
    },
}

/// The layout of the record.
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

pub struct FreedIds {
    pin: PathBuf,
    map: Array<MapData, u64>,
}

impl FreedIds {
    /// Opens the record, creating and pinning it if there is none (the pin directory must
    /// exist). A pin of another layout is refused, and left as it is.
    pub fn open_or_create(pin: &Path) -> Result<Self, FreedIdsError> {
        let err = |source| FreedIdsError::Map {
            pin: pin.to_owned(),
            source,
        };
        match MapLayout::of_pin(pin).map_err(err)? {
            Some(found) if found != layout() => {
                return Err(FreedIdsError::Layout {
                    pin: pin.to_owned(),
                    found,
                    expected: layout(),
                });
            }
            Some(_) => {}
            None => {
                let created = Array::<MapData, u64>::create(ENTRIES, 0).map_err(err)?;
                created.pin(pin).map_err(|source| FreedIdsError::Pin {
                    pin: pin.to_owned(),
                    source,
                })?;
            }
        }
        Self::open(pin)
    }

    /// Opens an existing record.
    pub fn open(pin: &Path) -> Result<Self, FreedIdsError> {
        let err = |source| FreedIdsError::Map {
            pin: pin.to_owned(),
            source,
        };
        let data = MapData::from_pin(pin).map_err(err)?;
        let map = Array::try_from(Map::Array(data)).map_err(err)?;
        Ok(Self {
            pin: pin.to_owned(),
            map,
        })
    }

    /// Every ID freed so far, with when. Read in batches where the kernel can (this runs at
    /// every start, and slot by slot it was most of the cost of a run without nodes).
    pub fn read(&self) -> Result<Vec<FreedId>, FreedIdsError> {
        let err = |source| FreedIdsError::Map {
            pin: self.pin.clone(),
            source,
        };
        let slots: Vec<(u32, u64)> =
            match crate::map_batch::lookup_all(self.map.map().fd().as_fd()).map_err(err)? {
                Some(slots) => slots,
                None => (0..)
                    .zip(self.map.iter())
                    .map(|(i, secs)| secs.map(|s| (i, s)))
                    .collect::<Result<_, _>>()
                    .map_err(err)?,
            };
        Ok(slots
            .into_iter()
            .filter(|(_, secs)| *secs > 0)
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
    pub fn write(&mut self, freed: &[FreedId]) -> Result<(), FreedIdsError> {
        for f in freed {
            let secs = f.freed_at.as_secs() + u64::from(f.freed_at.subsec_nanos() > 0);
            self.map
                .set(u32::from(f.id.get()), secs.max(1), 0)
                .map_err(|source| FreedIdsError::Map {
                    pin: self.pin.clone(),
                    source,
                })?;
        }
        Ok(())
    }
}

//! Checks an existing pin against the layout this build expects.
//!
//! aya 0.14 reuses a pinned map by name without comparing its definition, so a pin left by an
//! older, incompatible agent would be silently misread. We compare first and refuse to start on a
//! mismatch, deleting nothing: the pin may hold the only copy of the node IDs the datapath uses.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use aya::Pod;
use aya::maps::{Array, Map, MapData, MapError, MapInfo, MapType};

/// The definition of a map, as far as compatibility is concerned.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MapLayout {
    pub map_type: MapType,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
}

impl fmt::Display for MapLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?}, key {} B, value {} B, {} entries",
            self.map_type, self.key_size, self.value_size, self.max_entries
        )
    }
}

impl MapLayout {
    /// The layout of the map pinned at `path`, or `None` when nothing is pinned there.
    pub fn of_pin(path: &Path) -> Result<Option<Self>, aya::maps::MapError> {
        if !path.exists() {
            return Ok(None);
        }
        let info = MapInfo::from_pin(path)?;
        Ok(Some(Self {
            map_type: info.map_type()?,
            key_size: info.key_size(),
            value_size: info.value_size(),
            max_entries: info.max_entries(),
        }))
    }
}

impl MapLayout {
    /// Whether a map of this layout is pinned at `pin` for `record` (`false`: nothing is). A
    /// map of another layout is refused, and left as it is.
    pub fn pinned_at(&self, pin: &Path, record: &'static str) -> Result<bool, RecordError> {
        match Self::of_pin(pin).map_err(|source| RecordError::Map {
            record,
            pin: pin.to_owned(),
            source,
        })? {
            Some(found) if found != *self => Err(RecordError::Layout {
                record,
                pin: pin.to_owned(),
                found,
                expected: *self,
            }),
            Some(_) => Ok(true),
            None => Ok(false),
        }
    }
}

/// Pins `created`, an array just made for `record`, at `pin`.
pub fn pin_record<V: Pod>(
    created: Result<Array<MapData, V>, MapError>,
    pin: &Path,
    record: &'static str,
) -> Result<(), RecordError> {
    created
        .map_err(|source| RecordError::Map {
            record,
            pin: pin.to_owned(),
            source,
        })?
        .pin(pin)
        .map_err(|source| RecordError::Pin {
            record,
            pin: pin.to_owned(),
            source,
        })
}

/// Opens the array pinned at `pin` for `record`.
pub fn open_record<V: Pod>(
    pin: &Path,
    record: &'static str,
) -> Result<Array<MapData, V>, RecordError> {
    let err = |source| RecordError::Map {
        record,
        pin: pin.to_owned(),
        source,
    };
    let data = MapData::from_pin(pin).map_err(err)?;
    Array::try_from(Map::Array(data)).map_err(err)
}

/// Why one of the agent's own pinned records (maps only the agent reads, which keep what a
/// lost checkpoint would forget) could not be used; `record` names it.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("{record} {pin}: {source}")]
    Map {
        record: &'static str,
        pin: PathBuf,
        source: MapError,
    },
    #[error("pinning {record} at {pin}: {source}")]
    Pin {
        record: &'static str,
        pin: PathBuf,
        source: aya::pin::PinError,
    },
    #[error("{what} {record} {pin}: {source}")]
    Io {
        what: &'static str,
        record: &'static str,
        pin: PathBuf,
        source: io::Error,
    },
    #[error(
        "the pinned map {pin} is not {record} ({found}; expected {expected}); nothing was changed"
    )]
    Layout {
        record: &'static str,
        pin: PathBuf,
        found: MapLayout,
        expected: MapLayout,
    },
}

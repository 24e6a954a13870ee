//! Checks an existing pin against the layout this build expects.
//!
//! aya 0.14 reuses a pinned map by name without comparing its definition, so a pin left by an
//! older, incompatible agent would be silently misread. We compare first and refuse to start on a
//! mismatch, deleting nothing: the pin may hold the only copy of the node IDs the datapath uses.

use std::fmt;
use std::path::Path;

use aya::maps::{MapInfo, MapType};

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

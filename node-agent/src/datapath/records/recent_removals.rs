//! The pinned record of the brake's recent removals, `<bpffs>/node-agent/recent_removals`.
//!
//! The brake counts what it let through within the window (the confirm delay) together with
//! what a plan asks for now, so that a mass deletion cannot be split into small ones
//! (invariant 9). The checkpoint keeps that window across restarts; but a checkpoint can be lost
//! or corrupt while the kernel state lives on, and a window that starts empty again lets the
//! next plan remove as much as the first did. The freed-ID record alone is no stand-in: a
//! removed node whose ID stays in use (a nexthop someone else's route holds) frees none, and
//! orphan objects carry no ID at all. So each removal the brake lets through is also written
//! here, in the kernel, which lives exactly as long as the state it describes (invariant 9).
//!
//! A ring of [`SLOTS`] slots: a new entry takes the slot after the newest. When that slot still
//! holds an entry inside the window, the new entry absorbs its counts: a removal is then
//! remembered longer than it happened, never shorter, so a full ring makes the brake stricter,
//! not blind. The datapath does not read it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use aya::maps::{Array, MapData, MapType};
use node_agent_common as abi;
use state::checkpoint::RecentRemovals;

use crate::datapath::pins::{MapLayout, RecordError, open_record, pin_record};

/// Entries kept; more removals than this within one window are merged, as the module says.
pub const SLOTS: u32 = 1024;

type Slot = [u64; 2];

/// Names the record in errors.
const RECORD: &str = "the record of recent removals";

pub fn layout() -> MapLayout {
    MapLayout {
        map_type: MapType::Array,
        key_size: 4,
        value_size: size_of::<Slot>() as u32,
        max_entries: SLOTS,
    }
}

/// `<bpffs>/node-agent/recent_removals`.
pub fn pin(bpffs: &Path) -> PathBuf {
    crate::datapath::pin_dir(bpffs).join(abi::RECENT_REMOVALS_PIN)
}

pub struct RecentRemovalsRecord {
    pin: PathBuf,
    map: Array<MapData, Slot>,
    /// The slots as last read or written: the ring's position and what a new entry absorbs.
    slots: Vec<Slot>,
    /// Whether the record was there before this agent opened it (else it knows nothing yet).
    existed: bool,
}

impl RecentRemovalsRecord {
    /// Opens the record, creating and pinning an empty one if there is none (the pin directory
    /// must exist). A pin of another layout is refused, and left as it is.
    pub fn open_or_create(pin: &Path) -> Result<Self, RecordError> {
        if layout().pinned_at(pin, RECORD)? {
            return Self::open(pin);
        }
        pin_record(Array::<MapData, Slot>::create(SLOTS, 0), pin, RECORD)?;
        Ok(Self {
            existed: false,
            ..Self::open(pin)?
        })
    }

    /// Opens an existing record, changing nothing.
    pub fn open(pin: &Path) -> Result<Self, RecordError> {
        let map = open_record(pin, RECORD)?;
        let slots = map
            .iter()
            .collect::<Result<Vec<Slot>, _>>()
            .map_err(|source| RecordError::Map {
                record: RECORD,
                pin: pin.to_owned(),
                source,
            })?;
        Ok(Self {
            pin: pin.to_owned(),
            map,
            slots,
            existed: true,
        })
    }

    /// The removals remembered, oldest first; `None` for a record created by this agent, which
    /// knows nothing of what came before it.
    pub fn read(&self) -> Option<Vec<RecentRemovals>> {
        if !self.existed {
            return None;
        }
        let mut out: Vec<RecentRemovals> = self.slots.iter().filter_map(decode).collect();
        out.sort_by_key(|r| r.at);
        Some(out)
    }

    /// Remembers `removal`. An entry it displaces that is still younger than `keep_since` is
    /// merged into it.
    pub fn push(
        &mut self,
        removal: RecentRemovals,
        keep_since: Duration,
    ) -> Result<(), RecordError> {
        let (slot, merged) = next_slot(&self.slots, removal, keep_since);
        self.map
            .set(slot as u32, encode(&merged), 0)
            .map_err(|source| RecordError::Map {
                record: RECORD,
                pin: self.pin.clone(),
                source,
            })?;
        self.slots[slot] = encode(&merged);
        Ok(())
    }
}

/// Where `removal` goes (the slot after the newest entry), and what it becomes there.
fn next_slot(
    slots: &[Slot],
    removal: RecentRemovals,
    keep_since: Duration,
) -> (usize, RecentRemovals) {
    let newest = slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| decode(s).map(|r| (r.at, i)))
        .max();
    let slot = newest.map_or(0, |(_, i)| (i + 1) % slots.len());
    let merged = match decode(&slots[slot]) {
        Some(old) if old.at >= keep_since => RecentRemovals {
            nodes: removal.nodes.saturating_add(old.nodes),
            objects: removal.objects.saturating_add(old.objects),
            ..removal
        },
        _ => removal,
    };
    (slot, merged)
}

fn encode(r: &RecentRemovals) -> Slot {
    // Never 0, which marks an empty slot; u64 nanoseconds last until the year 2554.
    let at = u64::try_from(r.at.as_nanos()).unwrap_or(u64::MAX).max(1);
    [at, (u64::from(r.nodes) << 32) | u64::from(r.objects)]
}

fn decode(s: &Slot) -> Option<RecentRemovals> {
    (s[0] != 0).then(|| RecentRemovals {
        at: Duration::from_nanos(s[0]),
        nodes: (s[1] >> 32) as u32,
        objects: s[1] as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64, nodes: u32, objects: u32) -> RecentRemovals {
        RecentRemovals {
            at: Duration::from_secs(secs),
            nodes,
            objects,
        }
    }

    #[test]
    fn slots_round_trip_and_zero_is_empty() {
        let r = RecentRemovals {
            at: Duration::new(1_790_000_000, 123),
            nodes: 70_000,
            objects: 3,
        };
        assert_eq!(decode(&encode(&r)), Some(r));
        assert_eq!(decode(&[0, 5]), None);
    }

    #[test]
    fn the_ring_fills_after_the_newest_and_merges_what_it_displaces_inside_the_window() {
        let mut slots = vec![[0u64; 2]; 3];
        for (secs, n) in [(10, 1), (20, 2), (30, 3)] {
            let (i, r) = next_slot(&slots, at(secs, n, 0), Duration::from_secs(5));
            slots[i] = encode(&r);
        }
        let read: Vec<_> = slots.iter().filter_map(decode).collect();
        assert_eq!(read, [at(10, 1, 0), at(20, 2, 0), at(30, 3, 0)]);
        // Full: the next one takes the oldest slot; inside the window it absorbs its counts.
        let (i, r) = next_slot(&slots, at(40, 4, 1), Duration::from_secs(5));
        assert_eq!((i, r), (0, at(40, 5, 1)));
        // Outside the window the displaced entry is simply forgotten.
        let (i, r) = next_slot(&slots, at(40, 4, 1), Duration::from_secs(15));
        assert_eq!((i, r), (0, at(40, 4, 1)));
    }
}

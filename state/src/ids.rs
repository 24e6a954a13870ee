//! Node-ID allocation.
//!
//! A node ID is written into the datapath (map values, packet marks, xfrm marks), so an ID handed
//! to a new node while something still holds it for the old one would count, mark or match the
//! new node's traffic as the old one's. Hence: IDs are restored before anything is allocated,
//! never-used IDs come first, then a freed ID that has waited out the cool-down (15 minutes by
//! default: ample for anything that reads IDs to let go of the old node), the one freed longest
//! ago first.
//!
//! At the edge of the ID space (65,000 nodes leave about 535 IDs never used), a node-pool upgrade
//! can replace more nodes within the cool-down than there are free IDs. Then the freed ID that
//! has cooled longest is reused early, once it has cooled at least the floor (2 minutes by
//! default, `--id-reuse-floor`): the agent deletes a node's map entries, routes and xfrm objects
//! before it frees the ID, so what can still carry the old ID is what outlives those deletes:
//! packets queued in the stack (milliseconds), a segment the old node's peer retransmits
//! (TCP gives up within `TCP_RTO_MAX`, 120 s), and a reader that samples the per-ID counters or
//! marks (a scrape interval, 15 to 60 s). Below the floor a new node waits, with an error that
//! says when an ID comes free.
//!
//! Time is passed in (a [`Duration`] since the Unix epoch), never read here, so the allocator is
//! pure and its tests are exact.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::objects::NodeId;

/// The highest ID; 0 is the local node.
pub const MAX_ID: u16 = u16::MAX;

/// An ID freed at `freed_at` (since the Unix epoch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreedId {
    pub id: NodeId,
    pub freed_at: Duration,
}

/// What must survive a restart: the freed IDs with their free time, so the cool-down is not reset
/// by a restart. IDs in use are not stored here: they are restored from the map and the
/// checkpoint's node records.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorState {
    pub freed: Vec<FreedId>,
}

/// An ID handed out by [`IdAllocator::allocate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocated {
    pub id: NodeId,
    /// When the ID was freed, if it was used before: every never-used ID was taken, so a freed ID
    /// is reused, which is worth a warning.
    pub reused_after: Option<Duration>,
    /// Reused before its cool-down had passed (past the floor): worth a louder one.
    pub early: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error(
        "allocating a node ID: all {limit} IDs are in use or cooling down ({cooling} freed less than {cooldown:?} ago){}",
        next_free(*next_in, *floor)
    )]
    Exhausted {
        limit: u16,
        cooling: usize,
        cooldown: Duration,
        /// The floor a cooling ID must reach before it is reused early.
        floor: Duration,
        /// When the freed ID that has cooled longest reaches the floor; `None` when none is
        /// cooling (every ID is in use).
        next_in: Option<Duration>,
    },
}

fn next_free(next_in: Option<Duration>, floor: Duration) -> String {
    match next_in {
        Some(d) => format!(
            "; the next can be reused in {}s, once it has cooled {}s",
            d.as_secs().max(1),
            floor.as_secs()
        ),
        None => String::new(),
    }
}

const WORDS: usize = (MAX_ID as usize + 1) / 64;

/// A set of node IDs, one bit per ID (8 KiB): constant-time membership without hashing, and
/// iteration in ID order, which the planner needs for deterministic output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct IdSet(Box<[u64; WORDS]>);

impl IdSet {
    pub(crate) fn new() -> Self {
        Self(Box::new([0; WORDS]))
    }

    pub(crate) fn contains(&self, id: NodeId) -> bool {
        let i = id.get() as usize;
        self.0[i / 64] & (1 << (i % 64)) != 0
    }

    pub(crate) fn insert(&mut self, id: NodeId) {
        let i = id.get() as usize;
        self.0[i / 64] |= 1 << (i % 64);
    }

    pub(crate) fn remove(&mut self, id: NodeId) {
        let i = id.get() as usize;
        self.0[i / 64] &= !(1 << (i % 64));
    }

    /// The first ID from `start` on (counting 0) that is not in the set, a word of 64 at a
    /// time: at 65,000 nodes a fresh ID lies past 65,000 IDs in use.
    pub(crate) fn first_absent_from(&self, start: u32) -> Option<u32> {
        let mut w = usize::try_from(start / 64).ok()?;
        // The bits below `start` in its word count as present.
        let mut below = (1u64 << (start % 64)) - 1;
        while w < WORDS {
            let free = !(self.0[w] | below);
            if free != 0 {
                return Some(w as u32 * 64 + free.trailing_zeros());
            }
            below = 0;
            w += 1;
        }
        None
    }

    /// Adds every ID of `other`, a word at a time.
    pub(crate) fn union_with(&mut self, other: &IdSet) {
        for (a, b) in self.0.iter_mut().zip(other.0.iter()) {
            *a |= *b;
        }
    }

    /// The IDs in ascending order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.0
            .iter()
            .enumerate()
            .filter(|(_, bits)| **bits != 0)
            .flat_map(|(w, &bits)| {
                (0..64)
                    .filter(move |b| bits & (1 << b) != 0)
                    .filter_map(move |b| NodeId::new((w * 64 + b) as u16))
            })
    }
}

/// IDs to a page of an [`IdMap`].
const PAGE: usize = 256;

/// A value per node ID, in pages of 256 IDs allocated as IDs are written: a whole cluster's
/// map reads its 65,536 values in order without hashing, and the small one of an event-sized
/// plan allocates only the pages its few IDs fall in (a full table would be most of its work).
#[derive(Clone, Debug)]
pub(crate) struct IdMap<T>(Vec<Option<Box<[T; PAGE]>>>);

impl<T> Default for IdMap<T> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<T: Copy + Default> IdMap<T> {
    /// The value of `id`; the default where none was written.
    pub(crate) fn get(&self, id: NodeId) -> T {
        let (page, at) = Self::place(id);
        self.0
            .get(page)
            .and_then(Option::as_ref)
            .map_or_else(T::default, |p| p[at])
    }

    /// The value of `id`, to write.
    pub(crate) fn get_mut(&mut self, id: NodeId) -> &mut T {
        let (page, at) = Self::place(id);
        if self.0.len() <= page {
            self.0.resize_with(page + 1, || None);
        }
        &mut self.0[page].get_or_insert_with(|| Box::new([T::default(); PAGE]))[at]
    }

    /// Every ID of the pages written, with its value (the default for those not written), in
    /// ID order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (NodeId, T)> + '_ {
        self.0.iter().enumerate().flat_map(|(page, values)| {
            values.iter().flat_map(move |values| {
                values
                    .iter()
                    .enumerate()
                    .filter_map(move |(at, v)| Some((NodeId::new((page * PAGE + at) as u16)?, *v)))
            })
        })
    }

    fn place(id: NodeId) -> (usize, usize) {
        let i = usize::from(id.get());
        (i / PAGE, i % PAGE)
    }
}

/// The allocator for one planning pass.
#[derive(Clone, Debug)]
pub struct IdAllocator {
    cooldown: Duration,
    /// How long a freed ID cools at least before it is reused early; at most `cooldown`.
    floor: Duration,
    /// The highest ID handed out: [`MAX_ID`], or less where a test shrinks the ID space.
    max_id: u16,
    in_use: IdSet,
    /// Freed IDs and when; an ID is never both in use and here.
    freed: BTreeMap<NodeId, Duration>,
    /// The same, oldest first: reuse takes the first, so an allocation at the edge costs a
    /// lookup, not a walk of every freed ID.
    by_age: BTreeSet<(Duration, NodeId)>,
    /// IDs below this were found used or freed by a fresh-ID scan; a hint, never a rule.
    fresh_cursor: u32,
}

impl IdAllocator {
    pub fn new(cooldown: Duration, state: &AllocatorState) -> Self {
        Self::with_max_id(cooldown, MAX_ID, state)
    }

    /// An allocator that hands out IDs up to `max_id` only (tests of the ID space's edge).
    pub fn with_max_id(cooldown: Duration, max_id: u16, state: &AllocatorState) -> Self {
        let mut freed = BTreeMap::new();
        for f in &state.freed {
            // A duplicate keeps the later time: the safer cool-down.
            let e = freed.entry(f.id).or_insert(f.freed_at);
            *e = (*e).max(f.freed_at);
        }
        let by_age = freed.iter().map(|(id, at)| (*at, *id)).collect();
        Self {
            cooldown,
            floor: cooldown,
            max_id: max_id.max(1),
            in_use: IdSet::new(),
            freed,
            by_age,
            fresh_cursor: 1,
        }
    }

    /// Lets a freed ID be reused once it has cooled `floor` (at most the cool-down), when no
    /// never-used or fully cooled ID is left. Without it, the floor is the cool-down.
    pub fn with_reuse_floor(mut self, floor: Duration) -> Self {
        self.floor = floor.min(self.cooldown);
        self
    }

    fn unfree(&mut self, id: NodeId) {
        if let Some(at) = self.freed.remove(&id) {
            self.by_age.remove(&(at, id));
        }
    }

    pub fn is_in_use(&self, id: NodeId) -> bool {
        self.in_use.contains(id)
    }

    /// Marks a restored ID as in use, whatever its cool-down: restored IDs win, since the kernel
    /// already carries them. Returns `false` if it was already in use.
    pub fn reserve(&mut self, id: NodeId) -> bool {
        if self.is_in_use(id) {
            return false;
        }
        self.unfree(id);
        self.in_use.insert(id);
        true
    }

    /// [`Self::reserve`] for every ID of `ids`, at the cost of a union of bit sets: an
    /// event-sized plan knows tens of thousands of IDs only as in use by the rest of the cluster.
    pub(crate) fn reserve_all(&mut self, ids: &IdSet) {
        self.in_use.union_with(ids);
        let by_age = &mut self.by_age;
        self.freed.retain(|id, at| {
            let keep = !ids.contains(*id);
            if !keep {
                by_age.remove(&(*at, *id));
            }
            keep
        });
    }

    /// Hands out an ID: a never-used one if any, else the one freed longest ago if it has cooled
    /// the cool-down at `now`, or at least the floor (an early reuse).
    pub fn allocate(&mut self, now: Duration) -> Result<Allocated, IdError> {
        while let Some(c) = self.in_use.first_absent_from(self.fresh_cursor) {
            if c > u32::from(self.max_id) {
                break;
            }
            self.fresh_cursor = c + 1;
            let Some(id) = NodeId::new(c as u16) else {
                continue;
            };
            if !self.freed.contains_key(&id) {
                self.in_use.insert(id);
                return Ok(Allocated {
                    id,
                    reused_after: None,
                    early: false,
                });
            }
        }
        self.fresh_cursor = u32::from(self.max_id) + 1;
        // Longest freed first; IDs above a shrunk space are never handed out.
        let oldest = self
            .by_age
            .iter()
            .find(|(_, id)| id.get() <= self.max_id)
            .copied();
        match oldest {
            Some((freed_at, id)) if now.saturating_sub(freed_at) >= self.floor => {
                self.unfree(id);
                self.in_use.insert(id);
                Ok(Allocated {
                    id,
                    reused_after: Some(freed_at),
                    early: now.saturating_sub(freed_at) < self.cooldown,
                })
            }
            _ => Err(IdError::Exhausted {
                limit: self.max_id,
                cooling: self
                    .freed
                    .iter()
                    .filter(|(id, at)| {
                        id.get() <= self.max_id && now.saturating_sub(**at) < self.cooldown
                    })
                    .count(),
                cooldown: self.cooldown,
                floor: self.floor,
                next_in: oldest.map(|(at, _)| (at + self.floor).saturating_sub(now)),
            }),
        }
    }

    /// Returns an ID; it becomes reusable once the cool-down has passed after `now` (the floor,
    /// at the edge).
    pub fn free(&mut self, id: NodeId, now: Duration) {
        self.in_use.remove(id);
        self.unfree(id);
        self.freed.insert(id, now);
        self.by_age.insert((now, id));
    }

    /// The state to checkpoint. Freed IDs are kept after their cool-down too: they still order
    /// reuse (longest-freed first) and cost six bytes each.
    pub fn state(&self) -> AllocatorState {
        AllocatorState {
            freed: self
                .freed
                .iter()
                .map(|(id, at)| FreedId {
                    id: *id,
                    freed_at: *at,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(v: u16) -> NodeId {
        NodeId::new(v).unwrap()
    }
    const MIN: Duration = Duration::from_secs(60);

    #[test]
    fn the_first_absent_id_is_found_across_words() {
        let mut set = IdSet::new();
        assert_eq!(set.first_absent_from(0), Some(0));
        for v in 1..=200u16 {
            set.insert(id(v));
        }
        assert_eq!(set.first_absent_from(1), Some(201));
        assert_eq!(set.first_absent_from(0), Some(0));
        assert_eq!(set.first_absent_from(64), Some(201));
        assert_eq!(set.first_absent_from(300), Some(300));
        for v in 1..=u16::MAX {
            set.insert(id(v));
        }
        assert_eq!(set.first_absent_from(1), None);
        assert_eq!(set.first_absent_from(65_536), None);
    }

    #[test]
    fn an_id_map_keeps_a_value_per_id_and_allocates_only_the_pages_written() {
        let mut m: IdMap<u32> = IdMap::default();
        assert_eq!(m.get(id(65_535)), 0);
        assert_eq!(m.iter().count(), 0);
        for v in [1u16, 255, 256, 65_535] {
            *m.get_mut(id(v)) += u32::from(v);
        }
        *m.get_mut(id(256)) += 1;
        assert_eq!(m.get(id(1)), 1);
        assert_eq!(m.get(id(256)), 257);
        assert_eq!(m.get(id(65_535)), 65_535);
        assert_eq!(m.get(id(300)), 0, "on a written page, never written");
        assert_eq!(m.get(id(40_000)), 0, "on a page never written");
        let written: Vec<(u16, u32)> = m
            .iter()
            .filter(|(_, v)| *v > 0)
            .map(|(i, v)| (i.get(), v))
            .collect();
        assert_eq!(written, [(1, 1), (255, 255), (256, 257), (65_535, 65_535)]);
        // Pages 0, 1 and 255: ID 0 is no node ID, so 3 * 256 - 1 values.
        assert_eq!(m.iter().count(), 3 * 256 - 1);
    }

    #[test]
    fn zero_is_never_assigned_and_first_id_is_one() {
        let mut a = IdAllocator::new(MIN, &AllocatorState::default());
        assert_eq!(a.allocate(Duration::ZERO).map(|a| a.id), Ok(id(1)));
        assert_eq!(a.allocate(Duration::ZERO).map(|a| a.id), Ok(id(2)));
    }

    #[test]
    fn restored_ids_are_skipped_by_allocation() {
        let mut a = IdAllocator::new(MIN, &AllocatorState::default());
        assert!(a.reserve(id(1)));
        assert!(!a.reserve(id(1)));
        assert_eq!(a.allocate(Duration::ZERO).map(|a| a.id), Ok(id(2)));
    }

    #[test]
    fn reserving_a_set_is_reserving_each_of_its_ids() {
        // 2 was freed long ago: reserved, it is in use and no longer a candidate for reuse.
        let state = AllocatorState {
            freed: vec![FreedId {
                id: id(2),
                freed_at: Duration::ZERO,
            }],
        };
        let mut a = IdAllocator::with_max_id(MIN, 3, &state);
        let mut set = IdSet::new();
        set.insert(id(1));
        set.insert(id(2));
        a.reserve_all(&set);
        assert!(a.is_in_use(id(1)) && a.is_in_use(id(2)));
        assert!(!a.reserve(id(2)));
        assert_eq!(
            a.allocate(Duration::from_secs(1000)).map(|a| a.id),
            Ok(id(3))
        );
        assert!(
            a.allocate(Duration::from_secs(1000)).is_err(),
            "2 is not reused"
        );
    }

    #[test]
    fn freed_id_is_not_reused_before_cooldown_and_never_used_ids_come_first() {
        let mut a = IdAllocator::new(MIN, &AllocatorState::default());
        let first = a.allocate(Duration::ZERO).unwrap().id;
        a.free(first, Duration::from_secs(10));
        assert_eq!(
            a.allocate(Duration::from_secs(1000)),
            Ok(Allocated {
                id: id(2),
                reused_after: None,
                early: false
            })
        );
    }

    #[test]
    fn exhausted_ids_name_the_limit_then_longest_freed_is_reused_first() {
        let mut a = IdAllocator::new(MIN, &AllocatorState::default());
        for _ in 0..MAX_ID {
            a.allocate(Duration::ZERO).unwrap();
        }
        let e = a.allocate(Duration::ZERO).unwrap_err();
        assert!(e.to_string().contains("65535"), "{e}");
        a.free(id(7), Duration::from_secs(100));
        a.free(id(5), Duration::from_secs(200));
        assert!(matches!(
            a.allocate(Duration::from_secs(150)),
            Err(IdError::Exhausted { cooling: 2, .. })
        ));
        assert_eq!(
            a.allocate(Duration::from_secs(300)),
            Ok(Allocated {
                id: id(7),
                reused_after: Some(Duration::from_secs(100)),
                early: false
            })
        );
        assert_eq!(
            a.allocate(Duration::from_secs(300)).map(|a| a.id),
            Ok(id(5))
        );
    }

    #[test]
    fn cooldown_survives_a_restart_through_the_state() {
        let mut a = IdAllocator::new(MIN, &AllocatorState::default());
        for _ in 0..MAX_ID {
            a.allocate(Duration::ZERO).unwrap();
        }
        a.free(id(9), Duration::from_secs(100));
        let state = a.state();
        let mut b = IdAllocator::new(MIN, &state);
        for v in 1..=MAX_ID {
            if v != 9 {
                b.reserve(id(v));
            }
        }
        assert!(b.allocate(Duration::from_secs(120)).is_err());
        assert_eq!(
            b.allocate(Duration::from_secs(160)).map(|a| a.id),
            Ok(id(9))
        );
    }

    #[test]
    fn a_smaller_id_space_ends_at_its_limit_and_says_so() {
        let mut a = IdAllocator::with_max_id(MIN, 3, &AllocatorState::default());
        for v in 1..=3 {
            assert_eq!(a.allocate(Duration::ZERO).map(|a| a.id), Ok(id(v)));
        }
        a.free(id(2), Duration::from_secs(10));
        let e = a.allocate(Duration::from_secs(20)).unwrap_err();
        assert_eq!(
            e,
            IdError::Exhausted {
                limit: 3,
                cooling: 1,
                cooldown: MIN,
                floor: MIN,
                next_in: Some(Duration::from_secs(50)),
            }
        );
        assert!(e.to_string().contains("all 3 IDs"), "{e}");
        assert_eq!(
            a.allocate(Duration::from_secs(100)).map(|a| a.reused_after),
            Ok(Some(Duration::from_secs(10)))
        );
    }

    /// Every rung of the ladder, in order, at the edge of a small space: never-used, cooled
    /// (longest freed first), cooled past the floor only (early, longest freed first), and below
    /// the floor an error that says when.
    #[test]
    fn at_the_edge_the_longest_cooled_id_is_reused_once_past_the_floor() {
        const FLOOR: Duration = Duration::from_secs(20);
        let secs = Duration::from_secs;
        let mut a =
            IdAllocator::with_max_id(MIN, 4, &AllocatorState::default()).with_reuse_floor(FLOOR);
        for v in 1..=4 {
            let got = a.allocate(secs(0)).unwrap();
            assert_eq!((got.id, got.reused_after, got.early), (id(v), None, false));
        }
        a.free(id(3), secs(100));
        a.free(id(1), secs(105));
        a.free(id(4), secs(170));
        let e = a.allocate(secs(110)).unwrap_err();
        assert!(
            matches!(e, IdError::Exhausted { cooling: 3, next_in: Some(d), .. } if d == secs(10)),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("reused in 10s, once it has cooled 20s"),
            "{e}"
        );
        // 3 has cooled 60 s, a full cool-down; 1 only 55 s, past the floor: early.
        let got = a.allocate(secs(160)).unwrap();
        assert_eq!((got.id, got.early), (id(3), false));
        let got = a.allocate(secs(160)).unwrap();
        assert_eq!(
            (got.id, got.reused_after, got.early),
            (id(1), Some(secs(105)), true)
        );
        // 4 has cooled 0 s.
        assert!(a.allocate(secs(170)).is_err());
        let got = a.allocate(secs(190)).unwrap();
        assert_eq!((got.id, got.early), (id(4), true));
        let e = a.allocate(secs(190)).unwrap_err();
        assert!(
            matches!(
                e,
                IdError::Exhausted {
                    cooling: 0,
                    next_in: None,
                    ..
                }
            ),
            "every ID in use: {e:?}"
        );
        // Without a floor of its own, the floor is the cool-down: nothing early.
        let mut b = IdAllocator::with_max_id(MIN, 1, &AllocatorState::default());
        b.allocate(secs(0)).unwrap();
        b.free(id(1), secs(0));
        assert!(b.allocate(secs(59)).is_err());
        assert_eq!(b.allocate(secs(60)).map(|g| g.early), Ok(false));
    }

    #[test]
    fn reserving_a_cooling_id_takes_it_out_of_the_freed_list() {
        let mut a = IdAllocator::new(
            MIN,
            &AllocatorState {
                freed: vec![FreedId {
                    id: id(3),
                    freed_at: Duration::ZERO,
                }],
            },
        );
        assert!(a.reserve(id(3)));
        assert!(a.state().freed.is_empty());
    }
}

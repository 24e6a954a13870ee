//! Dense indices for a plan's resources, built in parts that fit a core's cache.
//!
//! A full plan at 65,000 dual-stack nodes interns about 260,000 resources and looks up as many
//! again (the key resources of our objects in the kernel). In one hash table of that size
//! every insert and every lookup is two cache misses, and that was half the plan. Here the
//! work is first written out, in order, to one list per part of the hash space (a stream of
//! writes the CPU does well); then each part's table is built and probed while it is small
//! enough to stay in cache. The answers go back to where the caller asked for them.
//!
//! What comes out is what one table would give: each distinct resource has one index, below
//! [`Interner::len`]. The index is the place of the resource's first intern, so indices follow
//! the order the caller interned in (node by node) rather than the hash's: the planner's walks
//! over nodes then touch its per-resource vectors in order, not at random. A place taken by a
//! repeated intern is a hole no index names; [`Interner::len`] counts holes too, as it bounds
//! the indices.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;
use foldhash::{HashMap, HashMapExt};

use super::resource::Resource;

/// A resource's place in an [`Interner`].
pub(super) type Res = u32;

/// A lookup's answer when no one interned the resource.
pub(super) const MISSING: Res = u32::MAX - 1;

/// About this many resources to a part: its table (24 bytes a bucket at most 7/8 full) and its
/// lists stay within a core's 512 KiB L2 on the machines we measure on. Debug builds (every
/// test) split even a handful of resources into parts, so that the planner's tests run through
/// the same split a large cluster takes.
const PER_PART: usize = if cfg!(debug_assertions) { 4 } else { 4096 };

/// At most 2^this many parts.
const MAX_BITS: u32 = 8;
// A part's number fits the byte [`Lookups`] keeps it in.
const _: () = assert!(MAX_BITS <= 8);

/// How resources are split into parts: by the top bits of a hash of their own.
#[derive(Clone)]
pub(super) struct Split {
    state: RandomState,
    bits: u32,
}

impl Split {
    /// Parts for about `interns` resources.
    pub fn new(interns: usize) -> Self {
        let bits = (interns / PER_PART)
            .checked_next_power_of_two()
            .map_or(MAX_BITS, |p| p.trailing_zeros().min(MAX_BITS));
        Self {
            state: RandomState::default(),
            bits,
        }
    }

    /// How many parts: more than one is work worth a second core.
    pub fn parts(&self) -> usize {
        1 << self.bits
    }

    /// Which part `r` falls in (each part's table hashes with another seed, so its buckets
    /// still spread).
    fn part(&self, r: &Resource) -> usize {
        if self.bits == 0 {
            0
        } else {
            (self.state.hash_one(r) >> (64 - self.bits)) as usize
        }
    }

    /// Room for `n` items spread over the parts: each gets its share and a little over; more
    /// only grows its list.
    fn lists<T>(&self, n: usize) -> Vec<Vec<T>> {
        let parts = self.parts();
        let room = n / parts + n / parts / 8 + 16;
        (0..parts).map(|_| Vec::with_capacity(room)).collect()
    }
}

/// Resources to intern, sorted into parts, and in the order they came.
pub(super) struct Interns {
    split: Split,
    /// Every interned resource, in call order: an intern's place is its position here.
    resources: Vec<Resource>,
    /// Per part: its interns, with their places, in call order.
    parts: Vec<Vec<(Resource, u32)>>,
}

impl Interns {
    /// Room for about `n` interns.
    pub fn new(split: Split, n: usize) -> Self {
        Self {
            parts: split.lists(n),
            split,
            resources: Vec::with_capacity(n),
        }
    }

    /// Interns `r` at the next place: 0, 1, 2... in the order of the calls.
    pub fn push(&mut self, r: Resource) {
        let p = self.split.part(&r);
        let at = self.resources.len() as u32;
        self.resources.push(r);
        self.parts[p].push((r, at));
    }
}

/// Resources to look up once everything is interned, sorted into parts, and the order they
/// came in.
pub(super) struct Lookups {
    split: Split,
    /// Per part: its lookups, in call order.
    parts: Vec<Vec<Resource>>,
    /// Per lookup, in call order: its part, and where its answer goes.
    asked: Vec<(u8, u32)>,
}

impl Lookups {
    /// Room for about `n` lookups.
    pub fn new(split: Split, n: usize) -> Self {
        Self {
            parts: split.lists(n),
            split,
            asked: Vec::with_capacity(n),
        }
    }

    /// Looks `r` up; its index, or [`MISSING`], goes to `found[at]` of [`run`]. Lookups asked
    /// in the order of their `at`s have their answers written in order.
    pub fn push(&mut self, r: Resource, at: u32) {
        let p = self.split.part(&r);
        self.parts[p].push(r);
        self.asked.push((p as u8, at));
    }
}

/// What one part gave: its table, its lookups' answers in order, and its repeated interns.
type PartDone = (
    HashMap<Resource, Res>,
    std::vec::IntoIter<Res>,
    Vec<(u32, Res)>,
);

/// Does the work, part by part (half of the parts on a second core where there is one), and
/// keeps the tables for [`Interner::get`]: each intern's index goes to `interned` (one entry
/// per intern, by place), each lookup's answer to `found`. `interns` and `lookups` must share
/// one [`Split`].
///
/// Answers are written in the order the caller asked, never part by part: a part's places are
/// spread over the whole range, and writing them from there was a cache miss each. An intern's
/// index is its own place unless the resource came before, so `interned` starts as the places
/// and only repeats are written out of order.
pub(super) fn run(
    interns: Interns,
    lookups: Lookups,
    interned: &mut [Res],
    found: &mut [Res],
) -> Interner {
    for (at, res) in interned.iter_mut().enumerate() {
        *res = at as Res;
    }
    let mut work: Vec<_> = interns.parts.into_iter().zip(lookups.parts).collect();
    let two = work.len() > 1;
    let second = work.split_off(work.len() / 2);
    let (mut done, rest) = super::parallel::both(
        two,
        || second.into_iter().map(one_part).collect::<Vec<_>>(),
        || work.into_iter().map(one_part).collect::<Vec<_>>(),
    );
    done.splice(0..0, rest);
    let mut tables = Vec::with_capacity(done.len());
    let mut answers = Vec::with_capacity(done.len());
    for (table, found, repeats) in done {
        for (at, res) in repeats {
            interned[at as usize] = res;
        }
        tables.push(table);
        answers.push(found);
    }
    for (p, at) in lookups.asked {
        found[at as usize] = answers[p as usize].next().unwrap_or(MISSING);
    }
    debug_assert!(
        answers.iter_mut().all(|a| a.next().is_none()),
        "every answer taken, in the order asked"
    );
    Interner {
        split: interns.split,
        parts: tables,
        resources: interns.resources,
    }
}

/// One part: its table from its interns (in call order, so the first of a resource gives its
/// index), then its lookups.
fn one_part((interns, lookups): (Vec<(Resource, u32)>, Vec<Resource>)) -> PartDone {
    let mut table: HashMap<Resource, Res> = HashMap::with_capacity(interns.len());
    let mut repeats = Vec::new();
    for (r, at) in interns {
        let res = *table.entry(r).or_insert(at);
        if res != at {
            repeats.push((at, res));
        }
    }
    let found: Vec<Res> = lookups
        .iter()
        .map(|r| table.get(r).copied().unwrap_or(MISSING))
        .collect();
    (table, found.into_iter(), repeats)
}

/// Every interned resource, by index, and the index of each.
pub(super) struct Interner {
    split: Split,
    parts: Vec<HashMap<Resource, Res>>,
    resources: Vec<Resource>,
}

impl Interner {
    /// A bound on the indices: the length of a vector indexed by them.
    pub fn len(&self) -> usize {
        self.resources.len()
    }

    /// The index of `r`, if it was interned.
    pub fn get(&self, r: &Resource) -> Option<Res> {
        self.parts[self.split.part(r)].get(r).copied()
    }

    pub fn resource(&self, r: Res) -> Resource {
        self.resources[r as usize]
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap as StdMap;
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;

    fn address(i: u32) -> Resource {
        Resource::Address(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)))
    }

    /// Many parts and few: one index per distinct resource, the same for each of its interns,
    /// and lookups that find exactly what was interned.
    #[test]
    fn gives_what_one_table_would() {
        for n in [0u32, 1, 100, 40_000] {
            // Every resource twice, and lookups of half of them plus as many never interned.
            let split = Split::new(2 * n as usize);
            let mut interns = Interns::new(split.clone(), 2 * n as usize);
            let mut lookups = Lookups::new(split, n as usize);
            for k in 0..2 * n {
                interns.push(address(k % n.max(1)));
            }
            for k in 0..n {
                lookups.push(address(2 * k), k);
            }
            let mut interned = vec![0; 2 * n as usize];
            let mut found = vec![0; n as usize];
            let interner = run(interns, lookups, &mut interned, &mut found);
            assert_eq!(interner.len(), 2 * n as usize);
            let distinct: std::collections::HashSet<Res> = interned.iter().copied().collect();
            assert_eq!(distinct.len(), n as usize);
            let mut seen: StdMap<Res, Resource> = StdMap::new();
            for k in 0..2 * n {
                let res = interned[k as usize];
                assert_eq!(res, k % n, "the place of its first intern");
                assert_eq!(interner.resource(res), address(k % n));
                assert_eq!(*seen.entry(res).or_insert(address(k % n)), address(k % n));
                assert_eq!(interner.get(&address(k % n)), Some(res));
            }
            for k in 0..n {
                let want = (2 * k < n).then(|| interner.get(&address(2 * k)).unwrap());
                assert_eq!(found[k as usize], want.unwrap_or(MISSING));
            }
            assert_eq!(interner.get(&address(n + 7)), None);
        }
    }
}

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
//! over nodes then touch its per-resource vectors in order, not at random. Places taken by a
//! repeated intern are holes no index names; [`Interner::len`] counts them too, as it bounds
//! the indices.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;
use foldhash::{HashMap, HashMapExt};

use super::claims::Resource;

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

/// The work of one [`Batch::run`]: resources to intern and to look up, each with the place its
/// answer goes, sorted into parts by hash.
pub(super) struct Batch {
    split: RandomState,
    bits: u32,
    interns: Vec<Vec<(Resource, u32)>>,
    lookups: Vec<Vec<(Resource, u32)>>,
}

impl Batch {
    /// Room for about `interns` interns and `lookups` lookups.
    pub fn new(interns: usize, lookups: usize) -> Self {
        let bits = (interns / PER_PART)
            .checked_next_power_of_two()
            .map_or(MAX_BITS, |p| p.trailing_zeros().min(MAX_BITS));
        let parts = 1usize << bits;
        // Hashes spread evenly: a part gets its share and a little over; more only grows its list.
        let room = |n: usize| n / parts + n / parts / 8 + 16;
        Self {
            split: RandomState::default(),
            bits,
            interns: (0..parts)
                .map(|_| Vec::with_capacity(room(interns)))
                .collect(),
            lookups: (0..parts)
                .map(|_| Vec::with_capacity(room(lookups)))
                .collect(),
        }
    }

    /// Interns `r`; its index goes to `interned[at]`. The `at`s of all interns are 0, 1, 2...
    /// in the order of the calls.
    pub fn intern(&mut self, r: Resource, at: u32) {
        let p = part(&self.split, self.bits, &r);
        self.interns[p].push((r, at));
    }

    /// Looks `r` up once everything is interned; its index, or [`MISSING`], goes to
    /// `found[at]`.
    pub fn look_up(&mut self, r: Resource, at: u32) {
        let p = part(&self.split, self.bits, &r);
        self.lookups[p].push((r, at));
    }

    /// Does the work, part by part, and keeps the tables for [`Interner::get`].
    pub fn run(self, interned: &mut [Res], found: &mut [Res]) -> Interner {
        let total: usize = self.interns.iter().map(Vec::len).sum();
        let mut out = Interner {
            split: self.split,
            bits: self.bits,
            parts: Vec::with_capacity(self.interns.len()),
            // Holes keep a placeholder that no index names.
            resources: vec![HOLE; total],
        };
        // Each part's lists are dropped once its table is built and probed. A part's interns are
        // in call order, so the first one of a resource gives its index.
        for (interns, lookups) in self.interns.into_iter().zip(self.lookups) {
            let mut table: HashMap<Resource, Res> = HashMap::with_capacity(interns.len());
            for (r, at) in interns {
                let res = *table.entry(r).or_insert(at);
                if res == at {
                    out.resources[at as usize] = r;
                }
                interned[at as usize] = res;
            }
            for (r, at) in lookups {
                found[at as usize] = table.get(&r).copied().unwrap_or(MISSING);
            }
            out.parts.push(table);
        }
        out
    }
}

const HOLE: Resource = Resource::Address(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));

/// Which part `r` falls in: the top `bits` bits of a hash of its own (each part's table hashes
/// with another seed, so its buckets still spread).
fn part(split: &RandomState, bits: u32, r: &Resource) -> usize {
    if bits == 0 {
        0
    } else {
        (split.hash_one(r) >> (64 - bits)) as usize
    }
}

/// Every interned resource, by index, and the index of each.
pub(super) struct Interner {
    split: RandomState,
    bits: u32,
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
        self.parts[part(&self.split, self.bits, r)].get(r).copied()
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
            let mut batch = Batch::new(2 * n as usize, n as usize);
            for k in 0..2 * n {
                batch.intern(address(k % n.max(1)), k);
            }
            for k in 0..n {
                batch.look_up(address(2 * k), k);
            }
            let mut interned = vec![0; 2 * n as usize];
            let mut found = vec![0; n as usize];
            let interner = batch.run(&mut interned, &mut found);
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

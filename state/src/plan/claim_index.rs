//! Which records claim what: the index an event-sized plan finds its part of the cluster with.
//!
//! An event touches a few nodes, and the part of the cluster it can move is those nodes and
//! every record that claims an address or pod CIDR they claim ([`super::plan_scoped`]). Finding
//! those records by walking the whole record costs, at 65,000 nodes, a few milliseconds of
//! cache misses at every event; this index finds them by lookup. It is built once from a record
//! and kept up to date by [`ClaimIndex::splice`] beside [`crate::checkpoint::Checkpoint::splice`],
//! so its cost is the event's, not the cluster's.
//!
//! Compact on purpose: at 65,000 dual-stack nodes it holds 260,000 claims. A claim is kept as a
//! 32-bit hash of the resource and the claiming record's node ID, and a node ID names its
//! record; a hash shared by two resources only costs the precise check the plan makes anyway.
//! It also counts what the plan needs of the rest of the cluster (records, IDs) so that an
//! event's plan never walks the record.

use std::collections::BTreeSet;
use std::collections::hash_map::Entry;
use std::hash::{BuildHasher, Hash};
use std::net::IpAddr;

use foldhash::fast::FixedState;
use foldhash::{HashMap, HashMapExt};
use ipnet::IpNet;

use super::resource::{Resource, resources_of};
use crate::checkpoint::{Checkpoint, NodeRecords, spliced_names};
use crate::ids::IdSet;
use crate::node::Node;
use crate::objects::NodeId;

/// Claims by resource hash, node IDs by record, and what the rest of the cluster adds up to.
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimIndex {
    /// Resource hash -> node IDs of the records claiming a resource of that hash.
    claims: MultiMap<u32, NodeId>,
    /// Node ID -> names of the records holding it (one, in a steady record).
    holders: MultiMap<NodeId, Box<str>>,
    /// Every record's addresses, in order, with its node ID: the records whose address a pod
    /// CIDR covers, found by range.
    addresses: BTreeSet<(IpAddr, NodeId)>,
    /// Every ID some record holds.
    ids: IdSet,
    /// Records indexed.
    records: usize,
    /// Records without a node ID: they cannot be indexed by one.
    unnumbered: usize,
}

impl ClaimIndex {
    /// The index of `record`'s nodes.
    pub fn of(record: &Checkpoint) -> Self {
        let n = record.nodes.len();
        let mut index = Self {
            // Two addresses and two pod CIDRs a dual-stack node.
            claims: MultiMap::with_capacity(4 * n),
            holders: MultiMap::with_capacity(n),
            addresses: BTreeSet::new(),
            ids: IdSet::new(),
            records: 0,
            unnumbered: 0,
        };
        for n in &record.nodes {
            index.add(n);
        }
        index
    }

    /// Follows [`Checkpoint::splice`]: call it with the record *before* that splice, the same
    /// names, and the nodes of the part about to be spliced in.
    pub fn splice(&mut self, record: &Checkpoint, names: &[String], part: &NodeRecords) {
        for name in &spliced_names(names, part) {
            for n in record.nodes.named(name) {
                self.remove(n);
            }
        }
        for n in part {
            self.add(n);
        }
    }

    fn add(&mut self, n: &Node) {
        self.records += 1;
        let Some(id) = n.node_id else {
            self.unnumbered += 1;
            return;
        };
        self.ids.insert(id);
        self.holders.insert(id, n.name.as_str().into());
        for r in resources_of(n) {
            self.claims.insert(hash(&r), id);
        }
        self.addresses.extend(n.ips().map(|ip| (ip, id)));
    }

    fn remove(&mut self, n: &Node) {
        self.records -= 1;
        let Some(id) = n.node_id else {
            self.unnumbered -= 1;
            return;
        };
        self.holders.remove(&id, |name| **name == *n.name);
        if self.holders.get(id).next().is_none() {
            self.ids.remove(id);
        }
        for r in resources_of(n) {
            self.claims.remove(&hash(&r), |m| *m == id);
        }
        for ip in n.ips() {
            self.addresses.remove(&(ip, id));
        }
    }

    /// Names of the records that may claim `r` (a superset: check each record).
    pub(super) fn claimants(&self, r: &Resource) -> impl Iterator<Item = &str> {
        self.claims
            .get(hash(r))
            .flat_map(|id| self.holders.get(*id).map(|name| &**name))
    }

    /// Names of the records with an address `cidr` covers.
    pub(super) fn covered(&self, cidr: &IpNet) -> impl Iterator<Item = &str> {
        let ids = NodeId::new(1).zip(NodeId::new(u16::MAX));
        ids.into_iter()
            .flat_map(|(lo, hi)| {
                self.addresses
                    .range((cidr.network(), lo)..=(cidr.broadcast(), hi))
            })
            .flat_map(|(_, id)| self.holders.get(*id).map(|name| &**name))
    }

    /// Names of the records that may have a pod CIDR covering `ip` (a superset: check each
    /// record): the claimants of every prefix holding it, one lookup per prefix length.
    pub(super) fn covering(&self, ip: IpAddr) -> impl Iterator<Item = &str> {
        let bits = if ip.is_ipv4() { 32 } else { 128 };
        (0..=bits).flat_map(move |len| {
            let net = IpNet::new(ip, len).map(|n| n.trunc());
            net.into_iter()
                .flat_map(|n| self.claims.get(hash(&Resource::PodCidr(n))))
                .flat_map(|id| self.holders.get(*id).map(|name| &**name))
        })
    }

    /// Whether this is the index of `record`, as far as counting tells (a cheap guard against
    /// an index left behind by a record replaced without it).
    pub(super) fn counts(&self, record: &Checkpoint) -> bool {
        self.records == record.nodes.len()
    }

    /// Whether every record has an ID, and no two the same: what the plan's accounting of the
    /// rest of the cluster by ID relies on.
    pub(super) fn ids_are_distinct(&self) -> bool {
        self.unnumbered == 0 && self.holders.shared == 0
    }

    /// Every ID some record holds.
    pub(super) fn ids(&self) -> &IdSet {
        &self.ids
    }
}

/// A fixed seed: an index rebuilt from the same record is the same index. A hash chosen to
/// collide only costs precise checks.
fn hash(r: &Resource) -> u32 {
    FixedState::with_seed(0x6e6f_6465_2d61_6774).hash_one(r) as u32
}

/// A map to one value for almost every key, and to several for a few: the first (least) value
/// in a table of small entries, any others beside it. Equal contents, equal maps, whatever the
/// order of inserts and removals.
#[derive(Clone, Debug)]
struct MultiMap<K, V> {
    first: HashMap<K, V>,
    /// The values after the first, sorted; only keys with more than one.
    more: HashMap<K, Vec<V>>,
    /// Keys with more than one value.
    shared: usize,
}

impl<K, V> Default for MultiMap<K, V> {
    fn default() -> Self {
        Self {
            first: HashMap::default(),
            more: HashMap::default(),
            shared: 0,
        }
    }
}

impl<K: Hash + Eq, V: PartialEq> PartialEq for MultiMap<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.first == other.first && self.more == other.more
    }
}

impl<K: Hash + Eq + Copy, V: Ord> MultiMap<K, V> {
    fn with_capacity(keys: usize) -> Self {
        Self {
            first: HashMap::with_capacity(keys),
            ..Self::default()
        }
    }

    fn insert(&mut self, k: K, v: V) {
        match self.first.entry(k) {
            Entry::Vacant(e) => {
                e.insert(v);
            }
            Entry::Occupied(mut e) => {
                let v = if v < *e.get() { e.insert(v) } else { v };
                let more = self.more.entry(k).or_default();
                if more.is_empty() {
                    self.shared += 1;
                }
                let at = more.partition_point(|m| *m <= v);
                more.insert(at, v);
            }
        }
    }

    /// Removes one value that `is` picks from under `k`, if there is one.
    fn remove(&mut self, k: &K, is: impl Fn(&V) -> bool) {
        let Entry::Occupied(mut first) = self.first.entry(*k) else {
            return;
        };
        let Entry::Occupied(mut more) = self.more.entry(*k) else {
            if is(first.get()) {
                first.remove();
            }
            return;
        };
        if is(first.get()) {
            first.insert(more.get_mut().remove(0));
        } else if let Some(at) = more.get().iter().position(&is) {
            more.get_mut().remove(at);
        }
        if more.get().is_empty() {
            more.remove();
            self.shared -= 1;
        }
    }

    fn get(&self, k: K) -> impl Iterator<Item = &V> {
        self.first
            .get(&k)
            .into_iter()
            .chain(self.more.get(&k).into_iter().flatten())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::support::{node, with_id};

    fn claimants(index: &ClaimIndex, r: &str) -> Vec<String> {
        let r = match r.parse() {
            Ok(ip) => Resource::Address(ip),
            Err(_) => Resource::PodCidr(r.parse().unwrap()),
        };
        index.claimants(&r).map(str::to_owned).collect()
    }

    #[test]
    fn claimants_are_found_by_resource_and_follow_a_splice() {
        let mut record = Checkpoint {
            nodes: vec![
                with_id(node("a", &["10.0.0.1"], &["10.1.1.0/24"]), 1),
                with_id(node("b", &["10.0.0.2"], &["10.1.2.0/24"]), 2),
            ]
            .into(),
            ..Checkpoint::default()
        };
        let mut index = ClaimIndex::of(&record);
        assert_eq!(claimants(&index, "10.0.0.1"), ["a"]);
        assert_eq!(claimants(&index, "10.1.2.0/24"), ["b"]);
        assert!(claimants(&index, "10.0.0.9").is_empty());
        assert!(index.counts(&record) && index.ids_are_distinct());

        // b readdressed onto a's old address, a gone, c new.
        let names = ["a".to_string(), "b".to_string(), "c".to_string()];
        let part = Checkpoint {
            nodes: vec![
                with_id(node("b", &["10.0.0.1"], &["10.1.2.0/24"]), 2),
                with_id(node("c", &["10.0.0.3"], &["10.1.3.0/24"]), 3),
            ]
            .into(),
            ..Checkpoint::default()
        };
        index.splice(&record, &names, &part.nodes);
        record.splice(&names, part);
        assert_eq!(index, ClaimIndex::of(&record));
        assert_eq!(claimants(&index, "10.0.0.1"), ["b"]);
        assert!(claimants(&index, "10.0.0.2").is_empty());
        assert_eq!(claimants(&index, "10.0.0.3"), ["c"]);
        assert!(index.counts(&record) && index.ids_are_distinct());
        assert!(!index.ids().contains(NodeId::new(1).unwrap()));

        // A record sharing an ID: the index still names every claimant (a superset: an ID
        // names both records), and says the IDs are not distinct.
        let names = ["d".to_string()];
        let part = Checkpoint {
            nodes: vec![with_id(node("d", &["10.0.0.4"], &["10.1.4.0/24"]), 3)].into(),
            ..Checkpoint::default()
        };
        index.splice(&record, &names, &part.nodes);
        record.splice(&names, part);
        assert_eq!(index, ClaimIndex::of(&record));
        assert_eq!(claimants(&index, "10.0.0.3"), ["c", "d"]);
        assert!(!index.ids_are_distinct());
    }

    #[test]
    fn a_multimap_is_the_same_whatever_the_order_of_its_changes() {
        let mut a = MultiMap::default();
        let mut b = MultiMap::default();
        for v in [3, 1, 2] {
            a.insert(7u32, v);
        }
        for v in [2, 3, 1, 9] {
            b.insert(7u32, v);
        }
        b.remove(&7, |v| *v == 9);
        assert_eq!(a, b);
        assert_eq!(a.get(7).copied().collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(a.shared, 1);
        for v in [1, 3] {
            a.remove(&7, |m| *m == v);
        }
        assert_eq!(a.get(7).copied().collect::<Vec<_>>(), [2]);
        assert_eq!(a.shared, 0);
        a.remove(&7, |m| *m == 2);
        a.remove(&7, |m| *m == 2);
        assert_eq!(a.get(7).count(), 0);
        assert_eq!(a, MultiMap::default());
    }
}

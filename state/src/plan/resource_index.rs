//! Steps 3-4, shared: every resource the plan's nodes claim, looked up by hash once per plan.
//!
//! A plan asks several questions of each address and pod CIDR: does anyone claim it (orphans),
//! who had it (incumbents), who has it now (conflicts), how many live nodes claim it and is its
//! map entry in the kernel (map room). Asked of a hash table each, at 65,000 nodes every question
//! is a cache miss in a table of a quarter of a million entries. Here each resource of each node
//! and record is hashed once into a dense index ([`super::interner`], which also looks up the
//! key resource of each of our objects in the kernel); the steps after that keep their facts in
//! vectors indexed by it, and the inventory is walked once, in order, to tie our objects to it.

use foldhash::{HashMap, HashMapExt};
use smallvec::SmallVec;

use super::config::PlanConfig;
use super::desired::KernelNexthops;
pub(super) use super::interner::Res;
use super::interner::{self, Interner, Interns, Lookups, MISSING, Split};
use super::nodes::{Live, Record};
use super::parallel;
use super::resource::{Resource, key_resource, maps_address, resources_of, secondary_resource};
use crate::ids::IdSet;
use crate::inventory::Inventory;
use crate::node::{Family, Node};
use crate::objects::{KernelObject, Nexthop, NexthopId, ObjectKind};

/// In a list of each object's key resource: the object has none.
const NO_KEY: Res = u32::MAX;

/// No object of the kind at the resource.
const NO_SLOT: u32 = u32::MAX;
/// More than one (routes to one CIDR with different metrics): ask the inventory.
const SEVERAL: u32 = u32::MAX - 1;

/// What one node (live or recorded) claims, as indices.
#[derive(Clone, Debug, Default)]
pub(super) struct NodeResources {
    /// The mapped addresses, then the pod CIDRs: what the node claims (invariant 13).
    pub claims: SmallVec<[Res; 4]>,
    /// How many of `claims` are addresses.
    pub mapped: usize,
    /// Every address, mapped or not: a route or state may use any of them as an endpoint.
    pub addresses: SmallVec<[Res; 4]>,
}

impl NodeResources {
    /// The mapped addresses.
    pub fn mapped_addresses(&self) -> &[Res] {
        &self.claims[..self.mapped]
    }

    /// The pod CIDRs.
    pub fn cidrs(&self) -> &[Res] {
        &self.claims[self.mapped..]
    }
}

/// Every resource a live node (as it is now, and as recorded) or a record claims, and how our
/// objects in the kernel relate to them.
pub(super) struct ResourceIndex {
    interner: Interner,
    /// Per live node.
    pub live: Vec<NodeResources>,
    /// Per record.
    pub records: Vec<NodeResources>,
    /// Per resource: the inventory slot of our map entry at it (an address) or our route to it
    /// (a pod CIDR), [`NO_SLOT`] or [`SEVERAL`].
    primary: Vec<u32>,
    /// The inventory slots of our nexthops.
    nexthops: NexthopSlots,
    /// Per inventory slot: someone claims the object through its key, its node ID or its
    /// secondary resource; an object of ours that no one claims is an orphan.
    owned: Vec<bool>,
    /// Per inventory slot: the index of the object's key resource, [`MISSING`] if no one claims
    /// it, or [`NO_KEY`] (the agent's own objects, nexthops).
    keys: Vec<Res>,
}

impl ResourceIndex {
    pub fn new(
        live: &[Live<'_>],
        records: &[Record<'_>],
        inventory: &Inventory,
        cfg: &PlanConfig,
    ) -> Self {
        // A record of a live node that lists what the node has now (the common case) shares the
        // node's indices; any other record's resources are interned too.
        let same: Vec<Option<usize>> = records
            .iter()
            .map(|rec| {
                rec.live.filter(|&i| {
                    let n = live[i].node;
                    n.addresses == rec.node.addresses && n.pod_cidrs == rec.node.pod_cidrs
                })
            })
            .collect();
        let interned_nodes = live.iter().map(|l| l.node).chain(
            records
                .iter()
                .zip(&same)
                .filter(|(_, s)| s.is_none())
                .map(|(r, _)| r.node),
        );
        let count = |n: &Node| n.addresses.len() + n.pod_cidrs.len();
        let total: usize = interned_nodes.clone().map(count).sum();

        // Every node's addresses then pod CIDRs, one after another in `flat`; every object's key
        // resource at its inventory slot in `keys`. The nodes and the inventory are walked at
        // once, on two cores where there are two.
        let split = Split::new(total);
        let (lookups, interns) = parallel::both(
            split.parts() > 1,
            || {
                let mut lookups = Lookups::new(split.clone(), inventory.len());
                for (slot, o) in inventory.slotted() {
                    if let Some(r) = key_resource(o) {
                        lookups.push(r, slot as u32);
                    }
                }
                lookups
            },
            || {
                let mut interns = Interns::new(split.clone(), total);
                for n in interned_nodes.clone() {
                    for r in resources_of(n) {
                        interns.push(r);
                    }
                }
                interns
            },
        );
        let mut keys = vec![NO_KEY; inventory.len()];
        let mut flat = vec![0; total];
        let interner = interner::run(interns, lookups, &mut flat, &mut keys);

        // What each node claims, and how our objects tie to the resources: apart, at once.
        let (tied, (live_res, records_res)) = parallel::both(
            split.parts() > 1,
            || Tied::new(&interner, &keys, inventory, records),
            || {
                let mut nodes = interned_nodes.scan(0usize, |start, n| {
                    let out = claims_of(n, &flat[*start..*start + count(n)], cfg);
                    *start += count(n);
                    Some(out)
                });
                let live_res: Vec<NodeResources> = nodes.by_ref().take(live.len()).collect();
                let records_res: Vec<NodeResources> = same
                    .iter()
                    .map(|s| match s {
                        Some(i) => live_res[*i].clone(),
                        None => nodes.next().unwrap_or_default(),
                    })
                    .collect();
                (live_res, records_res)
            },
        );
        Self {
            interner,
            live: live_res,
            records: records_res,
            primary: tied.primary,
            nexthops: tied.nexthops,
            owned: tied.owned,
            keys,
        }
    }

    /// How many resources there are: the length of a vector of facts about them.
    pub fn len(&self) -> usize {
        self.interner.len()
    }

    /// The index of `r`, if anyone claims it.
    pub fn get(&self, r: &Resource) -> Option<Res> {
        self.interner.get(r)
    }

    pub fn resource(&self, r: Res) -> Resource {
        self.interner.resource(r)
    }

    /// Whether our map entry for address `r` is in the kernel.
    pub fn has_map_entry(&self, r: Res) -> bool {
        self.primary[r as usize] != NO_SLOT
    }

    /// The inventory slot of our object with the identity of `o`, an object live node `i`
    /// desires: found through the node's resources where `o` is keyed by one (map entries,
    /// routes) or in a small table of our nexthops, by hash otherwise.
    pub fn slot(
        &self,
        inventory: &Inventory,
        i: usize,
        node: &Node,
        o: &KernelObject,
    ) -> Option<usize> {
        let res = &self.live[i];
        // Found by what makes up the identity (a map entry's address, a nexthop's ID), or by
        // the route's destination, whose metric is the rest of its identity.
        let (at, check) = match o {
            KernelObject::MapEntry(e) => (
                node.addresses
                    .iter()
                    .position(|a| a.ip == e.ip)
                    .map(|k| self.primary[res.addresses[k] as usize]),
                false,
            ),
            KernelObject::Route(r) => (
                node.pod_cidrs
                    .iter()
                    .position(|c| *c == r.dst)
                    .map(|k| self.primary[res.cidrs()[k] as usize]),
                true,
            ),
            KernelObject::Nexthop(n) => (Some(self.nexthops.get(n.id())), false),
            _ => (None, false),
        };
        match at {
            Some(NO_SLOT) => None,
            Some(slot) if slot != SEVERAL => {
                (!check || inventory.at(slot as usize).id() == o.id()).then_some(slot as usize)
            }
            _ => inventory.slot(&o.id()),
        }
    }

    /// Whether anyone claims our object at inventory slot `slot`. The agent's own objects (the
    /// guards: no key resource, no node) are never anyone's orphans: the brake does not count
    /// them. A nexthop is claimed through its node ID or its gateway.
    pub fn owns_slot(&self, slot: usize) -> bool {
        self.owned[slot]
    }

    /// The index of the key resource (a map entry's address, a route's destination) of our
    /// object at inventory slot `slot`, if anyone claims it.
    pub fn key(&self, slot: usize) -> Option<Res> {
        Some(self.keys[slot]).filter(|&r| r != NO_KEY && r != MISSING)
    }
}

/// The planner's view of our nexthops for [`super::desired::nexthop_toward`]: found through
/// the index's table of nexthop slots, not by hash (two lookups per node and family at scale).
pub(super) struct IndexedNexthops<'a> {
    pub index: &'a ResourceIndex,
    pub inventory: &'a Inventory,
}

impl KernelNexthops for IndexedNexthops<'_> {
    fn ours(&self, id: NexthopId) -> Option<&Nexthop> {
        match self.index.nexthops.get(id) {
            NO_SLOT => None,
            slot => match self.inventory.at(slot as usize) {
                KernelObject::Nexthop(n) => Some(n),
                _ => None,
            },
        }
    }

    fn inventory(&self) -> &Inventory {
        self.inventory
    }
}

/// The inventory slots of our nexthops, by ID. Ours are numbered by node ID, family and which
/// of the pair ([`NexthopId`]): where there are many, a vector indexed that way finds each one without a
/// hash lookup (at 65,000 nodes, a cache miss apiece); a few, or any ID outside our range, go in
/// a small table.
struct NexthopSlots {
    by_node: Vec<u32>,
    other: HashMap<NexthopId, u32>,
}

impl NexthopSlots {
    /// From this many nexthops on, the vector over every node ID, family and ID of the pair
    /// (1 MiB): below it,
    /// filling the vector would cost more than the lookups it saves. Debug builds (every test)
    /// take the vector from the first nexthop, so that the planner's tests go the way a large
    /// cluster does.
    const BY_NODE_FROM: usize = if cfg!(debug_assertions) { 1 } else { 4096 };

    fn new(count: usize) -> Self {
        let by_node = count >= Self::BY_NODE_FROM;
        Self {
            by_node: if by_node {
                vec![NO_SLOT; 4 << 16]
            } else {
                Vec::new()
            },
            other: HashMap::with_capacity(if by_node { 0 } else { count }),
        }
    }

    fn position(&self, id: NexthopId) -> Option<usize> {
        if self.by_node.is_empty() {
            return None;
        }
        let (node, family, second) = id.decode_pair()?;
        Some(
            4 * usize::from(node.get())
                + 2 * usize::from(second)
                + usize::from(family == Family::V6),
        )
    }

    fn insert(&mut self, id: NexthopId, slot: u32) {
        match self.position(id) {
            Some(i) => self.by_node[i] = slot,
            None => {
                self.other.insert(id, slot);
            }
        }
    }

    /// The slot of nexthop `id`, or [`NO_SLOT`].
    fn get(&self, id: NexthopId) -> u32 {
        match self.position(id) {
            Some(i) => self.by_node[i],
            None => self.other.get(&id).copied().unwrap_or(NO_SLOT),
        }
    }
}

/// How our objects in the kernel tie to the resources: found in one walk of the inventory.
struct Tied {
    primary: Vec<u32>,
    nexthops: NexthopSlots,
    owned: Vec<bool>,
}

impl Tied {
    /// Our map entries and routes by resource, our nexthops by ID, and which of our objects
    /// anyone claims; `keys` holds each object's key resource, by slot.
    fn new(
        interner: &Interner,
        keys: &[Res],
        inventory: &Inventory,
        records: &[Record<'_>],
    ) -> Self {
        let mut recorded_ids = IdSet::new();
        for id in records.iter().filter_map(|r| r.node.node_id) {
            recorded_ids.insert(id);
        }
        let mut t = Self {
            primary: vec![NO_SLOT; interner.len()],
            nexthops: NexthopSlots::new(inventory.count(ObjectKind::Nexthop)),
            owned: Vec::with_capacity(inventory.len()),
        };
        for (slot, o) in inventory.slotted() {
            let key = match keys[slot] {
                NO_KEY => None,
                MISSING => Some(None),
                r => Some(Some(r)),
            };
            match (o, key) {
                (KernelObject::MapEntry(_), Some(Some(r))) => {
                    t.primary[r as usize] = slot as u32;
                }
                (KernelObject::Route(_), Some(Some(r))) => {
                    let p = &mut t.primary[r as usize];
                    *p = if *p == NO_SLOT { slot as u32 } else { SEVERAL };
                }
                (KernelObject::Nexthop(n), _) => {
                    t.nexthops.insert(n.id(), slot as u32);
                }
                _ => {}
            }
            // A nexthop has no key resource but is a node's: someone's while its node ID is a
            // record's or its gateway is claimed, an orphan otherwise, which the brake counts
            // like any other (uncounted, the sweep of a lost checkpoint's nodes went past it).
            let claimed = || {
                o.node_id().is_some_and(|id| recorded_ids.contains(id))
                    || secondary_resource(o).is_some_and(|r| interner.get(&r).is_some())
            };
            let owned = match (o, key) {
                (KernelObject::Nexthop(_), _) | (_, Some(None)) => claimed(),
                (_, None | Some(Some(_))) => true,
            };
            t.owned.push(owned);
        }
        t
    }
}

/// What node `n` claims, from the indices of its resources in [`resources_of`] order (its
/// addresses, then its pod CIDRs).
fn claims_of(n: &Node, indices: &[Res], cfg: &PlanConfig) -> NodeResources {
    let (addresses, cidrs) = indices.split_at(n.addresses.len());
    let mut claims: SmallVec<[Res; 4]> = n
        .addresses
        .iter()
        .zip(addresses)
        .filter(|(a, _)| maps_address(cfg.include_external_ips, a.kind))
        .map(|(_, r)| *r)
        .collect();
    let mapped = claims.len();
    claims.extend_from_slice(cidrs);
    NodeResources {
        claims,
        mapped,
        addresses: addresses.into(),
    }
}

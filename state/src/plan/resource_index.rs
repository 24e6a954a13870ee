//! Steps 3-4, shared: every resource the plan's nodes claim, looked up by hash once per plan.
//!
//! A plan asks several questions of each address and pod CIDR: does anyone claim it (orphans),
//! who had it (incumbents), who has it now (conflicts), how many live nodes claim it and is its
//! map entry in the kernel (map room). Asked of a hash table each, at 65,000 nodes every question
//! is a cache miss in a table of a quarter of a million entries. Here each resource of each node
//! and record is hashed once into a dense index; the steps after that keep their facts in
//! vectors indexed by it, and the inventory is walked once to tie our objects to it.

use foldhash::{HashMap, HashMapExt};
use smallvec::SmallVec;

use super::PlanConfig;
use super::claims::{Resource, key_resource, secondary_resource};
use super::classify::Live;
use super::records::Record;
use crate::desired::maps_address;
use crate::ids::IdSet;
use crate::inventory::Inventory;
use crate::node::Node;
use crate::objects::{KernelObject, NexthopId, ObjectKind};

/// A resource's place in a [`ResourceIndex`].
pub(super) type Res = u32;

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
    index: HashMap<Resource, Res>,
    resources: Vec<Resource>,
    /// Per live node.
    pub live: Vec<NodeResources>,
    /// Per record.
    pub records: Vec<NodeResources>,
    /// Per resource: the inventory slot of our map entry at it (an address) or our route to it
    /// (a pod CIDR), [`NO_SLOT`] or [`SEVERAL`].
    primary: Vec<u32>,
    /// The inventory slots of our nexthops.
    nexthops: HashMap<NexthopId, u32>,
    /// Per inventory slot: someone claims the object through its key, its node ID or its
    /// secondary resource; an object of ours that no one claims is an orphan.
    owned: Vec<bool>,
    /// Per inventory slot: for a map entry whose address someone claims, that address.
    entry_address: Vec<Option<Res>>,
}

impl ResourceIndex {
    pub fn new(
        live: &[Live<'_>],
        records: &[Record<'_>],
        inventory: &Inventory,
        cfg: &PlanConfig,
    ) -> Self {
        let mut s = Self {
            // Live nodes and records mostly claim the same things: sized for one of them.
            index: HashMap::with_capacity(4 * live.len().max(records.len())),
            resources: Vec::with_capacity(4 * live.len().max(records.len())),
            live: Vec::with_capacity(live.len()),
            records: Vec::with_capacity(records.len()),
            primary: Vec::new(),
            nexthops: HashMap::with_capacity(inventory.count(ObjectKind::Nexthop)),
            owned: Vec::with_capacity(inventory.len()),
            entry_address: Vec::with_capacity(inventory.len()),
        };
        for l in live {
            let r = s.intern_node(l.node, cfg);
            s.live.push(r);
        }
        for rec in records {
            // A record of a live node that lists what the node has now: the common case.
            let same = rec.live.filter(|&i| {
                let n = live[i].node;
                n.addresses == rec.node.addresses && n.pod_cidrs == rec.node.pod_cidrs
            });
            let r = match same {
                Some(i) => s.live[i].clone(),
                None => s.intern_node(rec.node, cfg),
            };
            s.records.push(r);
        }
        s.primary = vec![NO_SLOT; s.resources.len()];
        let mut recorded_ids = IdSet::new();
        for id in records.iter().filter_map(|r| r.node.node_id) {
            recorded_ids.insert(id);
        }
        for (slot, o) in inventory.slotted() {
            let key = key_resource(o).map(|r| s.get(&r));
            let mut address = None;
            match (o, key) {
                (KernelObject::MapEntry(_), Some(Some(r))) => {
                    s.primary[r as usize] = slot as u32;
                    address = Some(r);
                }
                (KernelObject::Route(_), Some(Some(r))) => {
                    let p = &mut s.primary[r as usize];
                    *p = if *p == NO_SLOT { slot as u32 } else { SEVERAL };
                }
                (KernelObject::Nexthop(n), _) => {
                    s.nexthops.insert(n.id(), slot as u32);
                }
                _ => {}
            }
            let owned = match key {
                None | Some(Some(_)) => true,
                Some(None) => {
                    o.node_id().is_some_and(|id| recorded_ids.contains(id))
                        || secondary_resource(o).is_some_and(|r| s.get(&r).is_some())
                }
            };
            s.owned.push(owned);
            s.entry_address.push(address);
        }
        s
    }

    fn intern(&mut self, r: Resource) -> Res {
        let next = self.resources.len() as Res;
        let at = *self.index.entry(r).or_insert(next);
        if at == next {
            self.resources.push(r);
        }
        at
    }

    fn intern_node(&mut self, n: &Node, cfg: &PlanConfig) -> NodeResources {
        let mut out = NodeResources::default();
        for a in &n.addresses {
            let r = self.intern(Resource::Address(a.ip));
            out.addresses.push(r);
            if maps_address(cfg.include_external_ips, a.kind) {
                out.claims.push(r);
            }
        }
        out.mapped = out.claims.len();
        for c in &n.pod_cidrs {
            out.claims.push(self.intern(Resource::PodCidr(*c)));
        }
        out
    }

    /// How many resources there are: the length of a vector of facts about them.
    pub fn len(&self) -> usize {
        self.resources.len()
    }

    /// The index of `r`, if anyone claims it.
    pub fn get(&self, r: &Resource) -> Option<Res> {
        self.index.get(r).copied()
    }

    pub fn resource(&self, r: Res) -> Resource {
        self.resources[r as usize]
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
            KernelObject::Nexthop(n) => (
                Some(self.nexthops.get(&n.id()).copied().unwrap_or(NO_SLOT)),
                false,
            ),
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

    /// Whether anyone claims our object at inventory slot `slot`. The agent's own objects (no
    /// key resource) are never anyone's orphans: the brake does not count them.
    pub fn owns_slot(&self, slot: usize) -> bool {
        self.owned[slot]
    }

    /// For a map entry at inventory slot `slot`, its address, if anyone claims it.
    pub fn entry_address(&self, slot: usize) -> Option<Res> {
        self.entry_address[slot]
    }
}

//! Step 4, continued: admitting candidates one by one, in an order that favours what the
//! record knows: conflicts first ([`super::claims`]), then room in the node-ID map, then a node
//! ID. A candidate that fails any of them is held as a whole and reported; one that passes all
//! of them is programmed.

use std::net::IpAddr;

use foldhash::HashSet;
use ipnet::IpNet;
use smallvec::SmallVec;

use super::brake_memory::Brake;
use super::claims::{Blocker, Claims, Holder};
use super::nodes::{HeldWhy, Live, LiveClass, Record};
use super::ops::Allocation;
use super::problem::{InputError, InputProblem, err};
use super::resource::{ConflictWhy, Resource, mapped_ips, resources_of};
use super::resource_index::{Res, ResourceIndex};
use super::view::{Elsewhere, Local, PlanInput, is_local_entry};
use crate::ids::{IdAllocator, IdError, IdSet};
use crate::inventory::Inventory;
use crate::node::Node;
use crate::objects::{KernelObject, NodeId, ObjectId};

/// What admission leaves for the rest of the plan.
pub(super) struct Admitted {
    pub allocations: Vec<Allocation>,
    pub allocator: IdAllocator,
    /// Every ID the kernel or the record carries.
    pub seen_ids: IdSet,
    /// IDs given to programmed nodes.
    pub claimed: IdSet,
}

/// Room in the node-ID map (invariant 17): entries that stay whatever the candidates do, plus
/// the new entries of every candidate admitted so far.
struct MapRoom {
    capacity: usize,
    used: usize,
}

impl MapRoom {
    fn fits(&self, adds: usize, frees: usize) -> bool {
        (self.used + adds).saturating_sub(frees) <= self.capacity
    }

    fn commit(&mut self, adds: usize, frees: usize) {
        self.used = (self.used + adds).saturating_sub(frees);
    }
}

/// How many live nodes claim each mapped address, as they are and as recorded, by [`Res`].
fn address_claims(live: &[Live<'_>], index: &ResourceIndex) -> Vec<u32> {
    let mut count = vec![0u32; index.len()];
    for (i, l) in live.iter().enumerate() {
        let mut ips: SmallVec<[Res; 4]> = index.live[i].mapped_addresses().into();
        if let Some(r) = l.record {
            ips.extend_from_slice(index.records[r].mapped_addresses());
        }
        ips.sort_unstable();
        ips.dedup();
        for r in ips {
            count[r as usize] += 1;
        }
    }
    count
}

/// Map entries that stay whatever the candidates do: all but those deleted anyway (local
/// addresses; addresses no live node claims, unless a held removal or a held orphan keeps them).
fn staying_entries(
    input: &PlanInput<'_>,
    records: &[Record<'_>],
    index: &ResourceIndex,
    brake: &Brake,
    local: &Local,
    claims: &[u32],
) -> usize {
    let mut kept_addresses: HashSet<Res> = HashSet::default();
    let mut kept_ids: HashSet<NodeId> = HashSet::default();
    for (r, rec) in records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.live.is_none() && !brake.releases(r))
    {
        kept_addresses.extend(index.records[r].addresses.iter().copied());
        kept_ids.extend(rec.node.node_id);
    }
    input
        .inventory
        .slotted()
        .filter(|(slot, o)| match o {
            KernelObject::MapEntry(e) => {
                !is_local_entry(o, local)
                    && (index
                        .key(*slot)
                        .is_some_and(|r| claims[r as usize] > 0 || kept_addresses.contains(&r))
                        || kept_ids.contains(&e.node_id)
                        || !brake.releases_orphan(&o.id()))
            }
            _ => false,
        })
        .count()
}

/// Picks node IDs (invariant 5).
struct Ids<'a> {
    alloc: IdAllocator,
    claimed: IdSet,
    /// IDs records carry.
    recorded: IdSet,
    /// IDs records outside an event-sized plan's part carry.
    elsewhere: Option<&'a IdSet>,
    inventory: &'a Inventory,
}

impl<'p> Ids<'p> {
    /// The allocator, with every ID the kernel or the record carries reserved (and those of
    /// records outside the part); and those IDs seen.
    fn new(known: &Known<'p, '_>) -> (Self, IdSet) {
        let Known {
            input,
            records,
            elsewhere,
            ..
        } = *known;
        let cfg = input.config;
        let mut ids = Ids {
            alloc: IdAllocator::with_max_id(cfg.id_cooldown, cfg.max_node_id, input.allocator)
                .with_reuse_floor(cfg.id_reuse_floor),
            claimed: IdSet::new(),
            recorded: IdSet::new(),
            elsewhere: elsewhere.map(|e| &e.ids),
            inventory: input.inventory,
        };
        let mut seen_ids = IdSet::new();
        for id in input.inventory.node_ids() {
            seen_ids.insert(id);
        }
        for id in records.iter().filter_map(|r| r.node.node_id) {
            seen_ids.insert(id);
            ids.recorded.insert(id);
        }
        for id in seen_ids.iter() {
            ids.alloc.reserve(id);
        }
        if let Some(e) = elsewhere {
            ids.alloc.reserve_all(&e.ids);
        }
        (ids, seen_ids)
    }

    /// The record's ID; without a record, the ID the node's map entries carry if no record owns
    /// it; else a fresh one.
    fn pick(
        &mut self,
        l: &Live<'_>,
        records: &[Record<'_>],
        input: &PlanInput<'_>,
        local: &Local,
    ) -> Result<(NodeId, Option<Allocation>), IdError> {
        let record_id = l.record.and_then(|r| records[r].node.node_id);
        if let Some(id) = record_id
            && !self.claimed.contains(id)
        {
            return Ok((id, None));
        }
        if record_id.is_none() {
            let inherited = mapped_ips(l.node, input.config)
                .filter(|ip| !local.ips.contains(ip))
                .filter_map(|ip| match self.inventory.get(&ObjectId::MapEntry { ip }) {
                    Some(KernelObject::MapEntry(e)) => Some(e.node_id),
                    _ => None,
                })
                .find(|id| {
                    !self.claimed.contains(*id)
                        && !self.recorded.contains(*id)
                        && !self.elsewhere.is_some_and(|e| e.contains(*id))
                });
            if let Some(id) = inherited {
                return Ok((id, None));
            }
        }
        let a = self.alloc.allocate(input.now)?;
        Ok((
            a.id,
            Some(Allocation {
                node: l.node.name.clone(),
                id: a.id,
                reused_after: a.reused_after,
                early: a.early,
            }),
        ))
    }
}

/// What admission reads: the plan's input and what the steps before it found.
pub(super) struct Known<'p, 'a> {
    pub input: &'p PlanInput<'a>,
    pub records: &'p [Record<'a>],
    pub brake: &'p Brake,
    pub index: &'p ResourceIndex,
    pub local: &'p Local,
    pub elsewhere: Option<&'p Elsewhere>,
}

/// Decides every candidate: programmed with an ID, or held with the reason reported.
pub(super) fn admit(
    known: &Known<'_, '_>,
    live: &mut [Live<'_>],
    errors: &mut Vec<InputError>,
) -> Admitted {
    let Known {
        input,
        records,
        brake,
        index,
        local,
        elsewhere,
    } = *known;
    let (mut ids, seen_ids) = Ids::new(known);
    let claims = fixed_claims(known, live, &mut ids.claimed);
    let address_claims = address_claims(live, index);
    let room = MapRoom {
        capacity: input.config.map_capacity,
        used: staying_entries(input, records, index, brake, local, &address_claims)
            + elsewhere.map_or(0, |e| e.map_entries),
    };
    let mut admission = Admission {
        known,
        claims,
        room,
        ids,
        address_claims,
        addresses: AddressBook::of(live),
        allocations: Vec::new(),
    };
    // Nodes the record knows first, then new ones; each group in name order.
    let mut order: Vec<usize> = (0..live.len())
        .filter(|&i| live[i].class == LiveClass::Candidate)
        .collect();
    order.sort_by_key(|&i| live[i].record.is_none());
    for i in order {
        live[i].class = match admission.candidate(i, live) {
            Ok(id) => LiveClass::Programmed(id),
            Err((problem, why)) => {
                err(errors, &live[i].node.name, problem);
                LiveClass::Held(why)
            }
        };
    }
    Admitted {
        allocations: admission.allocations,
        allocator: admission.ids.alloc,
        seen_ids,
        claimed: admission.ids.claimed,
    }
}

/// Who has what before any candidate is admitted: the local node first (the first fixer wins),
/// then held live nodes and held removals, which keep what their records list, IDs included
/// (into `claimed`). Every record's live node is the incumbent of what the record lists.
fn fixed_claims(known: &Known<'_, '_>, live: &[Live<'_>], claimed: &mut IdSet) -> Claims {
    let Known {
        input,
        records,
        brake,
        index,
        local,
        ..
    } = *known;
    let mut claims = Claims::new(index);
    let local_resources = (local.ips.iter().map(|ip| Resource::Address(*ip)))
        .chain(local.cidrs.iter().map(|c| Resource::PodCidr(*c)));
    for r in local_resources.filter_map(|r| index.get(&r)) {
        claims.fix(r, Holder::Local);
    }
    for (i, l) in live.iter().enumerate() {
        if let Some(r) = l.record {
            for &res in &index.records[r].claims {
                if l.is_held() {
                    claims.fix(res, Holder::Held(i));
                }
                claims.incumbent(res, i);
            }
            if l.is_held()
                && let Some(id) = records[r].node.node_id
            {
                claimed.insert(id);
            }
        }
    }
    for (r, rec) in records.iter().enumerate() {
        if rec.live.is_none() && input.live.synced && !brake.releases(rec) {
            for &res in &index.records[r].claims {
                claims.fix(res, Holder::Removal(r));
            }
            if let Some(id) = rec.node.node_id {
                claimed.insert(id);
            }
        }
    }
    claims
}

/// Admission under way: who has what, the map's room and the IDs, as candidates come in.
struct Admission<'k, 'p, 'a> {
    known: &'k Known<'p, 'a>,
    claims: Claims,
    room: MapRoom,
    ids: Ids<'p>,
    /// [`address_claims`].
    address_claims: Vec<u32>,
    addresses: AddressBook,
    allocations: Vec<Allocation>,
}

impl Admission<'_, '_, '_> {
    /// Candidate `i`, admitted (its ID) or held (what holds it, and why), in the order of the
    /// checks: what is the local node's, addresses its pod CIDRs cover, conflicts, the map's
    /// room, an ID.
    fn candidate(
        &mut self,
        i: usize,
        live: &[Live<'_>],
    ) -> Result<NodeId, (InputProblem, HeldWhy)> {
        let Known {
            input,
            records,
            index,
            local,
            ..
        } = *self.known;
        let node = live[i].node;
        if let Some((cidr, local)) = overlaps_local(node, local) {
            let problem = InputProblem::OverlapsLocal { cidr, local };
            return Err((problem, HeldWhy::Conflict));
        }
        if let Some((cidr, ip, j)) = self.addresses.covered_by(&node.pod_cidrs) {
            let holder = live[j].node.name.clone();
            let problem = InputProblem::CoversAddress { cidr, ip, holder };
            return Err((problem, HeldWhy::Conflict));
        }
        let wants = |i: usize| index.live[i].claims.as_slice();
        let checked = self.claims.check(i, wants(i), |j, r| match live[j].class {
            // What a registering or malformed node claims now is unknown: its record stands.
            LiveClass::Held(HeldWhy::Registering | HeldWhy::Malformed) => true,
            // Any other node claims what it lists now. One held over a conflict, a full map or
            // no free ID keeps its objects, but a resource it has moved away from is free to
            // take: nobody live wants it.
            _ => wants(j).contains(&r),
        });
        if let Err((resource, blocker)) = checked {
            let problem = conflict(index.resource(resource), blocker, live, records);
            return Err((problem, HeldWhy::Conflict));
        }
        let (adds, frees) = map_delta(i, &live[i], index, &self.address_claims);
        if !self.room.fits(adds, frees) {
            let problem = InputProblem::MapFull {
                limit: input.config.map_capacity,
                needed: adds,
            };
            return Err((problem, HeldWhy::MapFull));
        }
        let (id, allocation) = self
            .ids
            .pick(&live[i], records, input, local)
            .map_err(|e| (InputProblem::from(e), HeldWhy::NoId))?;
        self.claims.take(i, wants(i));
        self.room.commit(adds, frees);
        self.ids.claimed.insert(id);
        self.allocations.extend(allocation);
        Ok(id)
    }
}

/// A pod CIDR of `node` that overlaps what is the local node's without being equal to it
/// (equal ones are claims, and conflicts of their own): one of its pod CIDRs, inside or around
/// it, a CIDR around one of its addresses (a `/0`, or a host route to it), or one that
/// overlaps an on-link prefix of the host, equal included. Its route would take traffic that
/// is the local node's: toward its pods, itself, or its own link (its gateway, its neighbours).
fn overlaps_local(node: &Node, local: &Local) -> Option<(IpNet, String)> {
    let overlap = |a: &IpNet, b: &IpNet| a.contains(&b.network()) || b.contains(&a.network());
    node.pod_cidrs.iter().find_map(|c| {
        let cidr = local
            .cidrs
            .iter()
            .find(|l| *l != c && overlap(l, c))
            .map(|l| l.to_string());
        let address = || {
            // The lowest: the same report every time, whatever the set's order.
            local
                .ips
                .iter()
                .filter(|ip| c.contains(*ip))
                .min()
                .map(|ip| format!("the address {ip}"))
        };
        let on_link = || {
            local
                .on_link
                .iter()
                .find(|o| overlap(&o.prefix, c))
                .map(|o| format!("the host's on-link prefix {} on {}", o.prefix, o.device))
        };
        cidr.or_else(address)
            .or_else(on_link)
            .map(|what| (*c, what))
    })
}

/// Every live node's addresses (a malformed node's as recorded), sorted, to find those a pod
/// CIDR covers: its route would take the traffic toward that node's address, and that node's
/// own routes, through a gateway the kernel then finds behind another node, with it. The node
/// whose pod CIDR covers an address is the one held, whoever's address it is (its own too).
struct AddressBook {
    /// `(address, index of the live node)`.
    sorted: Vec<(IpAddr, u32)>,
}

impl AddressBook {
    fn of(live: &[Live<'_>]) -> Self {
        let mut sorted: Vec<(IpAddr, u32)> = live
            .iter()
            .enumerate()
            .flat_map(|(i, l)| l.node.ips().map(move |ip| (ip, i as u32)))
            .collect();
        sorted.sort_unstable();
        Self { sorted }
    }

    /// The first of `cidrs` that covers a live node's address, the address and the node.
    fn covered_by(&self, cidrs: &[IpNet]) -> Option<(IpNet, IpAddr, usize)> {
        cidrs.iter().find_map(|c| {
            let from = self.sorted.partition_point(|(ip, _)| *ip < c.network());
            self.sorted
                .get(from)
                .filter(|(ip, _)| c.contains(ip))
                .map(|&(ip, j)| (*c, ip, j as usize))
        })
    }
}

/// New map entries live node `i` needs, and its recorded entries that go once it is programmed
/// (addresses it no longer has and no other live node claims).
fn map_delta(i: usize, l: &Live<'_>, index: &ResourceIndex, claims: &[u32]) -> (usize, usize) {
    let now = index.live[i].mapped_addresses();
    let adds = now.iter().filter(|r| !index.has_map_entry(**r)).count();
    let frees = l.record.map_or(0, |rec| {
        index.records[rec]
            .mapped_addresses()
            .iter()
            .filter(|r| index.has_map_entry(**r))
            .filter(|r| !now.contains(r))
            .filter(|r| claims[**r as usize] == 1)
            .count()
    });
    (adds, frees)
}

fn conflict(
    resource: Resource,
    blocker: Blocker,
    live: &[Live<'_>],
    records: &[Record<'_>],
) -> InputProblem {
    let (holder, why) = match blocker {
        Blocker::Taken(Holder::Local) => return InputProblem::LocalResource { resource },
        Blocker::Taken(Holder::Held(j)) => (&live[j].node.name, ConflictWhy::Held),
        Blocker::Taken(Holder::Removal(r)) => (&records[r].node.name, ConflictWhy::HeldRemoval),
        Blocker::Taken(Holder::Admitted(j)) => {
            let incumbent = live[j]
                .record
                .is_some_and(|r| resources_of(records[r].node).any(|x| x == resource));
            let why = if incumbent {
                ConflictWhy::Incumbent
            } else {
                ConflictWhy::Order
            };
            (&live[j].node.name, why)
        }
        Blocker::Incumbent(j) => (&live[j].node.name, ConflictWhy::Incumbent),
    };
    InputProblem::Conflict {
        resource,
        holder: holder.clone(),
        why,
    }
}

#[cfg(test)]
mod tests;

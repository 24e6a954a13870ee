//! Growing the maps online. A map's capacity is fixed when it is created, so a cluster that
//! outgrows the node-ID map gets new, larger maps, swapped in under the running datapath:
//!
//! 1. the object is loaded again with new maps at the new capacity, which are pinned under
//!    staging pins (`node_ids_grow`, `pod_cidrs_grow`: bpffs refuses dots in names), one pin
//!    operation each; the counters map is shared;
//! 2. every entry is copied from the live maps while the attached programs go on reading them
//!    (the agent writes nothing meanwhile: growing is a step of its reconcile);
//! 3. the new programs take over the attachments the way a restarted agent does
//!    ([`super::attach`]): atomically, so each packet is classified either by the old programs
//!    against the old maps or by the new ones against the new maps, and both hold every entry;
//!    if an attachment refuses, the old programs take every attachment back and nothing else
//!    changed;
//! 4. the intent records the new maps complete, and each staging pin is renamed over the live
//!    one (one atomic rename each, the node-ID map's last), so the agent's backends, the next
//!    agent and every tool open the new maps.
//!
//! The steps are those of a pin transaction ([`super::txn`]): its intent is pinned before the
//! first, and a crash or a failed step at any point is finished or undone by one rule, run by
//! the next start (or at once, for a failed step): before the new maps are recorded complete,
//! the staging pins go and the old maps stay; after, the renames are finished.

use std::path::Path;

use node_agent_common::{self as abi, NodeValue};

use super::maps::{NodeMap, NodeMapError, PodCidrMap};
use super::txn::{self, Kind, Recovery, Txn, TxnError};
use super::{Datapath, DatapathError, Pins, object};

impl Datapath {
    /// The node-ID and pod-CIDR maps' capacity: the smaller of the two (pins of unequal
    /// capacities are loaded each at its own, and the start grows both to the larger).
    pub fn capacity(&self) -> u32 {
        self.config.node_map_max
    }

    /// Grows the maps to `capacity` entries under the running datapath; a capacity no larger
    /// than today's changes nothing.
    pub fn grow(&mut self, capacity: u32) -> Result<(), DatapathError> {
        let from = self.config.node_map_max;
        if capacity <= from {
            return Ok(());
        }
        let bytes = object::bytes().ok_or(DatapathError::ObjectMissing)?;
        let mut config = self.config.clone();
        config.node_map_max = capacity;
        let bpffs = config.bpffs.clone();
        let fail = |what: String| DatapathError::Grow { capacity, what };
        // What an earlier attempt of this agent left (its recovery failed then) goes first.
        txn::recover(&bpffs).map_err(|e| fail(e.to_string()))?;
        let live = Pins::of(&bpffs);
        let (staged_ids, staged_cidrs) =
            (txn::staging(&live.node_ids), txn::staging(&live.pod_cidrs));
        let mut t = Txn::begin(Kind::Growth, &bpffs, capacity).map_err(|e| fail(e.to_string()))?;
        let mut next: Option<Datapath> = None;
        let (mut attached, mut filled) = (false, false);
        let mut stage = || -> Result<(), TxnError> {
            let n = t.step("load the programs with new maps", || {
                Self::open(bytes, &config, true).map_err(|e| e.to_string())
            })?;
            let n = next.insert(n);
            t.step("pin the staging node-ID map", || {
                n.pin_map(abi::NODE_IDS_MAP, &staged_ids)
            })?;
            t.step("pin the staging pod-CIDR map", || {
                n.pin_map(abi::POD_CIDRS_MAP, &staged_cidrs)
            })?;
            t.step("copy the entries into the new maps", || {
                copy_entries(&live, &staged_ids, &staged_cidrs)
            })?;
            // The new programs take the attachments over before any live pin moves: if one
            // refuses, the old programs take every attachment back.
            attached = true;
            t.step("attach the new programs", || {
                n.attach_all().map_err(|e| e.to_string())
            })?;
            t.filled()?;
            filled = true;
            Ok(())
        };
        let staged = stage();
        let result = staged.and_then(|()| t.commit());
        let Err(e) = result else {
            *self = next.expect("loaded");
            tracing::info!(
                from,
                to = capacity,
                "node-ID and pod-CIDR maps grown online"
            );
            return Ok(());
        };
        // Before the new maps were recorded complete, the old programs take back what the new
        // ones took, and the transaction is undone; after, it is finished.
        let back = if attached && !filled {
            self.attach_all().err()
        } else {
            None
        };
        let recovered = txn::recover(&bpffs);
        match (recovered, next) {
            (Ok(Recovery::RolledForward(_)), Some(next)) if back.is_none() => {
                *self = next;
                tracing::warn!(
                    from,
                    to = capacity,
                    error = %e,
                    "node-ID and pod-CIDR maps grown online; a step failed, and the recovery finished it"
                );
                Ok(())
            }
            (Err(r), next) => {
                if let (true, Some(next)) = (filled, next) {
                    *self = next;
                }
                Err(fail(format!(
                    "{e}; recovering failed too ({r}): restart the agent"
                )))
            }
            (Ok(_), _) => Err(fail(match back {
                None => format!("{e}; the old maps and programs are kept"),
                Some(b) => format!(
                    "{e}; putting the old programs back failed too ({b}): restart the agent"
                ),
            })),
        }
    }

    /// Pins the loaded object's map `name` at `pin`.
    fn pin_map(&self, name: &str, pin: &Path) -> Result<(), String> {
        self.ebpf
            .map(name)
            .ok_or_else(|| format!("the object has no map {name}"))?
            .pin(pin)
            .map_err(|e| format!("pinning {}: {e}", pin.display()))
    }
}

/// Copies every entry the agent wrote from the live maps into the staged ones. Entries the
/// agent never writes (undecodable keys) stay behind: the agent would purge them anyway.
fn copy_entries(live: &Pins, staged_ids: &Path, staged_cidrs: &Path) -> Result<(), String> {
    let e = |e: NodeMapError| e.to_string();
    let mut ids = NodeMap::open(staged_ids).map_err(e)?;
    for n in NodeMap::open(&live.node_ids)
        .map_err(e)?
        .dump()
        .map_err(e)?
        .entries
    {
        let value = NodeValue {
            id: n.node_id,
            spi: n.spi,
            flags: n.flags,
        };
        ids.upsert(n.ip, value).map_err(e)?;
    }
    if live.pod_cidrs.exists() {
        let mut cidrs = PodCidrMap::open(staged_cidrs).map_err(e)?;
        for c in PodCidrMap::open(&live.pod_cidrs)
            .map_err(e)?
            .dump()
            .map_err(e)?
            .entries
        {
            let value = NodeValue {
                id: c.node_id,
                spi: c.spi,
                flags: c.flags,
            };
            cidrs.upsert(c.cidr, value).map_err(e)?;
        }
    }
    Ok(())
}

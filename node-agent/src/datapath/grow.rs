//! Growing the maps online. A map's capacity is fixed when it is created, so a cluster that
//! outgrows the node-ID map gets new, larger maps, swapped in under the running datapath:
//!
//! 1. the object is loaded again against staging pins (`node_ids_grow`, `pod_cidrs_grow`: bpffs refuses dots in names), which
//!    creates the new maps at the new capacity; the counters map is shared;
//! 2. every entry is copied from the live maps while the attached programs go on reading them
//!    (the agent writes nothing meanwhile: growing is a step of its reconcile);
//! 3. the new programs take over the attachments the way a restarted agent does
//!    ([`super::attach`]): atomically, so each packet is classified either by the old programs
//!    against the old maps or by the new ones against the new maps, and both hold every entry;
//!    if an attachment refuses, the old programs take every attachment back and nothing else
//!    changed;
//! 4. each staging pin is renamed over the live one (one atomic rename each, the node-ID map's
//!    last), so the agent's backends, the next agent and every tool open the new maps.
//!
//! A crash before the renames leaves the old pins in place, with the next start taking the
//! attachments back (the next attempt removes stale staging pins); after them, the new maps are
//! pinned with every entry and the next start takes the attachments over; between them (the
//! pod-CIDR map's done, the node-ID map's not), the next start finishes the node-ID map's
//! rename before anything else ([`finish_cut_growth`]).

use std::io;
use std::path::{Path, PathBuf};

use node_agent_common::NodeValue;

use super::{Datapath, DatapathError, Pins, object};
use crate::node_map::NodeMap;
use crate::pod_cidr_map::PodCidrMap;

impl Datapath {
    /// The node-ID and pod-CIDR maps' capacity.
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
        let live = Pins::of(&config.bpffs);
        let staged = Pins {
            node_ids: staging(&live.node_ids),
            pod_cidrs: staging(&live.pod_cidrs),
            node_stats: live.node_stats.clone(),
        };
        let fail = |what: String| DatapathError::Grow { capacity, what };
        remove_staged(&staged).map_err(fail)?;
        let mut next = Self::open(bytes, &config, &staged)?;
        copy_entries(&live, &staged).map_err(fail)?;
        // The new programs take the attachments over before any pin moves: if one refuses, the
        // old programs take every attachment back, and the pins never changed.
        if let Err(e) = next.attach_all() {
            let back = self.attach_all();
            drop(next);
            let _ = remove_staged(&staged);
            return Err(match back {
                Ok(()) => fail(format!("{e}; the old maps and programs are kept")),
                Err(b) => fail(format!(
                    "{e}; putting the old programs back failed too ({b}): restart the agent"
                )),
            });
        }
        for (from, to) in [
            (&staged.pod_cidrs, &live.pod_cidrs),
            (&staged.node_ids, &live.node_ids),
        ] {
            std::fs::rename(from, to).map_err(|e| {
                fail(format!(
                    "pinning {} in place of {}: {e}; restart the agent",
                    from.display(),
                    to.display()
                ))
            })?;
        }
        *self = next;
        tracing::info!(
            from,
            to = capacity,
            "node-ID and pod-CIDR maps grown online"
        );
        Ok(())
    }
}

/// The node-ID map's staging pin, if a growth was cut between its two renames (a crash): the
/// pod-CIDR pin is the new map already, and the staging pin holds the new node-ID map with
/// every entry, which the programs attached last read. Left so, the two maps' capacities
/// differed and no start got past the pin checks.
pub(super) fn cut_growth(bpffs: &Path) -> Option<PathBuf> {
    let live = Pins::of(bpffs);
    let (node_ids, pod_cidrs) = (staging(&live.node_ids), staging(&live.pod_cidrs));
    (node_ids.exists() && !pod_cidrs.exists()).then_some(node_ids)
}

/// Finishes a growth cut between its renames: the staged node-ID map goes in place.
pub(super) fn finish_cut_growth(bpffs: &Path) -> Result<(), DatapathError> {
    let Some(staged) = cut_growth(bpffs) else {
        return Ok(());
    };
    let live = Pins::of(bpffs).node_ids;
    std::fs::rename(&staged, &live).map_err(|source| DatapathError::FinishGrowth {
        path: staged.clone(),
        source,
    })?;
    tracing::warn!(
        pin = %live.display(),
        "a map growth was cut short between its renames; finished it"
    );
    Ok(())
}

/// Removes staging pins an interrupted attempt left.
fn remove_staged(staged: &Pins) -> Result<(), String> {
    for p in [&staged.node_ids, &staged.pod_cidrs] {
        match std::fs::remove_file(p) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(format!("removing the staging pin {}: {e}", p.display()));
            }
            _ => {}
        }
    }
    Ok(())
}

/// `node_ids` -> `node_ids_grow`.
fn staging(pin: &Path) -> PathBuf {
    let mut name = pin.file_name().unwrap_or_default().to_owned();
    name.push("_grow");
    pin.with_file_name(name)
}

/// Copies every entry the agent wrote from the live maps into the staged ones. Entries the
/// agent never writes (undecodable keys) stay behind: the agent would purge them anyway.
fn copy_entries(live: &Pins, staged: &Pins) -> Result<(), String> {
    let e = |e: crate::node_map::NodeMapError| e.to_string();
    let mut ids = NodeMap::open(&staged.node_ids).map_err(e)?;
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
        let mut cidrs = PodCidrMap::open(&staged.pod_cidrs).map_err(e)?;
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

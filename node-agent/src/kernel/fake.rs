//! An in-memory kernel that fails on command: the one every unit test of the agent runs on.

use std::collections::BTreeMap;
use std::io;
use std::ops::{Deref, DerefMut};

use state::objects::{ObjectId, ObjectKind};
use state::testing::{ModelKernel, Refusal};

use super::*;

/// What to break.
#[derive(Default)]
pub struct Faults {
    /// The next this many dumps fail (as a dump that fails halfway does).
    pub dumps: usize,
    /// Ops on objects of these kinds fail (with `EBUSY`) while set.
    pub kinds: Vec<ObjectKind>,
    /// Ops on these identities fail while set.
    pub ids: Vec<ObjectId>,
    /// Remembering freed IDs fails while set.
    pub freed: bool,
}

/// The workspace's model kernel ([`ModelKernel`], whose objects it derefs to), with failures on
/// command and the kernel's other answers.
#[derive(Default)]
pub struct FakeKernel {
    pub model: ModelKernel,
    pub freed: BTreeMap<u16, FreedId>,
    /// The kernel's record of recent removals; `None` until one is remembered.
    pub removals: Option<Vec<RecentRemovals>>,
    pub faults: Faults,
    pub dumps: usize,
    pub applied: Vec<Op>,
    /// What [`Kernel::host`] answers.
    pub host: HostAddresses,
    /// How many times [`Kernel::host`] was asked.
    pub host_reads: usize,
    /// What [`Kernel::ipsec_keys`] answers.
    pub keys: Option<KeyRead>,
    /// What [`Kernel::check_attachments`] answers.
    pub pending: Vec<String>,
    /// What [`Kernel::route_nexthops`] answers.
    pub nexthops: bool,
    /// The capacities [`Kernel::grow_maps`] was asked for.
    pub grown: Vec<u32>,
    /// Destinations where someone else changed a route since the last dump (what a test
    /// planted there): [`Kernel::routes_since_dump`] says so until the next dump.
    pub routes_touched: Vec<IpNet>,
    /// Destinations someone else changes a route at while each of the next dumps runs (one
    /// list per dump, taken in turn): after the dump, they are touched.
    pub touched_during_dumps: Vec<Vec<IpNet>>,
}

fn busy(what: &str) -> OpError {
    OpError::Kernel {
        what: what.to_string(),
        source: io::Error::from_raw_os_error(libc::EBUSY),
    }
}

impl FakeKernel {
    fn fails(&self, op: &Op) -> bool {
        let o = op.object();
        self.faults.kinds.contains(&o.kind()) || self.faults.ids.contains(&o.id())
    }

    fn apply_one(&mut self, op: &Op) -> Result<(), OpError> {
        if self.fails(op) {
            return Err(busy(&format!("{} {}", op.verb(), op.object())));
        }
        let what = op.object().to_string();
        self.model.write(op).map_err(|refused| match refused {
            Refusal::Occupied => OpError::Occupied { what },
            Refusal::InUse { user } => OpError::InUse { what, user },
        })?;
        self.applied.push(op.clone());
        Ok(())
    }
}

impl Deref for FakeKernel {
    type Target = ModelKernel;
    fn deref(&self) -> &ModelKernel {
        &self.model
    }
}

impl DerefMut for FakeKernel {
    fn deref_mut(&mut self) -> &mut ModelKernel {
        &mut self.model
    }
}

impl Kernel for FakeKernel {
    async fn dump(&mut self) -> Result<Inventory, DumpError> {
        self.dumps += 1;
        self.routes_touched.clear();
        if !self.touched_during_dumps.is_empty() {
            self.routes_touched = self.touched_during_dumps.remove(0);
        }
        if self.faults.dumps > 0 {
            self.faults.dumps -= 1;
            return Err(DumpError::Kernel {
                kind: ObjectKind::Route,
                source: io::Error::from_raw_os_error(libc::ENOBUFS),
            });
        }
        Ok(self.model.inventory())
    }

    async fn host(&mut self) -> Result<HostAddresses, DumpError> {
        self.host_reads += 1;
        Ok(self.host.clone())
    }

    async fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), OpError>> {
        ops.iter().map(|op| self.apply_one(op)).collect()
    }

    async fn nexthops_ours(&mut self, ids: &[NexthopId]) -> Vec<Result<(), OpError>> {
        ids.iter()
            .map(|&id| {
                let at = ObjectId::Nexthop { id };
                match (self.ours.contains_key(&at), self.foreign.get(&at)) {
                    (true, _) => Ok(()),
                    (false, Some(theirs)) => Err(busy(theirs)),
                    (false, None) => Err(OpError::NexthopMissing),
                }
            })
            .collect()
    }

    async fn purge_junk(&mut self) -> Result<usize, OpError> {
        Ok(0)
    }

    fn freed_ids(&mut self) -> Result<Vec<FreedId>, OpError> {
        Ok(self.freed.values().copied().collect())
    }

    fn remember_freed(&mut self, freed: &[FreedId]) -> Result<(), OpError> {
        if self.faults.freed {
            return Err(busy("remembering freed IDs"));
        }
        for f in freed {
            self.freed.insert(f.id.get(), *f);
        }
        Ok(())
    }

    fn recent_removals(&mut self) -> Option<Vec<RecentRemovals>> {
        self.removals.clone()
    }

    fn remember_removal(
        &mut self,
        removal: RecentRemovals,
        _keep_since: Duration,
    ) -> Result<(), OpError> {
        self.removals.get_or_insert_default().push(removal);
        Ok(())
    }

    fn ipsec_keys(&mut self) -> Option<KeyRead> {
        self.keys.clone()
    }

    fn check_attachments(&mut self) -> Vec<String> {
        self.pending.clone()
    }

    fn route_nexthops(&self) -> bool {
        self.nexthops
    }

    fn routes_since_dump(&mut self, at: &[IpNet]) -> RoutesSinceDump {
        match at.iter().any(|dst| self.routes_touched.contains(dst)) {
            true => RoutesSinceDump::Touched,
            false => RoutesSinceDump::Untouched,
        }
    }

    fn grow_maps(&mut self, capacity: u32) -> Result<(), OpError> {
        self.grown.push(capacity);
        Ok(())
    }
}

//! Step 4: who keeps an address or a pod CIDR when several nodes claim it, as [`super::assign`]
//! admits candidates.
//!
//! A *resource* ([`Resource`]) is a mapped address or a pod CIDR. The order of precedence
//! (invariant 14): the local node; nodes that keep what they had whatever they claim now (held
//! live nodes and removals the brake holds); then the incumbent, the live node whose record
//! lists the resource; only then the order in which candidates are admitted.

use super::resource_index::{Res, ResourceIndex};

pub use super::resource::{ConflictWhy, Resource, mapped_ips};

/// Who has a resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Holder {
    Local,
    /// A held live node (index into the live nodes): keeps what its record lists.
    Held(usize),
    /// A removal the brake holds (index into the records).
    Removal(usize),
    /// A candidate admitted before (index into the live nodes).
    Admitted(usize),
}

/// The resources taken so far, and the incumbents, by [`Res`].
pub(super) struct Claims {
    taken: Vec<Option<Holder>>,
    /// The live node whose record lists the resource (the first in name order).
    incumbent: Vec<Option<usize>>,
}

/// What keeps a candidate from a resource: who has it, or the incumbent that still claims it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Blocker {
    Taken(Holder),
    Incumbent(usize),
}

impl Claims {
    /// Nothing taken, no incumbent, for the resources of `index`.
    pub fn new(index: &ResourceIndex) -> Self {
        Self {
            taken: vec![None; index.len()],
            incumbent: vec![None; index.len()],
        }
    }

    /// Gives `r` to `holder` unless someone has it already (the first fixer wins: the local
    /// node is fixed first).
    pub fn fix(&mut self, r: Res, holder: Holder) {
        self.taken[r as usize].get_or_insert(holder);
    }

    /// Records that the record of live node `live` lists `r`.
    pub fn incumbent(&mut self, r: Res, live: usize) {
        self.incumbent[r as usize].get_or_insert(live);
    }

    /// Whether candidate `who` may take all of `wants`: the first resource it may not, and what
    /// keeps it. `claims_now(j, r)` says whether live node `j` still claims `r`.
    pub fn check(
        &self,
        who: usize,
        wants: &[Res],
        claims_now: impl Fn(usize, Res) -> bool,
    ) -> Result<(), (Res, Blocker)> {
        for &r in wants {
            match self.taken[r as usize] {
                None => {}
                Some(Holder::Admitted(j)) if j == who => {}
                Some(h) => return Err((r, Blocker::Taken(h))),
            }
            if let Some(inc) = self.incumbent[r as usize]
                && inc != who
                && claims_now(inc, r)
            {
                return Err((r, Blocker::Incumbent(inc)));
            }
        }
        Ok(())
    }

    /// Gives every resource of `wants` to candidate `who`.
    pub fn take(&mut self, who: usize, wants: &[Res]) {
        for &r in wants {
            self.taken[r as usize] = Some(Holder::Admitted(who));
        }
    }
}

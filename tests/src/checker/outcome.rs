//! What a history run found, summed over histories for the coverage line.

/// What a history run found.
#[derive(Debug, Default)]
pub struct Outcome {
    pub steps: usize,
    /// The first step that broke an invariant, with what it broke.
    pub failure: Option<(usize, Vec<String>)>,
    /// Crash torture's figures: restarts checked for exactness, objects leaked and missing
    /// after them, and IDs of unchanged nodes that changed.
    pub rounds: usize,
    pub leaked: usize,
    pub missing: usize,
    pub id_changes: usize,
    /// Where the kills landed: before the kernel changed, after it changed but before the
    /// checkpoint did, after the checkpoint was written.
    pub kills: [usize; 3],
    /// Runs ended at once (a daemon killed, a test cut's `kill`), and operations or checkpoint
    /// writes failed by a test cut.
    pub crashes: usize,
    pub failed_ops: usize,
    /// Runs that reported a brake hold, and forced (`--force-prune`) runs.
    pub holds: usize,
    pub confirmations: usize,
    /// Steps at rest compared with a fresh agent's kernel.
    pub differential: usize,
    /// Runs that read a nodes file caught half-written.
    pub torn: usize,
    /// Held nodes (malformed or without addresses, recorded) judged for what they kept.
    pub held: usize,
    /// Runs whose source never completed a list.
    pub unsynced: usize,
    /// Of `confirmations`, the holds an operator confirmed to a running daemon.
    pub confirmed_holds: usize,
}

impl Outcome {
    pub(super) fn add(&mut self, o: &Outcome) {
        self.steps += o.steps;
        self.rounds += o.rounds;
        self.leaked += o.leaked;
        self.missing += o.missing;
        self.id_changes += o.id_changes;
        for (t, k) in self.kills.iter_mut().zip(o.kills) {
            *t += k;
        }
        self.crashes += o.crashes;
        self.failed_ops += o.failed_ops;
        self.holds += o.holds;
        self.confirmations += o.confirmations;
        self.differential += o.differential;
        self.torn += o.torn;
        self.held += o.held;
        self.unsynced += o.unsynced;
        self.confirmed_holds += o.confirmed_holds;
    }
}

//! The end-to-end invariant checker (`node_agent_tests::checker`): random, seeded histories of
//! the real binary, every invariant checked after every step. CI runs a fixed budget;
//! `NODE_AGENT_CHECK_STEPS` runs more, `NODE_AGENT_CHECK_SEED` replays a seed.

use node_agent_tests::checker::model::Profile;
use node_agent_tests::checker::{Budget, check};
use node_agent_tests::require_sandbox;

#[test]
fn random_histories_keep_every_invariant() {
    require_sandbox!("random_histories_keep_every_invariant");
    check("invariants", Budget::from_env(200, 25, Profile::INVARIANTS));
}

/// Crash torture on the same harness: a cluster of about eighty nodes, a tenth churned each
/// round (adds, deletes, readdressing, recycled IPs), the daemon killed with SIGKILL at a random
/// moment (during the apply, just after it, during the checkpoint write), then a restart that
/// must converge exactly: nothing leaked, nothing missing, unchanged nodes' IDs unchanged. CI
/// runs 50 rounds; `NODE_AGENT_CHECK_STEPS` (two steps a round) runs more.
#[test]
fn killed_mid_reconcile_the_agent_always_converges_exactly() {
    require_sandbox!("killed_mid_reconcile_the_agent_always_converges_exactly");
    check("torture", Budget::from_env(101, 101, Profile::TORTURE));
}

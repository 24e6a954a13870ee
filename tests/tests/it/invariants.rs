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

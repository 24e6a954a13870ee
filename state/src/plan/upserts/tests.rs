//! What is written for a programmed node: a pod CIDR without a gateway skipped, and nothing
//! written over a foreign object (invariant 6).

use crate::plan::tests::support::*;
use crate::plan::*;

#[test]
fn cidr_without_gateway_is_skipped_and_the_rest_programmed() {
    let r = Run::new();
    let mut k = Kernel::default();
    let v6_cidr_v4_only = node("c", &["10.0.0.3"], &["10.1.3.0/24", "fd01:3::/64"]);
    let (p, _) = r.reconcile(None, &[v6_cidr_v4_only], &mut k);
    assert!(matches!(
        problems(&p)[..],
        [(
            "c",
            InputProblem::NoGateway {
                family: Family::V6,
                ..
            }
        )]
    ));
    assert!(k.has(&route("10.1.3.0/24", "10.0.0.3")));
}

// ---- Invariant 6: foreign objects ----

#[test]
fn a_foreign_route_at_our_identity_is_a_conflict_and_never_replaced() {
    let r = Run::new();
    let mut k = Kernel::default();
    k.foreign.insert(
        route("10.1.2.0/24", "10.0.0.2").id(),
        "route 10.1.2.0/24 dev cni0 proto kernel".into(),
    );
    let (p, cp) = r.reconcile(None, &[a(), b()], &mut k);
    assert!(matches!(
        problems(&p)[..],
        [("b", InputProblem::Foreign { foreign, .. })] if foreign.contains("proto kernel")
    ));
    assert!(!k.ours.contains_key(&route("10.1.2.0/24", "10.0.0.2").id()));
    assert!(
        k.has(&map("10.0.0.2", 2)),
        "the node's other objects are programmed"
    );
    assert!(k.has(&route("10.1.1.0/24", "10.0.0.1")));
    // Nothing to do next time but report the conflict again.
    let p = r.plan(Some(&cp), &[a(), b()], &k);
    assert!(p.is_empty() && p.errors.len() == 1);
}

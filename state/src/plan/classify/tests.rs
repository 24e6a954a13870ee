//! Who is what among the live nodes: one entry per name, and a malformed node standing on its
//! record (invariant 8).

use crate::plan::tests::support::*;
use crate::plan::*;

#[test]
fn duplicate_live_name_keeps_the_first_entry() {
    let r = Run::new();
    let mut k = Kernel::default();
    let other = node("a", &["10.0.0.50"], &[]);
    let (p, _) = r.reconcile(None, &[a(), other], &mut k);
    assert!(matches!(
        problems(&p)[..],
        [("a", InputProblem::DuplicateName)]
    ));
    assert!(k.has(&map("10.0.0.1", 1)));
}

// ---- Invariant 8: transient is not gone ----

#[test]
fn a_malformed_node_keeps_every_object_after_a_restart() {
    let mut r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    // After the restart b's record does not validate; only the checkpoint knows its objects.
    r.malformed = vec![MalformedNode::named("b")];
    let p = r.plan(Some(&cp), &[a()], &k);
    assert!(p.is_empty(), "{p:?}");
    assert!(p.brake.is_none());
    assert!(p.checkpoint.nodes.contains(&with_id(b(), 2)));
    assert!(p.frees.is_empty());
    // Its address stays its own.
    let thief = node("c", &["10.0.0.2"], &["10.1.3.0/24"]);
    let p = r.plan(Some(&cp), &[a(), thief], &k);
    assert!(k.has(&map("10.0.0.2", 2)));
    assert!(p.upserts.is_empty(), "{:?}", p.upserts);
}

//! The **unsynced** oracle (invariant 1).

use std::collections::{BTreeMap, BTreeSet};

use super::StepFacts;
use super::record::Recorded;

/// What a run whose source never completed a list deleted or changed (invariant 1): every
/// object of ours in the kernel before it (map entries, routes, nexthops, xfrm objects) is there
/// after it as it was, and every recorded node's row is as it was (the record may gain nothing
/// either: with no list there is nothing to add).
pub(super) fn unsynced_lost(f: &StepFacts<'_>) -> Vec<String> {
    if !f.unsynced {
        return Vec::new();
    }
    let mut v = Vec::new();
    let mut changed = |what: &str, lost: Vec<String>| {
        if !lost.is_empty() {
            v.push(format!(
                "before any full list, {what} went or changed: {}",
                lost.join(", ")
            ));
        }
    };
    fn lost<K: Ord + std::fmt::Debug, V: PartialEq + std::fmt::Debug>(
        before: &BTreeMap<K, V>,
        after: &BTreeMap<K, V>,
    ) -> Vec<String> {
        (before.iter())
            .filter(|(k, v)| after.get(*k) != Some(*v))
            .map(|(k, v)| format!("{k:?} -> {v:?}"))
            .collect()
    }
    let (before, after) = (f.before, f.after);
    changed("map entries", lost(&before.map, &after.map));
    changed("routes", lost(&before.our_routes(), &after.our_routes()));
    changed(
        "nexthops",
        lost(&before.our_nexthops(), &after.our_nexthops()),
    );
    changed("xfrm objects", lost(&before.xfrm, &after.xfrm));
    let rows = |r: Option<&[Recorded]>| -> BTreeSet<String> {
        r.unwrap_or_default()
            .iter()
            .map(|r| format!("{r:?}"))
            .collect()
    };
    let (was, is) = (rows(f.record_before), rows(f.record_after));
    changed(
        "recorded nodes",
        was.symmetric_difference(&is).cloned().collect(),
    );
    v
}

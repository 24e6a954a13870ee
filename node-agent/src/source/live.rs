//! The live view, folded from source events.
//!
//! Like kube-runtime's reflector store, with two more rules. A node whose new record is
//! malformed keeps its last good record (and the error is reported), because dropping it would
//! make its kernel state look stale and get it deleted over a typo; a malformed node with no
//! good record in this process is still listed, by name and the UID its record carried, so the
//! planner keeps what the agent's own record of that node says it had (invariants 8 and 12).
//! And only full lists that contain the local node count as confirmations for the brake
//! (invariant 15).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use state::node::{Node, NodeError, RawNode};
use state::plan::{LiveView, MalformedNode};

use super::SourceEvent;

#[derive(Debug, Default)]
pub struct LiveState {
    /// The node this agent runs on.
    local: String,
    /// Shared with every view taken of them ([`LiveView::nodes`]).
    nodes: BTreeMap<String, Arc<Node>>,
    /// Nodes whose latest record failed validation, with the reason.
    errors: BTreeMap<String, Rejected>,
    /// The full list being received, between `Init` and `InitDone`.
    relist: Option<BTreeMap<String, Arc<Node>>>,
    relist_errors: BTreeMap<String, Rejected>,
    /// Names the last full list had more than one item of: the first item stands.
    duplicates: BTreeMap<String, Duplicate>,
    relist_duplicates: BTreeMap<String, Duplicate>,
    synced: bool,
    relists: u64,
    /// Full lists that contained the local node.
    confirming_relists: u64,
    source_errors: u64,
    last_error: Option<String>,
    /// The source's error since its last success: it cannot see node changes now.
    failing: Option<String>,
    /// What changed since [`Self::take_changes`] last ran.
    changes: Changes,
    /// Whether nodes' ExternalIPs are read. Without `--include-external-ips` nothing uses them,
    /// so they are dropped as they arrive: one the address policy refuses (a cloud's odd
    /// ExternalIP) must not hold a node whose every address in use is fine.
    external_ips: bool,
    /// The newest resourceVersion the view reflects ([`SourceEvent::Revision`]), and one
    /// announced for the event that comes next.
    revision: Option<u64>,
    announced: Option<u64>,
}

/// A node's latest record, rejected: why, and the UID it carried (which tells the planner which
/// of the agent's records of the name is this node's).
#[derive(Debug)]
pub struct Rejected {
    pub uid: String,
    pub error: NodeError,
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

/// A name one full list had several items of. The first item stands, whatever the others say
/// (a NodeList file edited by hand, two lists concatenated): the order of the list is the only
/// thing that tells them apart, and which one stands then does not change from one read of the
/// same list to the next. The others are ignored and reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Duplicate {
    /// The UID of the item that stands, and of each one ignored, in list order.
    pub first_uid: String,
    pub ignored_uids: Vec<String>,
}

impl std::fmt::Display for Duplicate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let uid = |u: &str| {
            if u.is_empty() {
                "no UID".to_owned()
            } else {
                format!("UID {u}")
            }
        };
        write!(
            f,
            "listed {} times in one list; the first item ({}) stands, the others are ignored (",
            self.ignored_uids.len() + 1,
            uid(&self.first_uid)
        )?;
        for (i, u) in self.ignored_uids.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{}", uid(u))?;
        }
        f.write_str(")")
    }
}

/// What changed in the live view since the last reconcile took its changes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Changes {
    /// A full list arrived (or none has yet): anything may have changed.
    #[default]
    Everything,
    /// Only the nodes of these names (changed, added, deleted or turned malformed).
    Names(BTreeSet<String>),
}

impl LiveState {
    pub fn new(local: impl Into<String>) -> Self {
        Self {
            local: local.into(),
            ..Self::default()
        }
    }

    /// Reads nodes' ExternalIPs too (`--include-external-ips`).
    pub fn with_external_ips(mut self, read: bool) -> Self {
        self.external_ips = read;
        self
    }

    /// Folds one event in; returns whether the live view (or its sync state) changed.
    pub fn apply(&mut self, event: SourceEvent) -> bool {
        if let SourceEvent::Revision(r) = event {
            self.announced = Some(r);
            return false;
        }
        let brings_revision = matches!(
            event,
            SourceEvent::InitDone | SourceEvent::Apply(_) | SourceEvent::Delete(_)
        );
        let changed = self.fold_event(event);
        if brings_revision && let Some(r) = self.announced.take() {
            self.revision = self.revision.max(Some(r));
        }
        changed
    }

    /// The newest Kubernetes resourceVersion the view reflects, where the source has one.
    pub fn revision(&self) -> Option<u64> {
        self.revision
    }

    fn fold_event(&mut self, mut event: SourceEvent) -> bool {
        if !self.external_ips
            && let SourceEvent::InitApply(raw) | SourceEvent::Apply(raw) = &mut event
        {
            raw.addresses.retain(|(kind, _)| kind != "ExternalIP");
        }
        if event.clears_failure() {
            self.failing = None;
        }
        match event {
            SourceEvent::Init => {
                self.relist = Some(BTreeMap::new());
                self.relist_errors.clear();
                self.relist_duplicates.clear();
                false
            }
            SourceEvent::InitApply(raw) => {
                let previous = &self.nodes;
                if let Some(buf) = self.relist.as_mut() {
                    // Of a name listed twice, the first item stands; the others are reported.
                    let first = buf
                        .get(&raw.name)
                        .map(|n| n.uid.to_string())
                        .or_else(|| self.relist_errors.get(&raw.name).map(|r| r.uid.clone()));
                    match first {
                        Some(first_uid) => {
                            self.relist_duplicates
                                .entry(raw.name)
                                .or_insert_with(|| Duplicate {
                                    first_uid,
                                    ignored_uids: Vec::new(),
                                })
                                .ignored_uids
                                .push(raw.uid);
                        }
                        None => Self::fold(buf, &mut self.relist_errors, Some(previous), raw),
                    }
                }
                false
            }
            SourceEvent::InitDone => {
                let Some(new) = self.relist.take() else {
                    return false;
                };
                let changed = !self.synced || new != self.nodes;
                let with_local =
                    new.contains_key(&self.local) || self.relist_errors.contains_key(&self.local);
                self.nodes = new;
                self.changes = Changes::Everything;
                self.errors = std::mem::take(&mut self.relist_errors);
                self.duplicates = std::mem::take(&mut self.relist_duplicates);
                self.synced = true;
                self.relists += 1;
                if with_local {
                    self.confirming_relists += 1;
                }
                self.last_error = None;
                changed
            }
            SourceEvent::Apply(raw) => {
                let name = raw.name.clone();
                let before = self.nodes.get(&name).cloned();
                // A malformed record leaves the good one in place: nothing to copy it from.
                Self::fold(&mut self.nodes, &mut self.errors, None, raw);
                self.touch(&name);
                self.nodes.get(&name) != before.as_ref()
            }
            SourceEvent::Delete(name) => {
                self.errors.remove(&name);
                self.duplicates.remove(&name);
                self.touch(&name);
                self.nodes.remove(&name).is_some()
            }
            SourceEvent::Error(msg) => {
                self.source_errors += 1;
                self.failing = Some(msg.clone());
                self.last_error = Some(msg);
                false
            }
            SourceEvent::Healthy | SourceEvent::Revision(_) => false,
        }
    }

    fn touch(&mut self, name: &str) {
        if let Changes::Names(names) = &mut self.changes {
            names.insert(name.to_owned());
        }
    }

    /// What changed since the last call, and starts over.
    pub fn take_changes(&mut self) -> Changes {
        std::mem::replace(&mut self.changes, Changes::Names(BTreeSet::new()))
    }

    /// Folds `raw` into `into`. A malformed record keeps the good one `previous` had (`None`:
    /// `into` is the map the good one is already in), if it is of the same node: a node of
    /// another UID under the name (the node was replaced while the watch was down, its
    /// successor malformed) is not the record's node, whose objects must go as a removal the
    /// brake counts, and whose addresses must not stay its. A malformed record without a
    /// readable UID keeps the good one: which node it is, nobody can tell.
    fn fold(
        into: &mut BTreeMap<String, Arc<Node>>,
        errors: &mut BTreeMap<String, Rejected>,
        previous: Option<&BTreeMap<String, Arc<Node>>>,
        raw: RawNode,
    ) {
        let (name, uid) = (raw.name.clone(), raw.uid.clone());
        match Node::from_raw(raw) {
            Ok(node) => {
                errors.remove(&name);
                into.insert(name, Arc::new(node));
            }
            Err(e) => {
                let same_node = |good: &Arc<Node>| uid.is_empty() || good.uid.as_str() == uid;
                match previous {
                    Some(p) => {
                        if let Some(good) = p.get(&name).filter(|g| same_node(g)) {
                            into.insert(name.clone(), good.clone());
                        }
                    }
                    None => {
                        if into.get(&name).is_some_and(|g| !same_node(g)) {
                            into.remove(&name);
                        }
                    }
                }
                errors.insert(name, Rejected { uid, error: e });
            }
        }
    }

    pub fn view(&self) -> LiveView {
        LiveView {
            nodes: self.nodes.values().cloned().collect(),
            malformed: self.malformed(self.errors.keys()),
            synced: self.synced,
            relists: self.confirming_relists,
        }
    }

    /// The view of the nodes named in `names` and of the local node: what an event-sized plan
    /// reads ([`state::plan::plan_scoped`]).
    pub fn view_of(&self, names: &BTreeSet<String>) -> LiveView {
        let wanted = names.iter().chain(std::iter::once(&self.local));
        LiveView {
            nodes: wanted
                .clone()
                .filter_map(|n| self.nodes.get(n))
                .cloned()
                .collect(),
            malformed: self.malformed(wanted),
            synced: self.synced,
            relists: self.confirming_relists,
        }
    }

    /// Of the nodes named, those whose records all failed validation.
    fn malformed<'a>(&self, names: impl Iterator<Item = &'a String>) -> Vec<MalformedNode> {
        names
            .filter(|n| !self.nodes.contains_key(*n))
            .filter_map(|n| {
                self.errors.get(n).map(|r| MalformedNode {
                    name: n.clone(),
                    uid: r.uid.clone(),
                })
            })
            .collect()
    }

    /// The source's error since its last success, if it has failed since: the agent cannot see
    /// node changes, so it is not ready.
    pub fn failing(&self) -> Option<&str> {
        self.failing.as_deref()
    }

    pub fn synced(&self) -> bool {
        self.synced
    }

    /// Completed full lists so far.
    pub fn relists(&self) -> u64 {
        self.relists
    }

    /// Completed full lists that contained the local node: the ones that may confirm a hold.
    pub fn confirming_relists(&self) -> u64 {
        self.confirming_relists
    }

    /// Nodes skipped or kept at their last good record because their input is malformed.
    pub fn errors(&self) -> &BTreeMap<String, Rejected> {
        &self.errors
    }

    /// Names the last full list had several items of, and which stood.
    pub fn duplicates(&self) -> &BTreeMap<String, Duplicate> {
        &self.duplicates
    }

    pub fn source_errors(&self) -> u64 {
        self.source_errors
    }

    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    pub fn get(&self, name: &str) -> Option<&Node> {
        self.nodes.get(name).map(|n| &**n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use state::testing::raw;

    fn state() -> LiveState {
        LiveState::new("local")
    }

    fn relist(s: &mut LiveState, nodes: &[RawNode]) -> bool {
        s.apply(SourceEvent::Init);
        for n in nodes {
            s.apply(SourceEvent::InitApply(n.clone()));
        }
        s.apply(SourceEvent::InitDone)
    }

    /// A revision counts from the event it announces on, for every kind of event that brings
    /// one; the events between (a list's start and items, an error) do not take it early.
    #[test]
    fn a_revision_is_reflected_only_with_the_event_it_announces() {
        let mut s = state();
        s.apply(SourceEvent::Revision(5));
        s.apply(SourceEvent::Init);
        s.apply(SourceEvent::InitApply(raw("local", &["10.0.0.9"], &[])));
        s.apply(SourceEvent::Error("a page failed".into()));
        assert_eq!(s.revision(), None, "announced, not yet brought");
        s.apply(SourceEvent::InitDone);
        assert_eq!(s.revision(), Some(5));
        let brought: [(u64, SourceEvent); 2] = [
            (7, SourceEvent::Apply(raw("n1", &["10.0.0.1"], &[]))),
            (9, SourceEvent::Delete("n1".into())),
        ];
        for (r, event) in brought {
            s.apply(SourceEvent::Revision(r));
            assert_eq!(s.revision(), Some(r - 2), "before {event:?}");
            s.apply(event);
            assert_eq!(s.revision(), Some(r));
        }
        // An older version (a relist after a compaction answered by a lagging member) does not
        // move it back.
        s.apply(SourceEvent::Revision(3));
        relist(&mut s, &[raw("local", &["10.0.0.9"], &[])]);
        assert_eq!(s.revision(), Some(9));
    }

    /// An ExternalIP the address policy refuses holds the node only where ExternalIPs are
    /// read (`--include-external-ips`); elsewhere nothing uses it, and the node stands.
    #[test]
    fn an_unusable_external_ip_holds_a_node_only_where_external_ips_are_read() {
        let mut n = raw("n1", &["10.0.0.1"], &[]);
        n.addresses.push(("ExternalIP".into(), "127.0.0.1".into()));
        for read in [false, true] {
            let mut s = state().with_external_ips(read);
            relist(&mut s, std::slice::from_ref(&n));
            let listed = s.view().nodes.iter().any(|v| v.name == "n1");
            assert_eq!(listed, !read, "external IPs read: {read}");
            assert_eq!(
                s.errors().len(),
                usize::from(read),
                "external IPs read: {read}"
            );
        }
    }

    /// Two items of one name in one list: the first stands, whatever the second says (valid or
    /// not), and the name is reported with both UIDs; a list without the repeat clears it.
    #[test]
    fn of_a_name_listed_twice_in_one_list_the_first_item_stands_and_both_are_reported() {
        let mut s = state();
        let mut second = raw("a", &["10.0.0.9"], &[]);
        second.uid = "uid-other".into();
        let mut bad = raw("b", &["not an ip"], &[]);
        bad.uid = "uid-bad".into();
        relist(
            &mut s,
            &[
                raw("local", &["10.0.0.100"], &[]),
                raw("a", &["10.0.0.1"], &[]),
                second,
                raw("b", &["10.0.0.2"], &[]),
                bad,
            ],
        );
        assert_eq!(
            s.get("a").unwrap().internal_ip(state::node::Family::V4),
            Some("10.0.0.1".parse().unwrap())
        );
        assert_eq!(s.get("a").unwrap().uid.as_str(), "uid-a");
        assert!(
            s.errors().is_empty(),
            "the ignored item is not validated: {:?}",
            s.errors()
        );
        assert_eq!(s.get("b").unwrap().uid.as_str(), "uid-b");
        let d = &s.duplicates()["a"];
        assert_eq!(
            d.to_string(),
            "listed 2 times in one list; the first item (UID uid-a) stands, the others are ignored (UID uid-other)"
        );
        assert_eq!(s.duplicates()["b"].ignored_uids, ["uid-bad"]);
        // A first item that is malformed stands too: the name is malformed, not the later item.
        let mut first_bad = raw("c", &["nope"], &[]);
        first_bad.uid = "uid-c1".into();
        relist(
            &mut s,
            &[
                raw("local", &["10.0.0.100"], &[]),
                first_bad,
                raw("c", &["10.0.0.3"], &[]),
            ],
        );
        assert!(s.get("c").is_none());
        assert!(s.errors().contains_key("c"));
        assert_eq!(s.duplicates()["c"].first_uid, "uid-c1");
        assert!(
            !s.duplicates().contains_key("a"),
            "a list without the repeat clears it"
        );
        relist(
            &mut s,
            &[
                raw("local", &["10.0.0.100"], &[]),
                raw("c", &["10.0.0.3"], &[]),
            ],
        );
        assert!(s.duplicates().is_empty());
        assert!(s.get("c").is_some());
    }

    #[test]
    fn not_synced_until_the_first_full_list_completes() {
        let mut s = state();
        s.apply(SourceEvent::Init);
        s.apply(SourceEvent::InitApply(raw("a", &["10.0.0.1"], &[])));
        assert!(!s.view().synced);
        assert!(
            s.view().nodes.is_empty(),
            "a partial list is not the live view"
        );
        assert!(s.apply(SourceEvent::InitDone));
        assert!(s.view().synced);
        assert_eq!(s.view().nodes.len(), 1);
    }

    #[test]
    fn a_relist_replaces_the_view_so_missed_deletes_show() {
        let mut s = state();
        relist(
            &mut s,
            &[raw("a", &["10.0.0.1"], &[]), raw("b", &["10.0.0.2"], &[])],
        );
        assert!(relist(&mut s, &[raw("a", &["10.0.0.1"], &[])]));
        assert_eq!(s.view().nodes.len(), 1);
        assert_eq!(s.relists(), 2);
        assert!(
            !relist(&mut s, &[raw("a", &["10.0.0.1"], &[])]),
            "an identical relist without the local node changes nothing"
        );
    }

    #[test]
    fn only_lists_with_the_local_node_confirm() {
        let mut s = state();
        relist(&mut s, &[raw("a", &["10.0.0.1"], &[])]);
        assert_eq!((s.relists(), s.view().relists), (1, 0));
        let local = raw("local", &["10.0.0.100"], &[]);
        assert!(relist(&mut s, std::slice::from_ref(&local)));
        assert!(
            !relist(&mut s, std::slice::from_ref(&local)),
            "an identical list"
        );
        assert_eq!((s.relists(), s.view().relists), (3, 2));
        // A malformed local node is still the local node.
        relist(&mut s, &[raw("local", &["bad"], &[])]);
        assert_eq!(s.view().relists, 3);
    }

    #[test]
    fn malformed_nodes_without_a_good_record_are_listed_by_name_and_uid() {
        let mut s = state();
        relist(
            &mut s,
            &[raw("a", &["10.0.0.1"], &[]), raw("b", &["nope"], &[])],
        );
        let v = s.view();
        assert_eq!(v.nodes.len(), 1);
        let b = MalformedNode {
            name: "b".into(),
            uid: "uid-b".into(),
        };
        assert_eq!(v.malformed, std::slice::from_ref(&b));
        assert_eq!(s.view_of(&["b".to_owned()].into()).malformed, [b]);
        // With a good record from before, the record stands and the name is not repeated.
        relist(
            &mut s,
            &[raw("a", &["10.0.0.1"], &[]), raw("b", &["10.0.0.2"], &[])],
        );
        relist(
            &mut s,
            &[raw("a", &["10.0.0.1"], &[]), raw("b", &["nope"], &[])],
        );
        assert!(s.view().malformed.is_empty());
        assert_eq!(s.view().nodes.len(), 2);
    }

    #[test]
    fn the_source_fails_until_its_next_success() {
        let mut s = state();
        relist(&mut s, &[raw("a", &["10.0.0.1"], &[])]);
        s.apply(SourceEvent::Error("forbidden (403)".into()));
        assert_eq!(s.failing(), Some("forbidden (403)"));
        s.apply(SourceEvent::Healthy);
        assert_eq!(s.failing(), None);
        s.apply(SourceEvent::Error("timed out".into()));
        s.apply(SourceEvent::Apply(raw("b", &["10.0.0.2"], &[])));
        assert_eq!(s.failing(), None);
    }

    /// kube-runtime's watcher says `Init` before it sends a list, so a list attempt that then
    /// fails must not read as a success in between: the agent would turn ready and back.
    #[test]
    fn a_list_attempt_is_no_success_until_its_list_completes() {
        let mut s = state();
        relist(&mut s, &[raw("a", &["10.0.0.1"], &[])]);
        s.apply(SourceEvent::Error("forbidden (403)".into()));
        s.apply(SourceEvent::Init);
        assert_eq!(s.failing(), Some("forbidden (403)"));
        s.apply(SourceEvent::InitApply(raw("a", &["10.0.0.1"], &[])));
        assert_eq!(
            s.failing(),
            Some("forbidden (403)"),
            "a page is no full list"
        );
        s.apply(SourceEvent::Error("forbidden (403)".into()));
        s.apply(SourceEvent::Init);
        s.apply(SourceEvent::InitApply(raw("a", &["10.0.0.1"], &[])));
        s.apply(SourceEvent::InitDone);
        assert_eq!(s.failing(), None);
    }

    #[test]
    fn errors_keep_the_view() {
        let mut s = state();
        relist(&mut s, &[raw("a", &["10.0.0.1"], &[])]);
        assert!(!s.apply(SourceEvent::Error("connection reset".into())));
        assert_eq!(s.view().nodes.len(), 1);
        assert_eq!(s.last_error(), Some("connection reset"));
    }

    #[test]
    fn a_malformed_update_keeps_the_last_good_record() {
        let mut s = state();
        relist(&mut s, &[raw("a", &["10.0.0.1"], &[])]);
        s.apply(SourceEvent::Apply(raw("a", &["not-an-ip"], &[])));
        assert_eq!(s.get("a").unwrap().addresses[0].ip.to_string(), "10.0.0.1");
        assert!(s.errors().contains_key("a"));
        relist(
            &mut s,
            &[
                raw("a", &["10.0.0.1"], &[]),
                raw("bad", &["10.0.0.300"], &[]),
            ],
        );
        assert!(s.errors().contains_key("bad") && !s.errors().contains_key("a"));
        assert!(s.get("bad").is_none(), "a node never seen valid is skipped");
    }

    /// A malformed record under the name of a node with another UID is another node: the
    /// good record of the first is not kept for it, by a relist or by a watch event.
    #[test]
    fn a_malformed_successor_under_the_name_does_not_keep_the_old_nodes_record() {
        let successor = RawNode {
            uid: "uid-a-2".into(),
            ..raw("a", &["not-an-ip"], &[])
        };
        let mut s = state();
        relist(&mut s, &[raw("a", &["10.0.0.1"], &[])]);
        relist(&mut s, std::slice::from_ref(&successor));
        assert!(s.get("a").is_none(), "relisted: {:?}", s.get("a"));
        assert_eq!(s.errors()["a"].uid, "uid-a-2");
        relist(&mut s, &[raw("a", &["10.0.0.1"], &[])]);
        s.apply(SourceEvent::Apply(successor));
        assert!(s.get("a").is_none(), "watched: {:?}", s.get("a"));
    }

    #[test]
    fn apply_and_delete_between_relists() {
        let mut s = state();
        relist(&mut s, &[]);
        assert!(s.apply(SourceEvent::Apply(raw("a", &["10.0.0.1"], &[]))));
        assert!(!s.apply(SourceEvent::Apply(raw("a", &["10.0.0.1"], &[]))));
        assert!(s.apply(SourceEvent::Delete("a".into())));
        assert!(s.view().nodes.is_empty());
    }
}

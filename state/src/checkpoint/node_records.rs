//! The record's live nodes, in name order.
//!
//! They sit in a B-tree of name groups, so that an event (a node added, removed or readdressed)
//! writes its own records and nothing else, at any size of cluster: a sorted list moved every
//! record after the one added or removed, a cost that grew with the cluster. Iteration is in name order, as the checkpoint's encoding and the planner's
//! merge of records and pending deletes need.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::collections::BTreeSet;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smallvec::SmallVec;

use crate::node::Node;

/// The records of one name, in the order they were put in; never empty. Usually one: several
/// only in a record written that way (the encoding allows it, and the planner reads it).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Group(SmallVec<[Node; 1]>);

impl Group {
    fn name(&self) -> &str {
        &self.0[0].name
    }
}

/// By name only: a set holds one group per name, so two groups that compare equal here are
/// never both in one.
impl Ord for Group {
    fn cmp(&self, other: &Self) -> Ordering {
        self.name().cmp(other.name())
    }
}

impl PartialOrd for Group {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Borrow<str> for Group {
    fn borrow(&self) -> &str {
        self.name()
    }
}

/// The record's live nodes by name: each change costs the records it touches and a B-tree
/// path (`O(log n)`), never a move of the others.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeRecords {
    groups: BTreeSet<Group>,
    len: usize,
}

impl NodeRecords {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every record, in name order (those of one name in the order they were put in).
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Node> + Clone {
        self.groups.iter().flat_map(|g| g.0.iter())
    }

    /// The records named `name`.
    pub fn named(&self, name: &str) -> &[Node] {
        self.groups.get(name).map_or(&[], |g| &g.0[..])
    }

    pub fn contains(&self, node: &Node) -> bool {
        self.named(&node.name).contains(node)
    }

    /// Puts `nodes`, all named `name`, in place of the records of `name` (none takes them out).
    /// Returns the records taken out and put in: the work the change cost, which does not grow
    /// with the rest of the record.
    pub fn replace(&mut self, name: &str, nodes: impl IntoIterator<Item = Node>) -> usize {
        let old = self.take(name).len();
        let new: SmallVec<[Node; 1]> = nodes.into_iter().collect();
        debug_assert!(new.iter().all(|n| n.name == name), "records of one name");
        let put = new.len();
        if put > 0 {
            self.len += put;
            self.groups.insert(Group(new));
        }
        old + put
    }

    /// Takes the records of `name` out.
    pub fn take(&mut self, name: &str) -> SmallVec<[Node; 1]> {
        let taken = self.groups.take(name).map(|g| g.0).unwrap_or_default();
        self.len -= taken.len();
        taken
    }

    /// Adds `node` after the records of its name.
    pub fn push(&mut self, node: Node) {
        let mut group = self.take(&node.name);
        group.push(node);
        self.len += group.len();
        self.groups.insert(Group(group));
    }

    /// Keeps the records `keep` says to.
    pub fn retain(&mut self, mut keep: impl FnMut(&Node) -> bool) {
        let groups = std::mem::take(&mut self.groups);
        *self = groups
            .into_iter()
            .flat_map(|g| g.0)
            .filter(|n| keep(n))
            .collect();
    }
}

impl FromIterator<Node> for NodeRecords {
    /// In name order, the records of one name in the order given (a stable sort).
    fn from_iter<I: IntoIterator<Item = Node>>(nodes: I) -> Self {
        let mut nodes: Vec<Node> = nodes.into_iter().collect();
        // Plans and checkpoints come in name order: checked in one pass, not sorted again.
        if !nodes.is_sorted_by(|a, b| a.name <= b.name) {
            nodes.sort_by(|a, b| a.name.cmp(&b.name));
        }
        let len = nodes.len();
        let mut groups: Vec<Group> = Vec::with_capacity(len);
        for n in nodes {
            match groups.last_mut() {
                Some(g) if g.name() == n.name => g.0.push(n),
                _ => groups.push(Group(smallvec::smallvec![n])),
            }
        }
        // Already in order: the set is built in one pass.
        let groups = groups.into_iter().collect();
        Self { groups, len }
    }
}

impl From<Vec<Node>> for NodeRecords {
    fn from(nodes: Vec<Node>) -> Self {
        nodes.into_iter().collect()
    }
}

impl<const N: usize> From<[Node; N]> for NodeRecords {
    fn from(nodes: [Node; N]) -> Self {
        nodes.into_iter().collect()
    }
}

impl Extend<Node> for NodeRecords {
    fn extend<I: IntoIterator<Item = Node>>(&mut self, nodes: I) {
        for n in nodes {
            self.push(n);
        }
    }
}

impl<'a> IntoIterator for &'a NodeRecords {
    type Item = &'a Node;
    type IntoIter = Box<dyn DoubleEndedIterator<Item = &'a Node> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl IntoIterator for NodeRecords {
    type Item = Node;
    type IntoIter = Box<dyn DoubleEndedIterator<Item = Node>>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.groups.into_iter().flat_map(|g| g.0))
    }
}

impl<const N: usize> PartialEq<[Node; N]> for NodeRecords {
    fn eq(&self, other: &[Node; N]) -> bool {
        self.len == N && self.iter().eq(other.iter())
    }
}

impl PartialEq<Vec<Node>> for NodeRecords {
    fn eq(&self, other: &Vec<Node>) -> bool {
        self.len == other.len() && self.iter().eq(other.iter())
    }
}

impl Serialize for NodeRecords {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for NodeRecords {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<Node>::deserialize(d).map(Self::from)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::node::RawNode;

    fn named(name: String, uid: u16) -> Node {
        Node::from_raw(RawNode {
            name,
            uid: format!("uid-{uid}"),
            addresses: vec![("InternalIP".into(), "10.0.0.1".into())],
            pod_cidrs: Vec::new(),
            boot_id: String::new(),
        })
        .expect("a valid node")
    }

    proptest! {
        /// Whatever the changes, the records are those of a sorted list changed the same way,
        /// in the same order, and each change costs only the records of its name.
        #[test]
        fn changes_leave_what_a_sorted_list_would_and_cost_only_their_names(
            record in proptest::collection::vec((0u16..200, 0u16..3), 0..80),
            changes in proptest::collection::vec((0u16..200, 0usize..3), 0..40),
        ) {
            let name = |k: u16| format!("node-{k:03}");
            let mut list: Vec<Node> = record.iter().map(|&(k, u)| named(name(k), u)).collect();
            list.sort_by(|a, b| a.name.cmp(&b.name));
            let mut records: NodeRecords = list.clone().into();
            for (step, &(k, count)) in changes.iter().enumerate() {
                let new: Vec<Node> = (0..count).map(|u| named(name(k), u as u16 + step as u16)).collect();
                let before = list.iter().filter(|n| n.name == name(k)).count();
                let at = list.partition_point(|n| n.name < name(k));
                list.retain(|n| n.name != name(k));
                list.splice(at..at, new.iter().cloned());
                prop_assert_eq!(records.replace(&name(k), new), before + count);
                prop_assert_eq!(&records, &list);
                prop_assert_eq!(records.len(), list.len());
            }
        }
    }
}

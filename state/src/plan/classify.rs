//! Step 2: live nodes, paired with their records, and what each one is.

use std::cmp::Ordering;

use super::nodes::{HeldWhy, Live, LiveClass, Record};
use super::problem::{InputError, InputProblem, err};
use super::view::{LiveView, MalformedNode};
use crate::node::Node;

/// Whether a record and a live node of the same name are the same node. A node deleted and
/// created again under its name has a new UID: its record is a removal (the brake counts it) and
/// the live node is new. Without a UID on either side (a hand-written NodeList) the name decides.
fn same_node(record: &Node, live_uid: &str) -> bool {
    record.uid.is_empty() || live_uid.is_empty() || record.uid == live_uid
}

/// The live view's remote nodes in name order, the valid ones and the malformed ones apart:
/// sorted on their own, so that a plan can sort them while it collects its records.
pub(super) struct Sorted<'a> {
    valid: Vec<&'a Node>,
    malformed: Vec<&'a MalformedNode>,
}

/// [`Sorted`] of `view`, the local node left out.
pub(super) fn sort<'a>(view: &'a LiveView, local: &str) -> Sorted<'a> {
    let mut valid: Vec<&Node> = view
        .nodes
        .iter()
        .map(|n| &**n)
        .filter(|n| n.name != local)
        .collect();
    // Stable: a repeated name follows the first entry with it, which wins.
    valid.sort_by(|a, b| a.name.cmp(&b.name));
    let mut malformed: Vec<&MalformedNode> =
        view.malformed.iter().filter(|m| m.name != local).collect();
    // Stable, as above: of a repeated name, the first entry stands.
    malformed.sort_by(|a, b| a.name.cmp(&b.name));
    malformed.dedup_by(|later, first| later.name == first.name);
    Sorted { valid, malformed }
}

/// The live nodes in name order, the local node and repeated names excluded (each reported),
/// paired with their records; `records[r].live` is set for every pair.
pub(super) fn classify<'a>(
    sorted: Sorted<'a>,
    records: &mut [Record<'a>],
    errors: &mut Vec<InputError>,
) -> Vec<Live<'a>> {
    let Sorted { valid, malformed } = sorted;
    let mut live: Vec<Live<'a>> = Vec::with_capacity(valid.len() + malformed.len());
    let (mut v, mut m, mut r) = (0, 0, 0);
    loop {
        // The next name in order: a valid node, else a malformed one.
        let next = match (valid.get(v), malformed.get(m)) {
            (None, None) => break,
            (Some(n), Some(bad)) if bad.name.cmp(&n.name) == Ordering::Less => Err(*bad),
            (Some(n), _) => Ok(*n),
            (None, Some(bad)) => Err(*bad),
        };
        let name = match next {
            Ok(n) => n.name.as_str(),
            Err(bad) => bad.name.as_str(),
        };
        while r < records.len() && records[r].node.name.as_str() < name {
            r += 1;
        }
        // The records of this name (several when a node was replaced under its name).
        let named = r..records[r..]
            .iter()
            .position(|x| x.node.name != name)
            .map_or(records.len(), |k| r + k);
        match next {
            Ok(n) => {
                v += 1;
                if live.last().is_some_and(|l| l.node.name == n.name) {
                    err(errors, &n.name, InputProblem::DuplicateName);
                    continue;
                }
                // A malformed entry of a name that also has a valid record is that record's.
                while malformed.get(m).is_some_and(|bad| bad.name == n.name) {
                    m += 1;
                }
                let record = named.clone().find(|&r| same_node(records[r].node, &n.uid));
                let class = if n.addresses.is_empty() {
                    LiveClass::Held(HeldWhy::Registering)
                } else {
                    LiveClass::Candidate
                };
                push(&mut live, records, n, record, class);
            }
            Err(bad) => {
                m += 1;
                // Without a record of this node there is nothing to keep; the source reports
                // the error. Without a UID to match, the newest record of the name stands in (a
                // live record sorts before a pending delete of the same name).
                if let Some(r) = named
                    .clone()
                    .find(|&r| same_node(records[r].node, &bad.uid))
                {
                    let node = records[r].node;
                    push(
                        &mut live,
                        records,
                        node,
                        Some(r),
                        LiveClass::Held(HeldWhy::Malformed),
                    );
                }
            }
        }
    }
    live
}

fn push<'a>(
    live: &mut Vec<Live<'a>>,
    records: &mut [Record<'a>],
    node: &'a Node,
    record: Option<usize>,
    class: LiveClass,
) {
    if let Some(r) = record {
        records[r].live = Some(live.len());
    }
    live.push(Live {
        node,
        record,
        class,
    });
}

#[cfg(test)]
mod tests;

//! A YAML NodeList read one item at a time.
//!
//! The YAML parser works on whole documents: it turns the entire text into events before the
//! first value is built, and a 65,000-node `kubectl get nodes -o yaml` came to 570 MiB that way.
//! But a list as kubectl (or anyone) writes it in block style has a shape that can be cut
//! without parsing: a top-level `items:` key, then one `- ` line per item at one indentation,
//! each item's lines indented past it. [`split`] reads the file line by line, parses each item
//! on its own as it ends, and keeps only the nodes and the small rest of the document (which
//! is parsed at the end, for `kind`). What it does not recognise, or cannot parse, it leaves to
//! the whole-document parser, which reports errors with their line and column.

use std::io::{self, BufRead};

use k8s_openapi::api::core::v1::Node;
use state::node::RawNode;

use super::node_object::raw_node;

/// What [`split`] made of a document: the nodes of its block-style `items` (`None` if it has
/// no such key: then the rest is the whole document), and the rest of the document's text.
pub struct Split {
    pub items: Option<Vec<RawNode>>,
    pub rest: String,
}

/// Where the reading is.
enum At {
    /// Before the top-level `items:`.
    Head,
    /// Inside the items: the column of their dashes once the first is seen.
    Items { dash: Option<usize> },
    /// After the items.
    Tail,
}

/// Reads a YAML NodeList from `reader`, parsing its block-style items one at a time; `None`
/// when the document is not of that shape or an item does not parse (the caller parses the
/// whole document then).
pub fn split(reader: impl BufRead) -> io::Result<Option<Split>> {
    let mut nodes = Vec::new();
    let mut rest = String::new();
    let mut at = At::Head;
    let mut item = String::new();
    for line in reader.lines() {
        let line = line?;
        if line == "---" || line == "..." || line.starts_with('\t') {
            return Ok(None);
        }
        let At::Items { dash } = &mut at else {
            if matches!(at, At::Head) && is_items_key(&line) {
                at = At::Items { dash: None };
            } else {
                rest.push_str(&line);
                rest.push('\n');
            }
            continue;
        };
        let indent = line.len() - line.trim_start_matches(' ').len();
        let content = &line[indent..];
        if content.is_empty() {
            // Kept: it may be inside a block scalar.
            item.push('\n');
            continue;
        }
        if content.starts_with('#') && dash.is_none_or(|d| indent < d + 2) {
            // A comment outside any item's content.
            continue;
        }
        let starts_item = content == "-" || content.starts_with("- ");
        let d = match *dash {
            None if starts_item => *dash.insert(indent),
            None => return Ok(None),
            Some(d) => d,
        };
        if indent == d && starts_item {
            if !take(&mut item, &mut nodes) {
                return Ok(None);
            }
            // The dash becomes a space: the item is a mapping two columns past the dash.
            item.push(' ');
            item.push_str(&line[d + 1..]);
        } else if indent >= d + 2 {
            item.push_str(&line[d..]);
        } else if indent <= d {
            // Back at the dashes' column or left of it: the document goes on past the items.
            if !take(&mut item, &mut nodes) {
                return Ok(None);
            }
            at = At::Tail;
            rest.push_str(&line);
            rest.push('\n');
            continue;
        } else {
            return Ok(None);
        }
        item.push('\n');
    }
    if !take(&mut item, &mut nodes) {
        return Ok(None);
    }
    let items = (!matches!(at, At::Head)).then_some(nodes);
    Ok(Some(Split { items, rest }))
}

/// `items:` at the top level, with nothing after it but a comment.
fn is_items_key(line: &str) -> bool {
    line.strip_prefix("items:")
        .is_some_and(|rest| rest.trim().is_empty() || rest.trim_start().starts_with('#'))
}

/// Parses the item gathered so far (if any) into `nodes`; false if it does not parse.
fn take(item: &mut String, nodes: &mut Vec<RawNode>) -> bool {
    if item.trim().is_empty() {
        item.clear();
        return true;
    }
    let parsed = serde_yaml::from_str::<Node>(item);
    item.clear();
    match parsed {
        Ok(node) => {
            nodes.push(raw_node(&node));
            true
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(text: &str) -> Vec<RawNode> {
        #[derive(serde::Deserialize)]
        struct Doc {
            items: Vec<Node>,
        }
        let doc: Doc = serde_yaml::from_str(text).unwrap();
        doc.items.iter().map(raw_node).collect()
    }

    fn cut(text: &str) -> Option<Split> {
        split(text.as_bytes()).unwrap()
    }

    const KUBECTL: &str = "\
apiVersion: v1
items:
- apiVersion: v1
  kind: Node
  metadata:
    name: n1
    uid: u1
  spec:
    podCIDRs:
    - 10.244.1.0/24
    - fd00:244:1::/64
  status:
    addresses:
    - address: 10.0.0.1
      type: InternalIP
# a comment at the left margin, and a blank line

-
  metadata:
    name: n2
    uid: |-
      multi

      line
  status:
    addresses: [{type: InternalIP, address: 10.0.0.2}]
kind: List
metadata:
  resourceVersion: \"\"
";

    #[test]
    fn a_block_list_is_cut_into_its_items_and_reads_as_the_whole_document_does() {
        let s = cut(KUBECTL).expect("the kubectl shape");
        let nodes = s.items.expect("block items");
        assert_eq!(nodes, whole(KUBECTL));
        assert_eq!(nodes.len(), 2);
        assert_eq!(
            nodes[1].uid, "multi\n\nline",
            "a blank line in a block scalar stays"
        );
        assert!(
            s.rest.contains("kind: List") && !s.rest.contains("n1"),
            "{}",
            s.rest
        );
        // The same list with its items indented under the key.
        let (head, tail) = KUBECTL.split_once("kind: List").unwrap();
        let (head, items) = head.split_once("items:\n").unwrap();
        let items: Vec<String> = items.lines().map(|l| format!("  {l}")).collect();
        let indented = format!("{head}items:\n{}\nkind: List{tail}", items.join("\n"));
        let s = cut(&indented).expect("indented items");
        assert_eq!(s.items.unwrap(), whole(&indented));
    }

    #[test]
    fn what_is_not_a_block_list_is_left_to_the_whole_document_parser() {
        // Flow items stay in the rest, parsed with it.
        let flow = "kind: List\nitems: [{metadata: {name: n1}}]\n";
        assert!(cut(flow).unwrap().items.is_none());
        assert_eq!(cut(flow).unwrap().rest, flow);
        for text in [
            "items:\n- metadata: {name: [\n",
            "items:\n  metadata: {}\n",
            "items:\n- metadata: {name: a}\n---\nitems: []\n",
        ] {
            assert!(cut(text).is_none(), "{text}");
        }
    }
}

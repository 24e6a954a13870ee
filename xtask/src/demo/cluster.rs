//! The demo's cluster: the nodes of `examples/nodes.yaml` as the sandbox builds them, the one
//! that restarts, the ones that go away, and the NodeList without them.

/// A node of `examples/nodes.yaml`, as the sandbox builds it (a unit test holds the two to each
/// other).
pub(super) struct Node {
    pub(super) name: &'static str,
    pub(super) ip4: &'static str,
    pub(super) ip6: Option<&'static str>,
    pub(super) pod_cidr: &'static str,
    /// The namespace of the node's one pod.
    pub(super) pod: &'static str,
}

pub(super) const NODES: [Node; 5] = [
    Node {
        name: "demo-local",
        ip4: "192.168.50.1",
        ip6: Some("fd00:50::1"),
        pod_cidr: "10.244.0.0/24",
        pod: "pod-local",
    },
    Node {
        name: "worker-a",
        ip4: "192.168.50.11",
        ip6: Some("fd00:50::11"),
        pod_cidr: "10.244.1.0/24",
        pod: "pod-a",
    },
    Node {
        name: "worker-b",
        ip4: "192.168.50.12",
        ip6: Some("fd00:50::12"),
        pod_cidr: "10.244.2.0/24",
        pod: "pod-b",
    },
    Node {
        name: "worker-c",
        ip4: "192.168.50.13",
        ip6: None,
        pod_cidr: "10.244.3.0/24",
        pod: "pod-c",
    },
    Node {
        name: "worker-d",
        ip4: "192.168.50.14",
        ip6: None,
        pod_cidr: "10.244.4.0/24",
        pod: "pod-d",
    },
];

/// The node whose agent restarts: index into [`NODES`].
pub(super) const LOCAL: usize = 0;

/// The nodes that go away while the local agent is down, in the second act: two of four remote
/// nodes, which the brake's default `--max-prune-ratio` of 0.5 lets through.
pub(super) const GONE: [&str; 2] = ["worker-b", "worker-d"];

pub(super) fn gone() -> Vec<usize> {
    (0..NODES.len())
        .filter(|&i| GONE.contains(&NODES[i].name))
        .collect()
}

/// The NodeList without the items named in `gone`: items are the blocks that start with `- `.
pub(super) fn drop_nodes(text: &str, gone: &[&str]) -> String {
    let mut blocks: Vec<String> = vec![String::new()];
    for line in text.lines() {
        if line.starts_with("- ") {
            blocks.push(String::new());
        }
        let last = blocks.last_mut().expect("one block at least");
        last.push_str(line);
        last.push('\n');
    }
    blocks
        .into_iter()
        .filter(|b| !gone.iter().any(|g| b.contains(&format!("{{name: {g},"))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::root;

    #[test]
    fn dropping_nodes_keeps_the_others_intact() {
        let text = std::fs::read_to_string(root().join("examples/nodes.yaml")).unwrap();
        let left = drop_nodes(&text, &GONE);
        assert!(
            !left.contains("worker-b") && !left.contains("worker-d"),
            "{left}"
        );
        for kept in ["demo-local", "worker-a", "worker-c", "192.168.50.13"] {
            assert!(left.contains(kept), "{kept} lost:\n{left}");
        }
        assert_eq!(left.matches("- apiVersion: v1").count(), 3);
    }

    /// The sandbox builds the nodes the example file lists, with their addresses and CIDRs.
    #[test]
    fn the_sandbox_nodes_are_the_example_files() {
        let text = std::fs::read_to_string(root().join("examples/nodes.yaml")).unwrap();
        assert_eq!(text.matches("kind: Node").count(), NODES.len());
        for n in &NODES {
            let block = drop_nodes(
                &text,
                &NODES
                    .iter()
                    .map(|x| x.name)
                    .filter(|x| *x != n.name)
                    .collect::<Vec<_>>(),
            );
            assert!(
                block.contains(&format!("{{name: {},", n.name)),
                "{}",
                n.name
            );
            assert!(
                block.contains(&format!("podCIDR: {},", n.pod_cidr)),
                "{block}"
            );
            assert!(block.contains(&format!("address: {}}}", n.ip4)), "{block}");
            match n.ip6 {
                Some(ip6) => assert!(block.contains(&format!("address: \"{ip6}\"")), "{block}"),
                None => assert!(!block.contains("fd00:50"), "{block}"),
            }
        }
    }
}

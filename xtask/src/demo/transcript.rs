//! What the demo printed, kept by name for `cargo xtask docs`.

/// The named parts of what the demo printed, in order: `cargo xtask docs` puts them in the
/// docs' recorded outputs. Every part's name is in [`PARTS`].
#[derive(Debug, Default)]
pub struct Transcript {
    parts: Vec<(&'static str, String)>,
    /// Scripts run on the local node for the docs, and what they printed.
    pub(super) on_node: Vec<(OnNode, String)>,
}

/// Commands to run on the local node as in the agent's pod, against the cluster's node list
/// less some nodes (what the agent would see if they went away).
#[derive(Clone, Debug, PartialEq)]
pub struct OnNode {
    /// Shell commands, one per line.
    pub commands: String,
    /// Nodes of `examples/nodes.yaml` left out of the list the commands see.
    pub without: Vec<String>,
}

/// Every part the demo records, in the order it prints them.
pub const PARTS: &[&str] = &[
    "nodes",
    "pods",
    "first-start-log",
    "bpftool-dump",
    "programmed",
    "pings",
    "stop-log",
    "still-routed",
    "plan",
    "run-once",
    "clean-result",
    "pings-after",
    "drift-log",
    "hold-status",
    "hold-wrong",
    "hold-confirmed",
    "hold-log",
    "teardown",
];

impl Transcript {
    /// What the demo printed under `part`, if it printed anything.
    pub fn part(&self, part: &str) -> Option<&str> {
        self.parts
            .iter()
            .find(|(p, _)| *p == part)
            .map(|(_, t)| t.as_str())
    }

    /// What `script`, given to [`run`], printed on the local node.
    pub fn on_node(&self, script: &OnNode) -> Option<&str> {
        self.on_node
            .iter()
            .find(|(s, _)| s == script)
            .map(|(_, t)| t.as_str())
    }

    /// Prints `text` and keeps it under `part`.
    pub(super) fn say(&mut self, part: &'static str, text: &str) {
        debug_assert!(PARTS.contains(&part), "{part} is not in PARTS");
        let mut text = text.to_owned();
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        print!("{text}");
        match self.parts.iter_mut().find(|(p, _)| *p == part) {
            Some((_, t)) => t.push_str(&text),
            None => self.parts.push((part, text)),
        }
    }
}

//! The NodeList file source (`--nodes-file`): the embedded default for running without a
//! cluster, and what the demo and the end-to-end tests drive.
//!
//! The file holds a Kubernetes NodeList in YAML or JSON, such as `kubectl get nodes -o yaml`.
//! It is polled: a change of size, mtime or inode triggers a parse, and so does every relist
//! interval even without a change (a fresh full list is what lets a held brake go ahead). Each
//! successful parse is a full relist. A parse error keeps the last good view and is reported with
//! its line and column; it never reads as "no nodes". A missing file means "not synced yet".

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use serde::Deserialize;
use state::node::RawNode;
use tokio::sync::mpsc;

use super::node_object::raw_node;
use super::{SourceEvent, SourceRequest};

/// Why the file could not be read as a NodeList.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}:{column}: {message}")]
    Syntax {
        path: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
}

/// `kubectl get nodes -o yaml` writes `kind: List`; the API server's own is `NodeList`.
#[derive(Deserialize)]
struct NodeListDoc {
    #[serde(default)]
    kind: Option<String>,
    items: Vec<Node>,
}

/// Parses a NodeList document (JSON if it starts with `{`, YAML otherwise).
pub fn parse(path: &Path, text: &str) -> Result<Vec<RawNode>, ParseError> {
    let syntax = |line, column, message: String| ParseError::Syntax {
        path: path.to_owned(),
        line,
        column,
        message,
    };
    let doc: NodeListDoc = if text.trim_start().starts_with('{') {
        serde_json::from_str(text).map_err(|e| syntax(e.line(), e.column(), e.to_string()))?
    } else {
        serde_yaml::from_str(text).map_err(|e| {
            let (line, column) = e.location().map_or((0, 0), |l| (l.line(), l.column()));
            syntax(line, column, e.to_string())
        })?
    };
    if let Some(kind) = doc.kind.as_deref()
        && kind != "List"
        && kind != "NodeList"
    {
        return Err(syntax(
            1,
            1,
            format!("kind is {kind:?}, expected NodeList or List"),
        ));
    }
    Ok(doc.items.iter().map(raw_node).collect())
}

/// What identifies one version of the file without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Signature {
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

fn signature(path: &Path) -> Option<Signature> {
    let m = std::fs::metadata(path).ok()?;
    Some(Signature {
        ino: m.ino(),
        len: m.len(),
        mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
    })
}

/// Polls a NodeList file and sends its full lists.
pub struct FileSource {
    pub path: PathBuf,
    /// How often the file's metadata is checked.
    pub poll: Duration,
    /// How often the file is re-read and re-sent even when unchanged.
    pub relist: Duration,
}

impl FileSource {
    /// Runs until the receiver is dropped. A [`SourceRequest::Relist`] re-reads the file at
    /// once.
    pub async fn run(
        self,
        tx: mpsc::Sender<SourceEvent>,
        mut requests: mpsc::Receiver<SourceRequest>,
    ) {
        let mut last: Option<Signature> = None;
        let mut last_read = Instant::now();
        let mut missing_logged = false;
        let mut asked = false;
        let mut requests_open = true;
        loop {
            let sig = signature(&self.path);
            let due = asked || last_read.elapsed() >= self.relist;
            asked = false;
            match sig {
                None => {
                    if !missing_logged {
                        tracing::warn!(path = %self.path.display(), "nodes file not found; not synced until it appears");
                        missing_logged = true;
                    }
                }
                Some(sig) if Some(sig) != last || due => {
                    missing_logged = false;
                    last = Some(sig);
                    last_read = Instant::now();
                    for ev in self.read() {
                        if tx.send(ev).await.is_err() {
                            return;
                        }
                    }
                }
                Some(_) => {}
            }
            tokio::select! {
                () = tokio::time::sleep(self.poll) => {}
                req = requests.recv(), if requests_open => match req {
                    Some(SourceRequest::Relist) => asked = true,
                    None => requests_open = false,
                },
            }
        }
    }

    /// One read of the file: a full list, or the error.
    fn read(&self) -> Vec<SourceEvent> {
        let parsed = match std::fs::read_to_string(&self.path) {
            Ok(text) => parse(&self.path, &text),
            Err(source) => Err(ParseError::Read {
                path: self.path.clone(),
                source,
            }),
        };
        match parsed {
            Ok(nodes) => std::iter::once(SourceEvent::Init)
                .chain(nodes.into_iter().map(SourceEvent::InitApply))
                .chain(std::iter::once(SourceEvent::InitDone))
                .collect(),
            Err(e) => {
                tracing::error!("nodes file unusable, keeping the last good view: {e}");
                vec![SourceEvent::Error(e.to_string())]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Node\n  metadata: {name: n1}\n  status:\n    addresses: [{type: InternalIP, address: 10.0.0.1}]\n";

    #[test]
    fn parses_kubectl_yaml_and_json() {
        let p = Path::new("nodes.yaml");
        assert_eq!(parse(p, YAML).unwrap()[0].name, "n1");
        let json = r#"{"apiVersion":"v1","kind":"NodeList","items":[{"apiVersion":"v1","kind":"Node","metadata":{"name":"n2"}}]}"#;
        assert_eq!(parse(p, json).unwrap()[0].name, "n2");
    }

    #[test]
    fn syntax_errors_carry_line_and_column() {
        let p = Path::new("nodes.yaml");
        let err = parse(p, "apiVersion: v1\nitems:\n- metadata: {name: [\n").unwrap_err();
        let ParseError::Syntax { line, .. } = &err else {
            panic!("{err}")
        };
        assert!(*line >= 3, "{err}");
        assert!(err.to_string().starts_with("nodes.yaml:"), "{err}");
        let err = parse(p, "{\"items\": [1,]}").unwrap_err();
        assert!(err.to_string().starts_with("nodes.yaml:1:"), "{err}");
    }

    #[test]
    fn other_kinds_are_refused() {
        let err = parse(Path::new("f"), "kind: PodList\nitems: []\n").unwrap_err();
        assert!(err.to_string().contains("PodList"), "{err}");
    }
}

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
use super::yaml_items;
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
    #[serde(deserialize_with = "raw_items")]
    items: Vec<RawNode>,
}

/// The items, each turned into a [`RawNode`] as soon as it is parsed and its Node object
/// dropped: a real Node carries managed fields, images and conditions, many times the size of
/// what the agent keeps, and 65,000 of them at once would not fit the agent's memory budget.
fn raw_items<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<RawNode>, D::Error> {
    struct Items;
    impl<'de> serde::de::Visitor<'de> for Items {
        type Value = Vec<RawNode>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a list of Nodes")
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Vec<RawNode>, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
            while let Some(node) = seq.next_element::<Node>()? {
                out.push(raw_node(&node));
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Items)
}

impl NodeListDoc {
    fn into_nodes(self, path: &Path) -> Result<Vec<RawNode>, ParseError> {
        match self.kind.as_deref() {
            Some(kind) if kind != "List" && kind != "NodeList" => Err(ParseError::Syntax {
                path: path.to_owned(),
                line: 1,
                column: 1,
                message: format!("kind is {kind:?}, expected NodeList or List"),
            }),
            _ => Ok(self.items),
        }
    }
}

fn syntax(path: &Path, line: usize, column: usize, message: String) -> ParseError {
    ParseError::Syntax {
        path: path.to_owned(),
        line,
        column,
        message,
    }
}

fn parse_yaml(path: &Path, text: &str) -> Result<NodeListDoc, ParseError> {
    serde_yaml::from_str(text).map_err(|e| {
        let (line, column) = e.location().map_or((0, 0), |l| (l.line(), l.column()));
        syntax(path, line, column, e.to_string())
    })
}

/// Reads and parses the NodeList file at `path` (JSON if it starts with `{`, YAML otherwise).
/// Neither is held whole (`kubectl get nodes -o json` of a large cluster runs to hundreds of
/// megabytes): JSON is parsed as it is read; YAML in block style is cut into its items, each
/// parsed on its own ([`yaml_items`]), and only another shape is parsed as a whole document.
pub fn parse_file(path: &Path) -> Result<Vec<RawNode>, ParseError> {
    use std::io::{BufRead, Read};
    let read = |source| ParseError::Read {
        path: path.to_owned(),
        source,
    };
    let mut file = std::io::BufReader::new(std::fs::File::open(path).map_err(read)?);
    let json = file
        .fill_buf()
        .map_err(read)?
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        == Some(&b'{');
    if json {
        let doc: NodeListDoc = serde_json::from_reader(file)
            .map_err(|e| syntax(path, e.line(), e.column(), e.to_string()))?;
        return doc.into_nodes(path);
    }
    if let Some(doc) = yaml_items::split(file)
        .map_err(read)?
        .and_then(|s| s.into_doc())
    {
        return doc.into_nodes(path);
    }
    // Not a block list, or something in it does not parse: the whole document, whose parser
    // says where.
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_string(&mut text))
        .map_err(read)?;
    parse_yaml(path, &text)?.into_nodes(path)
}

impl yaml_items::Split {
    /// The document this split came from; `None` if its rest does not parse.
    fn into_doc(self) -> Option<NodeListDoc> {
        match self.items {
            Some(items) => {
                #[derive(Deserialize)]
                struct Rest {
                    #[serde(default)]
                    kind: Option<String>,
                }
                let rest: Rest = serde_yaml::from_str(&self.rest).ok()?;
                Some(NodeListDoc {
                    kind: rest.kind,
                    items,
                })
            }
            None => serde_yaml::from_str(&self.rest).ok(),
        }
    }
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
                    // A file written while it was read (`kubectl ... > nodes.yaml` writes in
                    // chunks, and a prefix of a YAML list is a shorter list) is read again at
                    // the next poll, never taken as the list.
                    if let Some(events) = self.read_unchanged(sig).await {
                        last = Some(sig);
                        last_read = Instant::now();
                        for ev in events {
                            if tx.send(ev).await.is_err() {
                                return;
                            }
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

    /// One read of the file, off the async threads (a large list takes a while to parse): a
    /// full list, or the error.
    /// [`Self::read`], if the file still has signature `sig` once read: `None` if it changed
    /// meanwhile.
    async fn read_unchanged(&self, sig: Signature) -> Option<Vec<SourceEvent>> {
        let events = self.read().await;
        if signature(&self.path) == Some(sig) {
            Some(events)
        } else {
            tracing::debug!(path = %self.path.display(), "nodes file changed while read; reading it again");
            None
        }
    }

    async fn read(&self) -> Vec<SourceEvent> {
        let path = self.path.clone();
        let parsed = tokio::task::spawn_blocking(move || parse_file(&path))
            .await
            .unwrap_or_else(|e| {
                Err(ParseError::Read {
                    path: self.path.clone(),
                    source: std::io::Error::other(e),
                })
            });
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

    /// Parses `text` as the file `nodes.yaml` would be.
    fn parse(text: &str) -> Result<Vec<RawNode>, ParseError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nodes.yaml");
        std::fs::write(&path, text).unwrap();
        parse_file(&path).map_err(|e| match e {
            ParseError::Syntax {
                line,
                column,
                message,
                ..
            } => syntax(Path::new("nodes.yaml"), line, column, message),
            e => e,
        })
    }

    const YAML: &str = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Node\n  metadata: {name: n1}\n  status:\n    addresses: [{type: InternalIP, address: 10.0.0.1}]\n";

    /// A file that changed while it was read is not taken as the list: a YAML list caught
    /// A file that does not parse fails the source; the source's own poll finds it fixed and
    /// ends the failure with a full list: nothing else has to happen.
    #[tokio::test(flavor = "current_thread")]
    async fn a_broken_file_fails_the_source_until_its_own_poll_reads_it_fixed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nodes.yaml");
        std::fs::write(&path, "items: [").unwrap();
        let source = FileSource {
            path: path.clone(),
            poll: Duration::from_millis(10),
            relist: Duration::from_secs(60),
        };
        let (tx, mut rx) = mpsc::channel(64);
        let (_requests, requests_rx) = mpsc::channel(1);
        let task = tokio::spawn(source.run(tx, requests_rx));
        let mut live = super::super::live::LiveState::new("n1");
        let mut next = async || {
            let ev = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .expect("an event within 10 s")
                .unwrap();
            live.apply(ev.clone());
            (ev, live.failing().map(str::to_owned))
        };
        let (ev, failing) = next().await;
        assert!(matches!(ev, SourceEvent::Error(_)), "{ev:?}");
        assert!(failing.is_some());
        std::fs::write(&path, YAML).unwrap();
        loop {
            let (ev, failing) = next().await;
            if ev == SourceEvent::InitDone {
                assert_eq!(failing, None);
                break;
            }
            assert!(failing.is_some(), "still failing on {ev:?}");
        }
        task.abort();
    }

    /// half-written is a shorter list, and its missing nodes would have been pruned.
    #[tokio::test(flavor = "current_thread")]
    async fn a_file_changed_while_read_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nodes.yaml");
        // The first chunk of a longer list, as the writer's first write left it.
        std::fs::write(&path, YAML).unwrap();
        let half = signature(&path).unwrap();
        let two = format!(
            "{YAML}- apiVersion: v1\n  kind: Node\n  metadata: {{name: n2}}\n  status:\n    addresses: [{{type: InternalIP, address: 10.0.0.2}}]\n"
        );
        // The rest lands while the first chunk is read.
        std::fs::write(&path, &two).unwrap();
        let source = FileSource {
            path: path.clone(),
            poll: Duration::from_millis(10),
            relist: Duration::from_secs(60),
        };
        assert!(source.read_unchanged(half).await.is_none());
        let whole = source
            .read_unchanged(signature(&path).unwrap())
            .await
            .unwrap();
        let applied = whole
            .iter()
            .filter(|e| matches!(e, SourceEvent::InitApply(_)))
            .count();
        assert_eq!(applied, 2);
    }

    #[test]
    fn parses_kubectl_yaml_and_json() {
        assert_eq!(parse(YAML).unwrap()[0].name, "n1");
        let json = r#"{"apiVersion":"v1","kind":"NodeList","items":[{"apiVersion":"v1","kind":"Node","metadata":{"name":"n2"}}]}"#;
        assert_eq!(parse(json).unwrap()[0].name, "n2");
    }

    #[test]
    fn syntax_errors_carry_line_and_column() {
        let err = parse("apiVersion: v1\nitems:\n- metadata: {name: [\n").unwrap_err();
        let ParseError::Syntax { line, .. } = &err else {
            panic!("{err}")
        };
        assert!(*line >= 3, "{err}");
        assert!(err.to_string().starts_with("nodes.yaml:"), "{err}");
        let err = parse("{\"items\": [1,]}").unwrap_err();
        assert!(err.to_string().starts_with("nodes.yaml:1:"), "{err}");
    }

    #[test]
    fn other_kinds_are_refused() {
        let err = parse("kind: PodList\nitems: []\n").unwrap_err();
        assert!(err.to_string().contains("PodList"), "{err}");
    }

    #[test]
    fn json_with_leading_blank_lines_is_json_and_big_nodes_are_dropped_as_parsed() {
        // A Node as the API server writes it, with the bulk the agent does not keep.
        let images: Vec<String> = (0..50)
            .map(|i| format!(r#"{{"names":["registry.example/image-{i}:v1"],"sizeBytes":{i}}}"#))
            .collect();
        let node = |i: usize| {
            format!(
                r#"{{"metadata":{{"name":"n{i}","uid":"u{i}","managedFields":[{{"manager":"kubelet"}}]}},"spec":{{"podCIDR":"10.244.{i}.0/24"}},"status":{{"addresses":[{{"type":"InternalIP","address":"10.0.0.{i}"}}],"images":[{}]}}}}"#,
                images.join(",")
            )
        };
        let items: Vec<String> = (1..=3).map(node).collect();
        let json = format!(
            "\n\n  {{\"kind\":\"List\",\"items\":[{}]}}",
            items.join(",")
        );
        let nodes = parse(&json).unwrap();
        assert_eq!(
            nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
            ["n1", "n2", "n3"]
        );
        assert_eq!(nodes[2].pod_cidrs, ["10.244.3.0/24"]);
        let err = parse("\n\n{\"items\": [1,]}").unwrap_err();
        assert!(err.to_string().starts_with("nodes.yaml:3:"), "{err}");
    }

    #[test]
    fn a_missing_file_is_a_read_error_naming_it() {
        let err = parse_file(Path::new("/nonexistent/nodes.yaml")).unwrap_err();
        assert!(matches!(err, ParseError::Read { .. }), "{err}");
        assert!(err.to_string().contains("/nonexistent/nodes.yaml"), "{err}");
    }
}

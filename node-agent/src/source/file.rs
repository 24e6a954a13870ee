//! The NodeList file source (`--nodes-file`): the embedded default for running without a
//! cluster, and what the demo and the end-to-end tests drive.
//!
//! The file holds a Kubernetes NodeList in YAML or JSON, such as `kubectl get nodes -o yaml`.
//! It is polled: a change of size, mtime, ctime or inode triggers a parse, and so does every relist
//! interval even without a change (a fresh full list is what lets a held brake go ahead). Each
//! successful parse is a full relist. A parse error keeps the last good view and is reported with
//! its line and column; it never reads as "no nodes". A missing file means "not synced yet".

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use serde::Deserialize;
use state::node::RawNode;
use tokio::sync::mpsc;
// The source's own waits on tokio's clock, which its tests pause and move.
use tokio::time::Instant;

use state::input::{self, Input, InputError};

use super::node_object::raw_node;
use super::{SourceEvent, SourceRequest};

/// Why the file could not be read as a NodeList.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("reading {path}: the reading thread failed: {message}")]
    Reader { path: PathBuf, message: String },
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
    // `items:` with nothing after it (null) is an empty list, as YAML writers make of one.
    struct MaybeItems;
    impl<'de> serde::de::Visitor<'de> for MaybeItems {
        type Value = Vec<RawNode>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a list of Nodes")
        }

        fn visit_none<E: serde::de::Error>(self) -> Result<Vec<RawNode>, E> {
            Ok(Vec::new())
        }

        fn visit_unit<E: serde::de::Error>(self) -> Result<Vec<RawNode>, E> {
            Ok(Vec::new())
        }

        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Vec<RawNode>, D::Error> {
            d.deserialize_seq(Items)
        }
    }
    d.deserialize_option(MaybeItems)
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

/// How deep a NodeList nests. A Node as the API server prints it goes about a dozen levels deep
/// (its managed fields the deepest); anything past this is not a NodeList, and the parsers stop
/// there instead of working through it.
const MAX_DEPTH: usize = 64;

/// The YAML parser's limits. Sizes are the input gate's (the file's cap); the counts that grow
/// with the cluster (events, nodes, scalar bytes) follow from it. What a NodeList never holds is
/// refused early: nesting past [`MAX_DEPTH`], and anchors and aliases beyond a few (kubectl
/// writes none; a few expanded many times over is how a small file becomes a huge one).
fn yaml_options() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_reader_input_bytes = None;
    budget.max_depth = MAX_DEPTH;
    budget.flow_nesting_limit = MAX_DEPTH;
    budget.max_events = usize::MAX;
    budget.max_nodes = usize::MAX;
    budget.max_total_scalar_bytes = usize::MAX;
    budget.max_total_comment_bytes = usize::MAX;
    budget.max_anchors = 1024;
    budget.max_aliases = 1024;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options.emit_comments = false;
    options
}

/// Reads and parses the NodeList file at `path` (JSON if it starts with `{`, YAML otherwise),
/// through the input gate. Neither is held whole (`kubectl get nodes -o json` of a large
/// cluster runs to hundreds of megabytes): both parsers work as the file is read, and each node
/// is cut down to what the agent keeps as soon as it is parsed.
pub fn parse_file(path: &Path) -> Result<Vec<RawNode>, ParseError> {
    use std::io::BufRead;
    let gated = input::open(path, Input::NodeList)?;
    let mut file = std::io::BufReader::with_capacity(64 * 1024, gated);
    let refused =
        |file: &std::io::BufReader<input::Gated>, e| ParseError::Input(file.get_ref().error(e));
    let json = match file.fill_buf() {
        Ok(buf) => buf.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{'),
        Err(e) => return Err(refused(&file, e)),
    };
    if json {
        let mut de = serde_json::Deserializer::from_reader(&mut file);
        let doc = NodeListDoc::deserialize(&mut de).and_then(|doc| de.end().map(|()| doc));
        return match doc {
            Ok(doc) => doc.into_nodes(path),
            Err(e) => match e.io_error_kind() {
                Some(_) => Err(refused(&file, std::io::Error::from(e))),
                None => Err(syntax(path, e.line(), e.column(), e.to_string())),
            },
        };
    }
    let doc: Result<NodeListDoc, _> =
        serde_saphyr::from_reader_with_options(&mut file, yaml_options());
    match doc {
        Ok(doc) => doc.into_nodes(path),
        Err(e) => {
            if let Some(io) = io_error(&e) {
                return Err(refused(&file, io));
            }
            let (line, column) = e
                .location()
                .map_or((0, 0), |l| (l.line() as usize, l.column() as usize));
            Err(syntax(path, line, column, e.to_string()))
        }
    }
}

/// The read error under a YAML error, if that is what it is.
fn io_error(e: &serde_saphyr::Error) -> Option<std::io::Error> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return Some(std::io::Error::new(io.kind(), io.to_string()));
        }
        source = s.source();
    }
    None
}

/// What identifies one version of the file without reading it. The change time is in it
/// because a writer can set the modification time back, even to what it was, and cannot set
/// the change time at all: the kernel sets it at every write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Signature {
    ino: u64,
    len: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

fn signature(path: &Path) -> Option<Signature> {
    let m = std::fs::metadata(path).ok()?;
    let ns = |s: i64, ns: i64| i128::from(s) * 1_000_000_000 + i128::from(ns);
    Some(Signature {
        ino: m.ino(),
        len: m.len(),
        mtime_ns: ns(m.mtime(), m.mtime_nsec()),
        ctime_ns: ns(m.ctime(), m.ctime_nsec()),
    })
}

impl Signature {
    /// How long ago the file was last changed, by the wall clock (a time ahead of the clock is
    /// taken as now). From the change time: a modification time set back (by a writer that
    /// keeps it, or an NFS server whose clock lags) would make a half-written file look settled.
    fn age(&self) -> Duration {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        Duration::from_nanos(u64::try_from(now - self.ctime_ns).unwrap_or(0))
    }
}

/// Polls a NodeList file and sends its full lists.
///
/// A file can be read torn: a writer that writes it in place (`kubectl get nodes -o yaml >
/// nodes.yaml`, paged from the API server) and pauses at an item boundary leaves a valid,
/// shorter YAML list, and one that pauses inside an item a node missing its tail (an address,
/// a pod CIDR). A read that only adds nodes to the last list taken is taken at once (a torn
/// read can only lack what the whole file has); any other read, the first one included, is
/// taken only once the file has stayed unchanged for the settle period: a removal or a change
/// is confirmed by a later look, `settle` after, finding the same file. Writers that replace the
/// file by rename (`kubectl ... > tmp && mv tmp nodes.yaml`, a ConfigMap mount) are never seen
/// torn; the settle period only delays their removals.
pub struct FileSource {
    pub path: PathBuf,
    /// How often the file's metadata is checked.
    pub poll: Duration,
    /// How often the file is re-read and re-sent even when unchanged.
    pub relist: Duration,
    /// How long a read that removes or changes nodes waits for the file to stay unchanged.
    pub settle: Duration,
}

/// A read of the file that waits for the settle period before it is taken.
struct Unsettled {
    sig: Signature,
    nodes: Vec<RawNode>,
    seen: Instant,
}

/// What the last list taken held: a digest of each node by name.
#[derive(Default)]
struct Taken(std::collections::HashMap<String, u64>);

impl Taken {
    fn of(nodes: &[RawNode]) -> Self {
        Self(nodes.iter().map(|n| (n.name.clone(), digest(n))).collect())
    }

    /// Whether `nodes` holds every node of this list, unchanged (and perhaps more).
    fn only_added_to(&self, nodes: &[RawNode]) -> bool {
        let now: std::collections::HashMap<&str, u64> =
            nodes.iter().map(|n| (n.name.as_str(), digest(n))).collect();
        self.0
            .iter()
            .all(|(name, d)| now.get(name.as_str()) == Some(d))
    }
}

fn digest(node: &RawNode) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault};
    BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(node)
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
        let mut taken: Option<Taken> = None;
        let mut unsettled: Option<Unsettled> = None;
        let mut last_read = Instant::now();
        let mut missing_logged = false;
        let mut asked = false;
        let mut requests_open = true;
        loop {
            let sig = signature(&self.path);
            let due = asked || last_read.elapsed() >= self.relist;
            asked = false;
            let mut send = None;
            match sig {
                None => {
                    if !missing_logged {
                        tracing::warn!(path = %self.path.display(), "nodes file not found; not synced until it appears");
                        missing_logged = true;
                    }
                }
                Some(sig) if unsettled.as_ref().is_some_and(|u| u.sig == sig) => {
                    let u = unsettled.as_ref().expect("checked");
                    if u.seen.elapsed() >= self.settle || sig.age() >= self.settle {
                        send = unsettled.take().map(|u| (u.sig, Ok(u.nodes)));
                    }
                }
                Some(sig) if Some(sig) != last || due => {
                    missing_logged = false;
                    // A file written while it was read (`kubectl ... > nodes.yaml` writes in
                    // chunks) is read again at the next poll, never taken as the list.
                    match self.read_unchanged(sig).await {
                        None => {}
                        Some(Ok(nodes))
                            if sig.age() < self.settle
                                && !taken.as_ref().is_some_and(|t| t.only_added_to(&nodes)) =>
                        {
                            tracing::debug!(path = %self.path.display(), settle = ?self.settle, "nodes file removes or changes nodes; taken once it stays unchanged for the settle period");
                            unsettled = Some(Unsettled {
                                sig,
                                nodes,
                                seen: Instant::now(),
                            });
                        }
                        Some(read) => {
                            unsettled = None;
                            send = Some((sig, read));
                        }
                    }
                }
                Some(_) => {}
            }
            if let Some((sig, read)) = send {
                last = Some(sig);
                last_read = Instant::now();
                if let Ok(nodes) = &read {
                    taken = Some(Taken::of(nodes));
                }
                for ev in events(read) {
                    if tx.send(ev).await.is_err() {
                        return;
                    }
                }
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

    /// One read of the file, off the async threads (a large list takes a while to parse), if
    /// the file still has signature `sig` once read: `None` if it changed meanwhile.
    async fn read_unchanged(&self, sig: Signature) -> Option<Result<Vec<RawNode>, ParseError>> {
        let read = self.read().await;
        if signature(&self.path) == Some(sig) {
            Some(read)
        } else {
            tracing::debug!(path = %self.path.display(), "nodes file changed while read; reading it again");
            None
        }
    }

    async fn read(&self) -> Result<Vec<RawNode>, ParseError> {
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || parse_file(&path))
            .await
            .unwrap_or_else(|e| {
                Err(ParseError::Reader {
                    path: self.path.clone(),
                    message: e.to_string(),
                })
            })
    }
}

/// A read as the source's events: a full list, or the error.
fn events(read: Result<Vec<RawNode>, ParseError>) -> Vec<SourceEvent> {
    match read {
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
            settle: Duration::ZERO,
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

    /// A file that changed while it was read is not taken as the list: a YAML list caught
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
            settle: Duration::ZERO,
        };
        assert!(source.read_unchanged(half).await.is_none());
        let whole = source
            .read_unchanged(signature(&path).unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(whole.len(), 2);
    }

    fn list(names: &[&str]) -> String {
        let items: String = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                format!(
                    "- apiVersion: v1\n  kind: Node\n  metadata: {{name: {n}}}\n  status:\n    addresses: [{{type: InternalIP, address: 10.0.0.{}}}]\n",
                    i + 1
                )
            })
            .collect();
        format!("apiVersion: v1\nkind: List\nitems:\n{items}")
    }

    /// The tests' settle period, on tokio's paused clock: no one can set a file's change time
    /// back, so the settle period is waited out on the source's own clock, which a paused
    /// runtime moves on whenever the source sleeps (6000 polls here).
    const SETTLE: Duration = Duration::from_secs(60);

    /// Writes `text` in place, as a writer without a rename does.
    fn write(path: &Path, text: &str) {
        std::fs::write(path, text).unwrap();
    }

    /// Writes `text` in place with its modification time set `back`: a writer that keeps the
    /// old time, or an NFS server whose clock lags.
    fn write_backdated(path: &Path, text: &str, back: Duration) {
        write(path, text);
        let f = std::fs::File::options().write(true).open(path).unwrap();
        f.set_modified(std::time::SystemTime::now() - back).unwrap();
    }

    /// A source polling `path` every 10 ms with the settle period [`SETTLE`], and its events.
    fn settling_source(path: &Path) -> (tokio::task::JoinHandle<()>, mpsc::Receiver<SourceEvent>) {
        let source = FileSource {
            path: path.to_owned(),
            poll: Duration::from_millis(10),
            relist: Duration::from_secs(24 * 3600),
            settle: SETTLE,
        };
        let (tx, rx) = mpsc::channel(64);
        // No requests: the source goes on polling once their sender is gone.
        let (_, requests_rx) = mpsc::channel(1);
        (tokio::spawn(source.run(tx, requests_rx)), rx)
    }

    /// The lists the source sends, as the names in each.
    async fn next_list(rx: &mut mpsc::Receiver<SourceEvent>) -> Vec<String> {
        let mut names = Vec::new();
        loop {
            match rx.recv().await.expect("the source runs") {
                SourceEvent::Init => names.clear(),
                SourceEvent::InitApply(n) => names.push(n.name),
                SourceEvent::InitDone => return names,
                other => panic!("{other:?}"),
            }
        }
    }

    /// The next list, and how long the source's clock moved before it came: at least
    /// [`SETTLE`] for a list that waited, less for one taken at once.
    async fn timed_list(rx: &mut mpsc::Receiver<SourceEvent>) -> (Vec<String>, Duration) {
        let began = Instant::now();
        let names = next_list(rx).await;
        (names, began.elapsed())
    }

    /// A writer that pauses (here: for good) after the first item of a list it writes in place
    /// leaves a valid, shorter list: it is taken only once the file has stayed unchanged for the
    /// settle period, like the first read of a fresh file; a list that only adds nodes is taken
    /// at once, fresh as it is.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_list_that_drops_nodes_waits_for_the_file_to_settle() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nodes.yaml");
        write(&path, &list(&["n1", "n2"]));
        let (task, mut rx) = settling_source(&path);
        let (names, waited) = timed_list(&mut rx).await;
        assert_eq!(names, ["n1", "n2"]);
        assert!(
            waited >= SETTLE,
            "a fresh first read was taken after {waited:?}"
        );
        // Added to, freshly written: taken at once.
        write(&path, &list(&["n1", "n2", "n3"]));
        let (names, waited) = timed_list(&mut rx).await;
        assert_eq!(names, ["n1", "n2", "n3"]);
        assert!(waited < SETTLE, "a list that only adds waited {waited:?}");
        // Torn after its first item, and the writer pauses: confirmed a settle period later.
        write(&path, &list(&["n1"]));
        let (names, waited) = timed_list(&mut rx).await;
        assert_eq!(names, ["n1"]);
        assert!(
            waited >= SETTLE,
            "a fresh shorter list was taken after {waited:?}"
        );
        println!(
            "settle: a fresh first read and a fresh removal waited {SETTLE:?}, an addition did not"
        );
        task.abort();
    }

    /// A file just written whose modification time says it is old (set back by its writer, or
    /// by a lagging NFS server's clock) is as fresh as it is: its removals, its changes and a
    /// first read of it wait for the settle period all the same. Walked: each of the three, with
    /// the modification time a minute, an hour and a year back.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_modification_time_set_back_does_not_settle_a_fresh_file() {
        let changed = list(&["n1"]).replace("10.0.0.1", "10.0.0.9");
        let mut cases = 0;
        for back in [60, 3600, 365 * 24 * 3600].map(Duration::from_secs) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("nodes.yaml");
            write_backdated(&path, &list(&["n1", "n2"]), back);
            let (task, mut rx) = settling_source(&path);
            let (names, waited) = timed_list(&mut rx).await;
            assert_eq!(names, ["n1", "n2"]);
            assert!(
                waited >= SETTLE,
                "{back:?} back: a first read taken after {waited:?}"
            );
            for (what, text) in [("a removal", list(&["n1"])), ("a change", changed.clone())] {
                write_backdated(&path, &text, back);
                let (names, waited) = timed_list(&mut rx).await;
                assert_eq!(names, ["n1"], "{what}");
                assert!(
                    waited >= SETTLE,
                    "{back:?} back: {what} taken after {waited:?}"
                );
            }
            cases += 3;
            task.abort();
        }
        println!(
            "settle: {cases} fresh reads with the modification time set back waited {SETTLE:?}"
        );
    }

    /// A node changed in a fresh file (a writer paused inside its item: an address missing)
    /// waits too, and the first read of a fresh file, which has no list to add to.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_changed_node_and_a_first_fresh_read_wait_for_the_file_to_settle() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nodes.yaml");
        write(&path, &list(&["n1"]));
        let (task, mut rx) = settling_source(&path);
        let (names, waited) = timed_list(&mut rx).await;
        assert_eq!(names, ["n1"]);
        assert!(
            waited >= SETTLE,
            "a fresh first read was taken after {waited:?}"
        );
        let changed = list(&["n1"]).replace("10.0.0.1", "10.0.0.9");
        write(&path, &changed);
        let (names, waited) = timed_list(&mut rx).await;
        assert_eq!(names, ["n1"]);
        assert!(
            waited >= SETTLE,
            "a fresh change was taken after {waited:?}"
        );
        task.abort();
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
    fn an_items_key_with_nothing_after_it_is_an_empty_list() {
        for text in [
            "kind: List\nitems:\n",
            "kind: List\nitems: []\n",
            "{\"items\": null}",
        ] {
            assert_eq!(parse(text).unwrap(), [], "{text:?}");
        }
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
        assert!(matches!(err, ParseError::Input(_)), "{err}");
        assert!(err.to_string().contains("/nonexistent/nodes.yaml"), "{err}");
    }
}

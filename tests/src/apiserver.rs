//! An in-process stand-in for the Kubernetes API server, serving core/v1 Nodes only.
//!
//! The agent's correctness hangs on how it follows a list/watch: its first `InitDone` is the
//! "synced" signal that allows pruning, and every relist replaces its live view. Those paths only
//! run against something that behaves like the real API server at its edges: paginated lists over
//! a consistent snapshot, watches resumed from a resourceVersion, `410 Gone` when that version has
//! been compacted away, bookmarks, watches cut mid-stream, RBAC denials. A fake client would test
//! our idea of the protocol; this server lets the *real* kube client (the same crate version the
//! agent uses) speak the real protocol, over a kubeconfig, in the same process or from a spawned
//! agent binary.
//!
//! # What it serves
//!
//! * `GET /api/v1/nodes`: a `NodeList`. `limit` and `continue` paginate over a snapshot of the
//!   store taken at the first page, so the pages are consistent even when nodes change between
//!   them, exactly like etcd-backed lists. A continue token whose snapshot was compacted (see
//!   [`ApiServer::compact`]) is answered `410 Gone`, reason `Expired`. `resourceVersion` and
//!   `resourceVersionMatch` are validated and honoured where the store can (see below).
//! * `GET /api/v1/nodes?watch=true&resourceVersion=RV`: a chunked stream of newline-delimited
//!   watch events after `RV`: first the retained history, then live changes. An `RV` older than
//!   the retained history gets what the real watch cache sends: a `200` stream holding one `ERROR`
//!   event whose object is a `410 Expired` `Status`, then the end of the stream. (A `410` *HTTP*
//!   answer would be wrong: kube's watcher retries a failed watch request from the same version
//!   forever, but relists on the `ERROR` event.) `timeoutSeconds` ends the stream cleanly;
//!   `allowWatchBookmarks=true` lets [`ApiServer::bookmark`] reach the stream. Without a
//!   `resourceVersion` (or with `0`) the stream starts with a synthetic `ADDED` per node.
//! * `GET /api/v1/nodes/NAME`: one node, or `404 NotFound`.
//!
//! Every answer is `application/json`; every error is a `Status` object shaped like the real one.
//! Bad requests get `400 BadRequest`, unknown paths `404`, other methods `405`; no request can
//! make a handler panic.
//!
//! # Faithfulness, and where it stops
//!
//! * Stored nodes carry `metadata.resourceVersion` (a decimal string of one global counter),
//!   a `uid`, a `creationTimestamp` and `managedFields` (added when a test gives none), because
//!   the agent must cope with, and drop, all of them.
//! * List items carry no `apiVersion`/`kind` (the real server omits them inside a list); watch
//!   event objects carry both.
//! * `labelSelector` and `fieldSelector` are accepted and **ignored**: the agent watches all nodes.
//! * A list with `resourceVersion` newer than the store is answered `504 Timeout` at once (the real
//!   server waits up to a few seconds first). A list with `resourceVersionMatch=Exact` is served only
//!   for the current version or a still-retained pagination snapshot, else `410 Expired`. Any other
//!   version is served from the current state (which is "not older than" it).
//! * A watch from a version newer than the store starts from that version instead of waiting.
//! * The server sends bookmarks only when asked ([`ApiServer::bookmark`]), never periodically, and
//!   does not implement `sendInitialEvents` (streaming lists).
//! * Authentication is a fixed bearer token written into the kubeconfig; a request without it is
//!   answered `401 Unauthorized`. Authorization is all-or-nothing ([`ApiServer::set_forbidden`]), or
//!   denies the next few requests of a kind ([`ApiServer::forbid_next`]).
//!
//! # Threads and network namespaces
//!
//! The server runs on its own thread with its own tokio runtime, so synchronous test code and
//! tokio tests alike can drive it. [`ApiServer::start`] binds `127.0.0.1:0` **on the calling
//! thread** before handing the socket over: in the test sandboxes network namespaces belong to
//! threads, and a socket stays in the namespace it was created in. So a server started inside
//! [`crate::sandbox`] listens on that sandbox's loopback, and an agent process spawned from the
//! same sandbox thread reaches it there through the kubeconfig from [`ApiServer::kubeconfig`].

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry, Time};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc, oneshot};

/// The bearer token the kubeconfig carries and the server requires.
pub const TOKEN: &str = "node-agent-test-token";

/// The identity the real cluster would name in its `403` messages.
const USER: &str = "system:serviceaccount:kube-system:node-agent";

/// How many past events a watch can resume from unless [`Options::history`] says otherwise.
const DEFAULT_HISTORY: usize = 10_000;

/// How many paginated lists can be continued at once.
const MAX_SNAPSHOTS: usize = 64;

/// How a server is set up; [`Options::default`] is what [`ApiServer::start`] uses.
#[derive(Clone, Debug)]
pub struct Options {
    /// How many events the server retains for watches to resume from. Older events are
    /// forgotten as new ones come, and a watch from before them gets `410 Expired`, like the
    /// real watch cache's sliding window. [`ApiServer::compact`] forgets them all at once.
    pub history: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            history: DEFAULT_HISTORY,
        }
    }
}

/// How many `GET` requests of each kind the server has received, unauthorized and forbidden
/// ones included; tests use them to tell a relist (a new `list`) from a resumed watch (a new
/// `watch` only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Requests {
    /// `GET /api/v1/nodes` without `watch`, each page counted.
    pub list: u64,
    /// `GET /api/v1/nodes?watch=true`.
    pub watch: u64,
    /// `GET /api/v1/nodes/NAME`.
    pub get: u64,
    /// Lists of one node (`limit=1`, no `continue`), counted in `list` too: a client checking
    /// that it may list nodes, as the agent's probe does.
    pub probe: u64,
}

/// A kind of request, for [`ApiServer::forbid_next`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Every list, probes included.
    List,
    /// Lists of one node ([`Requests::probe`]).
    Probe,
    Watch,
    Get,
}

/// A running stand-in; dropping it stops the server and cuts every open connection.
pub struct ApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What the server thread and the test's handle share.
struct Shared {
    store: Mutex<Store>,
    /// Changes, bookmarks and drops, in the order they happened: one channel, sent to while the
    /// store lock is held, so a watch sees a [`Msg::Drop`] before any change made after it.
    events: broadcast::Sender<Msg>,
    forbidden: AtomicBool,
    /// Every request is answered `401 Unauthorized`, as when the token expired.
    revoked: AtomicBool,
    /// Every request is answered `500 InternalError`, as an API server in trouble does.
    failing: AtomicBool,
    /// Every connection is closed at once, as if nothing listened.
    refusing: AtomicBool,
    /// Every watch from a version is answered `410 Expired` at once, as a caching proxy that
    /// keeps no history does: lists succeed, watches never start.
    expiring: AtomicBool,
    /// How many of the next requests of each kind are answered `403 Forbidden`, by
    /// [`Kind`] (`u64::MAX`: all of them); see [`ApiServer::forbid_next`].
    forbid: [AtomicU64; 4],
    lists: AtomicU64,
    watches: AtomicU64,
    gets: AtomicU64,
    probes: AtomicU64,
}

/// The store: what etcd plus the watch cache hold for Nodes.
struct Store {
    /// The last resourceVersion handed out.
    rv: u64,
    /// Copy-on-write, so a pagination snapshot is one `Arc` clone.
    nodes: Arc<BTreeMap<String, Node>>,
    /// Retained events, oldest first; every event with a version above `floor` is here.
    history: VecDeque<Change>,
    floor: u64,
    history_limit: usize,
    /// The stores that paginated lists started from, by version, for their continue tokens.
    snapshots: BTreeMap<u64, Arc<BTreeMap<String, Node>>>,
}

/// One event, serialized once as the line every watch sends.
#[derive(Clone)]
struct Change {
    rv: u64,
    line: Bytes,
}

#[derive(Clone)]
enum Msg {
    Change(Change),
    Bookmark(u64),
    /// Abort every watch stream now.
    Drop,
}

impl ApiServer {
    /// Starts a server with the default [`Options`] on `127.0.0.1`, in the calling thread's
    /// network namespace.
    pub fn start() -> std::io::Result<Self> {
        Self::start_with(Options::default())
    }

    /// Starts a server with `options`; see [`ApiServer::start`].
    pub fn start_with(options: Options) -> std::io::Result<Self> {
        // Bound here, on the caller's thread, so it lives in the caller's network namespace.
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (events, _) = broadcast::channel(65_536);
        let shared = Arc::new(Shared {
            store: Mutex::new(Store {
                rv: 0,
                nodes: Arc::default(),
                history: VecDeque::new(),
                floor: 0,
                history_limit: options.history,
                snapshots: BTreeMap::new(),
            }),
            events,
            forbidden: AtomicBool::new(false),
            revoked: AtomicBool::new(false),
            failing: AtomicBool::new(false),
            expiring: AtomicBool::new(false),
            refusing: AtomicBool::new(false),
            forbid: Default::default(),
            lists: AtomicU64::new(0),
            watches: AtomicU64::new(0),
            gets: AtomicU64::new(0),
            probes: AtomicU64::new(0),
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (shutdown, stop) = oneshot::channel();
        let server = shared.clone();
        let thread = std::thread::Builder::new()
            .name("apiserver".into())
            .spawn(move || runtime.block_on(serve(listener, server, stop)))?;
        Ok(Self {
            addr,
            shared,
            shutdown: Some(shutdown),
            thread: Some(thread),
        })
    }

    /// Where the server listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes `dir/kubeconfig`, pointing at this server with [`TOKEN`], and returns its path.
    ///
    /// Plain HTTP: kube's client accepts an `http://` cluster URL, and no TLS keeps certificates
    /// out of tests that are not about TLS.
    pub fn kubeconfig(&self, dir: &Path) -> std::io::Result<PathBuf> {
        let path = dir.join("kubeconfig");
        std::fs::write(&path, self.kubeconfig_yaml())?;
        Ok(path)
    }

    /// The kubeconfig [`ApiServer::kubeconfig`] writes.
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1\n\
             kind: Config\n\
             clusters:\n\
             - name: stand-in\n  cluster:\n    server: {url}\n\
             users:\n\
             - name: node-agent\n  user:\n    token: {TOKEN}\n\
             contexts:\n\
             - name: stand-in\n  context:\n    cluster: stand-in\n    user: node-agent\n\
             current-context: stand-in\n",
            url = self.url()
        )
    }

    /// Adds `node`, or replaces the node of that name, and returns the new resourceVersion.
    ///
    /// The server stamps what the real one owns: `resourceVersion`, `uid` (unless a new node
    /// brings one) and
    /// `creationTimestamp` (kept across updates), and gives the node `managedFields` when it has
    /// none. Watches get `ADDED` or `MODIFIED`.
    ///
    /// # Panics
    ///
    /// If `node` has no name: that is a broken test, not a request.
    pub fn apply(&self, mut node: Node) -> u64 {
        let name = node.metadata.name.clone().expect("a node needs a name");
        let mut store = self.shared.lock();
        store.rv += 1;
        let rv = store.rv;
        let previous = store.nodes.get(&name);
        let kind = if previous.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let meta = &mut node.metadata;
        meta.resource_version = Some(rv.to_string());
        // A UID the test gives a new node stands in for the one the real server would make up
        // (to the agent, both are opaque); an update keeps the node's.
        let given = meta.uid.take();
        meta.uid = previous
            .and_then(|p| p.metadata.uid.clone())
            .or(given)
            .or_else(|| Some(uid(rv)));
        meta.creation_timestamp = previous
            .and_then(|p| p.metadata.creation_timestamp.clone())
            .or_else(|| Some(Time(k8s_openapi::jiff::Timestamp::now())));
        if meta.managed_fields.as_ref().is_none_or(Vec::is_empty) {
            meta.managed_fields = Some(managed_fields());
        }
        Arc::make_mut(&mut store.nodes).insert(name, node.clone());
        self.shared.record(&mut store, rv, kind, &node);
        rv
    }

    /// Adds a node that must not exist yet ([`ApiServer::apply`] with that check).
    ///
    /// # Panics
    ///
    /// If a node of that name exists, or `node` has no name.
    pub fn add(&self, node: Node) -> u64 {
        let name = node.metadata.name.as_deref().expect("a node needs a name");
        assert!(self.node(name).is_none(), "node {name} already exists");
        self.apply(node)
    }

    /// Replaces a node that must exist ([`ApiServer::apply`] with that check).
    ///
    /// # Panics
    ///
    /// If there is no node of that name, or `node` has no name.
    pub fn update(&self, node: Node) -> u64 {
        let name = node.metadata.name.as_deref().expect("a node needs a name");
        assert!(self.node(name).is_some(), "node {name} does not exist");
        self.apply(node)
    }

    /// Deletes the node `name`; returns the deletion's resourceVersion, or `None` if there was
    /// no such node. Watches get `DELETED` with the node's last state at the new version.
    pub fn delete(&self, name: &str) -> Option<u64> {
        let mut store = self.shared.lock();
        let mut node = Arc::make_mut(&mut store.nodes).remove(name)?;
        store.rv += 1;
        let rv = store.rv;
        node.metadata.resource_version = Some(rv.to_string());
        self.shared.record(&mut store, rv, "DELETED", &node);
        Some(rv)
    }

    /// The stored node `name`, as a list or get would return it.
    pub fn node(&self, name: &str) -> Option<Node> {
        self.shared.lock().nodes.get(name).cloned()
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }

    /// Answers every request from now on with `403 Forbidden`, as when the agent's RBAC is
    /// missing, or stops doing so. Open watches are not cut; pair with
    /// [`ApiServer::drop_watches`] for that.
    pub fn set_forbidden(&self, forbidden: bool) {
        self.shared.forbidden.store(forbidden, Ordering::SeqCst);
    }

    /// Answers the next `n` requests of `kind` with `403 Forbidden` (`u64::MAX`: every one until
    /// told otherwise; `0`: none from now on), as RBAC that grants some verbs and not others, or
    /// is granted back between two requests, does. A probe is forbidden if either
    /// [`Kind::Probe`] or [`Kind::List`] says so, and then counts against `Probe` first. Open
    /// watches are not cut.
    pub fn forbid_next(&self, kind: Kind, n: u64) {
        self.shared.forbid[kind as usize].store(n, Ordering::SeqCst);
    }

    /// Answers every request from now on with `401 Unauthorized`, as when the agent's token
    /// expired or was revoked, or stops doing so. Open watches are not cut.
    pub fn set_revoked(&self, revoked: bool) {
        self.shared.revoked.store(revoked, Ordering::SeqCst);
    }

    /// Answers every request from now on with `500 InternalError`, or stops doing so.
    pub fn set_failing(&self, failing: bool) {
        self.shared.failing.store(failing, Ordering::SeqCst);
    }

    /// Answers every watch from a version with `410 Expired` from now on (lists still
    /// succeed), or stops doing so. Open watches are not cut.
    pub fn set_expiring(&self, expiring: bool) {
        self.shared.expiring.store(expiring, Ordering::SeqCst);
    }

    /// Closes every new connection at once, as a server that is down does (the client sees it
    /// reset), and cuts the open watches; or serves again.
    pub fn set_unreachable(&self, unreachable: bool) {
        self.shared.refusing.store(unreachable, Ordering::SeqCst);
        if unreachable {
            self.drop_watches();
        }
    }

    /// Aborts every open watch connection mid-stream, without the end of the chunked body, the
    /// way a crashed API server or a cut network does. Changes made after this returns never
    /// reach the aborted watches.
    pub fn drop_watches(&self) {
        let _store = self.shared.lock();
        let _ = self.shared.events.send(Msg::Drop);
    }

    /// Forgets every retained event and pagination snapshot, like an etcd compaction: a watch
    /// resuming from any version before now gets `410 Expired` and must relist, and so does a
    /// paginated list continuing from before now.
    pub fn compact(&self) {
        let mut store = self.shared.lock();
        // The version moves on, as it would from writes to other resources in a real cluster:
        // a watch resuming even from the latest version seen so far is too old, while a fresh
        // list (at the new version) can be watched from.
        store.rv += 1;
        store.floor = store.rv;
        store.history.clear();
        store.snapshots.clear();
    }

    /// Sends a `BOOKMARK` at the current version to every watch that allowed bookmarks.
    pub fn bookmark(&self) {
        let store = self.shared.lock();
        let _ = self.shared.events.send(Msg::Bookmark(store.rv));
    }

    /// The requests received so far.
    pub fn requests(&self) -> Requests {
        Requests {
            list: self.shared.lists.load(Ordering::SeqCst),
            watch: self.shared.watches.load(Ordering::SeqCst),
            get: self.shared.gets.load(Ordering::SeqCst),
            probe: self.shared.probes.load(Ordering::SeqCst),
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(stop) = self.shutdown.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Shared {
    /// The store, even if a test thread panicked while holding it: its data stays consistent
    /// because every mutation completes before anything that can panic.
    fn lock(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a request of `kind` is to be forbidden by [`ApiServer::forbid_next`]; counts it.
    fn take_forbidden(&self, kind: Kind) -> bool {
        self.forbid[kind as usize]
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| match n {
                0 => None,
                u64::MAX => Some(n),
                n => Some(n - 1),
            })
            .is_ok()
    }

    /// Retains and broadcasts one change; called with the store locked, after the change.
    fn record(&self, store: &mut Store, rv: u64, kind: &str, node: &Node) {
        let change = Change {
            rv,
            line: watch_line(kind, &serde_json::to_value(node).unwrap_or(Value::Null)),
        };
        store.history.push_back(change.clone());
        while store.history.len() > store.history_limit {
            if let Some(old) = store.history.pop_front() {
                store.floor = old.rv;
            }
        }
        let floor = store.floor;
        store.snapshots.retain(|&v, _| v >= floor);
        let _ = self.events.send(Msg::Change(change));
    }
}

fn uid(rv: u64) -> String {
    format!("6e6f6465-0000-4000-8000-{rv:012x}")
}

/// What the kubelet's own status updates leave on a real node.
fn managed_fields() -> Vec<ManagedFieldsEntry> {
    let entry = |manager: &str, subresource: Option<&str>, fields: Value| ManagedFieldsEntry {
        api_version: Some("v1".into()),
        fields_type: Some("FieldsV1".into()),
        fields_v1: Some(FieldsV1(fields)),
        manager: Some(manager.into()),
        operation: Some("Update".into()),
        subresource: subresource.map(Into::into),
        time: Some(Time(k8s_openapi::jiff::Timestamp::now())),
    };
    vec![
        entry(
            "kubelet",
            None,
            json!({"f:metadata": {"f:labels": {".": {}, "f:kubernetes.io/hostname": {}}}}),
        ),
        entry(
            "kube-controller-manager",
            None,
            json!({"f:spec": {"f:podCIDR": {}, "f:podCIDRs": {".": {}}}}),
        ),
        entry(
            "kubelet",
            Some("status"),
            json!({"f:status": {"f:addresses": {}, "f:conditions": {}}}),
        ),
    ]
}

/// `{"type":KIND,"object":OBJECT}` and a newline: one event of a watch stream.
fn watch_line(kind: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": object}))
        .unwrap_or_else(|_| b"{}".to_vec());
    line.push(b'\n');
    Bytes::from(line)
}

type Body = BoxBody<Bytes, std::io::Error>;

async fn serve(
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
    mut stop: oneshot::Receiver<()>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            crate::report(&format!("apiserver stand-in: cannot listen: {e}"));
            return;
        }
    };
    loop {
        let stream = tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        if shared.refusing.load(Ordering::SeqCst) {
            drop(stream);
            continue;
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(handle(&shared, req)) }
            });
            // A connection's end, clean or not, is the client's business.
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The query of a request, decoded.
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(req: &Request<Incoming>) -> Self {
        let q = req.uri().query().unwrap_or("");
        Self(form_urlencoded::parse(q.as_bytes()).into_owned().collect())
    }

    /// The parameter's value; an empty value counts as absent, as in the real server.
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
    }

    fn flag(&self, key: &str) -> Result<bool, Refusal> {
        match self.get(key) {
            None | Some("false" | "0") => Ok(false),
            Some("true" | "1") => Ok(true),
            Some(v) => Err(bad_request(&format!("invalid value for {key}: {v:?}"))),
        }
    }

    fn number(&self, key: &str) -> Result<Option<u64>, Refusal> {
        self.get(key)
            .map(|v| {
                v.parse()
                    .map_err(|_| bad_request(&format!("invalid value for {key}: {v:?}")))
            })
            .transpose()
    }
}

fn handle(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().trim_end_matches('/');
    let name = match path.strip_prefix("/api/v1/nodes") {
        Some("") => None,
        Some(rest) => match rest.strip_prefix('/') {
            Some(n) if !n.is_empty() && !n.contains('/') => Some(n.to_owned()),
            _ => return not_found_path(req.uri().path()).into_response(),
        },
        None => return not_found_path(req.uri().path()).into_response(),
    };
    let query = Query::parse(&req);
    let watch = match query.flag("watch") {
        Ok(w) => w,
        Err(refusal) => return refusal.into_response(),
    };
    let verb = match (&name, watch) {
        (None, false) => "list",
        (None, true) => "watch",
        (Some(_), false) => "get",
        (Some(_), true) => {
            return bad_request("watch of a single node by path is not supported").into_response();
        }
    };
    if req.method() != Method::GET {
        return status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            &format!(
                "the server does not allow this method on the requested resource ({})",
                req.method()
            ),
        )
        .into_response();
    }
    let counter = match verb {
        "list" => &shared.lists,
        "watch" => &shared.watches,
        _ => &shared.gets,
    };
    counter.fetch_add(1, Ordering::SeqCst);
    let probe = verb == "list"
        && query.number("limit").ok().flatten() == Some(1)
        && query.get("continue").is_none();
    if probe {
        shared.probes.fetch_add(1, Ordering::SeqCst);
    }
    let authorized = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {TOKEN}"));
    if !authorized || shared.revoked.load(Ordering::SeqCst) {
        return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized").into_response();
    }
    if shared.failing.load(Ordering::SeqCst) {
        return status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "Internal error occurred: etcdserver: request timed out",
        )
        .into_response();
    }
    let forbidden_now = shared.forbidden.load(Ordering::SeqCst)
        || match verb {
            "list" => {
                (probe && shared.take_forbidden(Kind::Probe)) || shared.take_forbidden(Kind::List)
            }
            "watch" => shared.take_forbidden(Kind::Watch),
            _ => shared.take_forbidden(Kind::Get),
        };
    if forbidden_now {
        return forbidden(verb, name.as_deref()).into_response();
    }
    let result = match name {
        Some(name) => get(shared, &name),
        None if watch => watch_nodes(shared, &query),
        None => list(shared, &query),
    };
    result.unwrap_or_else(Refusal::into_response)
}

fn get(shared: &Shared, name: &str) -> Result<Response<Body>, Refusal> {
    match shared.lock().nodes.get(name) {
        Some(node) => Ok(json_response(
            StatusCode::OK,
            &serde_json::to_value(node).unwrap_or(Value::Null),
        )),
        None => Err(status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("nodes \"{name}\" not found"),
        )),
    }
}

/// What a continue token holds, base64url-encoded JSON like the real server's.
#[derive(serde::Serialize, serde::Deserialize)]
struct Continue {
    rv: u64,
    start: usize,
}

fn list(shared: &Shared, query: &Query) -> Result<Response<Body>, Refusal> {
    let limit = query.number("limit")?.filter(|&l| l > 0);
    let rv_match = query.get("resourceVersionMatch");
    let rv = query.get("resourceVersion");
    let mut store = shared.lock();
    let (snapshot_rv, snapshot, start) = if let Some(token) = query.get("continue") {
        if rv.is_some() {
            return Err(bad_request(
                "specifying resource version is not allowed when using continue",
            ));
        }
        let Continue { rv, start } = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(token)
            .ok()
            .and_then(|raw| serde_json::from_slice(&raw).ok())
            .ok_or_else(|| bad_request("continue key is not valid: incorrect encoded start resourceVersion (version meta.k8s.io/v1)"))?;
        let snapshot = store.snapshots.get(&rv).filter(|_| rv >= store.floor).ok_or_else(|| {
            status(
                StatusCode::GONE,
                "Expired",
                "The provided continue parameter is too old to display a consistent list result. \
                 You can start a new list without the continue parameter, or use the continue value \
                 from the response to retrieve the remainder of the results. Continuing with the \
                 provided token results in an inconsistent list - objects that were created, \
                 modified, or deleted between the time the first chunk was returned and now may \
                 show up in the list.",
            )
        })?;
        (rv, snapshot.clone(), start)
    } else {
        let wanted = match rv {
            None => {
                if rv_match.is_some() {
                    return Err(bad_request(
                        "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden unless resourceVersion is provided",
                    ));
                }
                None
            }
            Some(v) => Some(v.parse::<u64>().map_err(|_| {
                bad_request(&format!(
                    "resourceVersion: Invalid value: {v:?}: invalid resource version"
                ))
            })?),
        };
        match rv_match {
            None | Some("NotOlderThan" | "Exact") => {}
            Some(other) => {
                return Err(bad_request(&format!(
                    "resourceVersionMatch: Unsupported value: {other:?}: supported values: \"Exact\", \"NotOlderThan\""
                )));
            }
        }
        match wanted {
            Some(w) if w > store.rv => {
                return Err(status(
                    StatusCode::GATEWAY_TIMEOUT,
                    "Timeout",
                    &format!("Too large resource version: {w}, current: {}", store.rv),
                ));
            }
            Some(w) if rv_match == Some("Exact") && w != store.rv && w != 0 => {
                match store.snapshots.get(&w).filter(|_| w >= store.floor) {
                    Some(s) => (w, s.clone(), 0),
                    None => {
                        return Err(status(
                            StatusCode::GONE,
                            "Expired",
                            &format!("too old resource version: {w} ({})", store.floor),
                        ));
                    }
                }
            }
            _ => (store.rv, store.nodes.clone(), 0),
        }
    };
    let end = limit.map_or(snapshot.len(), |l| {
        start
            .saturating_add(usize::try_from(l).unwrap_or(usize::MAX))
            .min(snapshot.len())
    });
    let items: Vec<Value> = snapshot
        .values()
        .skip(start)
        .take(end.saturating_sub(start))
        .map(|n| {
            let mut v = serde_json::to_value(n).unwrap_or(Value::Null);
            // Inside a list the real server leaves the type to the list.
            if let Some(o) = v.as_object_mut() {
                o.remove("apiVersion");
                o.remove("kind");
            }
            v
        })
        .collect();
    let mut metadata = json!({"resourceVersion": snapshot_rv.to_string()});
    if end < snapshot.len() {
        let token = serde_json::to_vec(&Continue {
            rv: snapshot_rv,
            start: end,
        })
        .unwrap_or_default();
        metadata["continue"] = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(token)
            .into();
        metadata["remainingItemCount"] = (snapshot.len() - end).into();
        store.snapshots.entry(snapshot_rv).or_insert(snapshot);
        // Bounded like the real server's: older paginations then get `410 Expired`.
        while store.snapshots.len() > MAX_SNAPSHOTS {
            store.snapshots.pop_first();
        }
    }
    Ok(json_response(
        StatusCode::OK,
        &json!({"kind": "NodeList", "apiVersion": "v1", "metadata": metadata, "items": items}),
    ))
}

fn watch_nodes(shared: &Arc<Shared>, query: &Query) -> Result<Response<Body>, Refusal> {
    // As in the real server, 0 means "no timeout asked for", not "end at once".
    let timeout = query.number("timeoutSeconds")?.filter(|&t| t > 0);
    let bookmarks = query.flag("allowWatchBookmarks")?;
    if query.flag("sendInitialEvents")? {
        return Err(bad_request(
            "sendInitialEvents is not supported by this stand-in",
        ));
    }
    let from = match query.get("resourceVersion") {
        None | Some("0") => None,
        Some(v) => Some(v.parse::<u64>().map_err(|_| {
            bad_request(&format!(
                "resourceVersion: Invalid value: {v:?}: invalid resource version"
            ))
        })?),
    };
    // Read the backlog and subscribe under one lock, so no change falls between them.
    let store = shared.lock();
    let live = shared.events.subscribe();
    let (backlog, start) = match from {
        None => {
            let lines = store
                .nodes
                .values()
                .map(|n| watch_line("ADDED", &serde_json::to_value(n).unwrap_or(Value::Null)))
                .collect();
            (lines, store.rv)
        }
        Some(rv) if rv < store.floor || shared.expiring.load(Ordering::SeqCst) => {
            let gone = status_json(
                410,
                "Expired",
                &format!("too old resource version: {rv} ({})", store.floor),
            );
            let body = watch_line("ERROR", &gone);
            return Ok(stream_response(single(body)));
        }
        Some(rv) => {
            let lines = store
                .history
                .iter()
                .filter(|c| c.rv > rv)
                .map(|c| c.line.clone())
                .collect();
            (lines, rv.max(store.rv))
        }
    };
    drop(store);
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(64);
    tokio::spawn(pump(tx, backlog, start, live, bookmarks, timeout));
    let body =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
    Ok(stream_response(StreamBody::new(body).boxed()))
}

/// Feeds one watch stream: the backlog, then live changes after `start`, until the timeout
/// (a clean end), a [`Msg::Drop`] (an error, which makes hyper abort the connection without
/// ending the chunked body) or the client going away.
async fn pump(
    tx: mpsc::Sender<Result<Frame<Bytes>, std::io::Error>>,
    backlog: Vec<Bytes>,
    start: u64,
    mut live: broadcast::Receiver<Msg>,
    bookmarks: bool,
    timeout: Option<u64>,
) {
    let deadline = tokio::time::sleep(timeout.map_or(Duration::MAX / 4, Duration::from_secs));
    tokio::pin!(deadline);
    for line in backlog {
        if tx.send(Ok(Frame::data(line))).await.is_err() {
            return;
        }
    }
    loop {
        let msg = tokio::select! {
            _ = &mut deadline => return,
            _ = tx.closed() => return,
            msg = live.recv() => msg,
        };
        let line = match msg {
            Ok(Msg::Change(c)) if c.rv > start => c.line,
            Ok(Msg::Change(_)) => continue,
            Ok(Msg::Bookmark(rv)) if bookmarks => watch_line(
                "BOOKMARK",
                &json!({"kind": "Node", "apiVersion": "v1", "metadata": {"resourceVersion": rv.to_string()}}),
            ),
            Ok(Msg::Bookmark(_)) => continue,
            // A watcher too slow for the buffer is cut off, as the real server does.
            Ok(Msg::Drop) | Err(broadcast::error::RecvError::Lagged(_)) => {
                // hyper drops what it has buffered but not written when the body fails, so
                // first let it take every event sent before the drop (it flushes as soon as
                // the body has nothing more for it): a test that bookmarks and then drops must
                // know the bookmark went out. A client that does not read is cut regardless.
                for _ in 0..1000 {
                    if tx.capacity() == tx.max_capacity() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                tokio::task::yield_now().await;
                let _ = tx
                    .send(Err(std::io::Error::other("watch dropped by the test")))
                    .await;
                return;
            }
            Err(broadcast::error::RecvError::Closed) => return,
        };
        if tx.send(Ok(Frame::data(line))).await.is_err() {
            return;
        }
    }
}

fn single(line: Bytes) -> Body {
    Full::new(line).map_err(|never| match never {}).boxed()
}

fn stream_response(body: Body) -> Response<Body> {
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

fn json_response(code: StatusCode, value: &Value) -> Response<Body> {
    let body = serde_json::to_vec(value).unwrap_or_default();
    let mut resp = stream_response(single(Bytes::from(body)));
    *resp.status_mut() = code;
    resp
}

/// A `Status` object as the real server writes it.
fn status_json(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// An error answer: a `Status` object and its HTTP code.
struct Refusal {
    code: StatusCode,
    status: Value,
}

impl Refusal {
    fn into_response(self) -> Response<Body> {
        json_response(self.code, &self.status)
    }
}

fn status(code: StatusCode, reason: &str, message: &str) -> Refusal {
    Refusal {
        code,
        status: status_json(code.as_u16(), reason, message),
    }
}

fn bad_request(message: &str) -> Refusal {
    status(StatusCode::BAD_REQUEST, "BadRequest", message)
}

fn not_found_path(path: &str) -> Refusal {
    let mut refusal = status(
        StatusCode::NOT_FOUND,
        "NotFound",
        "the server could not find the requested resource",
    );
    refusal.status["details"] = json!({"causes": [{"reason": "UnexpectedServerResponse", "message": format!("404 page not found: {path}")}]});
    refusal
}

fn forbidden(verb: &str, name: Option<&str>) -> Refusal {
    let message = match name {
        Some(n) => format!(
            "nodes \"{n}\" is forbidden: User \"{USER}\" cannot {verb} resource \"nodes\" in API group \"\" at the cluster scope"
        ),
        None => format!(
            "nodes is forbidden: User \"{USER}\" cannot {verb} resource \"nodes\" in API group \"\" at the cluster scope"
        ),
    };
    let mut refusal = status(StatusCode::FORBIDDEN, "Forbidden", &message);
    refusal.status["details"] = match name {
        Some(n) => json!({"name": n, "kind": "nodes"}),
        None => json!({"kind": "nodes"}),
    };
    refusal
}

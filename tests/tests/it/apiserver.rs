//! The API-server stand-in, proven against the real kube client: the same kube and k8s-openapi
//! versions the agent uses, reaching it only through the kubeconfig it writes.
//!
//! The watcher tests drive `kube::runtime::watcher` by hand, one item at a time. A watcher only
//! acts when polled, so a test can break its watch, change the store and only then let it
//! reconnect: what it sees then is decided, not raced.

use std::time::Duration;

use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt as _, watcher as watch_nodes};
use kube::{Client, Config};
use node_agent_tests::agent::TestNode;
use node_agent_tests::apiserver::{ApiServer, Requests};

/// The longest any single step may take before the test fails instead of hanging.
const STEP: Duration = Duration::from_secs(10);

/// A server holding `n-0 .. n-{count-1}`, and a kube client built from its kubeconfig.
async fn setup(count: u32) -> (ApiServer, Client, tempfile::TempDir) {
    let server = ApiServer::start().expect("starting the stand-in");
    for i in 0..count {
        server.apply(TestNode::v4(&format!("n-{i:03}"), i).k8s());
    }
    let dir = tempfile::tempdir().unwrap();
    let path = server.kubeconfig(dir.path()).unwrap();
    let kubeconfig = Kubeconfig::read_from(&path).expect("reading the kubeconfig");
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("a config from the kubeconfig");
    assert_eq!(config.cluster_url.scheme_str(), Some("http"));
    let client = Client::try_from(config).expect("a client");
    (server, client, dir)
}

fn name(n: &Node) -> &str {
    n.metadata.name.as_deref().unwrap()
}

/// The next item of `stream`, failing the test after [`STEP`].
async fn next<S: Stream + Unpin>(stream: &mut S) -> S::Item {
    tokio::time::timeout(STEP, stream.next())
        .await
        .expect("timed out waiting for the watcher")
        .expect("the watcher stream ended")
}

/// The next event, skipping (and returning) the errors before it.
async fn next_event<S>(stream: &mut S) -> (Event<Node>, Vec<String>)
where
    S: Stream<Item = Result<Event<Node>, watcher::Error>> + Unpin,
{
    let mut errors = Vec::new();
    loop {
        match next(stream).await {
            Ok(e) => return (e, errors),
            Err(e) => errors.push(e.to_string()),
        }
    }
}

/// Reads one full initial list: `Init`, `InitApply`..., `InitDone`; returns the names.
async fn initial_list<S>(stream: &mut S) -> (Vec<String>, Vec<String>)
where
    S: Stream<Item = Result<Event<Node>, watcher::Error>> + Unpin,
{
    let (first, mut errors) = next_event(stream).await;
    assert!(matches!(first, Event::Init), "expected Init, got {first:?}");
    let mut names = Vec::new();
    loop {
        let (event, more) = next_event(stream).await;
        errors.extend(more);
        match event {
            Event::InitApply(n) => names.push(name(&n).to_owned()),
            Event::InitDone => return (names, errors),
            other => panic!("expected InitApply or InitDone, got {other:?}"),
        }
    }
}

/// Makes sure the watcher has its watch open: after `InitDone` it only opens it when polled
/// again, and a test that breaks "the watch" before that would break nothing.
async fn watching<S>(server: &ApiServer, stream: &mut S)
where
    S: Stream<Item = Result<Event<Node>, watcher::Error>> + Unpin,
{
    server.apply(TestNode::v4("w-open", 200).k8s());
    match next(stream).await.unwrap() {
        Event::Apply(n) => assert_eq!(name(&n), "w-open"),
        other => panic!("expected Apply, got {other:?}"),
    }
}

fn names(prefix_count: u32) -> Vec<String> {
    (0..prefix_count).map(|i| format!("n-{i:03}")).collect()
}

#[tokio::test]
async fn paginated_list_is_complete_and_consistent() {
    let (server, client, _dir) = setup(250).await;
    let api = Api::<Node>::all(client);
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    let mut pages = Vec::new();
    loop {
        let mut lp = ListParams::default().limit(100);
        if let Some(t) = token.take() {
            lp = lp.continue_token(&t);
        }
        let page = api.list(&lp).await.expect("a page");
        pages.push(page.items.len());
        if seen.is_empty() {
            // Changes between pages must not show in them: the list is one snapshot.
            server.apply(TestNode::v4("a-added-between-pages", 999).k8s());
            server.delete("n-249");
        }
        assert_eq!(page.metadata.resource_version.as_deref(), Some("250"));
        for n in &page.items {
            assert!(
                n.metadata
                    .managed_fields
                    .as_ref()
                    .is_some_and(|m| !m.is_empty()),
                "stored nodes carry managedFields"
            );
            seen.push(name(n).to_owned());
        }
        match page.metadata.continue_ {
            Some(t) if !t.is_empty() => token = Some(t),
            _ => break,
        }
    }
    assert_eq!(pages, [100, 100, 50]);
    assert_eq!(seen, names(250));
    assert_eq!(server.requests().list, 3);

    // The next list is at the new version and shows the changes.
    let all = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(all.items.len(), 250);
    assert_eq!(all.metadata.resource_version.as_deref(), Some("252"));
    assert_eq!(name(&all.items[0]), "a-added-between-pages");
}

#[tokio::test]
async fn continue_token_from_before_compaction_is_gone() {
    let (server, client, _dir) = setup(5).await;
    let api = Api::<Node>::all(client);
    let first = api.list(&ListParams::default().limit(2)).await.unwrap();
    let token = first.metadata.continue_.unwrap();
    assert_eq!(first.metadata.remaining_item_count, Some(3));
    server.compact();
    let err = api
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .expect_err("a compacted continue token must fail");
    match err {
        kube::Error::Api(s) => {
            assert_eq!(s.code, 410);
            assert_eq!(s.reason, "Expired");
        }
        other => panic!("expected a 410 Status, got {other:?}"),
    }
}

#[tokio::test]
async fn watcher_lists_then_follows_changes() {
    let (server, client, _dir) = setup(3).await;
    let mut stream = watch_nodes(Api::<Node>::all(client), watcher::Config::default()).boxed();
    let (listed, errors) = initial_list(&mut stream).await;
    assert_eq!(listed, names(3));
    assert!(errors.is_empty(), "{errors:?}");

    server.add(TestNode::v4("n-003", 3).k8s());
    match next(&mut stream).await.unwrap() {
        Event::Apply(n) => {
            assert_eq!(name(&n), "n-003");
            assert!(n.metadata.managed_fields.is_some());
        }
        other => panic!("expected Apply, got {other:?}"),
    }
    let mut changed = TestNode::v4("n-001", 1).k8s();
    changed.spec.as_mut().unwrap().pod_cidr = Some("10.200.0.0/24".into());
    let rv = server.update(changed);
    match next(&mut stream).await.unwrap() {
        Event::Apply(n) => {
            assert_eq!(name(&n), "n-001");
            assert_eq!(n.spec.unwrap().pod_cidr.as_deref(), Some("10.200.0.0/24"));
            assert_eq!(n.metadata.resource_version, Some(rv.to_string()));
        }
        other => panic!("expected Apply, got {other:?}"),
    }
    server.delete("n-000");
    match next(&mut stream).await.unwrap() {
        Event::Delete(n) => assert_eq!(name(&n), "n-000"),
        other => panic!("expected Delete, got {other:?}"),
    }
    assert_eq!(
        server.requests(),
        Requests {
            list: 1,
            watch: 1,
            get: 0,
            probe: 0,
        }
    );
}

#[tokio::test]
async fn watcher_relists_after_compaction_and_sees_deletes_it_missed() {
    let (server, client, _dir) = setup(3).await;
    let mut stream = watch_nodes(Api::<Node>::all(client), watcher::Config::default()).boxed();
    initial_list(&mut stream).await;
    watching(&server, &mut stream).await;
    let before = server.requests();

    // Broken while the watcher is not looking: a delete it never gets as an event.
    server.drop_watches();
    server.delete("n-001");
    server.compact();

    let (listed, errors) = initial_list(&mut stream).await;
    assert_eq!(listed, ["n-000", "n-002", "w-open"]);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("too old resource version")),
        "the resumed watch must end in 410 Expired: {errors:?}"
    );
    let after = server.requests();
    assert_eq!(after.list, before.list + 1, "one relist");
    assert_eq!(after.watch, before.watch + 1, "one failed resume");

    // And it keeps following from the relist.
    server.apply(TestNode::v4("n-009", 9).k8s());
    match next_event(&mut stream).await.0 {
        Event::Apply(n) => assert_eq!(name(&n), "n-009"),
        other => panic!("expected Apply, got {other:?}"),
    }
}

#[tokio::test]
async fn watcher_resumes_a_dropped_watch_without_relisting() {
    let (server, client, _dir) = setup(3).await;
    let mut stream = watch_nodes(Api::<Node>::all(client), watcher::Config::default()).boxed();
    initial_list(&mut stream).await;
    watching(&server, &mut stream).await;
    let before = server.requests();

    server.drop_watches();
    server.delete("n-002");
    server.apply(TestNode::v4("n-003", 3).k8s());

    // kube reads a chunked body cut short as the end of the watch, not as an error: it just
    // watches again from the last version it saw.
    let (event, errors) = next_event(&mut stream).await;
    match event {
        Event::Delete(n) => assert_eq!(name(&n), "n-002"),
        other => panic!("expected Delete, got {other:?}"),
    }
    assert!(errors.is_empty(), "{errors:?}");
    match next_event(&mut stream).await.0 {
        Event::Apply(n) => assert_eq!(name(&n), "n-003"),
        other => panic!("expected Apply, got {other:?}"),
    }
    let after = server.requests();
    assert_eq!(after.list, before.list, "no relist");
    assert_eq!(after.watch, before.watch + 1, "one resumed watch");
}

#[tokio::test]
async fn watcher_resumes_from_a_bookmark() {
    let (server, client, _dir) = setup(2).await;
    let mut stream = watch_nodes(Api::<Node>::all(client), watcher::Config::default()).boxed();
    initial_list(&mut stream).await;
    watching(&server, &mut stream).await;
    let before = server.requests();
    // The bookmark moves the watcher's version up to the compaction point, so it can resume
    // from there; without it the resume would get 410 and relist.
    server.compact();
    server.bookmark();
    server.drop_watches();
    server.apply(TestNode::v4("n-003", 3).k8s());
    match next_event(&mut stream).await.0 {
        Event::Apply(n) => assert_eq!(name(&n), "n-003"),
        other => panic!("expected Apply, got {other:?}"),
    }
    assert_eq!(server.requests().list, before.list, "no relist");
}

#[tokio::test]
async fn forbidden_fails_the_watcher_until_lifted() {
    let (server, client, _dir) = setup(3).await;
    server.set_forbidden(true);
    let mut stream = watch_nodes(Api::<Node>::all(client), watcher::Config::default())
        .default_backoff()
        .boxed();
    // kube 5's watcher says `Init` before it tries to list, so `Init` alone proves nothing;
    // what must never come while forbidden is an object or `InitDone`.
    let mut errors = Vec::new();
    while errors.len() < 2 {
        match next(&mut stream).await {
            Ok(Event::Init) => {}
            Ok(other) => panic!("nothing but Init may come while forbidden, got {other:?}"),
            Err(e) => errors.push(e.to_string()),
        }
    }
    for e in &errors {
        assert!(
            e.contains("forbidden") && e.contains("403"),
            "a 403 error naming the denial: {e}"
        );
    }
    server.set_forbidden(false);
    let mut listed = Vec::new();
    loop {
        match next(&mut stream).await.expect("no error once allowed") {
            Event::Init => listed.clear(),
            Event::InitApply(n) => listed.push(name(&n).to_owned()),
            Event::InitDone => break,
            other => panic!("expected the initial list, got {other:?}"),
        }
    }
    assert_eq!(listed, names(3));
    assert!(server.requests().list >= 3);
}

#[tokio::test]
async fn raw_watch_events_bookmarks_expiry_and_timeout() {
    let (server, client, _dir) = setup(2).await;
    let api = Api::<Node>::all(client);
    let list = api.list(&ListParams::default()).await.unwrap();
    let rv = list.metadata.resource_version.unwrap();
    let wp = WatchParams::default().timeout(2);
    let mut events = api.watch(&wp, &rv).await.unwrap().boxed();
    server.apply(TestNode::v4("n-002", 2).k8s());
    server.bookmark();
    server.delete("n-000");
    let added = next(&mut events).await.unwrap();
    assert!(
        matches!(&added, WatchEvent::Added(n) if name(n) == "n-002"),
        "{added:?}"
    );
    match next(&mut events).await.unwrap() {
        WatchEvent::Bookmark(b) => assert_eq!(b.metadata.resource_version, "3"),
        other => panic!("expected Bookmark, got {other:?}"),
    }
    match next(&mut events).await.unwrap() {
        WatchEvent::Deleted(n) => {
            assert_eq!(name(&n), "n-000");
            assert_eq!(n.metadata.resource_version.as_deref(), Some("4"));
        }
        other => panic!("expected Deleted, got {other:?}"),
    }
    // timeoutSeconds ends the stream cleanly.
    let end = tokio::time::timeout(STEP, events.next()).await.unwrap();
    assert!(end.is_none(), "{end:?}");

    // From before a compaction: one ERROR event with a 410 Status, then the end.
    server.compact();
    let mut events = api.watch(&wp, &rv).await.unwrap().boxed();
    match next(&mut events).await.unwrap() {
        WatchEvent::Error(s) => {
            assert_eq!(s.code, 410);
            assert_eq!(s.reason, "Expired");
        }
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }
    assert!(
        tokio::time::timeout(STEP, events.next())
            .await
            .unwrap()
            .is_none()
    );

    // Without a version: a synthetic ADDED per node, then live events.
    let mut events = api.watch(&wp, "0").await.unwrap().boxed();
    let mut added = Vec::new();
    for _ in 0..2 {
        match next(&mut events).await.unwrap() {
            WatchEvent::Added(n) => added.push(name(&n).to_owned()),
            other => panic!("expected Added, got {other:?}"),
        }
    }
    assert_eq!(added, ["n-001", "n-002"]);
}

/// Sends one raw HTTP/1.1 request and returns the status code and the body.
async fn raw(server: &ApiServer, request: &str) -> (u16, serde_json::Value) {
    use std::io::{Read as _, Write as _};
    let (addr, request) = (server.addr(), request.to_owned());
    let out = tokio::task::spawn_blocking(move || {
        let mut conn = std::net::TcpStream::connect(addr).unwrap();
        conn.set_read_timeout(Some(STEP)).unwrap();
        conn.write_all(request.as_bytes()).unwrap();
        let mut out = Vec::new();
        conn.read_to_end(&mut out).unwrap();
        out
    })
    .await
    .unwrap();
    let text = String::from_utf8(out).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    let code = head.split(' ').nth(1).unwrap().parse().unwrap();
    (code, serde_json::from_str(body).unwrap())
}

fn get(path: &str, token: bool) -> String {
    let auth = if token {
        format!(
            "Authorization: Bearer {}\r\n",
            node_agent_tests::apiserver::TOKEN
        )
    } else {
        String::new()
    };
    format!("GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n")
}

#[tokio::test]
async fn bad_requests_get_status_objects() {
    let (server, _client, _dir) = setup(1).await;
    for (request, code, reason) in [
        (get("/api/v1/nodes", false), 401, "Unauthorized"),
        (get("/api/v1/nodes?limit=ten", true), 400, "BadRequest"),
        (get("/api/v1/nodes?continue=%ZZ!!", true), 400, "BadRequest"),
        (
            get("/api/v1/nodes?continue=x&resourceVersion=5", true),
            400,
            "BadRequest",
        ),
        (
            get("/api/v1/nodes?watch=true&resourceVersion=abc", true),
            400,
            "BadRequest",
        ),
        (get("/api/v1/nodes?watch=maybe", true), 400, "BadRequest"),
        (
            get("/api/v1/nodes?resourceVersion=99", true),
            504,
            "Timeout",
        ),
        (get("/api/v1/pods", true), 404, "NotFound"),
        (get("/api/v1/nodes/nope", true), 404, "NotFound"),
        (
            "DELETE /api/v1/nodes/n-000 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".into(),
            405,
            "MethodNotAllowed",
        ),
    ] {
        let (got, body) = raw(&server, &request).await;
        assert_eq!(got, code, "{request}: {body}");
        assert_eq!(body["kind"], "Status", "{body}");
        assert_eq!(body["apiVersion"], "v1");
        assert_eq!(body["status"], "Failure");
        assert_eq!(body["reason"], reason, "{request}: {body}");
        assert_eq!(body["code"], code);
    }
    server.set_forbidden(true);
    let (code, body) = raw(&server, &get("/api/v1/nodes", true)).await;
    assert_eq!(code, 403);
    assert_eq!(
        body["message"],
        "nodes is forbidden: User \"system:serviceaccount:kube-system:node-agent\" cannot list \
         resource \"nodes\" in API group \"\" at the cluster scope"
    );
    // The node is still served once allowed; list items carry no apiVersion/kind.
    server.set_forbidden(false);
    let (code, body) = raw(&server, &get("/api/v1/nodes", true)).await;
    assert_eq!(code, 200);
    assert_eq!(body["kind"], "NodeList");
    assert!(body["items"][0].get("kind").is_none());
    assert_eq!(body["items"][0]["metadata"]["resourceVersion"], "1");
    let (code, body) = raw(&server, &get("/api/v1/nodes/n-000", true)).await;
    assert_eq!(code, 200);
    assert_eq!(body["kind"], "Node");
}

/// A server started inside a network namespace listens on that namespace's loopback only: a
/// client in the sandbox reaches it, the host does not.
#[test]
fn listens_in_the_callers_network_namespace() {
    if let Err(why) = node_agent_tests::can_sandbox() {
        node_agent_tests::skip(node_agent_tests::test_name!(), &why);
        return;
    }
    // Spawned from the test's thread, so in the host's namespace.
    let (to_host, addrs) = std::sync::mpsc::channel::<std::net::SocketAddr>();
    let (answer, reachable) = std::sync::mpsc::channel();
    let host = std::thread::spawn(move || {
        let addr = addrs.recv().unwrap();
        answer
            .send(std::net::TcpStream::connect(addr).is_ok())
            .unwrap();
    });
    let (listed, from_host) = node_agent_tests::sandbox(move |_| {
        let server = ApiServer::start().unwrap();
        server.apply(TestNode::v4("n-000", 0).k8s());
        let dir = tempfile::tempdir().unwrap();
        let path = server.kubeconfig(dir.path()).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listed = runtime.block_on(async {
            let kubeconfig = Kubeconfig::read_from(&path).unwrap();
            let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .unwrap();
            let api = Api::<Node>::all(Client::try_from(config).unwrap());
            let lp = ListParams::default();
            let list = tokio::time::timeout(STEP, api.list(&lp)).await;
            list.unwrap().unwrap().items.len()
        });
        to_host.send(server.addr()).unwrap();
        (listed, reachable.recv().unwrap())
    });
    host.join().unwrap();
    assert_eq!(listed, 1, "reachable inside the sandbox");
    assert!(!from_host, "unreachable from the host's namespace");
}

/// `drop_watches` cuts a watch the way a crash does: the chunked body never gets its final
/// empty chunk. Driven from plain synchronous code, as end-to-end tests do.
#[test]
fn drop_watches_cuts_the_chunked_body() {
    use std::io::{Read as _, Write as _};
    let server = ApiServer::start().unwrap();
    server.apply(TestNode::v4("n-000", 0).k8s());
    let mut conn = std::net::TcpStream::connect(server.addr()).unwrap();
    conn.set_read_timeout(Some(STEP)).unwrap();
    conn.write_all(get("/api/v1/nodes?watch=true&resourceVersion=0", true).as_bytes())
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"type\":\"ADDED\"") {
        let n = conn.read(&mut buf).unwrap();
        assert!(n > 0, "the watch ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&seen).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    server.drop_watches();
    loop {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
    assert!(
        !seen.ends_with(b"0\r\n\r\n"),
        "the body must be cut, not ended: {}",
        String::from_utf8_lossy(&seen)
    );
}

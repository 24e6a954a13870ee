//! The agent's Kubernetes source in-process against the API-server stand-in: every event it
//! sends is folded into a live view and a readiness the way the daemon folds them
//! (`node-agent/src/agent/intake.rs`), and checked after each one, so no moment of readiness
//! goes unseen. Nothing here needs root or the kernel.
//!
//! The waits are bounded by the source's backoff (the stand-in counts the probes the source
//! makes), never by how fast the machine is: readiness comes back by the source's own probe
//! within a known number of backoff periods, or the test says how many probes it saw.

use std::time::{Duration, Instant};

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use node_agent::source::kube::{KubeSource, MAX_BACKOFF};
use node_agent::source::live::LiveState;
use node_agent::source::{SourceEvent, SourceRequest};
use node_agent::telemetry::Telemetry;
use node_agent_tests::agent::TestNode;
use node_agent_tests::apiserver::{ApiServer, Kind};
use tokio::sync::mpsc;

/// Room for a slow machine on top of the backoff's own waits.
const SLACK: Duration = Duration::from_secs(30);

/// The source running against `server`, and what the daemon would make of its events.
struct Agent {
    events: mpsc::Receiver<SourceEvent>,
    _requests: mpsc::Sender<SourceRequest>,
    live: LiveState,
    telemetry: Telemetry,
    /// Every event since the last [`Agent::take_seen`].
    seen: Vec<SourceEvent>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Agent {
    async fn start(server: &ApiServer, dir: &std::path::Path) -> Self {
        let path = server.kubeconfig(dir).unwrap();
        let kubeconfig = Kubeconfig::read_from(&path).unwrap();
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .unwrap();
        let client = Client::try_from(config).unwrap();
        let (tx, events) = mpsc::channel(1024);
        let (requests, rx) = mpsc::channel(1);
        let task = tokio::spawn(KubeSource { kubeconfig: None }.run(client, tx, rx));
        let telemetry = Telemetry::new(Duration::MAX);
        // The kernel side is fine throughout: readiness is the source's alone.
        telemetry.set_reconciled(Ok(()));
        Self {
            events,
            _requests: requests,
            live: LiveState::new("n-0"),
            telemetry,
            seen: Vec::new(),
            task,
        }
    }

    /// Whether the agent would answer `/readyz` with 200.
    fn ready(&self) -> bool {
        self.telemetry.ready().is_ok()
    }

    /// Takes in the next event, as the daemon's intake does; `None` after `until`.
    async fn next(&mut self, until: Instant) -> Option<SourceEvent> {
        let left = until.saturating_duration_since(Instant::now());
        let ev = tokio::time::timeout(left, self.events.recv())
            .await
            .ok()?
            .expect("the source ended");
        self.live.apply(ev.clone());
        self.telemetry.set_source_failing(self.live.failing());
        self.seen.push(ev.clone());
        Some(ev)
    }

    fn take_seen(&mut self) -> Vec<SourceEvent> {
        std::mem::take(&mut self.seen)
    }

    /// Synced, ready, and with its watch open on `server`.
    async fn settle(&mut self, server: &ApiServer) {
        let until = Instant::now() + SLACK;
        while !self.live.synced() {
            self.next(until).await.expect("synced within the slack");
        }
        assert!(self.ready(), "{:?}", self.telemetry.ready());
        // The watcher opens its watch when polled after `InitDone`; a change it passes on says
        // the watch is open, so the test's drop does cut it.
        server.apply(TestNode::v4("n-9", 9).k8s());
        // The change's resourceVersion is announced before it.
        let ev = loop {
            let ev = self
                .next(until)
                .await
                .expect("the watch passes a change on");
            if !matches!(ev, SourceEvent::Revision(_)) {
                break ev;
            }
        };
        assert!(
            matches!(&ev, SourceEvent::Apply(n) if n.name == "n-9"),
            "expected the change, got {ev:?}"
        );
        self.take_seen();
    }
}

/// A stand-in holding two nodes, and an agent settled on it (its state directory kept with it).
async fn settled_on_two_nodes() -> (ApiServer, tempfile::TempDir, Agent) {
    let server = ApiServer::start().unwrap();
    server.apply(TestNode::v4("n-0", 1).k8s());
    server.apply(TestNode::v4("n-1", 2).k8s());
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(&server, dir.path()).await;
    agent.settle(&server).await;
    (server, dir, agent)
}

/// The nominal backoff periods (1 s doubling, capped) of the first `n` failures: what the
/// source may wait through, at most, before its `n+1`-th attempt.
fn backoff_periods(n: u32) -> Duration {
    (0..n)
        .map(|i| Duration::from_secs(1 << i.min(6)).min(MAX_BACKOFF))
        .sum()
}

/// The watch fails (403), the probe after it fails, the watch then resumes quietly and the API
/// server sends nothing at all: no node changes. The agent must still become ready, by its own
/// probes, within the backoff periods of the failures it saw. Before, the one probe after the
/// error was all, and the source stayed failing until the next node event: forever here.
#[tokio::test]
async fn a_quiet_recovery_is_found_by_the_agents_own_probes() {
    let (server, _dir, mut agent) = settled_on_two_nodes().await;
    let before = server.requests();
    let rv = server.resource_version();

    // The watch's resumption is refused once, and the first two probes; then all is allowed.
    const FAILED_PROBES: u64 = 2;
    server.forbid_next(Kind::Watch, 1);
    server.forbid_next(Kind::Probe, FAILED_PROBES);
    server.drop_watches();

    // One failure of the watch and FAILED_PROBES of probes, each a backoff period.
    let bound = backoff_periods(1 + FAILED_PROBES as u32) + SLACK;
    let began = Instant::now();
    let until = began + bound;
    let mut failed = false;
    while !(failed && agent.ready()) {
        let Some(ev) = agent.next(until).await else {
            panic!(
                "not ready {:.1} s after the watch failed (bound {bound:?}): {} probes, events {:?}; \
                 a failure must be ended by the agent's own probe, not by an event",
                began.elapsed().as_secs_f64(),
                server.requests().probe - before.probe,
                agent.seen,
            );
        };
        if matches!(ev, SourceEvent::Error(_)) {
            failed = true;
        }
        if failed && !matches!(ev, SourceEvent::Healthy) {
            assert!(!agent.ready(), "ready on {ev:?} before any probe succeeded");
        }
    }
    let after = server.requests();
    let probes = after.probe - before.probe;
    node_agent_tests::report(&format!(
        "quiet recovery: ready {:.1} s after the watch failed, by probe {probes} ({FAILED_PROBES} refused), no node event",
        began.elapsed().as_secs_f64()
    ));
    let seen = agent.take_seen();
    assert!(
        matches!(seen.as_slice(), [SourceEvent::Error(e), SourceEvent::Healthy] if e.contains("forbidden (403)")),
        "one error, then the probe's Healthy, and nothing else: {seen:?}"
    );
    assert_eq!(
        probes,
        FAILED_PROBES + 1,
        "probes until one succeeds, and no more"
    );
    assert_eq!(
        after.list - after.probe,
        before.list - before.probe,
        "no relist"
    );
    assert_eq!(server.resource_version(), rv, "no node event");
    // And it stays ready, with no more probes, on a quiet watch.
    assert!(
        agent
            .next(Instant::now() + Duration::from_secs(2))
            .await
            .is_none()
    );
    assert!(agent.ready());
    assert_eq!(server.requests().probe, after.probe);
}

/// Lists that keep failing (every one `403`, probes too) after a compaction: the watcher
/// relists, saying `Init` before each list attempt. Readiness must stay false through every
/// one of them until a check succeeds; before, each `Init` made the agent ready until its list
/// failed. Checked after every event the source sends, so no flap goes unseen.
#[tokio::test]
async fn readiness_does_not_flap_on_list_attempts_that_fail() {
    let (server, _dir, mut agent) = settled_on_two_nodes().await;
    let before = server.requests();

    server.forbid_next(Kind::List, u64::MAX);
    server.compact();
    server.drop_watches();

    // The resumed watch gets 410, then each list attempt fails after its wait: three failures.
    const ATTEMPTS: usize = 2;
    let began = Instant::now();
    let until = began + backoff_periods(2 * ATTEMPTS as u32 + 1) + SLACK;
    let mut failed = false;
    let mut inits = 0;
    let mut errors = 0;
    while inits < ATTEMPTS || errors <= ATTEMPTS {
        let Some(ev) = agent.next(until).await else {
            panic!(
                "{inits} list attempts and {errors} errors in {:.1} s; events {:?}",
                began.elapsed().as_secs_f64(),
                agent.seen
            );
        };
        match ev {
            SourceEvent::Error(_) => {
                failed = true;
                errors += 1;
            }
            SourceEvent::Init => inits += 1,
            _ => {}
        }
        if failed {
            assert!(
                !agent.ready(),
                "ready on {ev:?} while every list fails; events {:?}",
                agent.seen
            );
        }
    }
    let lists = server.requests().list - before.list;
    node_agent_tests::report(&format!(
        "failing list attempts: {inits} Init, {errors} errors, {lists} lists refused, never ready, in {:.1} s",
        began.elapsed().as_secs_f64()
    ));

    // Lists are allowed again: the next attempt or probe makes it ready.
    server.forbid_next(Kind::List, 0);
    let until = Instant::now() + MAX_BACKOFF + SLACK;
    while !agent.ready() {
        agent
            .next(until)
            .await
            .expect("ready again within a backoff period of lists being allowed");
    }
}

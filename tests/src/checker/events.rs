//! The event-sized mode: each step runs the daemon behind the Kubernetes API-server stand-in,
//! and the step's changes reach it as watch events while it runs, so that it plans them
//! event-sized (scopes, the claim index, spliced records) where the one-shot runs plan in full.
//!
//! A step's daemon starts, reconciles what the last step left (a restart: a full plan), is
//! shown the step's changes, and is stopped by SIGTERM once at rest. "At rest" is the daemon's
//! own word, not a time: `node_agent_source_revision` says which resourceVersion its last
//! finished reconcile planned from, and the step waits until that is the server's newest.
//! A daemon at rest answers for a one-shot run's exit status with its metrics: 3 while the
//! brake holds or the local node is missing, as `run --once` would exit.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::time::{Duration, Instant};

use super::model::{API_FAILURES, Action};
use super::once::{
    Acted, PATIENCE, cut, cut_fired, kill_after_reconcile, lose_records, reconciles, stop, unsynced,
};
use super::oracle::{Confirmed, Snapshot};
use super::outcome::Outcome;
use crate::agent::{AgentEnv, Daemon, TestNode, k8s_node, metric, scrape_metrics};
use crate::apiserver::ApiServer;
use node_agent::runtime::cut::CUT_ENV;

/// Where a step's daemon serves its metrics (in the history's own network namespace).
const METRICS: &str = "127.0.0.1:9968";

/// The API server a history's daemons watch, and the nodes it holds.
pub struct Cluster {
    server: ApiServer,
    served: BTreeMap<String, TestNode>,
}

impl Cluster {
    /// Starts the stand-in and points `env`'s agent at it.
    pub fn start(env: &mut AgentEnv) -> Self {
        let server = ApiServer::start().expect("starting the API server stand-in");
        let dir = env
            .state_dir
            .parent()
            .expect("a sandbox directory")
            .to_owned();
        env.kubeconfig = Some(server.kubeconfig(&dir).expect("writing the kubeconfig"));
        Self {
            server,
            served: BTreeMap::new(),
        }
    }

    /// `list` as an API server can hold it: one node per name, the first item standing.
    pub fn servable(list: &[TestNode]) -> Vec<TestNode> {
        let mut seen = std::collections::BTreeSet::new();
        list.iter()
            .filter(|n| seen.insert(n.name.clone()))
            .cloned()
            .collect()
    }

    /// Makes the server hold `list` (servable): nodes gone deleted, new ones added, changed ones
    /// updated, and one of another UID under a name deleted and added again, as a replaced
    /// node is. Returns the newest resourceVersion of the changes, if anything changed.
    pub fn serve(&mut self, list: &[TestNode]) -> Option<u64> {
        let want: BTreeMap<&str, &TestNode> = list.iter().map(|n| (n.name.as_str(), n)).collect();
        let mut newest = None;
        let gone: Vec<String> = self
            .served
            .keys()
            .filter(|name| !want.contains_key(name.as_str()))
            .cloned()
            .collect();
        for name in gone {
            newest = newest.max(self.server.delete(&name));
            self.served.remove(&name);
        }
        for (name, n) in want {
            match self.served.get(name) {
                Some(old) if old == n => continue,
                Some(old) if old.uid() != n.uid() => {
                    newest = newest.max(self.server.delete(name));
                }
                _ => {}
            }
            newest = newest.max(Some(self.server.apply(k8s_node(n))));
            self.served.insert(name.to_owned(), n.clone());
        }
        newest
    }

    /// The newest resourceVersion among the nodes the server holds: what a fresh list brings.
    fn listed(&self) -> u64 {
        self.served
            .keys()
            .filter_map(|name| self.server.node(name))
            .filter_map(|n| n.metadata.resource_version?.parse().ok())
            .max()
            .unwrap_or(0)
    }
}

/// Makes `server` fail every request as `failure` (of [`API_FAILURES`]) says, or stop.
fn fail(server: &ApiServer, failure: &str, on: bool) {
    match failure {
        "500" => server.set_failing(on),
        "403" => server.set_forbidden(on),
        "401" => server.set_revoked(on),
        "closed" => server.set_unreachable(on),
        other => unreachable!("no API failure {other}"),
    }
}

/// How a wait on a daemon ended.
enum Rest {
    /// Its last finished reconcile planned from the resourceVersion waited for; its metrics.
    At(String),
    /// It exited first, with this status.
    Exited(i32),
    /// It did neither within [`PATIENCE`].
    Stuck,
}

/// Waits until `d` has reconciled resourceVersion `version`, and at least once.
fn rest(d: &mut Daemon, version: u64) -> Rest {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Ok(Some(status)) = d.0.try_wait() {
            return Rest::Exited(status.code().unwrap_or(-1));
        }
        let text = scrape_metrics(METRICS);
        // A first reconcile finished too: before it, the gauge's 0 reflects nothing (a
        // cluster without a node has no version to wait for).
        let reconciled =
            metric(&text, "node_agent_reconcile_duration_seconds_count").is_some_and(|n| n >= 1.0);
        if reconciled
            && metric(&text, "node_agent_source_revision").is_some_and(|v| v >= version as f64)
        {
            return Rest::At(text);
        }
        if Instant::now() > deadline {
            return Rest::Stuck;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs the step's daemon as `action` says, showing it `list` (servable) through the server.
/// `broke` gets what a daemon did that no agent may (stuck, or not stopping on SIGTERM).
pub(super) fn act(
    env: &AgentEnv,
    cluster: &mut Cluster,
    action: &Action,
    list: &[TestNode],
    args: &[&str],
    seen: &mut Outcome,
    broke: &mut Vec<String>,
) -> Acted {
    let log_before = std::fs::read_to_string(env.log()).map_or(0, |l| l.len());
    lose_records(env, action);
    let forced = *action == Action::OnceForced;
    // The first step's cluster, and a forced step's changes, are there when the daemon starts:
    // `--force-prune` confirms its first plan only.
    if forced || cluster.served.is_empty() {
        cluster.serve(list);
    }
    if forced {
        seen.confirmations += 1;
    }
    let mut daemon_args = args.to_vec();
    daemon_args.extend(["--metrics-addr", METRICS, "--debounce", "0s"]);
    if forced {
        daemon_args.push("--force-prune");
    }
    let cut = cut(action);
    let cut_env: Vec<(&str, &OsStr)> = cut
        .as_deref()
        .map(|c| (CUT_ENV, OsStr::new(c)))
        .into_iter()
        .collect();
    // A source that never completes a list: the server fails every request, from the start.
    if let Action::Unsynced { ms, how } = action {
        let failure = API_FAILURES[how % API_FAILURES.len()];
        fail(&cluster.server, failure, true);
        let d = env.spawn(&daemon_args);
        cluster.serve(list);
        let acted = unsynced(d, *ms, seen, broke);
        fail(&cluster.server, failure, false);
        return acted;
    }
    let mut d = env.spawn_with_env(&cut_env, &daemon_args);
    let ended = |seen: &mut Outcome| {
        seen.crashes += 1;
        Acted {
            exit: None,
            waiting: Default::default(),
            shown: None,
            confirmed: None,
        }
    };
    match action {
        Action::KilledDaemon { ms } => {
            cluster.serve(list);
            std::thread::sleep(Duration::from_millis(*ms));
            let _ = d.kill();
            let _ = d.wait();
            return ended(seen);
        }
        Action::KilledAfterApply { us } => {
            let mut shown = None;
            if let Rest::At(_) = rest(&mut d, cluster.listed()) {
                // What the daemon did at its start it did to the last step's list.
                shown = Some(Snapshot::take(env));
                let before = reconciles(env);
                cluster.serve(list);
                kill_after_reconcile(env, d, before, *us);
            }
            return Acted {
                shown,
                ..ended(seen)
            };
        }
        _ => {}
    }
    let mut at_rest = rest(&mut d, cluster.listed());
    let mut shown = None;
    if let Rest::At(_) = at_rest {
        // What the daemon did at its start it did to the last step's list.
        shown = Some(Snapshot::take(env));
        if let Some(version) = cluster.serve(list) {
            at_rest = rest(&mut d, version);
        }
    }
    // An operator confirms the hold the daemon rests with (invariant 16), once.
    let mut confirmed = None;
    if *action == Action::Confirmed
        && let Rest::At(metrics) = &at_rest
        && metric(metrics, "node_agent_brake_held").is_some_and(|v| v > 0.0)
    {
        match confirm(env, &mut d) {
            Ok((hold, metrics)) => {
                seen.confirmations += 1;
                seen.confirmed_holds += 1;
                confirmed = Some(hold);
                at_rest = Rest::At(metrics);
            }
            Err(e) => broke.push(e),
        }
    }
    // The daemon at rest answers for the exit status a one-shot run would give.
    let exit = match at_rest {
        Rest::At(metrics) => {
            let held = metric(&metrics, "node_agent_brake_held").is_some_and(|v| v > 0.0);
            let no_local =
                metric(&metrics, "node_agent_local_node_missing").is_some_and(|v| v > 0.0);
            seen.holds += usize::from(held);
            match stop(d) {
                Some(0) if held || no_local => Some(3),
                Some(code) => Some(code),
                None => {
                    broke.push(format!(
                        "the daemon did not exit in {PATIENCE:?} after SIGTERM"
                    ));
                    None
                }
            }
        }
        Rest::Exited(code) => Some(code),
        Rest::Stuck => {
            broke.push(format!(
                "the daemon did not reflect the server's resourceVersion in {PATIENCE:?}"
            ));
            None
        }
    };
    // Changes a daemon that ended early did not see are the next step's daemon's to see.
    cluster.serve(list);
    let log = std::fs::read_to_string(env.log()).unwrap_or_default();
    match cut_fired(log.get(log_before..).unwrap_or_default()) {
        Some(true) => ended(seen),
        Some(false) => {
            seen.failed_ops += 1;
            Acted {
                exit: None,
                waiting: Default::default(),
                shown,
                confirmed,
            }
        }
        None => Acted {
            exit,
            waiting: Default::default(),
            shown,
            confirmed,
        },
    }
}

/// Confirms the hold daemon `d` rests with, as an operator does (`node-agent prune status`,
/// then `node-agent prune confirm <ID>`), and waits until it has released it: a reconcile
/// finished after the confirmation, and the hold of that ID gone. The hold, and the daemon's
/// metrics then; what went wrong otherwise.
fn confirm(env: &AgentEnv, d: &mut Daemon) -> Result<(Confirmed, String), String> {
    let (code, out, err) = env.cli(&["prune", "status", "--output", "json"]);
    let hold: serde_json::Value = match code {
        0 => serde_json::from_str(&out).map_err(|e| format!("prune status: {e}: {out}"))?,
        _ => return Err(format!("prune status exited {code}: {err}")),
    };
    let id = hold["id"]
        .as_str()
        .ok_or(format!("prune status names no hold: {out}"))?;
    let held = Confirmed {
        nodes: (hold["nodes"].as_array().into_iter().flatten())
            .filter_map(|n| n.as_str().map(str::to_owned))
            .collect(),
        orphans: hold["orphans"].as_u64().unwrap_or(0) as usize,
    };
    let reconciles = |m: &str| metric(m, "node_agent_reconcile_duration_seconds_count");
    let before = reconciles(&scrape_metrics(METRICS));
    let (code, _, err) = env.cli(&["prune", "confirm", id]);
    if code != 0 {
        return Err(format!("prune confirm {id} exited {code}: {err}"));
    }
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Ok(Some(status)) = d.0.try_wait() {
            return Err(format!("the daemon exited ({status}) after a confirmation"));
        }
        let metrics = scrape_metrics(METRICS);
        let (_, status, _) = env.cli(&["prune", "status", "--output", "json"]);
        let still = serde_json::from_str::<serde_json::Value>(&status)
            .is_ok_and(|h| h["id"].as_str() == Some(id));
        if !still && reconciles(&metrics) > before {
            return Ok((held, metrics));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the daemon did not release the confirmed hold {id} in {PATIENCE:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

//! The end-to-end invariant checker: random, seeded histories of the real binary in a sandbox,
//! with the invariants of `docs/design.md` checked after every step rather than an expected
//! state.
//!
//! A history changes the cluster ([`model::Change`]), shows the agent a list (sometimes a
//! partial one, another cluster's, or one without the local node: [`model::View`]) and runs the
//! agent ([`model::Action`]: a restart, a forced run, a daemon killed with SIGKILL at a random
//! moment, a lost or corrupt checkpoint): one-shot runs reading a nodes file, or, in the
//! event-sized mode, daemons behind the API-server stand-in that see the step's changes as watch
//! events ([`events`]). [`oracle`] judges each step. At the end the cluster is
//! mended, and two forced runs must leave the kernel exactly as the mended cluster needs, the
//! second with nothing to do.
//!
//! A failing history is replayed without each of its steps in turn, keeping the removals that
//! still fail, and printed shrunk.

pub mod events;
pub mod model;
mod once;
pub mod oracle;
mod outcome;

use std::collections::BTreeSet;
use std::io::Write as _;
use std::process::Command;
use std::time::{Duration, Instant};

use self::model::{Action, Change, Modes, Profile, Rng, Step, Truth, View, slot_cidr4};
use self::once::{Acted, act};
use self::oracle::{Recorded, Snapshot, StepFacts};
pub use self::outcome::Outcome;
use crate::agent::{AgentEnv, TestNode};
use crate::{ip, report, sandbox};

/// How much to run.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    pub seed: u64,
    pub histories: usize,
    pub steps: usize,
    pub profile: Profile,
}

impl Budget {
    /// From the environment (`NODE_AGENT_CHECK_SEED`, `NODE_AGENT_CHECK_STEPS`: the total over
    /// all histories), with `steps` total by default and a seed from the clock.
    pub fn from_env(default_steps: usize, per_history: usize, profile: Profile) -> Self {
        let total = steps_from_env(default_steps);
        Self {
            seed: seed_from_env(),
            histories: total.div_ceil(per_history).max(1),
            steps: per_history,
            profile,
        }
    }
}

/// The seed of a random run: `NODE_AGENT_CHECK_SEED` replays one; otherwise it comes from the
/// clock. Every user prints it, so any run can be replayed.
pub fn seed_from_env() -> u64 {
    std::env::var("NODE_AGENT_CHECK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
}

/// How many steps a random run takes: `NODE_AGENT_CHECK_STEPS`, or `default`.
pub fn steps_from_env(default: usize) -> usize {
    std::env::var("NODE_AGENT_CHECK_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The agent's default confirm delay: removals within it are counted together.
const WINDOW: Duration = Duration::from_secs(60);

/// Runs the histories of `budget`; panics with the (shrunk) history of the first failure.
pub fn check(name: &str, budget: Budget) {
    let started = Instant::now();
    report(&format!(
        "{name}: seed {} ({} histories of {} steps; NODE_AGENT_CHECK_SEED and NODE_AGENT_CHECK_STEPS set them)",
        budget.seed, budget.histories, budget.steps
    ));
    let mut total = Outcome::default();
    let mut modes_run: std::collections::BTreeSet<&str> = Default::default();
    for h in 0..budget.histories {
        let mut rng = Rng::new(budget.seed.wrapping_add(h as u64));
        let modes = Modes::draw(&mut rng, &budget.profile);
        modes_run.extend(modes.names());
        let steps = model::history(&mut rng, budget.profile, budget.steps);
        let list_seed = rng.next_u64();
        let evidence =
            std::env::temp_dir().join(format!("node-agent-check-{name}-{}-{h}", budget.seed));
        let run = Run {
            profile: budget.profile,
            modes,
            list_seed,
        };
        let outcome = run.history(&steps, Some(&evidence));
        total.add(&outcome);
        if let Some((at, broke)) = outcome.failure {
            // Shrinking replays the history up to 40 times; NODE_AGENT_CHECK_SHRINK=0 skips it.
            let shrunk = if std::env::var("NODE_AGENT_CHECK_SHRINK").as_deref() == Ok("0") {
                "  (not shrunk: NODE_AGENT_CHECK_SHRINK=0)".to_owned()
            } else {
                listing(&shrink(&steps, &run))
            };
            panic!(
                "{name}: seed {} history {h} (modes: {}) broke invariants at step {at}:\n  {}\nevidence (agent log, records, kernel before and after): {}\nhistory:\n{}\nshrunk to:\n{}",
                budget.seed,
                modes.names().join(" "),
                broke.join("\n  "),
                evidence.display(),
                listing(&steps),
                shrunk
            );
        }
    }
    report(&format!(
        "{name}: {} histories, {} steps, 0 violations, {:.1} s",
        budget.histories,
        total.steps,
        started.elapsed().as_secs_f64()
    ));
    report(&format!(
        "checker: seed {}, {} steps, modes: {}, crashes {}, failed ops {}, holds {}, confirmations {}, torn reads {}, differential {}, held {}, unsynced {}, confirmed holds {}",
        budget.seed,
        total.steps,
        modes_run.into_iter().collect::<Vec<_>>().join(" "),
        total.crashes,
        total.failed_ops,
        total.holds,
        total.confirmations,
        total.torn,
        total.differential,
        total.held,
        total.unsynced,
        total.confirmed_holds
    ));
    if budget.profile.torture {
        report(&format!(
            "{name}: {} restarts after SIGKILL checked: {} leaked, {} missing, {} ID changes (seed {})",
            total.rounds, total.leaked, total.missing, total.id_changes, budget.seed
        ));
    }
    report(&format!(
        "{name}: kills landed {} before the kernel changed, {} between the apply and the checkpoint, {} after the checkpoint",
        total.kills[0], total.kills[1], total.kills[2]
    ));
}

fn listing(steps: &[Step]) -> String {
    steps
        .iter()
        .enumerate()
        .map(|(i, s)| format!("  {i:3}: {s}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Replays `steps` without one step at a time, keeping each removal that still fails; at most
/// a few dozen replays.
fn shrink(steps: &[Step], run: &Run) -> Vec<Step> {
    let mut current = steps.to_vec();
    let mut replays = 0;
    let mut i = current.len();
    while i > 0 && replays < 40 {
        i -= 1;
        let mut candidate = current.clone();
        candidate.remove(i);
        replays += 1;
        if run.history(&candidate, None).failure.is_some() {
            current = candidate;
            i = i.min(current.len());
        }
    }
    current
}

/// Plants or clears the foreign objects the truth says exist: per slot, a `proto static` route
/// at the slot's pod CIDR, a route in table 100 through the IPv4 nexthop of node ID slot+1 (if
/// the agent made one: a foreign user it must never delete along with it), and an IPv6 nexthop
/// of its own at node ID slot+1's nexthop ID.
fn sync_foreign(planted: &mut Vec<usize>, want: &[usize]) {
    let quiet = |args: &[&str]| {
        let _ = Command::new("ip").args(args).output();
    };
    for s in planted.iter().filter(|s| !want.contains(s)) {
        quiet(&["route", "del", &slot_cidr4(*s), "proto", "static"]);
        quiet(&[
            "route",
            "del",
            &slot_cidr4(*s),
            "table",
            oracle::FOREIGN_TABLE,
        ]);
        quiet(&[
            "nexthop",
            "del",
            "id",
            &oracle::nexthop_id(*s as u16 + 1, true).to_string(),
        ]);
    }
    for s in want.iter().filter(|s| !planted.contains(s)) {
        // `replace`: if an object of ours is there, someone else's takes its place.
        ip(&[
            "route",
            "replace",
            &slot_cidr4(*s),
            "via",
            "10.88.3.250",
            "proto",
            "static",
        ]);
        let id = *s as u16 + 1;
        quiet(&[
            "route",
            "replace",
            &slot_cidr4(*s),
            "table",
            oracle::FOREIGN_TABLE,
            "nhid",
            &oracle::nexthop_id(id, false).to_string(),
            "proto",
            "static",
        ]);
        ip(&[
            "nexthop",
            "replace",
            "id",
            &oracle::nexthop_id(id, true).to_string(),
            "via",
            "fd00:88::250",
            "dev",
            "gw0",
            "proto",
            "static",
        ]);
    }
    *planted = want.to_vec();
}

/// Keeps what a failing step leaves for a post-mortem in `dir`: the agent's log (every run's,
/// steps marked), the record before the step and after it, and the kernel before and after it.
fn keep_evidence(dir: &std::path::Path, env: &AgentEnv, facts: &StepFacts<'_>) {
    let _ = std::fs::remove_dir_all(dir);
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let _ = std::fs::copy(env.log(), dir.join("agent.log"));
    let records: String = facts
        .record_before
        .unwrap_or_default()
        .iter()
        .map(|r| format!("{r:?}\n"))
        .collect();
    let _ = std::fs::write(dir.join("record-before.txt"), records);
    let _ = std::fs::write(
        dir.join("kernel-before.txt"),
        format!("{:#?}", facts.before),
    );
    let _ = std::fs::write(dir.join("kernel-after.txt"), format!("{:#?}", facts.after));
    let list: String = facts.list.iter().map(|n| format!("{n:?}\n")).collect();
    let _ = std::fs::write(dir.join("list.txt"), list);
    // The record as the agent left it, in its own words: held removals and pending deletes too.
    let (_, shown, err) = env.cli(&["state", "show"]);
    let _ = std::fs::write(dir.join("record-after.txt"), format!("{shown}{err}"));
}

/// How one history runs: its profile, the agent's modes, the seed of its lists.
pub struct Run {
    pub profile: Profile,
    pub modes: Modes,
    pub list_seed: u64,
}

impl Run {
    /// Runs `steps` in a fresh sandbox; stops at the first step that breaks an invariant, and
    /// keeps its evidence in `keep` if given.
    pub fn history(&self, steps: &[Step], keep: Option<&std::path::Path>) -> Outcome {
        let args = self.modes.args();
        sandbox(|sb| {
            self.modes.prepare_sandbox();
            let mut env = AgentEnv::new(&sb.bpffs);
            let mut cluster = self.modes.events.then(|| events::Cluster::start(&mut env));
            let mut rng = Rng::new(self.list_seed);
            let mut truth = Truth::new(&self.profile);
            let mut ids: std::collections::BTreeMap<String, (TestNode, u16)> = Default::default();
            let mut planted = Vec::new();
            let mut previous_clean: Vec<TestNode> = Vec::new();
            let mut previous_no_local = false;
            let mut window: Vec<(Instant, usize, usize)> = Vec::new();
            // When the kernel's records were last unpinned: the agent's window then lives in
            // the checkpoint alone, and a checkpoint lost after that forgets every removal
            // before it (nothing can remember them; design.md, "The window").
            let mut records_lost_at: Option<Instant> = None;
            let mut before = Snapshot::take(&env);
            let mut outcome = Outcome::default();
            for (i, step) in steps.iter().enumerate() {
                truth.apply(&step.change);
                sync_foreign(&mut planted, &truth.foreign);
                // Planting a foreign object over ours is someone else's change, not the agent's.
                before = before.with_foreign_of(&env);
                let list = truth.list(&step.view, &mut rng);
                let list = match cluster {
                    Some(_) => events::Cluster::servable(&list),
                    None => {
                        env.write_list(&list);
                        list
                    }
                };
                // What the agent reads of the list, which is what the oracle judges.
                let read = self.modes.as_read(&list);
                let record_before = oracle::record(&env);
                let _ = std::fs::OpenOptions::new()
                    .append(true)
                    .create(true)
                    .open(env.log())
                    .and_then(|mut f| writeln!(f, "=== step {i}: {step}"));
                let mut stuck = Vec::new();
                let Acted {
                    exit,
                    waiting,
                    shown,
                    confirmed,
                } = match &mut cluster {
                    Some(c) => events::act(
                        &env,
                        c,
                        &step.action,
                        &list,
                        &args,
                        &mut outcome,
                        &mut stuck,
                    ),
                    None => act(&env, &step.action, &list, &args, &mut outcome, &mut stuck),
                };
                let after = Snapshot::take(&env);
                // Read only where it is judged: after a run that did not finish.
                let record_after = exit.is_none().then(|| oracle::record(&env)).flatten();
                let unsynced = matches!(step.action, Action::Unsynced { .. });
                if exit.is_none() && !unsynced {
                    let kernel_changed = after != before;
                    let record_changed = record_after != record_before;
                    let phase = match (kernel_changed, record_changed) {
                        (_, true) => 2,
                        (true, false) => 1,
                        (false, false) => 0,
                    };
                    outcome.kills[phase] += 1;
                }
                let now = Instant::now();
                window.retain(|(t, ..)| now.duration_since(*t) < WINDOW);
                match step.action {
                    Action::LoseKernelRecords => records_lost_at = Some(now),
                    Action::LoseCheckpoint | Action::CorruptCheckpoint { .. } => {
                        if let Some(lost) = records_lost_at {
                            window.retain(|(t, ..)| *t >= lost);
                        }
                    }
                    _ => {}
                }
                // A daemon that came to rest on the last step's list before it was shown this
                // one programmed that list's clean nodes there: not a forced step's (its list is
                // served before the daemon starts), nor after a list without the local node.
                let rested = match shown.is_some()
                    && step.action != Action::OnceForced
                    && !previous_no_local
                {
                    true => previous_clean.clone(),
                    false => Vec::new(),
                };
                let facts = StepFacts {
                    list: &read,
                    previous_clean: &previous_clean,
                    record_before: record_before.as_deref(),
                    record_after: record_after.as_deref(),
                    record_lost: matches!(
                        step.action,
                        Action::LoseCheckpoint | Action::CorruptCheckpoint { .. }
                    ),
                    before: &before,
                    shown: shown.as_ref().unwrap_or(&before),
                    rested: &rested,
                    after: &after,
                    exit,
                    forced: step.action == Action::OnceForced,
                    confirmed: confirmed.as_ref(),
                    event_sized: cluster.is_some(),
                    no_local: step.view == View::NoLocal,
                    reached: cluster.is_none() || shown.is_some(),
                    unsynced,
                    foreign_slots: &truth.foreign,
                    window: window
                        .iter()
                        .fold((0, 0), |(n, o), (_, dn, dobj)| (n + dn, o + dobj)),
                    max_ratio: self.modes.max_ratio(),
                    nexthops: !self.modes.nexthops_off,
                    waiting: &waiting,
                };
                // Held nodes are judged (and counted) where the agent read the list.
                if !unsynced {
                    outcome.held += oracle::held(&facts).len();
                }
                let mut broke = oracle::violations(&facts);
                broke.append(&mut stuck);
                if self.profile.torture && exit.is_some() {
                    let (leaked, missing) =
                        oracle::exactness(&read, &after, !self.modes.nexthops_off);
                    let changed = oracle::id_changes(&read, &after, &mut ids);
                    outcome.rounds += 1;
                    outcome.leaked += leaked;
                    outcome.missing += missing;
                    outcome.id_changes += changed;
                    if leaked + missing + changed > 0 {
                        broke.push(format!(
                            "after the restart: {leaked} objects leaked, {missing} missing, {changed} IDs changed"
                        ));
                    }
                }
                // At rest (a run that finished on a list with the local node), the kernel is
                // what a fresh agent programs from the same record, list and foreign objects.
                if exit == Some(0) && step.view != View::NoLocal && !self.profile.torture {
                    outcome.differential += 1;
                    broke.extend(self.differential(
                        &env,
                        &list,
                        &read,
                        &truth.foreign,
                        &after,
                        &waiting,
                    ));
                }
                let (nodes, objects) = oracle::removals(&facts);
                window.push((now, nodes, objects));
                outcome.steps += 1;
                if !broke.is_empty() {
                    if let Some(dir) = keep {
                        keep_evidence(dir, &env, &facts);
                    }
                    outcome.failure = Some((i, broke));
                    return outcome;
                }
                previous_clean = oracle::clean(&read, record_before.as_deref(), &rested)
                    .into_iter()
                    .cloned()
                    .collect();
                previous_no_local = step.view == View::NoLocal;
                before = after;
            }
            if let Some(broke) =
                self.converge(&env, cluster.as_mut(), &mut truth, &mut planted, &mut rng)
            {
                if let Some(dir) = keep {
                    let _ = std::fs::create_dir_all(dir);
                    let _ = std::fs::copy(env.log(), dir.join("agent.log"));
                }
                outcome.failure = Some((steps.len(), broke));
            }
            outcome
        })
    }

    /// The differential oracle: a fresh agent in a sandbox of its own, given the record `env`'s
    /// agent wrote, the same list and the same foreign objects, programs an empty kernel. For
    /// every clean node of what the agent read of the list (`read`: valid, claiming nothing
    /// another claims), its map entries, routes and nexthops must be those `env`'s kernel holds
    /// (`after`), and the fresh agent's
    /// record must give it the same ID. Exempt, and why: what broken, unlisted or held nodes
    /// left (a broken node keeps what it had, a held removal keeps its objects: both depend on
    /// the history by design); nodes waiting for an ID (a freed ID may cool past the floor
    /// between the two runs); the record's times (holds, freed IDs) and counters (cleanup
    /// attempts, list counts), which say when, not what; and our nexthops a foreign route uses,
    /// kept whoever they were for (a foreign route cannot be planted before the nexthop exists).
    fn differential(
        &self,
        env: &AgentEnv,
        list: &[TestNode],
        read: &[TestNode],
        foreign: &[usize],
        after: &Snapshot,
        waiting: &BTreeSet<String>,
    ) -> Vec<String> {
        use std::os::unix::fs::PermissionsExt as _;
        let checkpoint = std::fs::read(env.checkpoint()).ok();
        let args = self.modes.args();
        let record = oracle::record(env);
        let (code, err, fresh, fresh_record) = sandbox(|sb| {
            self.modes.prepare_sandbox();
            let fresh = AgentEnv::new(&sb.bpffs);
            if let Some(bytes) = &checkpoint {
                std::fs::create_dir_all(&fresh.state_dir).unwrap();
                let path = fresh.checkpoint();
                std::fs::write(&path, bytes).unwrap();
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            }
            sync_foreign(&mut Vec::new(), foreign);
            fresh.write_list(list);
            let (code, _, err) = fresh.once(&args);
            (code, err, Snapshot::take(&fresh), oracle::record(&fresh))
        });
        let mut broke = Vec::new();
        if !matches!(code, 0 | 3) {
            broke.push(format!(
                "differential: the fresh agent exited {code}: {err}"
            ));
            return broke;
        }
        let id = |r: &Option<Vec<oracle::Recorded>>, name: &str| {
            r.as_deref()
                .unwrap_or_default()
                .iter()
                .find(|r| r.name == name)
                .and_then(|r| r.id)
        };
        // A node waiting for an ID at the edge of the ID space is held as it was; a moment later
        // (the fresh run) an ID may have cooled past the floor: when, not what.
        for n in oracle::clean(read, record.as_deref(), &[])
            .into_iter()
            .filter(|n| !waiting.contains(&n.name))
        {
            let diff = oracle::node_difference(n, after, &fresh);
            if !diff.is_empty() {
                broke.push(format!(
                    "differential: {} differs from what a fresh agent programs from the same record: {}",
                    n.name,
                    diff.join("; ")
                ));
            }
            let (ours, theirs) = (id(&record, &n.name), id(&fresh_record, &n.name));
            if ours != theirs {
                broke.push(format!(
                    "differential: the record gives {} ID {ours:?}, a fresh agent's record {theirs:?}",
                    n.name
                ));
            }
        }
        broke
    }

    /// The end of a history: the cluster mended, two forced runs; the kernel must hold exactly
    /// what the mended cluster needs, and the second run must write nothing.
    fn converge(
        &self,
        env: &AgentEnv,
        cluster: Option<&mut events::Cluster>,
        truth: &mut Truth,
        planted: &mut Vec<usize>,
        rng: &mut Rng,
    ) -> Option<Vec<String>> {
        let forced = [self.modes.args().as_slice(), &["--force-prune"]].concat();
        let nexthops = !self.modes.nexthops_off;
        truth.apply(&Change::Mend);
        sync_foreign(planted, &truth.foreign);
        let list = truth.list(&View::Full, rng);
        match cluster {
            Some(c) => {
                c.serve(&events::Cluster::servable(&list));
            }
            None => env.write_list(&list),
        }
        if self.modes.small_ids {
            // In a small ID space the brake's held removals may hold every ID: a first forced
            // run releases them, and their IDs cool down (the kernel records free times in whole
            // seconds, rounded up) before the runs that must converge, so that every node of the
            // mended cluster can have one.
            let _ = env.once(&forced);
            std::thread::sleep(model::SMALL_ID_COOLDOWN + Duration::from_secs(2));
        }
        let mut broke = Vec::new();
        let (code, _, err) = env.once(&forced);
        if code != 0 {
            broke.push(format!("the converging run exited {code}: {err}"));
        }
        let (code, report, _) = env.once(&forced);
        if code != 0 || report["kernel_writes"] != 0 {
            broke.push(format!(
                "a second converging run was not idle: exit {code}, {report}"
            ));
        }
        let after = Snapshot::take(env);
        let read = self.modes.as_read(&list);
        let remote: Vec<&TestNode> = read.iter().filter(|n| n.name != "local").collect();
        let want_ips: std::collections::BTreeSet<&str> = remote
            .iter()
            .flat_map(|n| n.ips.iter().map(String::as_str))
            .collect();
        let have_ips: std::collections::BTreeSet<&str> =
            after.map.keys().map(String::as_str).collect();
        if want_ips != have_ips {
            broke.push(format!(
                "map entries after converging: want {want_ips:?}, have {have_ips:?}"
            ));
        }
        let want_routes = oracle::wanted_routes(&remote, &after, &truth.foreign, nexthops);
        if after.our_routes() != want_routes {
            broke.push(format!(
                "routes after converging: want {want_routes:?}, have {:?}",
                after.our_routes()
            ));
        }
        let astray = after.astray_nexthops();
        if !astray.is_empty() {
            broke.push(format!(
                "nexthops of ours after converging that no route uses or that name another node: {astray:?}"
            ));
        }
        let ids: std::collections::BTreeSet<u16> = remote
            .iter()
            .filter_map(|n| after.map.get(&n.ips[0]).copied())
            .collect();
        if ids.len() != remote.len() {
            broke.push(format!("{} nodes share {} IDs", remote.len(), ids.len()));
        }
        // xfrm: nothing under an ID no listed node has; with IPsec, something for every node
        // with a pod CIDR of a family it has an address in.
        let leaked: Vec<&u16> = after.xfrm.keys().filter(|id| !ids.contains(*id)).collect();
        if !leaked.is_empty() {
            broke.push(format!(
                "xfrm objects after converging under IDs no listed node has: {leaked:?}"
            ));
        }
        if self.modes.ipsec {
            let family = |a: &str| a.contains(':');
            let missing: Vec<&str> = remote
                .iter()
                .filter(|n| {
                    let addressed = n
                        .cidrs
                        .iter()
                        .any(|c| n.ips.iter().take(2).any(|ip| family(ip) == family(c)));
                    let id = after.map.get(&n.ips[0]);
                    addressed && id.is_some_and(|id| !after.xfrm.contains_key(id))
                })
                .map(|n| n.name.as_str())
                .collect();
            if !missing.is_empty() {
                broke.push(format!(
                    "nodes without xfrm states and policies after converging: {missing:?}"
                ));
            }
        }
        match oracle::record(env) {
            Some(rec)
                if rec
                    .iter()
                    .any(|r: &Recorded| r.attempts > 0 || r.id.is_none()) =>
            {
                broke.push("pending deletes or ID-less records after converging".into());
            }
            None => broke.push("no checkpoint after converging".into()),
            _ => {}
        }
        (!broke.is_empty()).then_some(broke)
    }
}

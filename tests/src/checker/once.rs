//! A step's run of the agent as a one-shot run (`run --once` on the nodes file), and the pieces
//! every step's run is made of, one-shot or daemon ([`super::events`]): what an action takes
//! from the agent first, its test cut, and a kill just after a reconcile.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::model::{Action, FILE_FAILURES};
use super::oracle::{Confirmed, Snapshot};
use super::outcome::Outcome;
use crate::agent::{AgentEnv, Daemon, TestNode};
use node_agent::runtime::cut::CUT_ENV;
use node_agent_common as abi;

/// Runs the agent as `action` says, with `args`; the exit status, or `None` for a run that was
/// ended (a daemon killed, a test cut) or cut short by a failure a test injected (judged as a
/// crash: what it must not break it must not break, and the next run mends the rest).
pub(super) fn act(
    env: &AgentEnv,
    action: &Action,
    list: &[TestNode],
    args: &[&str],
    seen: &mut Outcome,
    broke: &mut Vec<String>,
) -> Acted {
    // A one-shot run's log joins the daemons' in the agent log: the evidence of a failure.
    let mut waiting = BTreeSet::new();
    let mut once = |args: &[&str], cut: Option<String>, torn: Option<u64>| {
        let cut_env = cut
            .as_ref()
            .map(|c| (CUT_ENV, std::ffi::OsStr::new(c.as_str())));
        let (code, report, stderr) = match torn {
            None => env.once_with_env(cut_env.as_slice(), args),
            Some(pct) => {
                let (ran, read_torn) = torn_once(env, list, pct, args);
                seen.torn += usize::from(read_torn);
                ran
            }
        };
        let _ = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(env.log())
            .and_then(|mut f| std::io::Write::write_all(&mut f, stderr.as_bytes()));
        if !report["brake"].is_null() {
            seen.holds += 1;
        }
        waiting = report["errors"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| {
                e["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("allocating a node ID"))
            })
            .filter_map(|e| Some(e["node"].as_str()?.to_owned()))
            .collect();
        match cut_fired(&stderr) {
            Some(true) => {
                seen.crashes += 1;
                None
            }
            Some(false) => {
                seen.failed_ops += 1;
                None
            }
            None => Some(code),
        }
    };
    let exit = match action {
        Action::Once | Action::Confirmed => once(args, None, None),
        Action::TornWrite { pct } => once(args, None, Some(*pct)),
        Action::OnceForced => {
            seen.confirmations += 1;
            once(&[args, &["--force-prune"]].concat(), None, None)
        }
        Action::LoseCheckpoint | Action::LoseKernelRecords | Action::CorruptCheckpoint { .. } => {
            lose_records(env, action);
            once(args, None, None)
        }
        Action::Cut { .. } => once(args, cut(action), None),
        Action::KilledDaemon { ms } => {
            seen.crashes += 1;
            let mut d = env.spawn(args);
            std::thread::sleep(Duration::from_millis(*ms));
            let _ = d.kill();
            let _ = d.wait();
            None
        }
        Action::KilledAfterApply { us } => {
            seen.crashes += 1;
            let before = reconciles(env);
            kill_after_reconcile(env, env.spawn(args), before, *us);
            None
        }
        Action::Unsynced { ms, how } => {
            match FILE_FAILURES[how % FILE_FAILURES.len()] {
                "cut" => std::fs::write(&env.nodes_file, unparsable(list)).unwrap(),
                "absent" => std::fs::remove_file(&env.nodes_file).unwrap(),
                other => unreachable!("no file failure {other}"),
            }
            let acted = unsynced(env.spawn(args), *ms, seen, broke);
            env.write_list(list);
            return acted;
        }
    };
    Acted {
        exit,
        waiting,
        shown: None,
        confirmed: None,
    }
}

/// How long a daemon may take to reflect a resourceVersion, to start, or to stop: far beyond
/// what any of it takes on a loaded machine; reached only by a daemon that is stuck.
pub(super) const PATIENCE: Duration = Duration::from_secs(120);

/// Stops `d` with SIGTERM (it writes its final checkpoint); its exit status, `None` if it did
/// not exit within [`PATIENCE`].
pub(super) fn stop(mut d: Daemon) -> Option<i32> {
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(d.0.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + PATIENCE;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = d.0.try_wait() {
            return Some(status.code().unwrap_or(-1));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// An [`Action::Unsynced`] step's daemon `d`, whose source never completes a list: it runs `ms`
/// milliseconds and is stopped. It must still be running (a source that fails is waited out,
/// not a reason to exit) and stop on SIGTERM; what it did to the kernel is the oracle's.
pub(super) fn unsynced(
    mut d: Daemon,
    ms: u64,
    seen: &mut Outcome,
    broke: &mut Vec<String>,
) -> Acted {
    seen.unsynced += 1;
    std::thread::sleep(Duration::from_millis(ms));
    if let Ok(Some(status)) = d.0.try_wait() {
        broke.push(format!(
            "a daemon whose source had not synced exited by itself ({status})"
        ));
    } else if stop(d).is_none() {
        broke.push(format!(
            "a daemon whose source had not synced did not exit in {PATIENCE:?} after SIGTERM"
        ));
    }
    Acted {
        exit: None,
        waiting: BTreeSet::new(),
        shown: None,
        confirmed: None,
    }
}

/// `list` as a nodes file cut inside its first flow sequence (an unterminated quote and
/// bracket): no YAML parser takes it, so a source reading it never completes a list.
fn unparsable(list: &[TestNode]) -> String {
    let text = crate::agent::node_list(list);
    match text.find("[\"") {
        Some(at) => text[..at + 3].to_owned(),
        None => "items: [\"".to_owned(),
    }
}

/// Reconciles the agent's log says finished with kernel writes.
pub(super) fn reconciles(env: &AgentEnv) -> usize {
    std::fs::read_to_string(env.log())
        .unwrap_or_default()
        .matches(" reconciled ")
        .count()
}

/// Kills `d` with SIGKILL `us` microseconds after the log shows a reconcile past the `before`th
/// finished: between the kernel apply and the checkpoint write, or during the write.
pub(super) fn kill_after_reconcile(env: &AgentEnv, mut d: Daemon, before: usize, us: u64) {
    // A round that changes nothing logs no such line (it is at debug): give up waiting.
    let deadline = Instant::now() + Duration::from_secs(5);
    while reconciles(env) == before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(200));
    }
    std::thread::sleep(Duration::from_micros(us));
    let _ = d.kill();
    let _ = d.wait();
}

/// What `action` takes from the agent before its run: the checkpoint lost or corrupt, the
/// kernel's records unpinned.
pub(super) fn lose_records(env: &AgentEnv, action: &Action) {
    match action {
        Action::LoseCheckpoint => {
            let _ = std::fs::remove_file(env.checkpoint());
        }
        Action::LoseKernelRecords => {
            for pin in [abi::RECENT_REMOVALS_PIN, abi::FREED_IDS_PIN] {
                let _ = std::fs::remove_file(node_agent::datapath::pin_dir(&env.bpffs).join(pin));
            }
        }
        Action::CorruptCheckpoint { at } => {
            if let Ok(mut bytes) = std::fs::read(env.checkpoint()) {
                let i = at % bytes.len().max(1);
                if let Some(b) = bytes.get_mut(i) {
                    *b ^= 0x5A;
                }
                let _ = std::fs::write(env.checkpoint(), bytes);
            }
        }
        _ => {}
    }
}

/// The test cut (`NODE_AGENT_TEST_CUT`) an action sets, if it is a cut.
pub(super) fn cut(action: &Action) -> Option<String> {
    match action {
        Action::Cut { sequence, at, kill } => {
            let how = if *kill { "kill" } else { "fail" };
            Some(format!("{sequence}:{at}:{how}"))
        }
        _ => None,
    }
}

/// Whether a test cut fired in `stderr` (an agent's log): `Some(true)` if it ended the run,
/// `Some(false)` if it failed an operation.
pub(super) fn cut_fired(stderr: &str) -> Option<bool> {
    stderr.lines().find_map(|l| {
        l.strip_prefix(&format!("{CUT_ENV}: "))
            .map(|l| l.ends_with(": kill"))
    })
}

/// `run --once` while the nodes file is written in place the way a writer that pauses leaves
/// it: the first items of `list` (`pct` percent, the local node first), a valid and shorter
/// list, then, once the run has read it, all of it. The run must end on the whole list (the
/// settle period, 1 s here, keeps a read that drops nodes from being taken). Whether the run read
/// the short list is told by the file's access time, set far back first (the kernel moves it to
/// now on the first read); the last value says so (`false` on a file system that keeps no access
/// times, or a run that ended first).
pub(super) fn torn_once(
    env: &AgentEnv,
    list: &[TestNode],
    pct: u64,
    args: &[&str],
) -> ((i32, serde_json::Value, String), bool) {
    use std::os::unix::fs::MetadataExt as _;
    let keep = (list.len() * pct as usize / 100).clamp(1.min(list.len()), list.len());
    std::fs::write(&env.nodes_file, crate::agent::node_list(&list[..keep])).unwrap();
    // Accessed "long ago": the first read sets the access time to now (relatime updates an
    // access time older than the modification time).
    std::fs::File::options()
        .write(true)
        .open(&env.nodes_file)
        .and_then(|f| {
            f.set_times(
                std::fs::FileTimes::new()
                    .set_accessed(std::time::UNIX_EPOCH + Duration::from_secs(1)),
            )
        })
        .unwrap();
    let read = || std::fs::metadata(&env.nodes_file).is_ok_and(|m| m.atime() > 1);
    let mut run = vec!["--once", "--output", "json", "--sync-timeout", "90s"];
    run.extend_from_slice(args);
    run.extend(["--nodes-file-settle", "1s"]);
    let mut child = env
        .command(&run)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !read() && Instant::now() < deadline && child.try_wait().ok().flatten().is_none() {
        std::thread::sleep(Duration::from_millis(2));
    }
    let torn = read();
    std::fs::write(&env.nodes_file, crate::agent::node_list(list)).unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    ((out.status.code().unwrap_or(-1), report, stderr), torn)
}

/// What a step's run did.
pub(super) struct Acted {
    /// Its exit status; `None` for a run ended or cut short.
    pub exit: Option<i32>,
    /// The nodes it reported waiting for a node ID (every ID in use or cooling).
    pub waiting: BTreeSet<String>,
    /// The kernel when the step's list reached the agent, where that was after the run began
    /// (a daemon that first came to rest on the last step's list); `None`: at its start.
    pub shown: Option<Snapshot>,
    /// The hold an operator confirmed during the run, if one was.
    pub confirmed: Option<Confirmed>,
}

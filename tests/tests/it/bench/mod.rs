//! Benchmarks (run by `cargo xtask bench`, with `NODE_AGENT_BENCH=1`): they print figures as
//! `bench: <name> <value> <unit>` lines and assert nothing about time.
//!
//! - [`backends`]: the objects of 5,000 remote nodes applied into a fresh namespace and removed
//!   again, next to the floor measured on the same work in the same run.
//! - [`scale`]: the agent at 5,000 and 65,000 dual-stack nodes: cold start, unchanged restart,
//!   restart with churn, one event with the daemon running, peak RSS and idle CPU, each beside
//!   its kernel floor, and how each grows between the sizes.
//! - [`waiting`]: what the daemon costs in each state where it can do nothing.

mod backends;
mod scale;
mod waiting;
mod xfrm_floor;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use node_agent_common::{NodeKey, NodeValue};
use node_agent_tests::agent::AgentEnv;
use node_agent_tests::{can_sandbox, report, skip};

pub(super) fn enabled(name: &str) -> bool {
    if std::env::var("NODE_AGENT_BENCH").as_deref() != Ok("1") {
        report(&format!(
            "SKIPPED {name}: a benchmark; `cargo xtask bench` runs it"
        ));
        return false;
    }
    if let Err(why) = can_sandbox() {
        skip(name, &why);
        return false;
    }
    true
}

pub(super) fn bench(name: &str, value: f64, unit: &str) {
    report(&format!("bench: {name} {value:.1} {unit}"));
}

pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// `bpf(BPF_OBJ_GET)`: an fd for a pinned object, without any library in between.
pub(super) fn obj_get(path: &Path) -> OwnedFd {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut attr = [0u64; 16];
    attr[0] = c.as_ptr() as u64;
    // SAFETY: attr is a zeroed bpf_attr with `pathname` set to a live C string.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            7, /* BPF_OBJ_GET */
            attr.as_mut_ptr(),
            128,
        )
    };
    assert!(
        fd >= 0,
        "BPF_OBJ_GET {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    // SAFETY: the kernel just returned this fd to us.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

/// `bpf(cmd)` on one element of a map: update (2) or delete (3).
pub(super) fn elem(fd: &OwnedFd, cmd: i64, key: &NodeKey, value: Option<&NodeValue>) {
    let mut attr = [0u64; 16];
    attr[0] = fd.as_raw_fd() as u64;
    attr[1] = key as *const NodeKey as u64;
    attr[2] = value.map_or(0, |v| v as *const NodeValue as u64);
    // SAFETY: attr is a bpf_attr for a map element op; key and value outlive the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), 128) };
    assert_eq!(rc, 0, "bpf({cmd}): {}", std::io::Error::last_os_error());
}

/// Runs the agent once to completion: wall time, exit code, peak RSS (KiB), report. The peak
/// is the agent's own (`peak_rss_kib` of its report, its `VmHWM`): the rusage `wait4` gives
/// would count this test process's memory too, since the child starts as a copy of it.
pub(super) fn timed_once(
    env: &AgentEnv,
    extra: &[&str],
) -> (Duration, i32, i64, serde_json::Value) {
    let mut args = vec!["--once", "--output", "json", "--sync-timeout", "120s"];
    args.extend_from_slice(extra);
    let cpu = children_cpu();
    let t = Instant::now();
    let out = env
        .command(&args)
        .stderr(std::process::Stdio::null())
        .output()
        .unwrap();
    let elapsed = t.elapsed();
    let ((user, system), (user0, system0)) = (children_cpu(), cpu);
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    report_cpu(elapsed, user - user0, system - system0);
    (
        elapsed,
        out.status.code().unwrap_or(-1),
        report["peak_rss_kib"].as_i64().unwrap_or(-1),
        report,
    )
}

/// The CPU this process's waited-for children used so far: (user, system) seconds.
fn children_cpu() -> (f64, f64) {
    // SAFETY: a zeroed rusage is a valid value, and getrusage fills the struct it is given.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut u);
        u
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (secs(u.ru_utime), secs(u.ru_stime))
}

/// Where a one-shot run's time went: the agent's own work (user) and the kernel's on its behalf
/// (system: netlink requests are handled in the sender's context), beside the wall clock.
fn report_cpu(wall: Duration, user: f64, system: f64) {
    report(&format!(
        "bench:   a one-shot run: {:.1} s wall, {user:.1} s user, {system:.1} s system",
        wall.as_secs_f64()
    ));
}

pub(super) fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the comm.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// CPU of a daemon with nothing it can do, `secs` seconds of it, in percent of one core.
pub(super) fn cpu_over(pid: u32, secs: u64) -> f64 {
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(secs));
    let after = cpu_ticks(pid);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (after - before) as f64 / hz / secs as f64 * 100.0
}

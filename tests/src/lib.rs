//! Test support for the kernel and end-to-end tiers.
//!
//! [`sandbox`] runs a test body on a fresh thread inside its own network namespace and mount
//! namespace, with a private bpffs and a private `/run/netns`. Namespaces belong to the thread, so
//! nothing the test does can reach the host's routes, xfrm state or bpffs, and everything is torn
//! down when the thread ends, whether the test passed or panicked. Commands spawned from the
//! thread (`ip`, `bpftool`, the agent binary) inherit its namespaces.

pub mod agent;
pub mod apiserver;
pub mod checker;
pub mod cluster;
pub mod fixture;
pub mod ip_xfrm;

pub use xtask::host::which;

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A running sandbox: where its bpffs is mounted.
pub struct Sandbox {
    pub bpffs: PathBuf,
}

/// Why a test could not run here; printed, and the test then returns without asserting.
///
/// Written straight to the process's stderr, past libtest's output capture, so a skip is
/// always visible. Under CI (`CI` set) a missing prerequisite of the host tiers is a failure:
/// CI machines have everything these tiers need.
pub fn skip(test: &str, why: &str) {
    if std::env::var_os("CI").is_some() {
        panic!("{test}: prerequisite missing in CI: {why}");
    }
    report(&format!("SKIPPED {test}: {why}"));
}

/// Whether this runs in the VM tier (`NODE_AGENT_VM=1`), whose kernels have everything the
/// tests need (ESP among it), so a missing feature there is a failure, not a skip.
pub fn in_vm_tier() -> bool {
    std::env::var("NODE_AGENT_VM").as_deref() == Ok("1")
}

/// Skips a test (or the part of it named by `test`) that needs ESP, printing why; in the VM
/// tier reaching this is a failure.
pub fn skip_without_esp(test: &str, why: &str) {
    if in_vm_tier() {
        panic!("{test}: the VM tier must have ESP, but: {why}");
    }
    report(&format!("SKIPPED {test}: {why}"));
}

/// The name of the function this is written in, as libtest names a test (its last path
/// segment), so a test's skip line names it without the name being written twice.
#[macro_export]
macro_rules! test_name {
    () => {{
        // A local fn's type name is its full path: `<crate>::<module>::<fn>::here`.
        fn here() {}
        $crate::enclosing_fn(::std::any::type_name_of_val(&here))
    }};
}

/// The enclosing function's name from the type name of a fn item declared in it (see
/// [`test_name!`]); closures between the two (`{{closure}}`) are skipped.
pub fn enclosing_fn(item_path: &'static str) -> &'static str {
    item_path
        .rsplit("::")
        .skip(1)
        .find(|seg| !seg.starts_with('{'))
        .unwrap_or(item_path)
}

/// Returns from the calling test, printing why (under the test's own name), when this process
/// cannot build sandboxes.
#[macro_export]
macro_rules! require_sandbox {
    () => {
        if let Err(why) = $crate::can_sandbox() {
            $crate::skip($crate::test_name!(), &why);
            return;
        }
    };
}

/// A single-threaded tokio runtime for a test body: built on the sandbox thread, its sockets
/// open in the sandbox's network namespace.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("building a tokio runtime")
}

/// Prints a line that must reach the log even when the test passes (skips, measured figures).
pub fn report(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Whether this process can build sandboxes; tests call it first and [`skip`] when not.
pub fn can_sandbox() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root for network/mount namespaces and bpffs".into());
    }
    if which("ip").is_none() {
        return Err("needs `ip` from iproute2 (cargo xtask setup installs it)".into());
    }
    Ok(())
}

/// Runs `body` in a fresh sandbox. Panics (failing the test) if the sandbox cannot be built;
/// call [`can_sandbox`] first to skip where it never could.
pub fn sandbox<R: Send>(body: impl FnOnce(&Sandbox) -> R + Send) -> R {
    let base = std::env::temp_dir().join(format!(
        "node-agent-test-{}-{}",
        std::process::id(),
        unique()
    ));
    std::fs::create_dir_all(&base).expect("creating the sandbox directory");
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            enter_namespaces(&base);
            let sb = Sandbox {
                bpffs: base.join("bpffs"),
            };
            body(&sb)
        })
        .join()
    });
    // The mounts lived in the thread's mount namespace, gone with it; only empty dirs remain.
    let _ = std::fs::remove_dir_all(&base);
    match result {
        Ok(r) => r,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn enter_namespaces(base: &Path) {
    // SAFETY: unshare affects only the calling thread's namespaces, which is the point.
    let rc = unsafe { libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWNS) };
    assert_eq!(rc, 0, "unshare: {}", std::io::Error::last_os_error());
    // Nothing mounted below may propagate back to the host.
    mount(None, "/", None, libc::MS_REC | libc::MS_PRIVATE, None);
    let bpffs = base.join("bpffs");
    std::fs::create_dir_all(&bpffs).expect("creating the bpffs mount point");
    mount(Some("bpf"), bpffs.to_str().unwrap(), Some("bpf"), 0, None);
    // `ip netns add` inside the sandbox must not leave files in the host's /run/netns.
    std::fs::create_dir_all("/run/netns").expect("creating /run/netns");
    mount(
        Some("tmpfs"),
        "/run/netns",
        Some("tmpfs"),
        0,
        Some("mode=0755"),
    );
    ip(&["link", "set", "lo", "up"]);
}

fn mount(
    src: Option<&str>,
    target: &str,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) {
    let c = |s: &str| CString::new(s).unwrap();
    let (src, target, fstype, data) = (src.map(c), c(target), fstype.map(c), data.map(c));
    let ptr = |o: &Option<CString>| o.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: every pointer is either null or a live NUL-terminated string.
    let rc = unsafe {
        libc::mount(
            ptr(&src),
            target.as_ptr(),
            ptr(&fstype),
            flags,
            ptr(&data).cast(),
        )
    };
    assert_eq!(
        rc,
        0,
        "mount {target:?}: {}",
        std::io::Error::last_os_error()
    );
}

/// Runs `f` on a thread that has entered the named network namespace (`ip netns add <name>`),
/// and returns what it returns. Sockets `f` opens live in that namespace; the caller's thread
/// stays where it is.
pub fn in_netns<R: Send>(name: &str, f: impl FnOnce() -> R + Send) -> R {
    xtask::host::in_netns(name, f).unwrap_or_else(|e| panic!("{e}"))
}

/// Writes a sysctl of the calling thread's network namespace, e.g. `net/ipv4/ip_forward`
/// (`/proc/sys/net` shows the namespace of the thread that opens it).
pub fn sysctl(key: &str, value: &str) {
    let path = Path::new("/proc/sys").join(key);
    std::fs::write(&path, value).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// Runs a command to completion and returns its output, panicking with its stderr on failure.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}",
        out.status,
        output_text(&out)
    );
    out
}

/// What a finished command printed: its stdout, then its stderr.
pub fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// This test executable, set to run only the test `name` (its full path, e.g.
/// `datapath::child_cuts_a_pin_transaction`) with its output shown: for the tests that run a
/// helper test in a child process with its own environment.
pub fn child_test(name: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
    cmd.args(["--exact", name, "--nocapture"]);
    cmd
}

/// Writes `bytes` to `path` mode 0600 (as a key file must be), by rename: never seen torn.
pub fn write_private(path: &std::path::Path, bytes: &[u8]) {
    use std::os::unix::fs::PermissionsExt;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// `ip ARGS...`, which must succeed.
pub fn ip(args: &[&str]) -> Output {
    run(Command::new("ip").args(args))
}

/// Runs `ip OPTS -batch -` with one command per line; each must succeed.
pub fn ip_batch(opts: &[&str], lines: &str) {
    use std::io::Write;
    let mut child = Command::new("ip")
        .args(opts)
        .args(["-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting ip -batch");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(lines.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "ip -batch failed: {}\n{lines}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The `node-agent` binary cargo built next to this test executable.
pub fn agent_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let bin = dir.join("node-agent");
    assert!(
        bin.is_file(),
        "{} is missing; build it with `cargo build -p node-agent` (cargo test --workspace does)",
        bin.display()
    );
    bin
}

/// Two hosts on a veth pair: `va` here (the sandbox's namespace) and `vb` in the named
/// namespace `peer`. The peer answers on two addresses per family: one the tests register as a
/// node and one they leave unknown. Neighbour entries are permanent both ways, so no ARP or NDP
/// packet ever crosses the link and packet counts are exact.
pub struct VethPair;

impl VethPair {
    pub const LOCAL_V4: &'static str = "10.99.0.1";
    pub const PEER_V4: &'static str = "10.99.0.2";
    pub const UNKNOWN_V4: &'static str = "10.99.0.3";
    pub const LOCAL_V6: &'static str = "fd00:99::1";
    pub const PEER_V6: &'static str = "fd00:99::2";
    pub const UNKNOWN_V6: &'static str = "fd00:99::3";

    pub fn create() -> Self {
        ip(&["netns", "add", "peer"]);
        ip(&[
            "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", "peer",
        ]);
        let mac = |args: &[&str]| -> String {
            let out = ip(args);
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j output");
            v[0]["address"].as_str().expect("link address").to_owned()
        };
        let va_mac = mac(&["-j", "link", "show", "va"]);
        let vb_mac = mac(&["-n", "peer", "-j", "link", "show", "vb"]);
        let mut here = format!(
            "addr add {}/24 dev va\naddr add {}/64 dev va nodad\nlink set va up\n",
            Self::LOCAL_V4,
            Self::LOCAL_V6
        );
        let mut there = String::from("link set lo up\nlink set vb up\n");
        for a in [Self::PEER_V4, Self::UNKNOWN_V4] {
            here.push_str(&format!(
                "neigh replace {a} lladdr {vb_mac} dev va nud permanent\n"
            ));
            there.push_str(&format!("addr add {a}/24 dev vb\n"));
        }
        for a in [Self::PEER_V6, Self::UNKNOWN_V6] {
            here.push_str(&format!(
                "neigh replace {a} lladdr {vb_mac} dev va nud permanent\n"
            ));
            there.push_str(&format!("addr add {a}/64 dev vb nodad\n"));
        }
        for a in [Self::LOCAL_V4, Self::LOCAL_V6] {
            there.push_str(&format!(
                "neigh replace {a} lladdr {va_mac} dev vb nud permanent\n"
            ));
        }
        ip_batch(&[], &here);
        ip_batch(&["-n", "peer"], &there);
        // Answer every probe: the tests count ICMP errors one for one.
        run(Command::new("ip").args([
            "netns",
            "exec",
            "peer",
            "sh",
            "-c",
            "echo 0 > /proc/sys/net/ipv4/icmp_ratelimit; echo 0 > /proc/sys/net/ipv6/icmp/ratelimit",
        ]));
        Self
    }
}

/// Programs attached to `iface` in `dir`: TCX links where the kernel has them (6.6+), netlink
/// tc filters before.
pub fn attached(iface: &str, dir: aya::programs::TcAttachType) -> usize {
    match aya::programs::SchedClassifier::query_tcx(iface, dir) {
        Ok((_, progs)) => progs.len(),
        Err(_) => {
            let d = if dir == aya::programs::TcAttachType::Ingress {
                "ingress"
            } else {
                "egress"
            };
            let out = run(Command::new("tc").args(["-j", "filter", "show", "dev", iface, d]));
            let filters: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            // `tc` lists each priority's head without options, then each filter with them.
            filters
                .as_array()
                .unwrap()
                .iter()
                .filter(|f| f["kind"] == "bpf" && f.get("options").is_some())
                .count()
        }
    }
}

#[cfg(test)]
mod tests {
    /// Skip lines name the test they skip: the macro finds its enclosing function from a plain
    /// body and from a closure in it.
    #[test]
    fn test_name_is_the_enclosing_function() {
        assert_eq!(test_name!(), "test_name_is_the_enclosing_function");
        let in_closure = || test_name!();
        assert_eq!(in_closure(), "test_name_is_the_enclosing_function");
    }
}

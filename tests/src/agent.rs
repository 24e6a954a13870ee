//! Driving the real `node-agent` binary in a sandbox: NodeList files, runs, and what the kernel
//! holds afterwards.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::{agent_bin, ip};

/// A remote or local node as a test describes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TestNode {
    pub name: String,
    /// InternalIPs.
    pub ips: Vec<String>,
    pub cidrs: Vec<String>,
    /// ExternalIPs (not mapped unless the agent runs with `--include-external-ips`).
    pub external: Vec<String>,
    /// `metadata.uid`; `uid-<name>` when `None`.
    pub uid: Option<String>,
}

impl TestNode {
    /// Node `name` with IPv4 `10.88.1.<i>` and pod CIDR `10.244.<i>.0/24`.
    pub fn v4(name: &str, i: u32) -> Self {
        Self {
            name: name.into(),
            ips: vec![format!("10.88.{}.{}", i / 250 + 1, i % 250 + 1)],
            cidrs: vec![format!("10.{}.{}.0/24", 100 + i / 250, i % 250)],
            ..Self::default()
        }
    }

    /// Adds IPv6 `fd00:88::<i>` and `fd00:244:<i>::/64`.
    pub fn dual(name: &str, i: u32) -> Self {
        let mut n = Self::v4(name, i);
        n.ips.push(format!("fd00:88::{:x}", i + 0x100));
        n.cidrs.push(format!("fd00:244:{:x}::/64", i + 1));
        n
    }

    /// Node `i` of a large cluster (up to a few hundred thousand nodes): IPv4 in 100.64.0.0/10
    /// and IPv6 in fd00:88::/64 (both on-link on the sandbox's `gw0`), a /26 pod CIDR in
    /// 10.128.0.0/9 and a /64 in fd00:244::/32.
    pub fn wide(name: &str, i: u32) -> Self {
        let v4 = std::net::Ipv4Addr::from(0x6440_0000 + i + 2);
        let v4_cidr = std::net::Ipv4Addr::from(0x0a80_0000 + (i << 6));
        Self {
            name: name.into(),
            ips: vec![
                v4.to_string(),
                format!("fd00:88::{:x}:{:x}", (i >> 16) + 1, i & 0xffff),
            ],
            cidrs: vec![
                format!("{v4_cidr}/26"),
                format!("fd00:244:{:x}:{:x}::/64", i >> 16, i & 0xffff),
            ],
            ..Self::default()
        }
    }

    /// This node as the Node object the API server holds (see [`k8s_node`]).
    pub fn k8s(&self) -> k8s_openapi::api::core::v1::Node {
        k8s_node(self)
    }

    /// Its addresses as a Node lists them, of each kind: InternalIPs, then ExternalIPs.
    pub fn addresses(&self) -> impl Iterator<Item = (&'static str, &str)> {
        let internal = self.ips.iter().map(|a| ("InternalIP", a.as_str()));
        let external = self.external.iter().map(|a| ("ExternalIP", a.as_str()));
        internal.chain(external)
    }

    pub fn uid(&self) -> String {
        self.uid
            .clone()
            .unwrap_or_else(|| format!("uid-{}", self.name))
    }
}

/// A NodeList in the YAML `kubectl get nodes -o yaml` writes.
pub fn node_list(nodes: &[TestNode]) -> String {
    let quoted = |v: &[String]| {
        v.iter()
            .map(|c| format!("\"{c}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut s = String::from("apiVersion: v1\nkind: List\nitems:\n");
    for n in nodes {
        let addresses: Vec<String> = n
            .addresses()
            .map(|(kind, a)| format!("{{type: {kind}, address: \"{a}\"}}"))
            .collect();
        let _ = writeln!(
            s,
            "- apiVersion: v1\n  kind: Node\n  metadata: {{name: {}, uid: \"{}\"}}\n  spec: {{podCIDRs: [{}]}}\n  status:\n    addresses: [{}]\n    nodeInfo: {{bootID: boot-{}, machineID: m, systemUUID: s, kernelVersion: k, osImage: o, containerRuntimeVersion: c, kubeletVersion: v, kubeProxyVersion: v, operatingSystem: linux, architecture: amd64}}",
            n.name,
            n.uid(),
            quoted(&n.cidrs),
            addresses.join(", "),
            n.name
        );
    }
    s
}

/// The same NodeList as [`node_list`], in the JSON `kubectl get nodes -o json` writes.
pub fn node_list_json(nodes: &[TestNode]) -> String {
    let items: Vec<serde_json::Value> = nodes
        .iter()
        .map(|n| {
            serde_json::json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": n.name, "uid": n.uid()},
                "spec": {"podCIDRs": n.cidrs},
                "status": {
                    "addresses": json_addresses(n),
                    "nodeInfo": {"bootID": format!("boot-{}", n.name)},
                },
            })
        })
        .collect();
    serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()
}

/// `n`'s `status.addresses` as the API server serves them.
fn json_addresses(n: &TestNode) -> Vec<serde_json::Value> {
    n.addresses()
        .map(|(kind, a)| serde_json::json!({"type": kind, "address": a}))
        .collect()
}

/// The local node every test cluster has.
pub fn local_node() -> TestNode {
    TestNode {
        name: "local".into(),
        ips: vec!["10.88.0.1".into(), "fd00:88::1".into()],
        cidrs: vec!["10.99.0.0/24".into()],
        ..TestNode::default()
    }
}

/// An agent set-up inside a sandbox: a link on which every test gateway is on-link, a state
/// dir and a nodes file.
pub struct AgentEnv {
    pub bpffs: PathBuf,
    pub state_dir: PathBuf,
    pub nodes_file: PathBuf,
    /// When set, the agent watches the API server of this kubeconfig instead of the file.
    pub kubeconfig: Option<PathBuf>,
    /// Flags every command of this environment gets (IPsec's, say).
    pub flags: Vec<String>,
}

impl AgentEnv {
    pub fn new(bpffs: &Path) -> Self {
        ip(&["link", "add", "gw0", "type", "veth", "peer", "name", "gw1"]);
        ip(&["addr", "add", "10.88.0.1/16", "dev", "gw0"]);
        ip(&["addr", "add", "fd00:88::1/64", "dev", "gw0", "nodad"]);
        ip(&["link", "set", "gw0", "up"]);
        ip(&["link", "set", "gw1", "up"]);
        let base = bpffs.parent().unwrap().to_owned();
        Self {
            bpffs: bpffs.to_owned(),
            state_dir: base.join("state"),
            nodes_file: base.join("nodes.yaml"),
            kubeconfig: None,
            flags: Vec::new(),
        }
    }

    /// Writes the nodes file: the local node plus `remote`.
    pub fn write_nodes(&self, remote: &[TestNode]) {
        let mut all = vec![local_node()];
        all.extend_from_slice(remote);
        self.write_list(&all);
    }

    /// Writes the nodes file with exactly `all` (a list without the local node, say).
    pub fn write_list(&self, all: &[TestNode]) {
        self.write_text(&node_list(all));
    }

    /// Writes the nodes file as JSON: the local node and `remote`.
    pub fn write_nodes_json(&self, remote: &[TestNode]) {
        let mut all = vec![local_node()];
        all.extend_from_slice(remote);
        self.write_text(&node_list_json(&all));
    }

    fn write_text(&self, text: &str) {
        let tmp = self.nodes_file.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &self.nodes_file).unwrap();
    }

    /// `node-agent <args>` with this environment's state directory and bpffs: exit code,
    /// stdout, stderr.
    pub fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(agent_bin())
            .args(args)
            .env("NODE_AGENT_STATE_DIR", &self.state_dir)
            .env("NODE_AGENT_BPFFS", &self.bpffs)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Every route of the main table, ours or not: `dst -> (gateway, protocol)`.
    pub fn all_routes(&self) -> BTreeMap<String, (String, String)> {
        let mut out = BTreeMap::new();
        for family in ["-4", "-6"] {
            let o = ip(&[family, "-j", "route", "show", "table", "main"]);
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            for r in v.as_array().unwrap() {
                out.insert(
                    r["dst"].as_str().unwrap().to_owned(),
                    (
                        r["gateway"].as_str().unwrap_or("-").to_owned(),
                        r["protocol"].as_str().unwrap_or("boot").to_owned(),
                    ),
                );
            }
        }
        out
    }

    /// Every nexthop of the namespace, ours or not: `id -> (gateway, protocol)`.
    pub fn nexthops(&self) -> BTreeMap<u32, (String, String)> {
        let o = ip(&["-j", "nexthop", "show"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        let mut out = BTreeMap::new();
        for n in v.as_array().into_iter().flatten() {
            out.insert(
                n["id"].as_u64().unwrap() as u32,
                (
                    n["gateway"].as_str().unwrap_or("-").to_owned(),
                    n["protocol"].as_str().unwrap_or("unspec").to_owned(),
                ),
            );
        }
        out
    }

    /// The routes of `table` (both families) that go through a nexthop: `dst -> nhid`.
    pub fn routes_through_nexthops(&self, table: &str) -> BTreeMap<String, u32> {
        let mut out = BTreeMap::new();
        for family in ["-4", "-6"] {
            // A table with no route yet does not exist: the kernel says so, and that is empty.
            let o = Command::new("ip")
                .args([family, "-j", "route", "show", "table", table])
                .output()
                .unwrap();
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
            for r in v.as_array().into_iter().flatten() {
                if let Some(id) = r["nhid"].as_u64() {
                    out.insert(r["dst"].as_str().unwrap().to_owned(), id as u32);
                }
            }
        }
        out
    }

    /// `node-agent run` with this environment's flags and `extra`.
    pub fn command(&self, extra: &[&str]) -> Command {
        let mut c = Command::new(agent_bin());
        c.arg("run");
        match &self.kubeconfig {
            Some(k) => c.arg("--kubeconfig").arg(k),
            None => c.arg("--nodes-file").arg(&self.nodes_file),
        };
        c.args([
            "--node-name",
            "local",
            "--datapath-iface",
            "gw0",
            "--nodes-file-poll",
            "50ms",
        ])
        .arg("--state-dir")
        .arg(&self.state_dir)
        .arg("--bpffs")
        .arg(&self.bpffs)
        .args(&self.flags)
        .args(extra)
        .env("NODE_AGENT_LOG", "info")
        // The harness replaces the file by rename, so it is never read torn: a short settle
        // keeps the mechanism on without adding the default's 5 s to every removal (set through
        // the environment, so that a test's own flag overrides it).
        .env("NODE_AGENT_NODES_FILE_SETTLE", "200ms");
        c
    }

    /// `run --once --output json`: exit code and the report.
    pub fn once(&self, extra: &[&str]) -> (i32, serde_json::Value, String) {
        self.once_with_env(&[], extra)
    }

    /// [`Self::once`] with `env` set for the agent (a preloaded library, say).
    pub fn once_with_env(
        &self,
        env: &[(&str, &OsStr)],
        extra: &[&str],
    ) -> (i32, serde_json::Value, String) {
        let mut args = vec!["--once", "--output", "json", "--sync-timeout", "90s"];
        args.extend_from_slice(extra);
        let out: Output = self
            .command(&args)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let code = out.status.code().unwrap_or(-1);
        // A run that failed as a whole (an error at its end, or a test's cut) prints no report.
        if code != 0 && out.stdout.is_empty() {
            return (code, serde_json::Value::Null, stderr);
        }
        let report = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("no JSON report ({e}); stderr:\n{stderr}"));
        (code, report, stderr)
    }

    /// Starts the daemon in the background, its log going to [`Self::log`] (a file, not a pipe:
    /// nobody reads the pipe while the test waits, and a full pipe would stall the agent). The
    /// guard kills it when dropped, so a failing test leaves no agent behind.
    pub fn spawn(&self, extra: &[&str]) -> Daemon {
        self.spawn_with_env(&[], extra)
    }

    /// [`Self::spawn`] with `env` set for the agent (a test cut, say).
    pub fn spawn_with_env(&self, env: &[(&str, &OsStr)], extra: &[&str]) -> Daemon {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .unwrap();
        Daemon(
            self.command(extra)
                .envs(env.iter().copied())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap(),
        )
    }

    /// Where daemons started by [`Self::spawn`] log.
    pub fn log(&self) -> PathBuf {
        self.state_dir.with_file_name("agent.log")
    }

    /// `ip -> node ID` of the pinned map.
    pub fn map(&self) -> BTreeMap<String, u16> {
        let pin = node_agent::datapath::node_ids_pin(&self.bpffs);
        let dump = node_agent::datapath::maps::NodeMap::open(&pin)
            .unwrap()
            .dump()
            .unwrap();
        dump.entries
            .iter()
            .map(|e| (e.ip.to_string(), e.node_id))
            .collect()
    }

    /// `dst -> gateway` of our routes (protocol 201), both families.
    pub fn routes(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for family in ["-4", "-6"] {
            let o = ip(&[family, "-j", "route", "show", "proto", "201"]);
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            for r in v.as_array().unwrap() {
                out.insert(
                    r["dst"].as_str().unwrap().to_owned(),
                    r["gateway"].as_str().unwrap_or("-").to_owned(),
                );
            }
        }
        out
    }

    /// [`wait_for`], with the daemon's log in the failure message.
    pub fn wait(&self, what: &str, timeout: Duration, cond: impl FnMut() -> bool) {
        if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_for(what, timeout, cond)
        })) {
            let log = std::fs::read_to_string(self.log()).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!(
                "{}\nagent processes:\n{}agent log (last 40 lines):\n{}",
                e.downcast_ref::<String>().cloned().unwrap_or_default(),
                agent_processes(),
                tail.join("\n")
            );
        }
    }

    pub fn checkpoint(&self) -> PathBuf {
        self.state_dir.join("nodes.ckpt")
    }
}

/// `n` dual-stack remote nodes named `node-0001`...
pub fn cluster(n: u32) -> Vec<TestNode> {
    (1..=n)
        .map(|i| TestNode::dual(&format!("node-{i:04}"), i))
        .collect()
}

/// Whether the kernel holds exactly what `nodes` need: for waiting on a daemon, which writes map
/// entries, nexthops and routes one after the other.
pub fn is_exact(env: &AgentEnv, nodes: &[TestNode]) -> bool {
    env.map().keys().cloned().collect::<Vec<_>>() == expected_ips(nodes)
        && env.routes() == expected_routes(nodes)
}

/// The kernel holds exactly what `nodes` need, and nothing else of ours.
pub fn assert_exact(env: &AgentEnv, nodes: &[TestNode]) {
    let map = env.map();
    assert_eq!(
        map.keys().cloned().collect::<Vec<_>>(),
        expected_ips(nodes),
        "map entries"
    );
    assert_eq!(env.routes(), expected_routes(nodes), "routes");
}

/// `n` as the Node object the API server holds: its UID where it has one of its own (the
/// stand-in keeps it, as the real server keeps the one it gave), ExternalIPs after InternalIPs.
pub fn k8s_node(n: &TestNode) -> k8s_openapi::api::core::v1::Node {
    // The hostname label is the one the kubelet sets on every node it registers.
    let mut node = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": n.name, "labels": {"kubernetes.io/hostname": n.name}},
        "spec": {"podCIDRs": n.cidrs},
        "status": {"addresses": json_addresses(n)},
    });
    if let Some(first) = n.cidrs.first() {
        node["spec"]["podCIDR"] = first.as_str().into();
    }
    if let Some(uid) = &n.uid {
        node["metadata"]["uid"] = uid.as_str().into();
    }
    serde_json::from_value(node).expect("a valid Node")
}

/// A daemon started by [`AgentEnv::spawn`]; killed and reaped when dropped.
pub struct Daemon(pub Child);

impl std::ops::Deref for Daemon {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Daemon {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// What the kernel must hold for `nodes`: every IP mapped, every CIDR routed via the node's
/// address of its family.
pub fn expected_routes(nodes: &[TestNode]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for n in nodes {
        for (c, gw) in node_routes(n) {
            let gw = gw.unwrap_or_else(|| panic!("{}: no address of {c}'s family", n.name));
            out.insert(c.to_owned(), gw.to_owned());
        }
    }
    out
}

/// The route each pod CIDR of `n` needs: through `n`'s first InternalIP of the CIDR's family
/// (`None` when it has none). The one rule every expectation of routes is built from.
pub fn node_routes(n: &TestNode) -> impl Iterator<Item = (&str, Option<&str>)> {
    n.cidrs.iter().map(|c| {
        let v6 = c.contains(':');
        // Via an InternalIP only (the checker's view lists ExternalIPs among the addresses).
        let gw = n
            .ips
            .iter()
            .find(|i| i.contains(':') == v6 && !n.external.contains(i));
        (c.as_str(), gw.map(String::as_str))
    })
}

pub fn expected_ips(nodes: &[TestNode]) -> Vec<String> {
    let mut ips: Vec<String> = nodes.iter().flat_map(|n| n.ips.clone()).collect();
    ips.sort();
    ips
}

/// Every running agent process, one line each: its PID, scheduler state, CPU seconds so far,
/// where in the kernel it waits, and its arguments. For a failure's message: an agent that made
/// no progress either burned CPU or waited on something, and this says which.
pub fn agent_processes() -> String {
    let tick = 100.0; // USER_HZ on every Linux this runs on
    let mut out = String::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let dir = entry.path();
        let Ok(cmdline) = std::fs::read(dir.join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !args.first().is_some_and(|a| a.ends_with("/node-agent")) {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
        // The fields after the command name, which is in parentheses and may hold spaces.
        let rest: Vec<&str> = stat
            .rsplit_once(')')
            .map_or(vec![], |(_, r)| r.split_whitespace().collect());
        let cpu: f64 = [11, 12]
            .iter()
            .filter_map(|i| rest.get(*i)?.parse::<f64>().ok())
            .sum::<f64>()
            / tick;
        let wchan = std::fs::read_to_string(dir.join("wchan")).unwrap_or_default();
        let _ = writeln!(
            out,
            "  pid {} state {} cpu {cpu:.2} s wchan {wchan}: {}",
            entry.file_name().to_string_lossy(),
            rest.first().unwrap_or(&"?"),
            args[1..].join(" ")
        );
    }
    out
}

/// Polls `cond` every 20 ms until it holds, panicking with `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The `/metrics` text of the agent listening on `addr`, or nothing while it does not answer
/// (tests poll it while the agent starts).
pub fn scrape_metrics(addr: &str) -> String {
    http_get(addr, "/metrics")
        .map(|(_, b)| b)
        .unwrap_or_default()
}

/// `GET path` on the agent's metrics address inside the sandbox: status code and body.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let status = raw.split_whitespace().nth(1)?.parse().ok()?;
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

/// The value of one sample line (`name{labels} value`) in Prometheus text.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// libfaketime, which moves the wall clock of the process it is preloaded into (and of no
/// other): for tests of a wall-clock step that must not touch the host's clock.
pub fn faketime_lib() -> Result<PathBuf, String> {
    ["/usr/lib/x86_64-linux-gnu/faketime", "/usr/lib/faketime"]
        .iter()
        .map(|dir| Path::new(dir).join("libfaketime.so.1"))
        .find(|p| p.exists())
        .ok_or_else(|| "libfaketime is not installed (`apt-get install faketime`)".into())
}

/// The environment that runs the agent with its wall clock `offset` away (libfaketime's
/// syntax: `+2h`); the monotonic and boot clocks are left as they are, as a real step leaves
/// them.
pub fn wall_clock_moved<'a>(lib: &'a Path, offset: &'a str) -> [(&'static str, &'a OsStr); 3] {
    [
        ("LD_PRELOAD", lib.as_os_str()),
        ("FAKETIME", OsStr::new(offset)),
        ("DONT_FAKE_MONOTONIC", OsStr::new("1")),
    ]
}

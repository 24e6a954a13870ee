//! `cargo xtask demo`: the agent's job, start to finish, on a small cluster in a sandbox.
//!
//! The task moves itself into fresh network and mount namespaces before anything else and
//! mounts a private tmpfs on `/run/netns`, so the namespaces it names, the agents, `ip` and
//! `bpftool` it runs can only ever see the sandbox: the host's routes, bpffs and named
//! namespaces are out of reach, and whatever a crash would leave vanishes when the task exits.
//!
//! The sandbox's own namespace is the switch: a bridge `wire`. Every node of
//! `examples/nodes.yaml` is a network namespace named after it with `eth0` on the wire (its
//! InternalIPs), a private bpffs and state directory, and its own agent. Every node has a pod: a
//! namespace whose interfaces the reference CNI plugins (`bridge`, `host-local`, `loopback`,
//! Debian's `containernetworking-plugins`) create from the node's pod CIDR, as a kubelet would.
//! Pods on different nodes reach each other only through the routes the agents program.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use xtask::host::parse_ping;

use crate::cmd::{self, root, step};
use crate::{build_ebpf, setup};

/// What the demo runs besides the toolchain: the reference CNI plugins and `ping`.
const PACKAGES: &[&str] = &["containernetworking-plugins", "iputils-ping"];
const CNI_PATH: &str = "/usr/lib/cni";

/// A node of `examples/nodes.yaml`, as the sandbox builds it (a unit test holds the two to each
/// other).
struct Node {
    name: &'static str,
    ip4: &'static str,
    ip6: Option<&'static str>,
    pod_cidr: &'static str,
    /// The namespace of the node's one pod.
    pod: &'static str,
}

const NODES: [Node; 5] = [
    Node {
        name: "demo-local",
        ip4: "192.168.50.1",
        ip6: Some("fd00:50::1"),
        pod_cidr: "10.244.0.0/24",
        pod: "pod-local",
    },
    Node {
        name: "worker-a",
        ip4: "192.168.50.11",
        ip6: Some("fd00:50::11"),
        pod_cidr: "10.244.1.0/24",
        pod: "pod-a",
    },
    Node {
        name: "worker-b",
        ip4: "192.168.50.12",
        ip6: Some("fd00:50::12"),
        pod_cidr: "10.244.2.0/24",
        pod: "pod-b",
    },
    Node {
        name: "worker-c",
        ip4: "192.168.50.13",
        ip6: None,
        pod_cidr: "10.244.3.0/24",
        pod: "pod-c",
    },
    Node {
        name: "worker-d",
        ip4: "192.168.50.14",
        ip6: None,
        pod_cidr: "10.244.4.0/24",
        pod: "pod-d",
    },
];

/// The node whose agent restarts: index into [`NODES`].
const LOCAL: usize = 0;

/// The nodes that go away while the local agent is down, in the second act: two of four remote
/// nodes, which the brake's default `--max-prune-ratio` of 0.5 lets through.
const GONE: [&str; 2] = ["worker-b", "worker-d"];

pub fn run() -> anyhow::Result<()> {
    if !cmd::is_root() {
        bail!(
            "the demo needs root (network and mount namespaces, bpffs): run `sudo cargo xtask demo`"
        );
    }
    setup::run()?;
    crate::apt::ensure("demo packages", PACKAGES, "")?;
    build_ebpf::run(&build_ebpf::Args { release: true })?;
    step("demo: cargo build -p node-agent");
    cmd::run(
        Command::new("cargo")
            .current_dir(root())
            .args(["build", "-p", "node-agent"]),
    )?;
    let agent = target_dir().join("debug/node-agent");

    let dir = std::env::temp_dir().join(format!("node-agent-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let start = Instant::now();
    let result = in_sandbox(&dir, &agent);
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    step(&format!(
        "demo: done in {:.1} s (after the build); the host's network namespace was never touched",
        start.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// Cargo's target directory: `CARGO_TARGET_DIR` when set (relative to the workspace root, where
/// the build runs), else `target/`.
fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => root().join(d),
        None => root().join("target"),
    }
}

fn in_sandbox(dir: &Path, agent: &Path) -> anyhow::Result<()> {
    step(
        "demo: 1. a sandbox: every node of examples/nodes.yaml is a network namespace on one wire",
    );
    // SAFETY: the task is single-threaded here; unshare moves only this process.
    if unsafe { libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWNS) } != 0 {
        bail!("unshare: {}", std::io::Error::last_os_error());
    }
    quiet(&["mount", "--make-rprivate", "/"])?;
    let mut s = Sandbox::new(dir, agent)?;
    let result = s.act();
    if result.is_err() {
        s.print_logs();
    }
    let left = s.teardown();
    result?;
    left?;
    Ok(())
}

/// The sandbox and what lives in it. Dropping it tears down whatever is still up, so a failed
/// step leaves nothing behind either; [`Sandbox::teardown`] does the same and checks it.
struct Sandbox {
    dir: PathBuf,
    agent: PathBuf,
    nodes_file: PathBuf,
    /// `/run/netns` did not exist before the demo made it.
    made_run_netns: bool,
    run_netns_mounted: bool,
    wire: bool,
    /// Indexes into [`NODES`] of the nodes whose namespace exists.
    nodes: Vec<usize>,
    /// Those whose pod namespace exists (its CNI `ADD` may have half run).
    pods: Vec<usize>,
    /// Those whose bpffs is mounted.
    mounts: Vec<usize>,
    agents: Vec<(usize, Child)>,
}

impl Sandbox {
    fn new(dir: &Path, agent: &Path) -> anyhow::Result<Self> {
        let run_netns = Path::new("/run/netns");
        let made_run_netns = !run_netns.exists();
        std::fs::create_dir_all(run_netns)?;
        let mut s = Self {
            dir: dir.to_owned(),
            agent: agent.to_owned(),
            nodes_file: dir.join("nodes.yaml"),
            made_run_netns,
            run_netns_mounted: false,
            wire: false,
            nodes: Vec::new(),
            pods: Vec::new(),
            mounts: Vec::new(),
            agents: Vec::new(),
        };
        // Names under /run/netns are this mount namespace's alone.
        quiet(&[
            "mount",
            "-t",
            "tmpfs",
            "-o",
            "mode=755",
            "demo-netns",
            "/run/netns",
        ])?;
        s.run_netns_mounted = true;
        quiet(&["ip", "link", "set", "lo", "up"])?;
        quiet(&["ip", "link", "add", "wire", "type", "bridge"])?;
        s.wire = true;
        quiet(&["ip", "link", "set", "wire", "up"])?;
        Ok(s)
    }

    fn node_dir(&self, i: usize) -> PathBuf {
        self.dir.join(NODES[i].name)
    }
    fn bpffs(&self, i: usize) -> PathBuf {
        self.node_dir(i).join("bpffs")
    }
    fn state(&self, i: usize) -> PathBuf {
        self.node_dir(i).join("state")
    }
    fn log(&self, i: usize) -> PathBuf {
        self.node_dir(i).join("agent.log")
    }

    /// The whole story; teardown is the caller's.
    fn act(&mut self) -> anyhow::Result<()> {
        std::fs::copy(root().join("examples/nodes.yaml"), &self.nodes_file)?;
        println!("NODE         UPLINK (eth0)                 POD_CIDR");
        for (i, n) in NODES.iter().enumerate() {
            self.add_node(i)?;
            let ips = [Some(n.ip4), n.ip6].into_iter().flatten();
            println!(
                "{:<12} {:<29} {}",
                n.name,
                ips.collect::<Vec<_>>().join(","),
                n.pod_cidr
            );
        }

        step(
            "demo: 2. a pod on every node, made by the reference CNI plugins (bridge, host-local, loopback)",
        );
        println!(
            "bridge config of {} (CNI_COMMAND=ADD, run in the node's namespace):\n{}",
            NODES[LOCAL].name,
            self.bridge_conf(LOCAL)
        );
        let mut pod_ips = Vec::new();
        for (i, n) in NODES.iter().enumerate() {
            let ip = self.add_pod(i)?;
            println!(
                "{:<10} on {:<11} eth0 {ip}/24 via cni0, leased by host-local",
                n.pod, n.name
            );
            pod_ips.push(ip);
        }

        step(&format!(
            "demo: 3. an agent on every node; {}'s logs below, the others' in their node's directory",
            NODES[LOCAL].name
        ));
        for i in 0..NODES.len() {
            self.start_agent(i, &["--nodes-file-poll", "200ms"])?;
        }
        for i in 0..NODES.len() {
            self.wait_ready(i)?;
        }

        step(&format!(
            "demo: 4. what {}'s agent programmed",
            NODES[LOCAL].name
        ));
        show(&[
            "bpftool",
            "map",
            "dump",
            "pinned",
            &format!("{}/node-agent/node_ids", self.bpffs(LOCAL).display()),
        ])?;
        self.show_programmed(LOCAL)?;

        step("demo: 5. pods on different nodes ping each other through the agents' routes");
        let all: Vec<usize> = (0..NODES.len()).collect();
        self.ping_mesh(&all, &pod_ips)?;

        step(&format!(
            "demo: 6. {}'s agent stops; while it is down, {} are deleted (their pods, agents and \
             namespaces go with them)",
            NODES[LOCAL].name,
            GONE.join(" and ")
        ));
        self.stop_agent(LOCAL)?;
        let text = std::fs::read_to_string(&self.nodes_file)?;
        let tmp = self.nodes_file.with_extension("tmp");
        std::fs::write(&tmp, drop_nodes(&text, &GONE))?;
        std::fs::rename(&tmp, &self.nodes_file)?;
        for i in gone() {
            self.remove_node(i)?;
        }
        let running: Vec<usize> = (0..NODES.len())
            .filter(|&i| i != LOCAL && !gone().contains(&i))
            .collect();
        for &i in &running {
            self.wait_routes_gone(i)?;
        }
        println!(
            "{}: their agents ran and removed their routes to them as the deletes came in",
            running
                .iter()
                .map(|&i| NODES[i].name)
                .collect::<Vec<_>>()
                .join(", ")
        );
        println!(
            "{} still routes to them; nothing told its agent:",
            NODES[LOCAL].name
        );
        self.show_routes(LOCAL)?;

        step("demo: 7. on restart it synthesizes the deletes the watch never delivered");
        let local = NODES[LOCAL].name;
        let mut plan = vec!["ip", "netns", "exec", local, self.agent.to_str().unwrap()];
        let nodes_file = self.nodes_file.to_str().unwrap().to_owned();
        let state = self.state(LOCAL).to_str().unwrap().to_owned();
        let bpffs = self.bpffs(LOCAL).to_str().unwrap().to_owned();
        plan.extend([
            "plan",
            "--nodes-file",
            &nodes_file,
            "--node-name",
            local,
            "--state-dir",
            &state,
            "--bpffs",
            &bpffs,
        ]);
        show(&plan)?;
        let out = self
            .agent_cmd(LOCAL, &["--once"])
            .output()
            .context("running node-agent --once")?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        if !out.status.success() {
            bail!(
                "node-agent --once failed: {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for line in String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| l.contains("deleted"))
        {
            println!("{line}");
        }
        step("demo: the clean result");
        self.show_programmed(LOCAL)?;
        show(&[
            self.agent.to_str().unwrap(),
            "state",
            "show",
            "--state-dir",
            &state,
        ])?;

        step("demo: 8. the remaining pods still talk");
        let left: Vec<usize> = (0..NODES.len()).filter(|i| !gone().contains(i)).collect();
        self.ping_mesh(&left, &pod_ips)?;
        step("demo: 9. CNI DEL for every pod, agents stopped, namespaces deleted, bpffs unmounted");
        Ok(())
    }

    /// The node's namespace, its uplink on the wire, forwarding on, its bpffs mounted.
    fn add_node(&mut self, i: usize) -> anyhow::Result<()> {
        let n = &NODES[i];
        std::fs::create_dir_all(self.bpffs(i))?;
        quiet(&["mount", "-t", "bpf", "bpf", self.bpffs(i).to_str().unwrap()])?;
        self.mounts.push(i);
        quiet(&["ip", "netns", "add", n.name])?;
        self.nodes.push(i);
        let port = format!("w{i}");
        quiet(&[
            "ip", "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", n.name,
        ])?;
        quiet(&["ip", "link", "set", &port, "master", "wire", "up"])?;
        let ip4 = format!("{}/24", n.ip4);
        quiet(&["ip", "-n", n.name, "link", "set", "lo", "up"])?;
        quiet(&["ip", "-n", n.name, "addr", "add", &ip4, "dev", "eth0"])?;
        // An IPv6 address on every uplink, listed or not, so the IPv6 InternalIPs of the others
        // are on-link gateways on every node.
        let ip6 = format!("fd00:50::{}/64", n.ip4.rsplit('.').next().unwrap_or("0"));
        quiet(&[
            "ip", "-n", n.name, "addr", "add", &ip6, "dev", "eth0", "nodad",
        ])?;
        quiet(&["ip", "-n", n.name, "link", "set", "eth0", "up"])?;
        quiet(&[
            "ip",
            "netns",
            "exec",
            n.name,
            "sysctl",
            "-qw",
            "net.ipv4.ip_forward=1",
        ])
    }

    /// The `bridge` plugin's config for node `i`'s pods: a `cni0` bridge holding the gateway,
    /// addresses from the node's pod CIDR, leases under the node's directory.
    fn bridge_conf(&self, i: usize) -> String {
        let conf = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "demo",
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": true,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": NODES[i].pod_cidr}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": self.node_dir(i).join("ipam"),
            },
        });
        serde_json::to_string_pretty(&conf).expect("JSON")
    }

    fn loopback_conf() -> &'static str {
        r#"{"cniVersion": "1.0.0", "name": "demo-lo", "type": "loopback"}"#
    }

    /// Runs a CNI plugin for node `i`'s pod, in the node's namespace as a kubelet would, and
    /// returns its result (JSON).
    fn cni(&self, i: usize, command: &str, plugin: &str, ifname: &str) -> anyhow::Result<String> {
        use std::io::Write as _;
        let n = &NODES[i];
        let conf = match plugin {
            "bridge" => self.bridge_conf(i),
            _ => Self::loopback_conf().to_owned(),
        };
        let mut child = Command::new("ip")
            .args(["netns", "exec", n.name])
            .arg(Path::new(CNI_PATH).join(plugin))
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", n.pod)
            .env("CNI_NETNS", format!("/run/netns/{}", n.pod))
            .env("CNI_IFNAME", ifname)
            .env("CNI_PATH", CNI_PATH)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {CNI_PATH}/{plugin}"))?;
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(conf.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "CNI {command} {plugin} for {}: {}\n{}{}",
                n.pod,
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Node `i`'s pod: its namespace, `lo` up, `eth0` on the node's `cni0`. Returns its IPv4.
    fn add_pod(&mut self, i: usize) -> anyhow::Result<String> {
        quiet(&["ip", "netns", "add", NODES[i].pod])?;
        self.pods.push(i);
        self.cni(i, "ADD", "loopback", "lo")?;
        let result = self.cni(i, "ADD", "bridge", "eth0")?;
        let json: serde_json::Value =
            serde_json::from_str(&result).context("the bridge plugin's result")?;
        let addr = json["ips"][0]["address"]
            .as_str()
            .with_context(|| format!("no address in the bridge plugin's result: {result}"))?;
        Ok(addr.split('/').next().unwrap_or(addr).to_owned())
    }

    /// `CNI_COMMAND=DEL` for node `i`'s pod, then its namespace goes.
    fn del_pod(&mut self, i: usize) -> anyhow::Result<()> {
        self.pods.retain(|&p| p != i);
        let bridge = self.cni(i, "DEL", "bridge", "eth0");
        let lo = self.cni(i, "DEL", "loopback", "lo");
        let ns = quiet(&["ip", "netns", "del", NODES[i].pod]);
        bridge.and(lo).and(ns)
    }

    fn agent_cmd(&self, i: usize, extra: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", NODES[i].name])
            .arg(&self.agent)
            .arg("run")
            .arg("--nodes-file")
            .arg(&self.nodes_file)
            .args(["--node-name", NODES[i].name, "--datapath-iface", "eth0"])
            .arg("--state-dir")
            .arg(self.state(i))
            .arg("--bpffs")
            .arg(self.bpffs(i))
            .args(extra)
            // The file is replaced by rename, never torn: no need to wait long for it to settle.
            .env("NODE_AGENT_NODES_FILE_SETTLE", "200ms");
        c
    }

    /// Starts node `i`'s agent as a daemon (`ip netns exec` becomes the agent): the local one
    /// logs to the terminal, the others to `<node>/agent.log`.
    fn start_agent(&mut self, i: usize, extra: &[&str]) -> anyhow::Result<()> {
        let mut c = self.agent_cmd(i, extra);
        if i != LOCAL {
            let log = std::fs::File::create(self.log(i))?;
            c.stdout(Stdio::null()).stderr(log);
        }
        let child = c
            .spawn()
            .with_context(|| format!("starting {}'s agent", NODES[i].name))?;
        self.agents.push((i, child));
        Ok(())
    }

    /// Waits for node `i`'s agent's first checkpoint: it has reconciled.
    fn wait_ready(&mut self, i: usize) -> anyhow::Result<()> {
        let ckpt = self.state(i).join("nodes.ckpt");
        let start = Instant::now();
        while !ckpt.exists() {
            if let Some((_, child)) = self.agents.iter_mut().find(|(a, _)| *a == i)
                && let Some(status) = child.try_wait()?
            {
                bail!("{}'s agent exited early: {status}", NODES[i].name);
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!("{}'s agent was not ready after 60 s", NODES[i].name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Waits until node `i`'s routes to the pod CIDRs of the [`GONE`] nodes are gone.
    fn wait_routes_gone(&self, i: usize) -> anyhow::Result<()> {
        let start = Instant::now();
        loop {
            let routes = cmd::output(Command::new("ip").args([
                "-n",
                NODES[i].name,
                "route",
                "show",
                "proto",
                "201",
            ]))
            .unwrap_or_default();
            let stale: Vec<&str> = gone()
                .into_iter()
                .map(|g| NODES[g].pod_cidr)
                .filter(|c| routes.contains(c))
                .collect();
            if stale.is_empty() {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(20) {
                bail!(
                    "{}'s running agent still routes to {} 20 s after the nodes were deleted",
                    NODES[i].name,
                    stale.join(", ")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGTERM to node `i`'s agent; it must exit cleanly within 20 s.
    fn stop_agent(&mut self, i: usize) -> anyhow::Result<()> {
        let Some(pos) = self.agents.iter().position(|(a, _)| *a == i) else {
            return Ok(());
        };
        let (_, mut child) = self.agents.remove(pos);
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    bail!("{}'s agent exited with {status} on SIGTERM", NODES[i].name);
                }
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "{}'s agent did not stop within 20 s of SIGTERM",
                    NODES[i].name
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Node `i` leaves: its agent stops, its pod is deleted, its namespace goes, its bpffs is
    /// unmounted. Every step is tried; the first failure is returned.
    fn remove_node(&mut self, i: usize) -> anyhow::Result<()> {
        let mut result = self.stop_agent(i);
        if self.pods.contains(&i) {
            result = result.and(self.del_pod(i));
        }
        if self.nodes.contains(&i) {
            self.nodes.retain(|&n| n != i);
            // Its port first: a namespace is dismantled after `ip netns del` returns, and the
            // veth's other end would outlive it for a moment.
            result = result.and(quiet(&["ip", "link", "del", &format!("w{i}")]));
            result = result.and(quiet(&["ip", "netns", "del", NODES[i].name]));
        }
        if self.mounts.contains(&i) {
            self.mounts.retain(|&n| n != i);
            result = result.and(quiet(&["umount", self.bpffs(i).to_str().unwrap()]));
        }
        result
    }

    /// Pings from every pod of `nodes` to every other one's, all at once (3 each), and fails
    /// unless every ping is answered.
    fn ping_mesh(&self, nodes: &[usize], pod_ips: &[String]) -> anyhow::Result<()> {
        let (from, to) = (nodes[0], nodes[1]);
        println!(
            "$ ip netns exec {} ping -c 3 -W 1 -i 0.2 {}   # {} -> {}, and so on for each pair",
            NODES[from].pod, pod_ips[to], NODES[from].name, NODES[to].name
        );
        let mut pings = Vec::new();
        for &a in nodes {
            for &b in nodes.iter().filter(|&&b| b != a) {
                let child = Command::new("ip")
                    .args(["netns", "exec", NODES[a].pod, "ping", "-c", "3", "-W", "1"])
                    .args(["-i", "0.2", &pod_ips[b]])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .context("starting ping")?;
                pings.push((a, b, child));
            }
        }
        let (mut sent, mut answered) = (0, 0);
        let mut lines: Vec<String> = Vec::new();
        for (a, b, child) in pings {
            let out = child.wait_with_output()?;
            let text = String::from_utf8_lossy(&out.stdout);
            let (s, r) = parse_ping(&text).unwrap_or((0, 0));
            sent += s;
            answered += r;
            let line = format!("{:<10} ({:<10}) ->", NODES[a].pod, NODES[a].name);
            let hit = format!(" {}:{r}/{s}", NODES[b].pod);
            match lines.last_mut() {
                Some(l) if l.starts_with(&line) => l.push_str(&hit),
                _ => lines.push(line + &hit),
            }
        }
        for l in lines {
            println!("{l}");
        }
        println!("pods: {sent} pings sent, {answered} answered");
        if sent == 0 || answered != sent {
            bail!("pods: {} pings were not answered", sent - answered);
        }
        Ok(())
    }

    fn show_routes(&self, i: usize) -> anyhow::Result<()> {
        show(&["ip", "-n", NODES[i].name, "route", "show", "proto", "201"])
    }

    /// The node-ID map, our nexthops and routes, as an operator would look at them.
    fn show_programmed(&self, i: usize) -> anyhow::Result<()> {
        show(&[
            self.agent.to_str().unwrap(),
            "map",
            "dump",
            "--bpffs",
            self.bpffs(i).to_str().unwrap(),
        ])?;
        let ns = NODES[i].name;
        show(&["ip", "-n", ns, "nexthop", "list", "protocol", "201"])?;
        self.show_routes(i)?;
        show(&["ip", "-n", ns, "-6", "route", "show", "proto", "201"])
    }

    /// The tail of every agent's log, after a failure.
    fn print_logs(&self) {
        for i in (0..NODES.len()).filter(|&i| i != LOCAL) {
            let log = std::fs::read_to_string(self.log(i)).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            if lines.is_empty() {
                continue;
            }
            eprintln!("--- {}'s agent log, last lines:", NODES[i].name);
            for l in &lines[lines.len().saturating_sub(15)..] {
                eprintln!("{l}");
            }
        }
    }

    /// Removes everything the demo made (pods by CNI `DEL`), then checks that nothing is left:
    /// no named namespace, no interface on the switch, no bpffs mount, no IPAM lease.
    fn teardown(&mut self) -> anyhow::Result<()> {
        let mut result = Ok(());
        for i in 0..NODES.len() {
            result = result.and(self.remove_node(i));
        }
        let left_ns = cmd::output(Command::new("ip").args(["netns", "list"])).unwrap_or_default();
        let leases = ipam_leases(&self.dir);
        if self.wire {
            self.wire = false;
            result = result.and(quiet(&["ip", "link", "del", "wire"]));
        }
        let links = cmd::output(Command::new("ip").args(["-o", "link", "show"]))
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.contains(" lo:"))
            .map(|l| l.split(':').nth(1).unwrap_or(l).trim().to_owned())
            .collect::<Vec<_>>();
        let mounts = std::fs::read_to_string("/proc/self/mounts")
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(self.dir.to_str().unwrap()))
            .count();
        if self.run_netns_mounted {
            self.run_netns_mounted = false;
            result = result.and(quiet(&["umount", "/run/netns"]));
        }
        if self.made_run_netns {
            self.made_run_netns = false;
            let _ = std::fs::remove_dir("/run/netns");
        }
        // The host's own named namespaces, now visible again: none may carry a demo name.
        let host_ns = cmd::output(Command::new("ip").args(["netns", "list"])).unwrap_or_default();
        let on_host: Vec<&str> = host_ns
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| NODES.iter().any(|x| x.name == *n || x.pod == *n))
            .collect();
        let namespaces = left_ns.lines().count() + on_host.len();
        let removed = std::fs::remove_dir_all(&self.dir).is_ok() || !self.dir.exists();
        result?;
        if namespaces + links.len() + mounts + leases.len() > 0 || !removed {
            bail!(
                "the demo left {namespaces} namespaces ({} {}), interfaces {links:?}, {mounts} \
                 mounts, IPAM leases {leases:?}, its directory removed: {removed}",
                left_ns.trim(),
                on_host.join(" ")
            );
        }
        println!(
            "demo: nothing left: 0 namespaces (ip netns list), 0 interfaces, 0 bpffs mounts, \
             0 IPAM leases (CNI DEL released them all), {} removed",
            shown_path(&self.dir)
        );
        Ok(())
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let up = !self.agents.is_empty() || !self.nodes.is_empty() || self.wire;
        if (up || self.run_netns_mounted)
            && let Err(e) = self.teardown()
        {
            eprintln!("demo: cleaning up after a failure: {e:#}");
        }
    }
}

fn gone() -> Vec<usize> {
    (0..NODES.len())
        .filter(|&i| GONE.contains(&NODES[i].name))
        .collect()
}

/// The leases host-local holds under `dir`: a file per address, beside its `lock` and
/// `last_reserved_ip.*` bookkeeping.
fn ipam_leases(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for n in &NODES {
        let net = dir.join(n.name).join("ipam/demo");
        for entry in std::fs::read_dir(&net).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name != "lock" && !name.starts_with("last_reserved_ip") {
                out.push(format!("{}/{name}", n.name));
            }
        }
    }
    out
}

/// The NodeList without the items named in `gone`: items are the blocks that start with `- `.
fn drop_nodes(text: &str, gone: &[&str]) -> String {
    let mut blocks: Vec<String> = vec![String::new()];
    for line in text.lines() {
        if line.starts_with("- ") {
            blocks.push(String::new());
        }
        let last = blocks.last_mut().expect("one block at least");
        last.push_str(line);
        last.push('\n');
    }
    blocks
        .into_iter()
        .filter(|b| !gone.iter().any(|g| b.contains(&format!("{{name: {g},"))))
        .collect()
}

/// Runs a command without echoing it; fails with its stderr.
fn quiet(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args[0]))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A path as a reader would see it: the sandbox's directories under `/tmp`.
fn shown_path(p: &Path) -> String {
    shown(&p.display().to_string())
}

fn shown(text: &str) -> String {
    text.replace(&format!("{}/", std::env::temp_dir().display()), "/tmp/")
}

/// Runs and prints a command the way a reader would type it: the agent by its name (it is on the
/// `PATH` of a node's pod), the sandbox's directories under `/tmp`.
fn show(args: &[&str]) -> anyhow::Result<()> {
    let words: Vec<&str> = args
        .iter()
        .map(|a| match Path::new(a).file_name() {
            Some(name) if name == "node-agent" && a.starts_with('/') => "node-agent",
            _ => a,
        })
        .collect();
    println!("$ {}", shown(&words.join(" ")));
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args[0]))?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropping_nodes_keeps_the_others_intact() {
        let text = std::fs::read_to_string(root().join("examples/nodes.yaml")).unwrap();
        let left = drop_nodes(&text, &GONE);
        assert!(
            !left.contains("worker-b") && !left.contains("worker-d"),
            "{left}"
        );
        for kept in ["demo-local", "worker-a", "worker-c", "192.168.50.13"] {
            assert!(left.contains(kept), "{kept} lost:\n{left}");
        }
        assert_eq!(left.matches("- apiVersion: v1").count(), 3);
    }

    /// The sandbox builds the nodes the example file lists, with their addresses and CIDRs.
    #[test]
    fn the_sandbox_nodes_are_the_example_files() {
        let text = std::fs::read_to_string(root().join("examples/nodes.yaml")).unwrap();
        assert_eq!(text.matches("kind: Node").count(), NODES.len());
        for n in &NODES {
            let block = drop_nodes(
                &text,
                &NODES
                    .iter()
                    .map(|x| x.name)
                    .filter(|x| *x != n.name)
                    .collect::<Vec<_>>(),
            );
            assert!(
                block.contains(&format!("{{name: {},", n.name)),
                "{}",
                n.name
            );
            assert!(
                block.contains(&format!("podCIDR: {},", n.pod_cidr)),
                "{block}"
            );
            assert!(block.contains(&format!("address: {}}}", n.ip4)), "{block}");
            match n.ip6 {
                Some(ip6) => assert!(block.contains(&format!("address: \"{ip6}\"")), "{block}"),
                None => assert!(!block.contains("fd00:50"), "{block}"),
            }
        }
    }

    #[test]
    fn ping_summaries() {
        let iputils = "3 packets transmitted, 2 received, 33% packet loss, time 405ms\n";
        assert_eq!(parse_ping(iputils), Some((3, 2)));
        assert_eq!(parse_ping("ping: connect: Network is unreachable\n"), None);
    }
}

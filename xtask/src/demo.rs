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

/// The named parts of what the demo printed, in order: `cargo xtask docs` puts them in the
/// docs' recorded outputs. Every part's name is in [`PARTS`].
#[derive(Debug, Default)]
pub struct Transcript {
    parts: Vec<(&'static str, String)>,
    /// Scripts run on the local node for the docs, and what they printed.
    on_node: Vec<(OnNode, String)>,
}

/// Commands to run on the local node as in the agent's pod, against the cluster's node list
/// less some nodes (what the agent would see if they went away).
#[derive(Clone, Debug, PartialEq)]
pub struct OnNode {
    /// Shell commands, one per line.
    pub commands: String,
    /// Nodes of `examples/nodes.yaml` left out of the list the commands see.
    pub without: Vec<String>,
}

/// Every part the demo records, in the order it prints them.
pub const PARTS: &[&str] = &[
    "nodes",
    "pods",
    "first-start-log",
    "bpftool-dump",
    "programmed",
    "pings",
    "stop-log",
    "still-routed",
    "plan",
    "run-once",
    "clean-result",
    "pings-after",
    "teardown",
];

impl Transcript {
    /// What the demo printed under `part`, if it printed anything.
    pub fn part(&self, part: &str) -> Option<&str> {
        self.parts
            .iter()
            .find(|(p, _)| *p == part)
            .map(|(_, t)| t.as_str())
    }

    /// What `script`, given to [`run`], printed on the local node.
    pub fn on_node(&self, script: &OnNode) -> Option<&str> {
        self.on_node
            .iter()
            .find(|(s, _)| s == script)
            .map(|(_, t)| t.as_str())
    }

    /// Prints `text` and keeps it under `part`.
    fn say(&mut self, part: &'static str, text: &str) {
        debug_assert!(PARTS.contains(&part), "{part} is not in PARTS");
        let mut text = text.to_owned();
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        print!("{text}");
        match self.parts.iter_mut().find(|(p, _)| *p == part) {
            Some((_, t)) => t.push_str(&text),
            None => self.parts.push((part, text)),
        }
    }
}

/// Runs the demo. Each of `scripts` also runs on the local node once its agent has programmed
/// the cluster, as in the agent's pod ([`Sandbox::on_node`]); what they print is kept in the
/// transcript, not printed.
pub fn run(scripts: &[OnNode]) -> anyhow::Result<Transcript> {
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

    sweep_dead_demos();
    let dir = std::env::temp_dir().join(format!("{DIR_PREFIX}{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let start = Instant::now();
    let result = in_sandbox(&dir, &agent, scripts);
    let _ = std::fs::remove_dir_all(&dir);
    let transcript = result?;
    step(&format!(
        "demo: done in {:.1} s (after the build); the host's network namespace was never touched",
        start.elapsed().as_secs_f64()
    ));
    Ok(transcript)
}

/// The demo's directory is this and its PID.
const DIR_PREFIX: &str = "node-agent-demo-";

/// Removes the directories of demos whose process is gone. A demo removes its own, but one that
/// was interrupted (Ctrl-C, kill -9, a crash) cannot; its namespaces and mounts went with it.
fn sweep_dead_demos() {
    let tmp = std::env::temp_dir();
    for entry in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(DIR_PREFIX)
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            match std::fs::remove_dir_all(entry.path()) {
                Ok(()) => step(&format!(
                    "demo: removed {} (left by an interrupted demo)",
                    shown_path(&entry.path())
                )),
                Err(e) => step(&format!(
                    "demo: cannot remove {} (left by an interrupted demo): {e}",
                    shown_path(&entry.path())
                )),
            }
        }
    }
}

/// Cargo's target directory: `CARGO_TARGET_DIR` when set (relative to the workspace root, where
/// the build runs), else `target/`.
fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => root().join(d),
        None => root().join("target"),
    }
}

fn in_sandbox(dir: &Path, agent: &Path, scripts: &[OnNode]) -> anyhow::Result<Transcript> {
    step(
        "demo: 1. a sandbox: every node of examples/nodes.yaml is a network namespace on one wire",
    );
    // SAFETY: the task is single-threaded here; unshare moves only this process.
    if unsafe { libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWNS) } != 0 {
        bail!("unshare: {}", std::io::Error::last_os_error());
    }
    quiet(&["mount", "--make-rprivate", "/"])?;
    let mut s = Sandbox::new(dir, agent)?;
    let result = s.act(scripts);
    if result.is_err() {
        s.print_logs();
    }
    let left = s.teardown();
    result?;
    left?;
    Ok(std::mem::take(&mut s.transcript))
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
    transcript: Transcript,
    /// How much of the local agent's log has been printed.
    local_log_shown: usize,
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
            transcript: Transcript::default(),
            local_log_shown: 0,
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
    fn act(&mut self, scripts: &[OnNode]) -> anyhow::Result<()> {
        let pod_ips = self.build_cluster()?;
        self.show_the_job(scripts, &pod_ips)?;
        self.lose_nodes_while_down()?;
        self.restart(&pod_ips)?;
        step("demo: 9. CNI DEL for every pod, agents stopped, namespaces deleted, bpffs unmounted");
        Ok(())
    }

    /// Steps 1 to 3: the nodes, a pod on each, an agent on each. Returns the pods' addresses.
    fn build_cluster(&mut self) -> anyhow::Result<Vec<String>> {
        std::fs::copy(root().join("examples/nodes.yaml"), &self.nodes_file)?;
        let mut table = String::from("NODE         UPLINK (eth0)                 POD_CIDR\n");
        for (i, n) in NODES.iter().enumerate() {
            self.add_node(i)?;
            let ips = [Some(n.ip4), n.ip6].into_iter().flatten();
            table += &format!(
                "{:<12} {:<29} {}\n",
                n.name,
                ips.collect::<Vec<_>>().join(","),
                n.pod_cidr
            );
        }
        self.transcript.say("nodes", &table);

        step(
            "demo: 2. a pod on every node, made by the reference CNI plugins (bridge, host-local, loopback)",
        );
        let conf = format!(
            "bridge config of {} (CNI_COMMAND=ADD, run in the node's namespace):\n{}",
            NODES[LOCAL].name,
            shown(&self.bridge_conf(LOCAL))
        );
        self.transcript.say("pods", &conf);
        let mut pod_ips = Vec::new();
        for (i, n) in NODES.iter().enumerate() {
            let ip = self.add_pod(i)?;
            let line = format!(
                "{:<10} on {:<11} eth0 {ip}/24 via cni0, leased by host-local",
                n.pod, n.name
            );
            self.transcript.say("pods", &line);
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
        let log = self.local_log()?;
        self.transcript.say("first-start-log", &log);
        Ok(pod_ips)
    }

    /// Steps 4 and 5: what the local agent programmed, the docs' scripts, and the pods talking.
    fn show_the_job(&mut self, scripts: &[OnNode], pod_ips: &[String]) -> anyhow::Result<()> {
        step(&format!(
            "demo: 4. what {}'s agent programmed",
            NODES[LOCAL].name
        ));
        let dump = show(&[
            "bpftool",
            "map",
            "dump",
            "pinned",
            &format!("{}/node-agent/node_ids", self.bpffs(LOCAL).display()),
        ])?;
        self.transcript.say("bpftool-dump", &dump);
        let programmed = self.show_programmed(LOCAL)?;
        self.transcript.say("programmed", &programmed);
        for (n, script) in scripts.iter().enumerate() {
            let out = self.on_node(LOCAL, script, n)?;
            self.transcript.on_node.push((script.clone(), out));
        }

        step("demo: 5. pods on different nodes ping each other through the agents' routes");
        let all: Vec<usize> = (0..NODES.len()).collect();
        let pings = self.ping_mesh(&all, pod_ips);
        self.transcript.say("pings", &pings.text);
        pings.result
    }

    /// Step 6: the local agent stops and [`GONE`] nodes go; the running agents follow, the local
    /// node still routes to them.
    fn lose_nodes_while_down(&mut self) -> anyhow::Result<()> {
        step(&format!(
            "demo: 6. {}'s agent stops; while it is down, {} are deleted (their pods, agents and \
             namespaces go with them)",
            NODES[LOCAL].name,
            GONE.join(" and ")
        ));
        self.stop_agent(LOCAL)?;
        let log = self.local_log()?;
        self.transcript.say("stop-log", &log);
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
        let still = format!(
            "{}: their agents ran and removed their routes to them as the deletes came in\n\
             {} still routes to them; nothing told its agent:\n{}",
            running
                .iter()
                .map(|&i| NODES[i].name)
                .collect::<Vec<_>>()
                .join(", "),
            NODES[LOCAL].name,
            self.show_routes(LOCAL)?
        );
        self.transcript.say("still-routed", &still);
        Ok(())
    }

    /// Steps 7 and 8: the plan, the one-shot run that synthesizes the deletes, the clean result,
    /// the remaining pods still talking.
    fn restart(&mut self, pod_ips: &[String]) -> anyhow::Result<()> {
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
        let plan = show(&plan)?;
        self.transcript.say("plan", &plan);
        let out = self
            .agent_cmd(LOCAL, &["--once"])
            .output()
            .context("running node-agent --once")?;
        if !out.status.success() {
            bail!(
                "node-agent --once failed: {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let mut once = String::from_utf8_lossy(&out.stdout).into_owned();
        for line in String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| l.contains("deleted"))
        {
            once += &format!("{}\n", shown(line));
        }
        self.transcript.say("run-once", &once);
        step("demo: the clean result");
        let programmed = self.show_programmed(LOCAL)?;
        let state_show = show(&[
            self.agent.to_str().unwrap(),
            "state",
            "show",
            "--state-dir",
            &state,
        ])?;
        self.transcript
            .say("clean-result", &(programmed + &state_show));

        step("demo: 8. the remaining pods still talk");
        let left: Vec<usize> = (0..NODES.len()).filter(|i| !gone().contains(i)).collect();
        let pings = self.ping_mesh(&left, pod_ips);
        self.transcript.say("pings-after", &pings.text);
        pings.result
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

    /// Starts node `i`'s agent as a daemon (`ip netns exec` becomes the agent), logging to
    /// `<node>/agent.log`; the demo prints the local one's at each step ([`Self::local_log`]).
    fn start_agent(&mut self, i: usize, extra: &[&str]) -> anyhow::Result<()> {
        let mut c = self.agent_cmd(i, extra);
        let log = std::fs::File::create(self.log(i))?;
        c.stdout(Stdio::null()).stderr(log);
        let child = c
            .spawn()
            .with_context(|| format!("starting {}'s agent", NODES[i].name))?;
        self.agents.push((i, child));
        Ok(())
    }

    /// Runs `script` on node `i` as in the agent's pod: in the node's network namespace and a
    /// mount namespace of its own, with the node's bpffs at `/sys/fs/bpf`, its state directory
    /// at `/run/node-agent`, a private `/etc/iproute2/rt_protos.d`, the agent on the `PATH` and
    /// the pod's settings in the environment (its node, its uplink, and the node list less
    /// `script.without`, as a file: `n` names it). Returns what the commands printed to stdout,
    /// whatever their exit status (`node-agent plan` exits 3 while the brake holds); the setup
    /// must succeed.
    fn on_node(&self, i: usize, script: &OnNode, n: usize) -> anyhow::Result<String> {
        let nodes = self.dir.join(format!("on-node-{n}.yaml"));
        let without: Vec<&str> = script.without.iter().map(String::as_str).collect();
        std::fs::write(
            &nodes,
            drop_nodes(&std::fs::read_to_string(&self.nodes_file)?, &without),
        )?;
        let setup = format!(
            "set -e\n\
             mount --bind {} /sys/fs/bpf\n\
             mount -t tmpfs tmpfs /run\n\
             mkdir /run/node-agent\n\
             mount --bind {} /run/node-agent\n\
             mount -t tmpfs tmpfs /etc/iproute2/rt_protos.d\n\
             set +e\n",
            self.bpffs(i).display(),
            self.state(i).display()
        );
        let path = format!(
            "{}:{}",
            self.agent.parent().expect("a file").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", NODES[i].name))
            .args(["unshare", "--mount", "sh", "-c"])
            .arg(format!("{setup}{}\n", script.commands))
            .env("PATH", path)
            .env("NODE_AGENT_NODE_NAME", NODES[i].name)
            .env("NODE_AGENT_DATAPATH_IFACE", "eth0")
            .env("NODE_AGENT_NODES_FILE", &nodes)
            .env("NODE_AGENT_NODES_FILE_SETTLE", "200ms")
            .output()
            .context("running nsenter")?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if stdout.is_empty() {
            bail!(
                "on {}: `{}` printed nothing: {}\n{}",
                NODES[i].name,
                script.commands,
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(stdout)
    }

    /// The local agent's log lines since the last call, paths as a reader sees them.
    fn local_log(&mut self) -> anyhow::Result<String> {
        let log = std::fs::read_to_string(self.log(LOCAL))?;
        let new = log.get(self.local_log_shown..).unwrap_or_default();
        self.local_log_shown = log.len();
        Ok(shown(new))
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

    /// Pings from every pod of `nodes` to every other one's, all at once (3 each), then a TCP
    /// echo between every pair: the summary, and a failure unless every ping is answered and
    /// every byte comes back.
    fn ping_mesh(&self, nodes: &[usize], pod_ips: &[String]) -> Pings {
        let mut text = String::new();
        let result = self.ping_mesh_into(nodes, pod_ips, &mut text);
        Pings { text, result }
    }

    fn ping_mesh_into(
        &self,
        nodes: &[usize],
        pod_ips: &[String],
        text: &mut String,
    ) -> anyhow::Result<()> {
        let (from, to) = (nodes[0], nodes[1]);
        *text += &format!(
            "$ ip netns exec {} ping -c 3 -W 1 -i 0.2 {}   # {} -> {}, and so on for each pair\n",
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
            *text += &format!("{l}\n");
        }
        *text += &format!("pods: {sent} pings sent, {answered} answered\n");
        if sent == 0 || answered != sent {
            bail!("pods: {} pings were not answered", sent - answered);
        }
        let pairs: Vec<(usize, usize)> = nodes
            .iter()
            .flat_map(|&a| nodes.iter().filter(move |&&b| b != a).map(move |&b| (a, b)))
            .collect();
        let results: Vec<anyhow::Result<usize>> = std::thread::scope(|s| {
            let runs: Vec<_> = pairs
                .iter()
                .enumerate()
                .map(|(n, &(a, b))| {
                    let port = TCP_PORT + n as u16;
                    s.spawn(move || tcp_echo(NODES[a].pod, NODES[b].pod, &pod_ips[b], port))
                })
                .collect();
            runs.into_iter()
                .map(|r| {
                    r.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("panicked")))
                })
                .collect()
        });
        let echoed: usize = results.iter().filter_map(|r| r.as_ref().ok()).sum();
        *text += &format!(
            "pods: TCP {} connections, {} KiB sent, {} KiB echoed back\n",
            pairs.len(),
            pairs.len() * TCP_BYTES / 1024,
            echoed / 1024
        );
        for (r, (a, b)) in results.into_iter().zip(&pairs) {
            r.with_context(|| format!("TCP from {} to {}", NODES[*a].pod, NODES[*b].pod))?;
        }
        Ok(())
    }

    fn show_routes(&self, i: usize) -> anyhow::Result<String> {
        show(&["ip", "-n", NODES[i].name, "route", "show", "proto", "201"])
    }

    /// The node-ID map, our nexthops and routes, as an operator would look at them.
    fn show_programmed(&self, i: usize) -> anyhow::Result<String> {
        let ns = NODES[i].name;
        Ok(show(&[
            self.agent.to_str().unwrap(),
            "map",
            "dump",
            "--bpffs",
            self.bpffs(i).to_str().unwrap(),
        ])? + &show(&["ip", "-n", ns, "nexthop", "list", "protocol", "201"])?
            + &self.show_routes(i)?
            + &show(&["ip", "-n", ns, "-6", "route", "show", "proto", "201"])?)
    }

    /// The tail of every agent's log, after a failure.
    fn print_logs(&self) {
        for (i, node) in NODES.iter().enumerate() {
            let log = std::fs::read_to_string(self.log(i)).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            if lines.is_empty() {
                continue;
            }
            eprintln!("--- {}'s agent log, last lines:", node.name);
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
        let done = format!(
            "demo: nothing left: 0 namespaces (ip netns list), 0 interfaces, 0 bpffs mounts, \
             0 IPAM leases (CNI DEL released them all), {} removed",
            shown_path(&self.dir)
        );
        self.transcript.say("teardown", &done);
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

/// What each TCP connection of the mesh sends, and the first of the ports its servers use.
const TCP_BYTES: usize = 64 * 1024;
const TCP_PORT: u16 = 7100;

/// Runs `f` on a thread of its own in the named network namespace (sockets belong to the
/// namespace of the thread that makes them).
fn in_netns<T>(ns: &str, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    use std::os::fd::AsRawFd as _;
    let file = std::fs::File::open(format!("/run/netns/{ns}"))
        .with_context(|| format!("opening namespace {ns}"))?;
    // SAFETY: setns(2) on a namespace file we hold open; it moves only this thread.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("setns {ns}: {}", std::io::Error::last_os_error());
    }
    f()
}

/// One TCP connection from pod `from` to pod `to` at `addr`: [`TCP_BYTES`] sent, the server
/// echoes them, the client checks what came back. Returns the bytes echoed. Every socket has a
/// timeout, so a lost route fails the step instead of hanging it.
fn tcp_echo(from: &str, to: &str, addr: &str, port: u16) -> anyhow::Result<usize> {
    use std::io::{Read as _, Write as _};
    use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
    let timeout = Some(Duration::from_secs(10));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            let listener = in_netns(to, || Ok(TcpListener::bind(("0.0.0.0", port))?));
            let _ = ready_tx.send(listener.is_ok());
            in_netns(to, || {
                let listener = listener?;
                // Accepting without blocking for ever: a client that never connects ends the
                // server at the deadline too.
                listener.set_nonblocking(true)?;
                let deadline = Instant::now() + Duration::from_secs(10);
                let mut conn = loop {
                    match listener.accept() {
                        Ok((conn, _)) => break conn,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            if Instant::now() > deadline {
                                bail!("no connection within 10 s");
                            }
                            std::thread::sleep(Duration::from_millis(10));
                        }
                        Err(e) => return Err(e.into()),
                    }
                };
                conn.set_nonblocking(false)?;
                conn.set_read_timeout(timeout)?;
                conn.set_write_timeout(timeout)?;
                let mut data = Vec::new();
                conn.read_to_end(&mut data)?;
                conn.write_all(&data)?;
                Ok(())
            })
        });
        if ready_rx.recv_timeout(Duration::from_secs(10)) != Ok(true) {
            return server
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the server panicked")))
                .and(Err(anyhow::anyhow!("the server did not listen")));
        }
        let client = in_netns(from, || {
            let target: SocketAddr = format!("{addr}:{port}").parse()?;
            let mut conn = TcpStream::connect_timeout(&target, Duration::from_secs(10))?;
            conn.set_read_timeout(timeout)?;
            conn.set_write_timeout(timeout)?;
            let sent: Vec<u8> = (0..TCP_BYTES).map(|i| (i % 251) as u8).collect();
            conn.write_all(&sent)?;
            conn.shutdown(Shutdown::Write)?;
            let mut back = Vec::new();
            conn.read_to_end(&mut back)?;
            if back != sent {
                bail!("{} of {} bytes came back intact", back.len(), sent.len());
            }
            Ok(back.len())
        });
        let served = server
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the server panicked")));
        served?;
        client
    })
}

/// What [`Sandbox::ping_mesh`] printed, and whether every ping was answered.
struct Pings {
    text: String,
    result: anyhow::Result<()>,
}

/// Runs a command and returns it and its output the way a reader would type and see it: the agent
/// by its name (it is on the `PATH` of a node's pod), the sandbox's directories under `/tmp`.
fn show(args: &[&str]) -> anyhow::Result<String> {
    let words: Vec<&str> = args
        .iter()
        .map(|a| match Path::new(a).file_name() {
            Some(name) if name == "node-agent" && a.starts_with('/') => "node-agent",
            _ => a,
        })
        .collect();
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args[0]))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(format!(
        "$ {}\n{}",
        shown(&words.join(" ")),
        shown(&String::from_utf8_lossy(&out.stdout))
    ))
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

//! The sandbox and what lives in it: the wire, a namespace, a pod and an agent per node, and
//! the commands run there the way a reader would run them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use xtask::cni::PodNetwork;

use super::cluster::{LOCAL, NODES, drop_nodes, gone};
use super::transcript::{OnNode, Transcript};
use crate::cmd;

/// The sandbox and what lives in it. Dropping it tears down whatever is still up, so a failed
/// step leaves nothing behind either; [`Sandbox::teardown`] does the same and checks it.
pub(super) struct Sandbox {
    pub(super) dir: PathBuf,
    pub(super) agent: PathBuf,
    pub(super) nodes_file: PathBuf,
    /// `/run/netns` did not exist before the demo made it.
    pub(super) made_run_netns: bool,
    pub(super) run_netns_mounted: bool,
    pub(super) wire: bool,
    /// Indexes into [`NODES`] of the nodes whose namespace exists.
    pub(super) nodes: Vec<usize>,
    /// Those whose pod namespace exists (its CNI `ADD` may have half run).
    pub(super) pods: Vec<usize>,
    /// Those whose bpffs is mounted.
    pub(super) mounts: Vec<usize>,
    pub(super) agents: Vec<(usize, Child)>,
    pub(super) transcript: Transcript,
    /// How much of the local agent's log has been printed.
    pub(super) local_log_shown: usize,
}

impl Sandbox {
    pub(super) fn new(dir: &Path, agent: &Path) -> anyhow::Result<Self> {
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

    pub(super) fn node_dir(&self, i: usize) -> PathBuf {
        self.dir.join(NODES[i].name)
    }
    pub(super) fn bpffs(&self, i: usize) -> PathBuf {
        self.node_dir(i).join("bpffs")
    }
    pub(super) fn state(&self, i: usize) -> PathBuf {
        self.node_dir(i).join("state")
    }
    pub(super) fn log(&self, i: usize) -> PathBuf {
        self.node_dir(i).join("agent.log")
    }

    /// The node's namespace, its uplink on the wire, forwarding on, its bpffs mounted.
    pub(super) fn add_node(&mut self, i: usize) -> anyhow::Result<()> {
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

    /// Node `i`'s pod network: a `cni0` bridge holding the gateway, addresses from the node's
    /// pod CIDR, leases under the node's directory.
    pub(super) fn net(&self, i: usize) -> PodNetwork {
        PodNetwork {
            name: "demo".into(),
            node_ns: NODES[i].name.into(),
            bridge: "cni0".into(),
            cidrs: vec![NODES[i].pod_cidr.into()],
            mtu: None,
            leases: self.node_dir(i).join("ipam"),
        }
    }

    /// Node `i`'s pod: its namespace, `lo` up, `eth0` on the node's `cni0`. Returns its IPv4.
    pub(super) fn add_pod(&mut self, i: usize) -> anyhow::Result<String> {
        quiet(&["ip", "netns", "add", NODES[i].pod])?;
        self.pods.push(i);
        let ips = self.net(i).add(NODES[i].pod)?;
        Ok(ips[0].clone())
    }

    /// `CNI_COMMAND=DEL` for node `i`'s pod, then its namespace goes.
    pub(super) fn del_pod(&mut self, i: usize) -> anyhow::Result<()> {
        self.pods.retain(|&p| p != i);
        let del = self.net(i).del(NODES[i].pod);
        let ns = quiet(&["ip", "netns", "del", NODES[i].pod]);
        del.and(ns)
    }

    pub(super) fn agent_cmd(&self, i: usize, extra: &[&str]) -> Command {
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
    pub(super) fn start_agent(&mut self, i: usize, extra: &[&str]) -> anyhow::Result<()> {
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
    pub(super) fn on_node(&self, i: usize, script: &OnNode, n: usize) -> anyhow::Result<String> {
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
    pub(super) fn local_log(&mut self) -> anyhow::Result<String> {
        let log = std::fs::read_to_string(self.log(LOCAL))?;
        let new = log.get(self.local_log_shown..).unwrap_or_default();
        self.local_log_shown = log.len();
        Ok(shown(new))
    }

    /// The local agent's log lines since the last call that hold `needle`.
    pub(super) fn local_log_lines(&mut self, needle: &str) -> anyhow::Result<String> {
        Ok(self
            .local_log()?
            .lines()
            .filter(|l| l.contains(needle))
            .map(|l| format!("{l}\n"))
            .collect())
    }

    /// Waits for node `i`'s agent's first checkpoint: it has reconciled.
    pub(super) fn wait_ready(&mut self, i: usize) -> anyhow::Result<()> {
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

    /// Waits until node `i`'s agent answers `/readyz` with 200: it has listed and reconciled.
    pub(super) fn wait_readyz(&self, i: usize) -> anyhow::Result<()> {
        let ns = NODES[i].name;
        let readyz = || -> anyhow::Result<bool> {
            xtask::host::in_netns(ns, || -> anyhow::Result<bool> {
                use std::io::{Read as _, Write as _};
                let mut c = std::net::TcpStream::connect("127.0.0.1:9965")?;
                c.set_read_timeout(Some(Duration::from_secs(2)))?;
                c.write_all(b"GET /readyz HTTP/1.0\r\n\r\n")?;
                let mut answer = String::new();
                c.read_to_string(&mut answer)?;
                Ok(answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200"))
            })?
        };
        let start = Instant::now();
        while !readyz().unwrap_or(false) {
            if start.elapsed() > Duration::from_secs(30) {
                bail!("{ns}'s agent was not ready 30 s after it started");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Waits until node `i`'s agent's log, since it was started, has a line with `needle`.
    pub(super) fn wait_log(&self, i: usize, needle: &str) -> anyhow::Result<()> {
        let start = Instant::now();
        while !std::fs::read_to_string(self.log(i))?.contains(needle) {
            if start.elapsed() > Duration::from_secs(30) {
                bail!("{}'s agent logged no `{needle}` in 30 s", NODES[i].name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Waits until node `i`'s routes to the pod CIDRs of the [`GONE`] nodes are gone.
    pub(super) fn wait_routes_gone(&self, i: usize) -> anyhow::Result<()> {
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
    pub(super) fn stop_agent(&mut self, i: usize) -> anyhow::Result<()> {
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
    pub(super) fn remove_node(&mut self, i: usize) -> anyhow::Result<()> {
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
    pub(super) fn show_routes(&self, i: usize) -> anyhow::Result<String> {
        show(&["ip", "-n", NODES[i].name, "route", "show", "proto", "201"])
    }

    /// The node-ID map, our nexthops and routes, as an operator would look at them.
    pub(super) fn show_programmed(&self, i: usize) -> anyhow::Result<String> {
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
    pub(super) fn print_logs(&self) {
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
    pub(super) fn teardown(&mut self) -> anyhow::Result<()> {
        let mut result = Ok(());
        for i in 0..NODES.len() {
            result = result.and(self.remove_node(i));
        }
        let left_ns = cmd::output(Command::new("ip").args(["netns", "list"])).unwrap_or_default();
        let leases: Vec<String> = (0..NODES.len())
            .flat_map(|i| {
                let held = self.net(i).leases_held();
                held.into_iter()
                    .map(move |l| format!("{}/{l}", NODES[i].name))
            })
            .collect();
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

/// Runs a command without echoing it; fails with its stderr.
pub(super) fn quiet(args: &[&str]) -> anyhow::Result<()> {
    run(args).map(drop)
}

/// Runs a command; its standard output, or an error with the command and its standard error.
fn run(args: &[&str]) -> anyhow::Result<Vec<u8>> {
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
    Ok(out.stdout)
}

/// A path as a reader would see it: the sandbox's directories under `/tmp`.
pub(super) fn shown_path(p: &Path) -> String {
    shown(&p.display().to_string())
}

pub(super) fn shown(text: &str) -> String {
    text.replace(&format!("{}/", std::env::temp_dir().display()), "/tmp/")
}

/// Runs a command and returns it and its output the way a reader would type and see it: the agent
/// by its name (it is on the `PATH` of a node's pod), the sandbox's directories under `/tmp`.
pub(super) fn show(args: &[&str]) -> anyhow::Result<String> {
    let words: Vec<&str> = args
        .iter()
        .map(|a| match Path::new(a).file_name() {
            Some(name) if name == "node-agent" && a.starts_with('/') => "node-agent",
            _ => a,
        })
        .collect();
    let stdout = run(args)?;
    Ok(format!(
        "$ {}\n{}",
        shown(&words.join(" ")),
        shown(&String::from_utf8_lossy(&stdout))
    ))
}

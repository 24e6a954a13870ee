//! A cluster of node namespaces on one wire, each with a pod behind a bridge and its own agent:
//! what the IPsec proofs run on (`tests/tests/it/ipsec.rs`).
//!
//! The sandbox's own namespace is the switch: a bridge `wire` with one port per node. Node `i`
//! is the namespace `node<i>` with `eth0` on the wire (192.168.77.i, fd00:77::i); its pod is the
//! namespace `pod<i>`, made as a container runtime makes it, by the reference CNI plugins
//! (`xtask::cni`): a `cni0` bridge holding the gateways (10.244.i.1/24, fd00:244:i::1/64), the
//! pod's `eth0` on it (10.244.i.2, fd00:244:i::2, leased by `host-local`, MTU 1400 to leave room
//! for ESP). [`Cluster::remove_pods`] runs their `DEL`. Each node's agent has
//! its own bpffs, state directory and key file, and runs with `ip netns exec`, as a
//! DaemonSet's pod runs in the host's network namespace.
//!
//! [`Capture`] counts the frames that enter the wire by what they are: ESP, or pod traffic in
//! the clear (an IP packet with a pod address), or other (ARP, neighbour discovery). The pods'
//! traffic (pings and TCP bytes, through [`ping`], [`LongPing`] and [`tcp_transfer`]) is
//! tallied per cluster, for the `pods:` line of [`Cluster::remove_pods`].

use std::cell::Cell;
use std::fmt::Write as _;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use state::objects::SpiLayout;
use xtask::cni::PodNetwork;
use xtask::host::parse_ping;

use crate::agent::{Daemon, TestNode, node_list, wait_for};
use crate::{agent_bin, in_netns, ip, ip_batch, run, sysctl};

/// The key number an SPI of ours carries, 0 for one of neither layout.
fn key_of(spi: u32) -> u32 {
    node_agent_common::esp_spi::key_of(spi).map_or(0, u32::from)
}

/// One simulated node.
#[derive(Clone, Debug)]
pub struct SimNode {
    pub name: String,
    pub index: u8,
    pub dir: PathBuf,
}

impl SimNode {
    pub fn ns(&self) -> String {
        format!("node{}", self.index)
    }
    pub fn pod_ns(&self) -> String {
        format!("pod{}", self.index)
    }
    pub fn ip4(&self) -> String {
        format!("192.168.77.{}", self.index)
    }
    pub fn ip6(&self) -> String {
        format!("fd00:77::{}", self.index)
    }
    pub fn pod4(&self) -> String {
        format!("10.244.{}.2", self.index)
    }
    pub fn pod6(&self) -> String {
        format!("fd00:244:{}::2", self.index)
    }
    pub fn bpffs(&self) -> PathBuf {
        self.dir.join("bpffs")
    }
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }
    pub fn key_file(&self) -> PathBuf {
        self.dir.join("ipsec.keys")
    }
    pub fn log(&self) -> PathBuf {
        self.dir.join("agent.log")
    }

    /// Its pod network: the reference CNI plugins' `cni0` bridge, the node's pod CIDRs, MTU 1400
    /// to leave room for ESP, leases under the node's directory.
    pub fn pod_network(&self) -> PodNetwork {
        let i = self.index;
        PodNetwork {
            name: "cluster".into(),
            node_ns: self.ns(),
            bridge: "cni0".into(),
            cidrs: vec![format!("10.244.{i}.0/24"), format!("fd00:244:{i}::/64")],
            mtu: Some(1400),
            leases: self.dir.join("ipam"),
        }
    }

    /// The node as the NodeList shows it (`uid` set by the caller when it is recycled).
    pub fn test_node(&self) -> TestNode {
        TestNode {
            name: self.name.clone(),
            ips: vec![self.ip4(), self.ip6()],
            cidrs: vec![
                format!("10.244.{}.0/24", self.index),
                format!("fd00:244:{}::/64", self.index),
            ],
            ..TestNode::default()
        }
    }

    /// `ip -n <node ns> ARGS`.
    pub fn ip(&self, args: &[&str]) -> String {
        let mut all = vec!["-n".to_string(), self.ns()];
        all.extend(args.iter().map(|s| s.to_string()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        String::from_utf8_lossy(&ip(&all).stdout).into_owned()
    }

    /// The kernel's non-zero xfrm counters in the node's namespace (`/proc/net/xfrm_stat`), for
    /// a failure's message.
    pub fn xfrm_errors(&self) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns(), "cat", "/proc/net/xfrm_stat"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        out.lines()
            .filter(|l| l.split_whitespace().nth(1).is_some_and(|v| v != "0"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The node's xfrm states as `(src, dst, spi)`, the SPI as the wire carries it.
    pub fn states(&self) -> Vec<(String, String, u32)> {
        let text = self.ip(&["xfrm", "state"]);
        let mut out = Vec::new();
        let mut pending: Option<(String, String)> = None;
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.first() == Some(&"src") && f.len() >= 4 {
                pending = Some((f[1].to_owned(), f[3].to_owned()));
            } else if let (Some((src, dst)), Some(pos)) =
                (&pending, f.iter().position(|w| *w == "spi"))
            {
                let spi = u32::from_str_radix(f[pos + 1].trim_start_matches("0x"), 16).unwrap();
                out.push((src.clone(), dst.clone(), spi));
                pending = None;
            }
        }
        out.sort();
        out
    }

    /// The key numbers of the node's states (the low 4 bits of their SPIs in either layout),
    /// each once.
    pub fn spis(&self) -> Vec<u32> {
        let mut s: Vec<u32> = self.states().iter().map(|s| key_of(s.2)).collect();
        s.sort_unstable();
        s.dedup();
        s
    }

    /// Bytes the node's OUT states (source = the node) have encrypted.
    pub fn out_bytes(&self) -> u64 {
        let text = self.ip(&["-s", "xfrm", "state"]);
        let mut total = 0;
        let mut out_state = false;
        let mut lifetime = false;
        for line in text.lines() {
            let t = line.trim();
            if t.starts_with("src ") {
                let src = t.split_whitespace().nth(1).unwrap_or("");
                out_state = src == self.ip4() || src == self.ip6();
            } else if t.starts_with("lifetime current:") {
                lifetime = true;
            } else if lifetime {
                lifetime = false;
                if out_state && let Some(b) = t.split('(').next() {
                    total += b.trim().parse::<u64>().unwrap_or(0);
                }
            }
        }
        total
    }

    /// A metric of the node's agent.
    pub fn metric(&self, series: &str) -> Option<f64> {
        let text = in_netns(&self.ns(), || {
            crate::agent::http_get("127.0.0.1:9965", "/metrics")
        })?
        .1;
        crate::agent::metric(&text, series)
    }

    /// `node-agent ipsec status --output json` in the node's namespace.
    pub fn ipsec_status(&self) -> serde_json::Value {
        let out = run(Command::new("ip")
            .args(["netns", "exec", &self.ns()])
            .arg(agent_bin())
            .args(["ipsec", "status", "--output", "json"])
            .arg("--state-dir")
            .arg(self.state_dir())
            .arg("--bpffs")
            .arg(self.bpffs())
            .arg("--ipsec-key-file")
            .arg(self.key_file()));
        serde_json::from_slice(&out.stdout).expect("ipsec status JSON")
    }

    /// The agent's log, for failure messages.
    /// The lines of the agent's log that contain any of `words`.
    pub fn log_grep(&self, words: &[&str]) -> String {
        let log = std::fs::read_to_string(self.log()).unwrap_or_default();
        let hits: Vec<&str> = log
            .lines()
            .filter(|l| words.iter().any(|w| l.contains(w)))
            .collect();
        hits.join("\n")
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.log()).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// The wire, its nodes, and the NodeList every agent reads.
pub struct Cluster {
    pub dir: PathBuf,
    pub nodes: Vec<SimNode>,
    pub nodes_file: PathBuf,
}

impl Cluster {
    /// The switch, in the calling thread's namespace (a sandbox).
    pub fn new(dir: &Path) -> Self {
        TRAFFIC.set(Traffic::default());
        ip(&["link", "add", "wire", "type", "bridge"]);
        ip(&["link", "set", "wire", "up"]);
        Self {
            dir: dir.to_owned(),
            nodes: Vec::new(),
            nodes_file: dir.join("nodes.yaml"),
        }
    }

    /// Node `index` named `name`, with its pod and its own bpffs; no agent yet.
    pub fn add_node(&mut self, name: &str, index: u8) -> SimNode {
        let n = SimNode {
            name: name.to_owned(),
            index,
            dir: self.dir.join(name),
        };
        std::fs::create_dir_all(n.bpffs()).unwrap();
        run(Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(n.bpffs()));
        let (ns, pod) = (n.ns(), n.pod_ns());
        let port = format!("w{index}");
        ip(&["netns", "add", &ns]);
        ip(&["netns", "add", &pod]);
        ip(&[
            "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&["link", "set", &port, "master", "wire", "up"]);
        let i = index;
        ip_batch(
            &["-n", &ns],
            &format!(
                "link set lo up\n\
                 addr add 192.168.77.{i}/24 dev eth0\naddr add fd00:77::{i}/64 dev eth0 nodad\n\
                 link set eth0 up\n"
            ),
        );
        // The pod, as a container runtime makes it: the sandbox namespace, then the plugins.
        let ips = n
            .pod_network()
            .add(&pod)
            .unwrap_or_else(|e| panic!("{name}'s pod: {e:#}"));
        assert_eq!(
            ips,
            [n.pod4(), n.pod6()],
            "{name}'s pod: host-local leases the first address after the gateway"
        );
        in_netns(&ns, || {
            sysctl("net/ipv4/ip_forward", "1");
            sysctl("net/ipv6/conf/all/forwarding", "1");
        });
        self.nodes.push(n.clone());
        n
    }

    /// `CNI_COMMAND=DEL` for every pod, then its namespace goes; fails unless every lease was
    /// released. Returns the cluster's `pods:` line: pods made and deleted, and their traffic.
    pub fn remove_pods(&mut self) -> String {
        for n in &self.nodes {
            let net = n.pod_network();
            net.del(&n.pod_ns())
                .unwrap_or_else(|e| panic!("{}'s pod: {e:#}", n.name));
            ip(&["netns", "del", &n.pod_ns()]);
            let held = net.leases_held();
            assert!(
                held.is_empty(),
                "{}: leases left after DEL: {held:?}",
                n.name
            );
        }
        let t = TRAFFIC.get();
        format!(
            "pods: {} made and deleted through the CNI plugins, 0 leases left; {} pings sent, {} answered; TCP {} KiB",
            self.nodes.len(),
            t.pings_sent,
            t.pings_answered,
            t.tcp_bytes / 1024
        )
    }

    /// Writes the NodeList every agent reads.
    pub fn write_nodes(&self, nodes: &[TestNode]) {
        let tmp = self.nodes_file.with_extension("tmp");
        std::fs::write(&tmp, node_list(nodes)).unwrap();
        std::fs::rename(&tmp, &self.nodes_file).unwrap();
    }

    /// Starts `n`'s agent, with IPsec where the node has a key file; `extra` flags come last
    /// (delays, resync).
    pub fn start_agent(&self, n: &SimNode, extra: &[&str]) -> Daemon {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(n.log())
            .unwrap();
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &n.ns()])
            .arg(agent_bin())
            .args(["run", "--node-name", &n.name, "--nodes-file-poll", "200ms"])
            // Written by rename, never torn: see `tests/src/agent.rs`.
            .env("NODE_AGENT_NODES_FILE_SETTLE", "200ms")
            .arg("--nodes-file")
            .arg(&self.nodes_file)
            .arg("--state-dir")
            .arg(n.state_dir())
            .arg("--bpffs")
            .arg(n.bpffs())
            .args(["--datapath-iface", "eth0", "--pod-iface", "cni0"]);
        if n.key_file().exists() {
            c.arg("--ipsec-key-file").arg(n.key_file());
        }
        c.args(extra)
            .env("NODE_AGENT_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log);
        Daemon(c.spawn().unwrap())
    }

    /// Waits until `n` holds exactly `states` xfrm states, all of key `spi` (in either SPI
    /// layout).
    pub fn wait_states(&self, n: &SimNode, states: usize, spi: u32, timeout: Duration) {
        let what = format!("{}: {states} xfrm states of SPI {spi}", n.name);
        if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_for(&what, timeout, || {
                let s = n.states();
                s.len() == states && s.iter().all(|x| key_of(x.2) == spi)
            })
        })) {
            panic!(
                "{}\nstates now: {:?}\nagent log:\n{}\nagents:\n{}",
                e.downcast_ref::<String>().cloned().unwrap_or_default(),
                n.states(),
                n.log_tail(40),
                crate::agent::agent_processes()
            );
        }
    }
}

/// Runs `body` on a new cluster in a sandbox, when `can_run` (given the test's name) says this
/// kernel can; then deletes the pods through CNI and prints the cluster's `pods:` line. Skips,
/// saying why, where no sandbox can be made.
pub fn with_cluster(
    name: &str,
    can_run: impl FnOnce(&str) -> bool + Send,
    body: impl FnOnce(&mut Cluster) + Send,
) {
    if let Err(why) = crate::can_sandbox() {
        crate::skip(name, &why);
        return;
    }
    crate::sandbox(|sb| {
        if !can_run(name) {
            return;
        }
        let dir = sb.bpffs.parent().unwrap().join("cluster");
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = Cluster::new(&dir);
        body(&mut c);
        crate::report(&c.remove_pods());
    });
}

/// What the pods of this thread's cluster sent and got.
#[derive(Clone, Copy, Debug, Default)]
struct Traffic {
    pings_sent: u64,
    pings_answered: u64,
    tcp_bytes: u64,
}

thread_local! {
    static TRAFFIC: Cell<Traffic> = Cell::new(Traffic::default());
}

fn tally(f: impl FnOnce(&mut Traffic)) {
    let mut t = TRAFFIC.get();
    f(&mut t);
    TRAFFIC.set(t);
}

/// Writes a key file holding `keys` (SPI, hex and SPI layout), mode 0600: per-pair keys
/// (`<spi>+`), or global ones.
pub fn write_keys(path: &Path, keys: &[(u8, &str, SpiLayout)], per_pair: bool) {
    let plus = if per_pair { "+" } else { "" };
    let mut text = String::new();
    for (spi, hex, layout) in keys {
        let option = match layout {
            SpiLayout::Key => "",
            SpiLayout::PerSender => " per-sender-spi",
        };
        let _ = writeln!(text, "{spi}{plus} rfc4106(gcm(aes)) 0x{hex} 128{option}");
    }
    crate::write_private(path, text.as_bytes());
}

/// `ping` from a pod: `(sent, received)`, tallied in the cluster's `pods:` line. Busybox's or
/// iputils' summary line is parsed.
pub fn ping(pod_ns: &str, dst: &str, count: u32) -> (u64, u64) {
    let (sent, received) = ping_untallied(pod_ns, dst, count);
    tally(|t| {
        (t.pings_sent, t.pings_answered) = (t.pings_sent + sent, t.pings_answered + received)
    });
    (sent, received)
}

/// Whether one ping from a pod is answered: for waits, which the `pods:` line does not count.
pub fn answers(pod_ns: &str, dst: &str) -> bool {
    ping_untallied(pod_ns, dst, 1).1 == 1
}

fn ping_untallied(pod_ns: &str, dst: &str, count: u32) -> (u64, u64) {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            pod_ns,
            "ping",
            "-c",
            &count.to_string(),
            "-W",
            "1",
            dst,
        ])
        .output()
        .expect("starting ping");
    parse_ping(&String::from_utf8_lossy(&out.stdout))
        .unwrap_or_else(|| panic!("no ping summary: {}", String::from_utf8_lossy(&out.stderr)))
}

/// A ping that runs until stopped: `ping -i <interval>` from a pod.
pub struct LongPing(std::process::Child);

/// What a [`LongPing`] saw: its summary, and which sequence numbers got no answer (in runs,
/// so a failure can say when in the test they were lost).
#[derive(Debug)]
pub struct PingRun {
    pub sent: u64,
    pub received: u64,
    pub lost: Vec<std::ops::RangeInclusive<u64>>,
    /// The last request was unanswered when ping was stopped, and is in no count.
    pub in_flight: bool,
}

impl LongPing {
    pub fn start(pod_ns: &str, dst: &str, interval: &str) -> Self {
        Self(
            Command::new("ip")
                .args(["netns", "exec", pod_ns, "ping", "-i", interval, dst])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("starting ping"),
        )
    }

    /// Stops it (SIGINT, so it prints its summary).
    pub fn stop(mut self) -> PingRun {
        // SAFETY: kill on a child we own.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let mut stdout = String::new();
        if let Some(mut pipe) = self.0.stdout.take() {
            std::io::Read::read_to_string(&mut pipe, &mut stdout).unwrap();
        }
        self.0.wait().unwrap();
        let run = PingRun::of_interrupted(&stdout).expect("a ping summary");
        tally(|t| {
            (t.pings_sent, t.pings_answered) =
                (t.pings_sent + run.sent, t.pings_answered + run.received)
        });
        run
    }
}

impl PingRun {
    /// What a ping stopped by SIGINT printed. ping stops at once and counts the request it sent
    /// last unanswered even when the answer is on its way (on a slow guest, a few percent of
    /// stops), so an unanswered last request is left out of every count: only it can be in
    /// flight.
    pub fn of_interrupted(text: &str) -> Option<Self> {
        let (mut sent, received) = parse_ping(text)?;
        let mut lost = lost_runs(text, sent);
        let mut in_flight = false;
        if let Some(r) = lost.pop() {
            let last = (first_seq(text) + sent).saturating_sub(1);
            if *r.end() == last {
                (sent, in_flight) = (sent - 1, true);
                if r.start() < r.end() {
                    lost.push(*r.start()..=last - 1);
                }
            } else {
                lost.push(r);
            }
        }
        Some(Self {
            sent,
            received,
            lost,
            in_flight,
        })
    }
}

/// A ping left running by a test that failed is killed, not left to outlive its namespace.
impl Drop for LongPing {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// The sequence number of the first request: busybox numbers from 0, iputils from 1. Told by
/// the summary, there even when nothing was answered: iputils writes `N received`, busybox
/// `N packets received`.
fn first_seq(text: &str) -> u64 {
    let summary = text.lines().find(|l| l.contains("transmitted"));
    u64::from(summary.is_some_and(|l| !l.contains("packets received")))
}

/// The runs of the `sent` sequence numbers that no reply line names (`seq=N` in busybox's
/// lines, `icmp_seq=N` in iputils').
pub fn lost_runs(text: &str, sent: u64) -> Vec<std::ops::RangeInclusive<u64>> {
    // Only replies: an error about a request (`From ... icmp_seq=3 Destination Net
    // Unreachable`) names it too.
    let answered: std::collections::BTreeSet<u64> = text
        .lines()
        .filter(|l| l.contains(" bytes from "))
        .filter_map(|l| {
            let rest = &l[l.find("seq=")? + 4..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect();
    let first = first_seq(text);
    let mut runs: Vec<std::ops::RangeInclusive<u64>> = Vec::new();
    for seq in (first..first + sent).filter(|s| !answered.contains(s)) {
        match runs.last_mut() {
            Some(r) if *r.end() + 1 == seq => *r = *r.start()..=seq,
            _ => runs.push(seq..=seq),
        }
    }
    runs
}

/// Moments of a test relative to its start, for a failure's message: when what the test did
/// happened, beside when its pings were lost. Threads that watch the test mark it too.
pub struct Timeline {
    start: std::time::Instant,
    wall: std::time::SystemTime,
    marks: std::sync::Mutex<Vec<(Duration, String)>>,
}

impl Timeline {
    pub fn start() -> Self {
        Self {
            start: std::time::Instant::now(),
            wall: std::time::SystemTime::now(),
            marks: std::sync::Mutex::default(),
        }
    }

    pub fn mark(&self, what: &str) {
        let at = self.start.elapsed();
        self.marks.lock().unwrap().push((at, what.to_owned()));
    }
}

impl std::fmt::Display for Timeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let epoch = self
            .wall
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        writeln!(
            f,
            "  +0.00 s is {:.3} s after the Unix epoch",
            epoch.as_secs_f64()
        )?;
        let mut marks = self.marks.lock().unwrap().clone();
        marks.sort_by_key(|m| m.0);
        for (at, what) in &marks {
            writeln!(f, "  +{:.2} s {what}", at.as_secs_f64())?;
        }
        Ok(())
    }
}

/// Sends `bytes` over TCP from pod `from` to `to` (an address in pod `to_ns`) and returns what
/// the receiver counted.
pub fn tcp_transfer(from: &str, to_ns: &str, to: &str, bytes: usize) -> usize {
    use std::io::{Read, Write};
    let addr: std::net::SocketAddr = std::net::SocketAddr::new(to.parse().unwrap(), 5001);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            in_netns(to_ns, || {
                let l = std::net::TcpListener::bind(addr).unwrap();
                tx.send(()).unwrap();
                let (mut c, _) = l.accept().unwrap();
                c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let mut n = 0;
                let mut buf = vec![0u8; 65536];
                loop {
                    match c.read(&mut buf) {
                        Ok(0) => break,
                        Ok(k) => n += k,
                        Err(e) => panic!("receiving: {e} after {n} bytes"),
                    }
                }
                n
            })
        });
        rx.recv().unwrap();
        in_netns(from, || {
            let mut c = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(10))
                .expect("connecting");
            let chunk = vec![0x5au8; 64 * 1024];
            let mut left = bytes;
            while left > 0 {
                let k = left.min(chunk.len());
                c.write_all(&chunk[..k]).expect("sending");
                left -= k;
            }
        });
        let got = server.join().unwrap();
        tally(|t| t.tcp_bytes += got as u64);
        got
    })
}

/// Counts of frames entering the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    pub esp: u64,
    /// IP packets with a pod address in the clear: what IPsec must never let out.
    pub clear_pod: u64,
    /// Everything else (ARP, neighbour discovery, node-to-node traffic).
    pub other: u64,
}

/// An `AF_PACKET` capture of every frame that enters the wire through a node's port.
pub struct Capture {
    stop: Arc<AtomicBool>,
    counts: Arc<[AtomicU64; 3]>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Capture {
    /// Starts capturing in the calling thread's namespace (the switch), on the ports named
    /// `w<i>`.
    pub fn start() -> Self {
        let fd = packet_socket().expect("an AF_PACKET socket");
        let stop = Arc::new(AtomicBool::new(false));
        let counts: Arc<[AtomicU64; 3]> = Arc::new(Default::default());
        let thread = {
            let (stop, counts) = (stop.clone(), counts.clone());
            std::thread::spawn(move || capture_loop(&fd, &stop, &counts))
        };
        Self {
            stop,
            counts,
            thread: Some(thread),
        }
    }

    pub fn seen(&self) -> Seen {
        Seen {
            esp: self.counts[0].load(Ordering::Relaxed),
            clear_pod: self.counts[1].load(Ordering::Relaxed),
            other: self.counts[2].load(Ordering::Relaxed),
        }
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn packet_socket() -> io::Result<OwnedFd> {
    let proto = (libc::ETH_P_ALL as u16).to_be() as i32;
    // SAFETY: plain socket(2); the fd is owned at once.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh, valid descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 100_000,
    };
    // SAFETY: a valid fd and a properly sized option value.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            size_of::<libc::timeval>() as u32,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

fn port_index(ifindex: i32) -> bool {
    let mut name = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `name` has IF_NAMESIZE bytes, as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(ifindex as u32, name.as_mut_ptr()) };
    if p.is_null() {
        return false;
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) };
    name.to_bytes().starts_with(b"w") && name.to_bytes() != b"wire"
}

fn capture_loop(fd: &OwnedFd, stop: &AtomicBool, counts: &[AtomicU64; 3]) {
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: zeroed sockaddr_ll is valid; recvfrom fills at most its size.
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = size_of::<libc::sockaddr_ll>() as u32;
        // SAFETY: buffer and address pointers are valid for the sizes given.
        let n = unsafe {
            libc::recvfrom(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
                (&raw mut from).cast(),
                &mut len,
            )
        };
        if n <= 0 {
            continue;
        }
        if from.sll_pkttype == libc::PACKET_OUTGOING || !port_index(from.sll_ifindex) {
            continue;
        }
        let slot = classify(&buf[..n as usize]);
        counts[slot].fetch_add(1, Ordering::Relaxed);
    }
}

/// 0: ESP, 1: pod traffic in the clear, 2: anything else.
pub fn classify(frame: &[u8]) -> usize {
    let is_pod = |a: &[u8]| match a.len() {
        4 => a[0] == 10 && a[1] == 244,
        _ => a[..4] == [0xfd, 0x00, 0x02, 0x44],
    };
    let Some(ethertype) = frame.get(12..14) else {
        return 2;
    };
    let (proto, src, dst) = match ethertype {
        [0x08, 0x00] if frame.len() >= 34 => (frame[23], &frame[26..30], &frame[30..34]),
        [0x86, 0xdd] if frame.len() >= 54 => (frame[20], &frame[22..38], &frame[38..54]),
        _ => return 2,
    };
    if proto == 50 {
        0
    } else if is_pod(src) || is_pod(dst) {
        1
    } else {
        2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_told_apart() {
        let mut v4 = vec![0u8; 34];
        v4[12..14].copy_from_slice(&[0x08, 0x00]);
        v4[23] = 1;
        v4[26..30].copy_from_slice(&[10, 244, 1, 2]);
        v4[30..34].copy_from_slice(&[10, 244, 2, 2]);
        assert_eq!(classify(&v4), 1, "ICMP between pods in the clear");
        v4[23] = 50;
        assert_eq!(classify(&v4), 0);
        let mut v6 = vec![0u8; 54];
        v6[12..14].copy_from_slice(&[0x86, 0xdd]);
        v6[20] = 58;
        v6[22..26].copy_from_slice(&[0xfd, 0x00, 0x00, 0x77]);
        assert_eq!(classify(&v6), 2, "node to node");
        v6[38..42].copy_from_slice(&[0xfd, 0x00, 0x02, 0x44]);
        assert_eq!(classify(&v6), 1);
        assert_eq!(classify(&[0u8; 20]), 2);
    }

    #[test]
    fn ping_summaries_of_busybox_and_iputils() {
        let bb = "--- 10.244.2.2 ping statistics ---\n5 packets transmitted, 4 packets received, 20% packet loss\n";
        assert_eq!(parse_ping(bb), Some((5, 4)));
        let iputils = "5 packets transmitted, 5 received, 0% packet loss, time 4005ms\n";
        assert_eq!(parse_ping(iputils), Some((5, 5)));
    }

    #[test]
    fn lost_pings_come_out_as_runs_of_sequence_numbers() {
        let bb = "64 bytes from 10.244.2.2: seq=0 ttl=63 time=1 ms\n\
                  64 bytes from 10.244.2.2: seq=3 ttl=63 time=1 ms\n\
                  64 bytes from 10.244.2.2: seq=5 ttl=63 time=1 ms\n\
                  7 packets transmitted, 3 packets received, 57% packet loss\n";
        assert_eq!(lost_runs(bb, 7), vec![1..=2, 4..=4, 6..=6]);
        // An error about a request is no answer to it.
        let iputils = "64 bytes from 10.244.2.2: icmp_seq=1 ttl=63 time=1 ms\n\
                       From 10.244.1.1 icmp_seq=2 Destination Net Unreachable\n\
                       64 bytes from 10.244.2.2: icmp_seq=3 ttl=63 time=1 ms\n\
                       4 packets transmitted, 2 received, +1 errors, 50% packet loss\n";
        assert_eq!(lost_runs(iputils, 4), vec![2..=2, 4..=4]);
        // Nothing answered: still numbered as the ping numbers.
        let none = "3 packets transmitted, 0 received, 100% packet loss\n";
        assert_eq!(lost_runs(none, 3), vec![1..=3]);
    }

    #[test]
    fn the_request_in_flight_when_ping_is_stopped_is_not_lost() {
        let reply = |seq: &str| format!("64 bytes from 10.244.2.2: {seq} ttl=63 time=1 ms\n");
        // iputils numbers from 1, busybox from 0: the last request is 4 and 3.
        for (seq, first, got) in [
            ("icmp_seq=", 1, "received"),
            ("seq=", 0, "packets received"),
        ] {
            let summary = |sent: u64, n: u64| format!("{sent} packets transmitted, {n} {got}\n");
            let r = |n: u64| reply(&format!("{seq}{}", first + n));
            let run = |text: String| PingRun::of_interrupted(&text).unwrap();
            // The last of four unanswered: in flight, left out.
            let t = run(r(0) + &r(1) + &r(2) + &summary(4, 3));
            assert_eq!(
                (t.sent, t.received, t.lost, t.in_flight),
                (3, 3, vec![], true)
            );
            // A run that reaches the last request: only the last is left out.
            let t = run(r(0) + &r(1) + &summary(4, 2));
            assert_eq!((t.sent, t.lost), (3, vec![first + 2..=first + 2]));
            // A request lost before the last one stays lost.
            let t = run(r(0) + &r(2) + &r(3) + &summary(4, 3));
            assert_eq!((t.sent, t.lost), (4, vec![first + 1..=first + 1]));
            assert!(!t.in_flight);
            // Nothing answered, nothing sent.
            let t = run(summary(0, 0));
            assert_eq!((t.sent, t.lost), (0, vec![]));
        }
    }
}

//! Traffic between the pods: pings and a TCP echo between every pair, counted.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use xtask::host::{in_netns, parse_ping};

use super::cluster::NODES;
use super::sandbox::Sandbox;

impl Sandbox {
    /// Pings from every pod of `nodes` to every other one's, all at once (3 each), then a TCP
    /// echo between every pair: the summary, and a failure unless every ping is answered and
    /// every byte comes back.
    pub(super) fn ping_mesh(&self, nodes: &[usize], pod_ips: &[String]) -> Pings {
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
}

/// What each TCP connection of the mesh sends, and the first of the ports its servers use.
const TCP_BYTES: usize = 64 * 1024;
const TCP_PORT: u16 = 7100;

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
            let listener = in_netns(to, || TcpListener::bind(("0.0.0.0", port))).and_then(|l| l);
            let _ = ready_tx.send(listener.is_ok());
            // The listener is the pod's, whichever thread accepts on it.
            (|| {
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
            })()
        });
        if ready_rx.recv_timeout(Duration::from_secs(10)) != Ok(true) {
            return server
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the server panicked")))
                .and(Err(anyhow::anyhow!("the server did not listen")));
        }
        let client = in_netns(from, || -> anyhow::Result<usize> {
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
        })
        .map_err(anyhow::Error::from)
        .and_then(|r| r);
        let served = server
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the server panicked")));
        served?;
        client
    })
}

/// What [`Sandbox::ping_mesh`] printed, and whether every ping was answered.
pub(super) struct Pings {
    pub(super) text: String,
    pub(super) result: anyhow::Result<()>,
}

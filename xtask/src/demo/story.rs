//! The demo's story, act by act: what a reader sees happen.

use anyhow::{Context, bail};

use super::cluster::{GONE, LOCAL, NODES, drop_nodes, gone};
use super::sandbox::{Sandbox, quiet, show, shown};
use super::transcript::OnNode;
use crate::cmd::{root, step};

impl Sandbox {
    /// The whole story; teardown is the caller's.
    pub(super) fn act(&mut self, scripts: &[OnNode]) -> anyhow::Result<()> {
        let pod_ips = self.build_cluster()?;
        self.show_the_job(scripts, &pod_ips)?;
        self.lose_nodes_while_down()?;
        self.restart(&pod_ips)?;
        self.repair_drift()?;
        self.hold_a_wipe()?;
        step(
            "demo: 11. CNI DEL for every pod, agents stopped, namespaces deleted, bpffs unmounted",
        );
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
            shown(&self.net(LOCAL).bridge_conf())
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

    /// Step 9: a route of ours deleted by hand behind a running daemon is written back at its
    /// next resync (1 s here, 5 minutes by default).
    fn repair_drift(&mut self) -> anyhow::Result<()> {
        let local = NODES[LOCAL].name;
        let (victim, cidr) = NODES
            .iter()
            .find(|n| n.name != local && !GONE.contains(&n.name))
            .map(|n| (n.name, n.pod_cidr))
            .expect("a remote node left");
        step(&format!(
            "demo: 9. {local}'s route to {victim}'s pods deleted by hand under a running daemon \
             comes back at its next resync"
        ));
        self.local_log_shown = 0;
        self.start_agent(
            LOCAL,
            &["--nodes-file-poll", "200ms", "--resync-interval", "1s"],
        )?;
        self.wait_readyz(LOCAL)?;
        quiet(&["ip", "-n", local, "route", "del", cidr, "proto", "201"])?;
        self.wait_log(LOCAL, "repaired drift")?;
        let log = self.local_log_lines("repaired drift")?;
        self.transcript.say("drift-log", &log);
        self.stop_agent(LOCAL)
    }

    /// Step 10: the list loses every remote node at once, as an RBAC error or the wrong cluster
    /// would make it look. The local daemon holds the wipe; an operator's wrong confirmation is
    /// refused, the right one releases it.
    fn hold_a_wipe(&mut self) -> anyhow::Result<()> {
        let local = NODES[LOCAL].name;
        step(&format!(
            "demo: 10. the list loses every remote node at once; {local}'s daemon holds the wipe \
             until an operator confirms it"
        ));
        // The new daemon's log starts empty.
        self.local_log_shown = 0;
        // Whether its first list is the whole one or already the wipe, it holds.
        self.start_agent(LOCAL, &["--nodes-file-poll", "200ms"])?;
        let remote: Vec<&str> = NODES
            .iter()
            .map(|n| n.name)
            .filter(|n| *n != local && !GONE.contains(n))
            .collect();
        let text = std::fs::read_to_string(&self.nodes_file)?;
        let tmp = self.nodes_file.with_extension("tmp");
        std::fs::write(&tmp, drop_nodes(&text, &remote))?;
        std::fs::rename(&tmp, &self.nodes_file)?;

        let agent = self.agent.to_str().expect("a UTF-8 path").to_owned();
        let state = self.state(LOCAL).to_str().expect("a UTF-8 path").to_owned();
        let status = [agent.as_str(), "prune", "status", "--state-dir", &state];
        let start = std::time::Instant::now();
        let held = loop {
            let out = show(&status)?;
            if let Some(id) = out
                .lines()
                .find_map(|l| l.strip_prefix("hold "))
                .and_then(|l| l.split_whitespace().next())
            {
                self.transcript.say("hold-status", &out);
                break id.to_owned();
            }
            if start.elapsed() > std::time::Duration::from_secs(30) {
                bail!("{local}'s daemon held nothing 30 s after the wipe:\n{out}");
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        };

        let wrong = "0123456789ab";
        let out = std::process::Command::new(&agent)
            .args(["prune", "confirm", wrong, "--state-dir", &state])
            .output()
            .context("running node-agent prune confirm")?;
        if out.status.success() {
            bail!("a confirmation of hold {wrong} went through; {held} is held");
        }
        let refused = format!(
            "$ node-agent prune confirm {wrong} --state-dir {}\n{}",
            shown(&state),
            shown(&String::from_utf8_lossy(&out.stderr))
        );
        self.transcript.say("hold-wrong", &refused);
        let confirm = [
            agent.as_str(),
            "prune",
            "confirm",
            &held,
            "--state-dir",
            &state,
        ];
        let sent = show(&confirm)?;
        self.transcript.say("hold-confirmed", &sent);
        self.wait_log(LOCAL, "the brake released held removals")?;
        self.wait_log(LOCAL, "reconciled writes")?;
        let log = self.local_log_lines("node_agent::agent::reconciler")?;
        self.transcript.say("hold-log", &log);
        Ok(())
    }
}

//! The demo's story, act by act: what a reader sees happen.

use anyhow::{Context, bail};

use super::cluster::{GONE, LOCAL, NODES, drop_nodes, gone};
use super::sandbox::{Sandbox, show, shown};
use super::transcript::OnNode;
use crate::cmd::{root, step};

impl Sandbox {
    /// The whole story; teardown is the caller's.
    pub(super) fn act(&mut self, scripts: &[OnNode]) -> anyhow::Result<()> {
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
}

//! Every command the operator's guide shows is run or parsed by this file, so it cannot rot.
//!
//! A command is a line that starts with `$ ` inside a ```` ```sh ```` block of `docs/*.md`
//! (```` ```text ```` blocks hold recorded output, and are not commands). Each one must
//! be one of:
//!
//! - a `node-agent` command: parsed by the agent's real parser (`node_agent::cli::Cli`);
//! - a `cargo xtask` command: parsed by xtask's own parser (`cargo xtask <args> --help`);
//! - a command in [`EXECUTED`]: [`doc_commands_run_in_a_sandbox`] runs it verbatim, as root, in a
//!   private network and mount namespace with the agent running on `examples/nodes.yaml`;
//! - a command in [`CLUSTER_ONLY`]: it needs a cluster or a Docker engine, which no test has; the
//!   list says which test checks what it touches instead.
//!
//! `kubectl -n node-agent exec ds/node-agent -- CMD` is checked as CMD, after checking that the
//! namespace and the DaemonSet's name are the ones `deploy/` creates.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use node_agent::cli::Cli;
use node_agent_tests::fixture::workspace_root;
use node_agent_tests::{agent_bin, can_sandbox, run, sandbox, skip};

/// Run verbatim by [`doc_commands_run_in_a_sandbox`] (inside `kubectl exec` or on the node).
const EXECUTED: &[&str] = &[
    "ls /sys/fs/bpf/node-agent /sys/fs/bpf/node-agent/links",
    "bpftool map show pinned /sys/fs/bpf/node-agent/node_ids",
    "bpftool map dump pinned /sys/fs/bpf/node-agent/node_ids",
    "bpftool map lookup pinned /sys/fs/bpf/node-agent/node_stats key 1 0 0 0",
    "ip nexthop list protocol 201",
    "ip route show proto 201",
    "ip -6 route show proto 201",
    "echo \"201 node-agent\" > /etc/iproute2/rt_protos.d/node-agent.conf",
    "ip route show proto node-agent",
    "curl -s http://127.0.0.1:9965/metrics",
    "curl -s http://127.0.0.1:9965/readyz",
    "curl -s http://127.0.0.1:9965/healthz",
    "ls /run/node-agent",
];

/// Commands no test can run (no cluster, no Docker engine, no registry), and what checks them
/// instead.
const CLUSTER_ONLY: &[(&str, &str)] = &[
    (
        "kubectl apply -k deploy/",
        "deploy.rs: every manifest parses and is listed",
    ),
    (
        "kubectl apply -k deploy/monitoring/",
        "deploy.rs: the PrometheusRule is generated from the rules promtool checks and tests",
    ),
    (
        "kubectl delete -k deploy/",
        "deploy.rs: every manifest parses and is listed",
    ),
    (
        "kubectl -n node-agent rollout status ds/node-agent",
        "deploy.rs: namespace and name",
    ),
    (
        "kubectl -n node-agent create secret generic node-agent-ipsec-key --from-file=keys=./ipsec-keys",
        "deploy.rs: ipsec_key_is_an_optional_read_only_secret (Secret name, key `keys`)",
    ),
    (
        "kubectl -n node-agent logs ds/node-agent",
        "deploy.rs: namespace and name",
    ),
    (
        "docker build -t registry.example.com/node-agent:0.1.0 .",
        "image.rs builds this Dockerfile with podman; deploy.rs: \
         dockerfile_packages_what_xtask_builds_with_the_tested_tools",
    ),
    (
        "podman push registry.example.com/node-agent:0.1.0",
        "(the registry is yours)",
    ),
];

/// The prefix that runs a command in the agent's pod.
const EXEC: &str = "kubectl -n node-agent exec ds/node-agent -- ";

/// `(file:line, command)` for every `$ ` line inside a `sh` block of `docs/*.md`.
fn doc_commands() -> Vec<(String, String)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(workspace_root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no docs/*.md");
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        out.extend(commands_in(&name, &text));
    }
    out
}

fn commands_in(name: &str, text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    // `None` outside a fence, else the fence's language.
    let mut fence: Option<&str> = None;
    for (i, line) in text.lines().enumerate() {
        if let Some(lang) = line.trim_start().strip_prefix("```") {
            fence = match fence {
                None => Some(lang.trim()),
                Some(_) => None,
            };
        } else if fence == Some("sh")
            && let Some(cmd) = line.strip_prefix("$ ")
        {
            out.push((format!("docs/{name}:{}", i + 1), cmd.trim().to_owned()));
        }
    }
    out
}

/// Splits a command line the way `sh` would for the simple lines the docs use: whitespace,
/// single and double quotes.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote = None;
    let mut any = false;
    for c in line.chars() {
        match (quote, c) {
            (None, '\'' | '"') => {
                quote = Some(c);
                any = true;
            }
            (Some(q), c) if c == q => quote = None,
            (None, c) if c.is_whitespace() => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            (_, c) => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

#[derive(Debug, PartialEq)]
enum Vouch {
    /// Parsed by the agent's parser.
    Agent,
    /// To be parsed by xtask's parser (`cargo xtask <args> --help`).
    Xtask(Vec<String>),
    Executed,
    ClusterOnly,
}

/// How `cmd` is covered, or why it is not. A trailing `2>&1` is the shell's (the docs show an
/// error message that way), not the command's.
fn vouch(cmd: &str) -> Result<Vouch, String> {
    if let Some(cmd) = cmd.strip_suffix(" 2>&1") {
        return vouch(cmd);
    }
    if let Some(inner) = cmd.strip_prefix(EXEC) {
        return vouch(inner);
    }
    if cmd.starts_with("kubectl") && cmd.contains(" exec ") {
        return Err(format!(
            "`{cmd}`: run things in the agent's pod as `{EXEC}CMD`"
        ));
    }
    if EXECUTED.contains(&cmd) {
        return Ok(Vouch::Executed);
    }
    if CLUSTER_ONLY.iter().any(|(c, _)| *c == cmd) {
        return Ok(Vouch::ClusterOnly);
    }
    let w = words(cmd);
    match w.first().map(String::as_str) {
        Some("node-agent") => match <Cli as clap::Parser>::try_parse_from(&w) {
            Ok(_) => Ok(Vouch::Agent),
            Err(e)
                if matches!(
                    e.kind(),
                    clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
                ) =>
            {
                Ok(Vouch::Agent)
            }
            Err(e) => Err(format!("`{cmd}`: the agent refuses it: {e}")),
        },
        Some("cargo") if w.get(1).map(String::as_str) == Some("xtask") => {
            Ok(Vouch::Xtask(w[2..].to_vec()))
        }
        _ => Err(format!(
            "`{cmd}` is neither run by this test (EXECUTED) nor parsed by a real parser"
        )),
    }
}

#[test]
fn every_command_in_the_docs_is_parsed_or_run_by_a_test() {
    let commands = doc_commands();
    assert!(commands.len() > 10, "{commands:?}");
    let mut problems = Vec::new();
    let mut xtask = Vec::new();
    for (at, cmd) in &commands {
        match vouch(cmd) {
            Ok(Vouch::Xtask(args)) => xtask.push((at, args)),
            Ok(_) => {}
            Err(e) => problems.push(format!("{at}: {e}")),
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
    // xtask is a binary: ask its own parser, `xtask <args> --help`. It sits next to the agent
    // after `cargo xtask ...` (CI runs `cargo xtask test`, which builds it first).
    let bin = workspace_root().join("target/debug/xtask");
    if !bin.is_file() {
        skip(
            node_agent_tests::test_name!(),
            &format!(
                "{} is not built (run any `cargo xtask` first); xtask commands unchecked",
                bin.display()
            ),
        );
        return;
    }
    for (at, args) in xtask {
        let out = Command::new(&bin)
            .args(&args)
            .arg("--help")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{at}: `cargo xtask {}` is refused by xtask: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The lists hold only what the docs show, so an entry cannot outlive its command.
#[test]
fn every_listed_command_is_in_the_docs() {
    let shown: Vec<String> = doc_commands()
        .into_iter()
        .map(|(_, c)| c.strip_prefix(EXEC).unwrap_or(&c).to_owned())
        .collect();
    for cmd in EXECUTED.iter().chain(CLUSTER_ONLY.iter().map(|(c, _)| c)) {
        assert!(
            shown.iter().any(|s| s == cmd),
            "`{cmd}` is listed but no doc shows it"
        );
    }
}

#[test]
fn the_check_refuses_commands_nothing_vouches_for() {
    // A flag the agent does not have, a subcommand it does not have.
    assert!(vouch("node-agent state show --state-directory /run/node-agent").is_err());
    assert!(vouch("node-agent map list").is_err());
    assert!(vouch(&format!("{EXEC}node-agent map dump --bpfs /sys/fs/bpf")).is_err());
    // A command no test runs; a pod that is not the agent's.
    assert!(vouch("bpftool prog show").is_err());
    assert!(vouch("kubectl -n kube-system exec ds/node-agent -- node-agent map dump").is_err());
    // What does pass.
    assert_eq!(vouch("node-agent map dump --output json"), Ok(Vouch::Agent));
    assert_eq!(vouch("node-agent run --once 2>&1"), Ok(Vouch::Agent));
    assert!(vouch("node-agent run --once 2>&1 --bogus").is_err());
    assert_eq!(
        vouch(&format!(
            "{EXEC}bpftool map dump pinned /sys/fs/bpf/node-agent/node_ids"
        )),
        Ok(Vouch::Executed)
    );
    assert_eq!(
        words(r#"echo "201 node-agent" > /x"#),
        ["echo", "201 node-agent", ">", "/x"]
    );
    assert_eq!(
        commands_in(
            "x.md",
            "$ not fenced\n```sh\n$ ip route show proto 201\noutput\n```\n"
        ),
        [(
            "docs/x.md:3".to_string(),
            "ip route show proto 201".to_string()
        )]
    );
}

#[test]
fn kubectl_commands_name_the_namespace_and_daemonset_deploy_creates() {
    let k: serde_json::Value = serde_saphyr::from_str(
        &std::fs::read_to_string(workspace_root().join("deploy/kustomization.yaml")).unwrap(),
    )
    .unwrap();
    let ds: serde_json::Value = serde_saphyr::from_str(
        &std::fs::read_to_string(workspace_root().join("deploy/daemonset.yaml")).unwrap(),
    )
    .unwrap();
    let ns = k["namespace"].as_str().unwrap();
    let name = ds["metadata"]["name"].as_str().unwrap();
    assert_eq!(EXEC, format!("kubectl -n {ns} exec ds/{name} -- "));
    for (cmd, _) in CLUSTER_ONLY
        .iter()
        .filter(|(c, _)| c.starts_with("kubectl -n"))
    {
        assert!(cmd.starts_with(&format!("kubectl -n {ns} ")), "{cmd}");
    }
    let secret = ds["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|v| v["secret"]["secretName"].as_str())
        .unwrap();
    assert!(
        CLUSTER_ONLY
            .iter()
            .any(|(c, _)| c.contains(&format!("generic {secret} --from-file=keys=")))
    );
    let env = std::fs::read_to_string(workspace_root().join("deploy/node-agent.env")).unwrap();
    assert!(env.contains("NODE_AGENT_IPSEC_KEY_FILE=/etc/node-agent/ipsec/keys"));
}

/// Runs every [`EXECUTED`] command and every `node-agent` command of the docs that works
/// without a cluster, where the docs say they run: on a node with the agent running, its bpffs at
/// `/sys/fs/bpf` and its state in `/run/node-agent`. The sandbox mounts a private bpffs there, and
/// tmpfs over `/run` and `/etc/iproute2/rt_protos.d`, so the host sees none of it.
#[test]
fn doc_commands_run_in_a_sandbox() {
    let name = node_agent_tests::test_name!();
    if let Err(why) = can_sandbox() {
        skip(name, &why);
        return;
    }
    for tool in ["bpftool", "curl"] {
        if node_agent_tests::which(tool).is_none() {
            skip(name, &format!("needs `{tool}`"));
            return;
        }
    }
    let agent = agent_bin();
    let nodes = std::env::temp_dir().join(format!("node-agent-docs-{}.yaml", std::process::id()));
    std::fs::copy(workspace_root().join("examples/nodes.yaml"), &nodes).unwrap();
    let agent_commands: Vec<String> = doc_commands()
        .into_iter()
        .map(|(_, c)| c.strip_prefix(EXEC).unwrap_or(&c).to_owned())
        .filter(|c| {
            // `plan` and `run` without --nodes-file talk to the API server: parsed only.
            c.starts_with("node-agent state ") || c.starts_with("node-agent map ")
        })
        .collect();
    sandbox(|_| {
        let sh = |cmd: &str| {
            let path = format!(
                "{}:{}",
                agent.parent().unwrap().display(),
                std::env::var("PATH").unwrap_or_default()
            );
            run(Command::new("sh").args(["-c", cmd]).env("PATH", path))
        };
        sh("mount -t bpf bpf /sys/fs/bpf");
        sh("mount -t tmpfs tmpfs /run && mkdir /run/node-agent");
        sh("mount -t tmpfs tmpfs /etc/iproute2/rt_protos.d");
        for line in [
            "ip link add eth0 type veth peer name eth0-peer",
            "ip addr add 192.168.50.1/24 dev eth0",
            "ip addr add fd00:50::1/64 dev eth0 nodad",
            "ip link set eth0 up",
            "ip link set eth0-peer up",
        ] {
            sh(line);
        }
        let mut daemon = Command::new(&agent)
            .args([
                "run",
                "--node-name",
                "demo-local",
                "--datapath-iface",
                "eth0",
            ])
            .arg("--nodes-file")
            .arg(&nodes)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while !Path::new("/run/node-agent/nodes.ckpt").exists() {
            if let Some(status) = daemon.try_wait().unwrap() {
                panic!("the agent exited: {status}");
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no checkpoint after 60 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // Ready once the first reconcile is done.
        while !String::from_utf8_lossy(
            &Command::new("curl")
                .args(["-s", "http://127.0.0.1:9965/readyz"])
                .output()
                .unwrap()
                .stdout,
        )
        .contains("ready")
        {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "not ready after 60 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut failed = Vec::new();
        for cmd in EXECUTED.iter().map(|c| c.to_string()).chain(agent_commands) {
            let out = Command::new("sh")
                .args(["-c", &cmd])
                .env(
                    "PATH",
                    format!(
                        "{}:{}",
                        agent.parent().unwrap().display(),
                        std::env::var("PATH").unwrap_or_default()
                    ),
                )
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let echo = cmd.starts_with("echo ");
            if !out.status.success() || (stdout.trim().is_empty() && !echo) {
                failed.push(format!(
                    "`{cmd}`: {} {stdout}{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
        let status = daemon.wait().unwrap();
        assert!(failed.is_empty(), "{failed:#?}");
        assert!(status.success(), "the agent on SIGTERM: {status}");
    });
    let _ = std::fs::remove_file(&nodes);
}

/// Every test `docs/design.md` names as the proof of an invariant (`path/to/file.rs::test_name`)
/// exists in that file, so the list cannot point at a test that was renamed or removed.
#[test]
fn every_test_the_design_names_exists() {
    let root = workspace_root();
    let design = std::fs::read_to_string(root.join("docs/design.md")).unwrap();
    let mut named = 0;
    for part in design.split('`').skip(1).step_by(2) {
        let Some((file, test)) = part.split_once(".rs::") else {
            continue;
        };
        let path = root.join(format!("{file}.rs"));
        let source = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("docs/design.md names {}: {e}", path.display()));
        assert!(
            source.contains(&format!("fn {test}(")),
            "docs/design.md names {file}.rs::{test}, which does not exist"
        );
        named += 1;
    }
    assert!(named >= 17, "only {named} tests named");
}

//! The `deploy/` manifests and the `Dockerfile`, checked without a cluster or a Docker engine.
//!
//! Every manifest is parsed into its k8s-openapi type (which also checks apiVersion and kind),
//! and the properties the operator's guide promises are asserted one by one. The DaemonSet's
//! args and every `NODE_AGENT_*` variable are checked against the agent's real command line
//! (`node_agent::cli::Cli`), and the whole configuration is handed to the agent's own parser in
//! a child process. The Dockerfile is compared with what xtask builds and installs (the image
//! itself is built and run by `tests/image.rs`). The alerts in `deploy/monitoring/` go through
//! `promtool check rules` and `promtool test rules`, and the PrometheusRule and the docs' alert
//! table are checked to be generated from them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::CommandFactory;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, Namespace, PodSpec, ServiceAccount, Volume};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use node_agent::cli::{Cli, Command as AgentCommand};
use serde::Deserialize;

// ---------------------------------------------------------------------------------------------
// Loading

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the workspace")
        .to_owned()
}

fn read(rel: &str) -> String {
    let path = root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn load<T: serde::de::DeserializeOwned>(rel: &str) -> T {
    serde_saphyr::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Kustomization {
    api_version: String,
    kind: String,
    namespace: String,
    resources: Vec<String>,
    #[serde(default)]
    config_map_generator: Vec<ConfigMapGenerator>,
    #[serde(default)]
    images: Vec<Image>,
    /// Patches of an overlay, checked by the overlay's own test.
    #[serde(default)]
    patches: Vec<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ConfigMapGenerator {
    name: String,
    envs: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Image {
    name: String,
    new_name: String,
    new_tag: String,
}

fn kustomization() -> Kustomization {
    kustomization_in("")
}

/// The manifest of the one resource of kind `kind` listed in the kustomization.
fn resource<T: serde::de::DeserializeOwned>(kind: &str) -> T {
    let files: Vec<String> = kustomization()
        .resources
        .into_iter()
        .filter(|f| kind_of(f) == kind)
        .collect();
    assert_eq!(
        files.len(),
        1,
        "expected one {kind} manifest, found {files:?}"
    );
    load(&format!("deploy/{}", files[0]))
}

fn kind_of(file: &str) -> String {
    let v: serde_json::Value = load(&format!("deploy/{file}"));
    v["kind"]
        .as_str()
        .unwrap_or_else(|| panic!("deploy/{file} has no kind"))
        .to_owned()
}

fn daemonset() -> DaemonSet {
    resource("DaemonSet")
}

fn pod(ds: &DaemonSet) -> &PodSpec {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("the DaemonSet has a pod spec")
}

fn agent(ds: &DaemonSet) -> &Container {
    let p = pod(ds);
    assert_eq!(p.containers.len(), 1, "one container: the agent");
    &p.containers[0]
}

fn volume<'a>(p: &'a PodSpec, name: &str) -> &'a Volume {
    p.volumes
        .iter()
        .flatten()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

/// `--flag=value` (or `--flag value`) from the container's args.
fn arg_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter().enumerate().find_map(|(i, a)| {
        if let Some(v) = a.strip_prefix(&format!("{flag}=")) {
            Some(v)
        } else if a == flag {
            args.get(i + 1).map(String::as_str)
        } else {
            None
        }
    })
}

/// `deploy/node-agent.env`: the settings (`KEY=value`) and the commented-out ones an operator
/// is told to enable (`#KEY=value`).
/// `KEY=value` pairs.
type Settings = Vec<(String, String)>;

fn env_file() -> (Settings, Settings) {
    let generators = kustomization().config_map_generator;
    assert_eq!(generators.len(), 1, "one ConfigMap: {generators:?}");
    assert_eq!(generators[0].envs.len(), 1);
    // The DaemonSet takes its environment from the generated ConfigMap.
    let ds = daemonset();
    let from: Vec<_> = agent(&ds)
        .env_from
        .iter()
        .flatten()
        .filter_map(|e| e.config_map_ref.as_ref().map(|c| c.name.clone()))
        .collect();
    assert_eq!(
        from,
        [generators[0].name.clone()],
        "envFrom the generated ConfigMap"
    );
    let text = read(&format!("deploy/{}", generators[0].envs[0]));
    let (mut set, mut commented) = (Vec::new(), Vec::new());
    let is_key = |k: &str| {
        !k.is_empty()
            && k.chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
    };
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix('#') {
            if let Some((k, v)) = rest.split_once('=')
                && is_key(k)
            {
                commented.push((k.to_owned(), v.to_owned()));
            }
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("not a KEY=value line: {line:?}"));
        assert!(
            k.starts_with("NODE_AGENT_") && is_key(k),
            "{k}: only NODE_AGENT_<FLAG> settings"
        );
        set.push((k.to_owned(), v.to_owned()));
    }
    (set, commented)
}

// ---------------------------------------------------------------------------------------------
// The agent's command line

/// What is wrong with `args` (the container's args) and `env` (variable names set on it) for
/// the agent's real command line: an unknown subcommand, flag, or `NODE_AGENT_*` variable.
fn cli_problems(args: &[String], env: &[String]) -> Vec<String> {
    let mut cmd = Cli::command();
    // Propagates the global flags (--log-format) into the subcommands.
    cmd.build();
    let mut problems = Vec::new();
    let Some(sub) = args.first() else {
        return vec!["no subcommand in args".into()];
    };
    let Some(run) = cmd.find_subcommand(sub) else {
        return vec![format!("`{sub}` is not a node-agent subcommand")];
    };
    if sub != "run" {
        problems.push(format!(
            "the DaemonSet must run `node-agent run`, not `{sub}`"
        ));
    }
    let longs: BTreeSet<String> = run
        .get_arguments()
        .filter_map(|a| a.get_long().map(str::to_owned))
        .collect();
    for a in &args[1..] {
        if let Some(flag) = a.strip_prefix("--") {
            let name = flag.split('=').next().unwrap_or(flag);
            if !longs.contains(name) {
                problems.push(format!("--{name} is not a flag of `node-agent {sub}`"));
            }
        }
    }
    let envs: BTreeSet<String> = run
        .get_arguments()
        .filter_map(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()))
        .collect();
    for e in env.iter().filter(|e| e.starts_with("NODE_AGENT_")) {
        if !envs.contains(e) {
            problems.push(format!(
                "{e} is not the variable of any `node-agent {sub}` flag"
            ));
        }
    }
    problems
}

fn env_names(c: &Container) -> Vec<String> {
    c.env.iter().flatten().map(|e| e.name.clone()).collect()
}

#[test]
fn args_and_variables_are_flags_of_the_real_cli() {
    let ds = daemonset();
    let c = agent(&ds);
    assert!(c.command.is_none(), "the image's entrypoint is the agent");
    let args = c.args.clone().unwrap_or_default();
    let (set, commented) = env_file();
    let mut env = env_names(c);
    env.extend(set.iter().chain(&commented).map(|(k, _)| k.clone()));
    let problems = cli_problems(&args, &env);
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn the_checker_rejects_what_the_agent_does_not_know() {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    // A correct configuration passes...
    assert_eq!(
        cli_problems(
            &s(&["run", "--state-dir=/run/node-agent", "--log-format", "json"]),
            &s(&["NODE_NAME", "NODE_AGENT_METRICS_ADDR"])
        ),
        Vec::<String>::new()
    );
    // ...a flag, a variable or a subcommand the agent does not have fails.
    let bad_flag = cli_problems(&s(&["run", "--node-map-size=10"]), &[]);
    assert_eq!(
        bad_flag,
        ["--node-map-size is not a flag of `node-agent run`"]
    );
    let bad_env = cli_problems(&s(&["run"]), &s(&["NODE_AGENT_NODE_MAP_SIZE"]));
    assert_eq!(
        bad_env,
        ["NODE_AGENT_NODE_MAP_SIZE is not the variable of any `node-agent run` flag"]
    );
    // A flag of another subcommand is not a `run` flag.
    assert!(!cli_problems(&s(&["run", "--nodes-file-pol=1s"]), &[]).is_empty());
    assert!(!cli_problems(&s(&["serve"]), &[]).is_empty());
    assert!(!cli_problems(&s(&["plan"]), &[]).is_empty());
}

/// The pod's environment as the kubelet builds it: downward-API fields filled with sample
/// values, `$(VAR)` references expanded, then the ConfigMap's variables (`envFrom`).
fn pod_environment(c: &Container, extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for (k, v) in extra {
        out.push((k.clone(), v.clone()));
    }
    for e in c.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), None) => {
                let mut v = v.clone();
                for (k, val) in &out {
                    v = v.replace(&format!("$({k})"), val);
                }
                v
            }
            (None, Some(from)) => {
                let path = &from.field_ref.as_ref().expect("a fieldRef").field_path;
                match path.as_str() {
                    "spec.nodeName" => "worker-7".into(),
                    "status.hostIP" => "10.1.2.7".into(),
                    other => panic!("no sample value for {other}"),
                }
            }
            other => panic!(
                "env {} is neither a value nor a fieldRef: {other:?}",
                e.name
            ),
        };
        // Later entries override, as in Kubernetes.
        out.retain(|(k, _)| k != &e.name);
        out.push((e.name.clone(), value));
    }
    out
}

/// Runs [`child_parses_the_manifest_config`] in a child process whose environment is exactly
/// `env`, and returns what it printed (or panics with its output when it failed).
fn parse_in_child(args: &[String], env: &[(String, String)]) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "deploy::child_parses_the_manifest_config",
            "--nocapture",
        ])
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("DEPLOY_TEST_ARGS", args.join("\x1f"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "the agent refused the manifest's configuration:\n{text}"
    );
    text
}

/// The DaemonSet's args and environment, as the pod would see them, are accepted by the agent's
/// own parser, and mean what the manifest says.
#[test]
fn manifest_configuration_is_accepted_by_the_agent() {
    let ds = daemonset();
    let c = agent(&ds);
    let args = c.args.clone().unwrap_or_default();
    let (set, commented) = env_file();
    let env = pod_environment(c, &set);
    let text = parse_in_child(&args, &env);
    assert!(text.contains("node_name=worker-7"), "{text}");
    assert!(text.contains("metrics_addr=10.1.2.7:9965"), "{text}");
    assert!(text.contains("state_dir=/run/node-agent"), "{text}");
    assert!(text.contains("bpffs=/sys/fs/bpf"), "{text}");
    assert!(
        text.contains("ipsec=None"),
        "IPsec is off by default: {text}"
    );
    // The commented-out settings, once enabled as the env file says, are accepted too.
    let mut all = set.clone();
    all.extend(commented);
    let env = pod_environment(c, &all);
    let text = parse_in_child(&args, &env);
    assert!(
        text.contains("ipsec=Some(\"/etc/node-agent/ipsec/keys\")"),
        "{text}"
    );
}

/// A helper: [`manifest_configuration_is_accepted_by_the_agent`] runs it in a child process with
/// `DEPLOY_TEST_ARGS`; alone it says so and passes.
#[test]
fn child_parses_the_manifest_config() {
    let Ok(args) = std::env::var("DEPLOY_TEST_ARGS") else {
        eprintln!(
            "a helper of manifest_configuration_is_accepted_by_the_agent; nothing to do alone"
        );
        return;
    };
    let argv = std::iter::once("node-agent").chain(args.split('\x1f'));
    let cli = match <Cli as clap::Parser>::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) => panic!("{e}"),
    };
    let AgentCommand::Run(run) = cli.command else {
        panic!("not `node-agent run`");
    };
    let config = run.agent.config().expect("the agent's own validation");
    println!("node_name={}", config.node_name);
    println!("metrics_addr={}", run.metrics_addr);
    println!("state_dir={}", run.agent.state_dir.display());
    println!("bpffs={}", run.agent.bpffs.bpffs.display());
    println!("ifaces={:?}", run.agent.datapath_ifaces);
    println!("ipsec={:?}", config.ipsec_key_file);
    assert!(!run.agent.datapath_ifaces.is_empty(), "no --datapath-iface");
}

// ---------------------------------------------------------------------------------------------
// The manifests

#[test]
fn every_manifest_parses_into_its_kubernetes_type() {
    let k = kustomization();
    let mut kinds = BTreeMap::new();
    for file in &k.resources {
        let rel = format!("deploy/{file}");
        let kind = kind_of(file);
        match kind.as_str() {
            "Namespace" => drop(load::<Namespace>(&rel)),
            "ServiceAccount" => drop(load::<ServiceAccount>(&rel)),
            "ClusterRole" => drop(load::<ClusterRole>(&rel)),
            "ClusterRoleBinding" => drop(load::<ClusterRoleBinding>(&rel)),
            "DaemonSet" => drop(load::<DaemonSet>(&rel)),
            other => panic!("{rel}: no test knows kind {other}"),
        }
        *kinds.entry(kind).or_insert(0) += 1;
    }
    for kind in [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
    ] {
        assert_eq!(kinds.get(kind), Some(&1), "one {kind}: {kinds:?}");
    }
    let ns: Namespace = resource("Namespace");
    assert_eq!(ns.metadata.name.as_deref(), Some(k.namespace.as_str()));
}

/// Sub-folders of `deploy/` with a kustomization of their own, kept out of the default one
/// because applying them needs what not every cluster has.
const OPTIONAL: &[(&str, &str)] = &[
    (
        "monitoring",
        "the PrometheusRule needs the Prometheus operator's CRD",
    ),
    (
        "privileged",
        "an alternative to deploy/ (a privileged agent container), applied instead of it",
    ),
];

/// Files in `deploy/` that no kustomization lists, and what they are.
const NOT_RESOURCES: &[(&str, &str)] = &[
    (
        "monitoring/rules.yaml",
        "the alerts as a plain Prometheus rule file, the source of prometheusrule.yaml",
    ),
    (
        "monitoring/rules_test.yaml",
        "promtool's unit tests of rules.yaml",
    ),
];

/// The kustomization of `deploy/<dir>` (`dir` empty or ending in `/`).
fn kustomization_in(dir: &str) -> Kustomization {
    let k: Kustomization = load(&format!("deploy/{dir}kustomization.yaml"));
    assert_eq!(k.api_version, "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k.kind, "Kustomization");
    k
}

/// What is wrong with the files of `deploy/<dir>` against its kustomization: files it does not
/// list, entries that do not exist, sub-folders that are not optional kustomizations.
fn unaccounted(dir: &str) -> Vec<String> {
    let k = kustomization_in(dir);
    // `../` and the like are other kustomizations (an overlay's base), not files of this one.
    let mut listed: BTreeSet<String> = k
        .resources
        .iter()
        .filter(|r| !r.starts_with("../"))
        .cloned()
        .collect();
    listed.extend(k.config_map_generator.iter().flat_map(|g| g.envs.clone()));
    listed.insert("kustomization.yaml".into());
    listed.extend(
        NOT_RESOURCES
            .iter()
            .filter_map(|(f, _)| f.strip_prefix(dir))
            .filter(|f| !f.contains('/'))
            .map(str::to_owned),
    );
    let mut problems = Vec::new();
    let mut present = BTreeSet::new();
    for entry in std::fs::read_dir(root().join("deploy").join(dir)).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.file_type().unwrap().is_dir() {
            let sub = format!("{dir}{name}");
            if OPTIONAL.iter().any(|(d, _)| *d == sub) {
                problems.extend(unaccounted(&format!("{sub}/")));
            } else {
                problems.push(format!(
                    "deploy/{sub}/ is a folder, but not an optional kustomization (OPTIONAL)"
                ));
            }
            continue;
        }
        present.insert(name);
    }
    for f in listed.difference(&present) {
        problems.push(format!(
            "deploy/{dir}{f} is listed (kustomization.yaml or NOT_RESOURCES) but absent"
        ));
    }
    for f in present.difference(&listed) {
        problems.push(format!(
            "deploy/{dir}{f} is in no kustomization.yaml and not in NOT_RESOURCES"
        ));
    }
    problems
}

#[test]
fn kustomization_lists_every_file_in_deploy() {
    let problems = unaccounted("");
    assert!(problems.is_empty(), "{problems:#?}");
    // `kubectl apply -k deploy/` works on a cluster without the optional parts' CRDs.
    let k = kustomization();
    for (dir, why) in OPTIONAL {
        assert!(
            !k.resources
                .iter()
                .any(|r| r.trim_end_matches('/') == *dir || r.starts_with(&format!("{dir}/"))),
            "deploy/kustomization.yaml must not include {dir}/: {why}"
        );
    }
    // The image tag follows the workspace version.
    assert_eq!(k.images.len(), 1);
    assert_eq!(k.images[0].name, "node-agent");
    assert!(!k.images[0].new_name.is_empty());
    assert_eq!(k.images[0].new_tag, workspace_field("version"));
    let ds = daemonset();
    assert_eq!(agent(&ds).image.as_deref(), Some("node-agent"));
}

/// The capabilities the agent container adds, each with a comment right above it saying what
/// needs it (the manifest is read as text for the comments).
const AGENT_CAPS: &[&str] = &["BPF", "PERFMON", "NET_ADMIN"];

#[test]
fn only_the_init_container_is_privileged_and_the_agent_has_only_what_it_needs() {
    let ds = daemonset();
    let p = pod(&ds);
    assert_eq!(p.host_network, Some(true));
    let sa: ServiceAccount = resource("ServiceAccount");
    assert_eq!(p.service_account_name, sa.metadata.name);
    for c in p.init_containers.iter().flatten() {
        let sc = c.security_context.as_ref().expect("a securityContext");
        assert_eq!(
            sc.privileged,
            Some(true),
            "{}: mounts the bpffs Bidirectional",
            c.name
        );
    }
    let c = agent(&ds);
    let sc = c.security_context.as_ref().expect("a securityContext");
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        sc.run_as_user,
        Some(0),
        "root: the host's bpffs is 0700, old pins root's"
    );
    assert_eq!(
        sc.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
        Some("RuntimeDefault")
    );
    let caps = sc.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    let added: Vec<&str> = caps.add.iter().flatten().map(String::as_str).collect();
    assert_eq!(
        added, AGENT_CAPS,
        "exactly what tests/tests/it/caps.rs proves enough"
    );
    let text = read("deploy/daemonset.yaml");
    let lines: Vec<&str> = text.lines().collect();
    for cap in AGENT_CAPS {
        let at = lines
            .iter()
            .position(|l| l.trim() == format!("- {cap}"))
            .unwrap_or_else(|| panic!("- {cap} in deploy/daemonset.yaml"));
        assert!(
            lines[at - 1].trim_start().starts_with('#'),
            "{cap}: say in a comment above it what needs it"
        );
    }
    // Bidirectional propagation needs a privileged container.
    for m in c.volume_mounts.iter().flatten() {
        assert_ne!(
            m.mount_propagation.as_deref(),
            Some("Bidirectional"),
            "{}: the agent is not privileged",
            m.name
        );
    }
}

#[test]
fn the_privileged_overlay_makes_only_the_agent_container_privileged() {
    let k = kustomization_in("privileged/");
    assert_eq!(k.resources, ["../"]);
    assert_eq!(k.patches.len(), 1);
    let patch = &k.patches[0];
    assert_eq!(patch["target"]["kind"].as_str(), Some("DaemonSet"));
    assert_eq!(patch["target"]["name"].as_str(), Some("node-agent"));
    let ops: serde_json::Value =
        serde_saphyr::from_str(patch["patch"].as_str().expect("an inline JSON patch")).unwrap();
    // Applied to the real DaemonSet: the agent container, and nothing else, turns privileged.
    let mut ds = serde_json::to_value(daemonset()).unwrap();
    for op in ops.as_array().unwrap() {
        assert_eq!(op["op"], "replace");
        let at = ds
            .pointer_mut(op["path"].as_str().unwrap())
            .unwrap_or_else(|| panic!("{} is not in the DaemonSet", op["path"]));
        *at = op["value"].clone();
    }
    let containers = &ds["spec"]["template"]["spec"]["containers"];
    assert_eq!(containers[0]["name"], "node-agent");
    assert_eq!(containers[0]["securityContext"]["privileged"], true);
    let install = read("docs/install.md");
    assert!(
        install.contains("deploy/privileged/"),
        "docs/install.md says when to use the overlay"
    );
}

#[test]
fn node_name_and_host_ip_come_from_the_downward_api() {
    let ds = daemonset();
    let c = agent(&ds);
    let field = |name: &str| {
        let e = c
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .unwrap_or_else(|| panic!("no env {name}"));
        e.value_from
            .as_ref()
            .and_then(|f| f.field_ref.as_ref())
            .map(|f| f.field_path.clone())
    };
    assert_eq!(field("NODE_NAME").as_deref(), Some("spec.nodeName"));
    assert_eq!(field("HOST_IP").as_deref(), Some("status.hostIP"));
    // The agent reads NODE_NAME itself (not through clap), so make sure it still does.
    assert!(
        read("node-agent/src/cli/run.rs").contains("std::env::var(\"NODE_NAME\")"),
        "the agent no longer reads NODE_NAME"
    );
}

#[test]
fn bpffs_and_state_dir_are_host_paths_with_the_right_propagation() {
    let ds = daemonset();
    let p = pod(&ds);
    let c = agent(&ds);
    let args = c.args.clone().unwrap_or_default();
    let mount = |c: &Container, vol: &str| {
        c.volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == vol)
            .unwrap_or_else(|| panic!("{} does not mount {vol}", c.name))
            .clone()
    };
    // The bpffs: the host's, where --bpffs says; Bidirectional in the (privileged) init
    // container that mounts one when the host has none, so the mount reaches the host;
    // HostToContainer in the agent, which sees it and is not privileged.
    let bpffs = volume(p, "bpffs").host_path.as_ref().expect("hostPath");
    assert_eq!(bpffs.path, "/sys/fs/bpf");
    let init = p
        .init_containers
        .as_ref()
        .expect("the bpffs init container");
    for (c, propagation) in [(c, "HostToContainer"), (&init[0], "Bidirectional")] {
        let m = mount(c, "bpffs");
        assert_eq!(m.mount_path, "/sys/fs/bpf");
        assert_eq!(
            m.mount_propagation.as_deref(),
            Some(propagation),
            "{}",
            c.name
        );
    }
    assert_eq!(arg_value(&args, "--bpffs"), Some("/sys/fs/bpf"));
    let script = init[0].command.as_ref().unwrap().join(" ");
    assert!(script.contains("mount -t bpf bpf /sys/fs/bpf"), "{script}");
    // The state directory: the host's, created when missing, where --state-dir says.
    let state = volume(p, "state").host_path.as_ref().expect("hostPath");
    assert_eq!(state.path, "/run/node-agent");
    assert_eq!(state.type_.as_deref(), Some("DirectoryOrCreate"));
    assert_eq!(mount(c, "state").mount_path, "/run/node-agent");
    assert_eq!(arg_value(&args, "--state-dir"), Some("/run/node-agent"));
}

#[test]
fn ipsec_key_is_an_optional_read_only_secret() {
    let ds = daemonset();
    let p = pod(&ds);
    let secret = volume(p, "ipsec-key")
        .secret
        .as_ref()
        .expect("a Secret volume");
    assert_eq!(secret.optional, Some(true));
    assert_eq!(secret.default_mode, Some(0o400));
    let m = agent(&ds)
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "ipsec-key")
        .expect("the key is mounted");
    assert_eq!(m.read_only, Some(true));
    // The key file the env file names (enabled or not) is inside that mount.
    let (set, commented) = env_file();
    let key: Vec<_> = set
        .iter()
        .chain(&commented)
        .filter(|(k, _)| k == "NODE_AGENT_IPSEC_KEY_FILE")
        .collect();
    assert_eq!(key.len(), 1, "{key:?}");
    assert!(
        key[0].1.starts_with(&format!("{}/", m.mount_path)),
        "{key:?}"
    );
}

#[test]
fn probes_reach_readyz_and_healthz_on_the_address_the_agent_binds() {
    let ds = daemonset();
    let c = agent(&ds);
    let port = c
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .expect("a metrics port");
    let probe = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        let get = p
            .as_ref()
            .and_then(|p| p.http_get.clone())
            .expect("an httpGet probe");
        assert_eq!(get.port, IntOrString::String("metrics".into()));
        assert!(
            get.host.is_none(),
            "the kubelet probes the pod IP = node IP"
        );
        get.path.unwrap()
    };
    assert_eq!(probe(&c.readiness_probe), "/readyz");
    assert_eq!(probe(&c.liveness_probe), "/healthz");
    // The agent binds the node's IP on that port (the default, 127.0.0.1, is unreachable).
    let addr = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_AGENT_METRICS_ADDR")
        .and_then(|e| e.value.clone())
        .expect("NODE_AGENT_METRICS_ADDR");
    assert_eq!(addr, format!("$(HOST_IP):{}", port.container_port));
}

/// A memory quantity in MiB (only the suffixes the manifest uses).
fn mib(q: &str) -> u64 {
    if let Some(n) = q.strip_suffix("Mi") {
        n.parse().unwrap()
    } else if let Some(n) = q.strip_suffix("Gi") {
        n.parse::<u64>().unwrap() * 1024
    } else {
        panic!("unexpected quantity {q}")
    }
}

#[test]
fn resources_fit_the_agents_targets() {
    let ds = daemonset();
    let r = agent(&ds).resources.clone().expect("resources");
    let requests = r.requests.expect("requests");
    let limits = r.limits.expect("limits");
    assert!(requests.contains_key("cpu"), "{requests:?}");
    // RSS is about 36 MiB at 5,000 nodes: request that with room. The limit must clear the peak
    // `cargo xtask bench` measures at 65,000 nodes (about 245 MiB, the cold start; the target is
    // under 256) with half again as headroom, or the agent is OOM-killed on the largest
    // clusters it supports.
    let req = mib(&requests["memory"].0);
    let lim = mib(&limits["memory"].0);
    assert!(req >= 64, "memory request {req} Mi");
    assert!(
        lim >= 384,
        "memory limit {lim} Mi is under the 65,000-node peak with headroom"
    );
    assert!(
        !limits.contains_key("cpu"),
        "no CPU limit (throttling delays cleanups)"
    );
}

#[test]
fn runs_on_every_node_and_has_time_for_the_final_checkpoint() {
    let ds = daemonset();
    let p = pod(&ds);
    let tolerations = p.tolerations.as_ref().expect("tolerations");
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "a toleration of every taint: {tolerations:?}"
    );
    assert!(p.termination_grace_period_seconds.unwrap_or(30) >= 30);
    assert_eq!(
        p.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
}

#[test]
fn rolling_update_never_runs_two_agents_on_one_node() {
    let ds = daemonset();
    let strategy = ds
        .spec
        .as_ref()
        .unwrap()
        .update_strategy
        .clone()
        .expect("updateStrategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let ru = strategy.rolling_update.expect("rollingUpdate");
    assert_eq!(ru.max_surge, Some(IntOrString::Int(0)));
    assert_eq!(ru.max_unavailable, Some(IntOrString::Int(1)));
}

#[test]
fn rbac_grants_reading_nodes_and_nothing_else() {
    let role: ClusterRole = resource("ClusterRole");
    assert!(role.aggregation_rule.is_none());
    let rules = role.rules.expect("rules");
    assert_eq!(rules.len(), 1, "one rule: {rules:?}");
    let rule = &rules[0];
    assert_eq!(rule.api_groups.as_deref(), Some(&[String::new()][..]));
    assert_eq!(rule.resources.as_deref(), Some(&["nodes".to_string()][..]));
    let verbs: BTreeSet<&str> = rule.verbs.iter().map(String::as_str).collect();
    assert_eq!(verbs, BTreeSet::from(["get", "list", "watch"]));
    assert_eq!(rule.verbs.len(), 3, "no verb twice");
    assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none());

    let binding: ClusterRoleBinding = resource("ClusterRoleBinding");
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(binding.role_ref.api_group, "rbac.authorization.k8s.io");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let sa: ServiceAccount = resource("ServiceAccount");
    let subjects = binding.subjects.expect("subjects");
    assert_eq!(subjects.len(), 1, "{subjects:?}");
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(Some(&subjects[0].name), sa.metadata.name.as_ref());
    assert_eq!(subjects[0].namespace, sa.metadata.namespace);
    assert_eq!(
        sa.metadata.namespace.as_deref(),
        Some(kustomization().namespace.as_str())
    );
}

// ---------------------------------------------------------------------------------------------
// The Dockerfile

/// `[workspace.package]` field of the root Cargo.toml, e.g. `version` or `rust-version`.
fn workspace_field(name: &str) -> String {
    let toml = read("Cargo.toml");
    let section = toml
        .split("[workspace.package]")
        .nth(1)
        .expect("[workspace.package]");
    section
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} = \"")))
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no {name} in [workspace.package]"))
        .to_owned()
}

/// The string literal of `const NAME: &str = "...";` in `src`.
fn const_str(src: &str, name: &str) -> String {
    src.lines()
        .find_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix(&format!("const {name}: &str = \""))
        })
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no const {name}"))
        .to_owned()
}

/// The quoted strings of the slice literal that defines `const PACKAGES` (one line or several).
fn packages(setup: &str) -> Vec<String> {
    let start = setup
        .find("const PACKAGES")
        .expect("const PACKAGES in xtask/src/setup.rs");
    let rest = &setup[start..];
    let list = rest.split_once("= &[").expect("a slice literal").1;
    let list = list
        .split_once("];")
        .expect("the end of the slice literal")
        .0;
    list.split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The files the Dockerfile's expectations are derived from.
struct Sources {
    setup: String,
    image: String,
    readme: String,
}

impl Sources {
    fn read() -> Self {
        Self {
            setup: read("xtask/src/setup.rs"),
            image: read("xtask/src/image.rs"),
            readme: read("README.md"),
        }
    }
}

/// What the Dockerfile must say, derived from xtask's source and the workspace.
#[derive(Debug)]
struct Expected {
    /// The default of `ARG BASE`: the registry base `cargo xtask image` pulls.
    base: String,
    /// What `cargo xtask setup` installs on the build machine: the runtime packages are among
    /// them, so the image's tools are the ones the tests ran the docs' commands with.
    setup_packages: Vec<String>,
    /// The agent `cargo xtask image` builds, relative to the workspace: what the Dockerfile
    /// copies and the only file .dockerignore lets into the context.
    binary: String,
    /// The route protocol the agent writes, named in the image's rt_protos.d.
    route_protocol: String,
}

fn expected() -> Expected {
    expected_from(&Sources::read()).unwrap_or_else(|e| panic!("{e}"))
}

/// The expectations, or why xtask's source no longer fits the chain they are derived from.
fn expected_from(src: &Sources) -> Result<Expected, String> {
    let image = &src.image;
    if !image.contains("build_ebpf::run(&build_ebpf::Args { release: true })") {
        return Err("xtask image no longer builds the eBPF object with --release".into());
    }
    // `cargo build ...` in xtask image: the string literals of the `.args([...])` that starts
    // with "build".
    let args: Vec<String> = image
        .split_once("\"build\",")
        .map(|(_, rest)| format!("\"build\",{}", rest.split(']').next().unwrap_or("")))
        .ok_or("no `cargo build` of the agent in xtask image")?
        .split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    let build = format!("cargo {}", args.join(" "));
    if !(src.readme.contains(&build) && src.readme.contains("cargo xtask build-ebpf --release")) {
        return Err(format!(
            "the README builds the agent otherwise than xtask image (`{build}`)"
        ));
    }
    let profile = if args.iter().any(|a| a == "--release") {
        "release"
    } else {
        "debug"
    };
    let package = args
        .iter()
        .skip_while(|a| *a != "-p")
        .nth(1)
        .ok_or("xtask image's cargo build names no package")?;
    let built = format!("target/{profile}/{package}");
    let binary = const_str(image, "BINARY");
    if binary != built {
        return Err(format!(
            "xtask image's BINARY {binary} is not what its `{build}` builds ({built})"
        ));
    }
    Ok(Expected {
        base: const_str(image, "REGISTRY_BASE"),
        setup_packages: packages(&src.setup),
        binary,
        route_protocol: format!(
            "mkdir -p /etc/iproute2/rt_protos.d && echo \"{} node-agent\" > \
             /etc/iproute2/rt_protos.d/node-agent.conf",
            node_agent::backends::routes::DEFAULT_ROUTE_PROTOCOL
        ),
    })
}

/// One instruction of a Dockerfile: its keyword, its text (continuations joined), and the
/// comment lines right above it.
struct Instruction {
    keyword: String,
    text: String,
    comments: Vec<String>,
}

fn instructions(dockerfile: &str) -> Vec<Instruction> {
    let mut out = Vec::new();
    let mut comments = Vec::new();
    let mut lines = dockerfile.lines();
    while let Some(line) = lines.next() {
        let line = line.trim();
        if let Some(c) = line.strip_prefix('#') {
            comments.push(c.trim().to_owned());
            continue;
        }
        if line.is_empty() {
            comments.clear();
            continue;
        }
        let mut text = line.to_owned();
        while text.ends_with('\\') {
            text.pop();
            text.push(' ');
            text.push_str(lines.next().unwrap_or("").trim());
        }
        let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let (keyword, rest) = text.split_once(' ').unwrap_or((&text, ""));
        out.push(Instruction {
            keyword: keyword.to_uppercase(),
            text: rest.to_owned(),
            comments: std::mem::take(&mut comments),
        });
    }
    out
}

/// The packages of `apt-get update && apt-get install -y --no-install-recommends A B && rm ...`.
fn apt_packages(run: &str) -> Option<Vec<String>> {
    let parts: Vec<&str> = run.split("&&").map(str::trim).collect();
    if parts.len() != 3 || parts[0] != "apt-get update" || parts[2] != "rm -rf /var/lib/apt/lists/*"
    {
        return None;
    }
    let install = parts[1]
        .strip_prefix("DEBIAN_FRONTEND=noninteractive ")
        .unwrap_or(parts[1])
        .strip_prefix("apt-get install -y --no-install-recommends ")?;
    Some(install.split(' ').map(str::to_owned).collect())
}

/// What the runtime must have: bpftool and ip for the docs' inspection commands, the CA store
/// the Kubernetes client loads.
const RUNTIME_TOOLS: &[&str] = &["bpftool", "iproute2", "ca-certificates"];

/// A package that has no business in the runtime image: a compiler, a toolchain, headers.
fn is_build_tool(pkg: &str) -> bool {
    pkg.ends_with("-dev")
        || [
            "llvm",
            "clang",
            "gcc",
            "g++",
            "rustc",
            "cargo",
            "build-essential",
        ]
        .iter()
        .any(|t| pkg.starts_with(t))
}

/// What is wrong with `dockerfile` and `dockerignore` against `want`: a build stage, another
/// base, a RUN that mirrors nothing or something unknown, runtime packages that are not the
/// tested tools or are build tools, a COPY of another file than the agent xtask builds, a build
/// context that lets more in.
fn dockerfile_problems(dockerfile: &str, dockerignore: &str, want: &Expected) -> Vec<String> {
    let mut problems = Vec::new();
    let all = instructions(dockerfile);
    let of = |kw: &str| -> Vec<&Instruction> { all.iter().filter(|i| i.keyword == kw).collect() };
    let froms: Vec<&str> = of("FROM").iter().map(|i| i.text.as_str()).collect();
    if froms != ["${BASE}"] {
        problems.push(format!(
            "stages {froms:?}: one stage, FROM ${{BASE}} (the Dockerfile packages the agent \
             xtask built; it does not build)"
        ));
    }
    let args: Vec<&str> = of("ARG").iter().map(|i| i.text.as_str()).collect();
    let base = format!("BASE={}", want.base);
    if args != [base.as_str()] {
        problems.push(format!(
            "ARG {args:?}: expected [{base}], the base xtask image pulls"
        ));
    }
    if all.first().map(|i| i.keyword.as_str()) != Some("ARG") {
        problems.push("ARG BASE must come before FROM".into());
    }
    let mut seen = BTreeSet::new();
    for i in of("RUN") {
        let ids: Vec<&str> = i
            .comments
            .iter()
            .filter_map(|c| c.strip_prefix("mirrors: "))
            .collect();
        let [id] = ids[..] else {
            problems.push(format!(
                "RUN {} has {} `# mirrors:` lines, not one",
                i.text,
                ids.len()
            ));
            continue;
        };
        if !seen.insert(id.to_owned()) {
            problems.push(format!("two RUNs mirror {id}"));
        }
        match id {
            "runtime:packages" => match apt_packages(&i.text) {
                None => problems.push(format!("{id}: not a plain apt-get install: {}", i.text)),
                Some(got) => {
                    for p in &got {
                        if !want.setup_packages.contains(p) {
                            problems.push(format!(
                                "{id}: {p} is not among the packages xtask setup installs \
                                 (and the tests run with): {:?}",
                                want.setup_packages
                            ));
                        }
                        if is_build_tool(p) {
                            problems.push(format!("{id}: {p} is a build tool"));
                        }
                    }
                    for t in RUNTIME_TOOLS {
                        if !got.iter().any(|p| p == t) {
                            problems.push(format!("{id}: the runtime lacks {t}"));
                        }
                    }
                }
            },
            "runtime:route-protocol" => {
                if i.text != want.route_protocol {
                    problems.push(format!(
                        "{id}: the Dockerfile runs `{}`, expected `{}`",
                        i.text, want.route_protocol
                    ));
                }
            }
            other => problems.push(format!("`# mirrors: {other}` names no known step")),
        }
    }
    for id in ["runtime:packages", "runtime:route-protocol"] {
        if !seen.contains(id) {
            problems.push(format!("no RUN mirrors {id}"));
        }
    }
    let copies: Vec<&str> = of("COPY").iter().map(|i| i.text.as_str()).collect();
    let copy = format!("{} /usr/local/bin/node-agent", want.binary);
    if copies != [copy.as_str()] {
        problems.push(format!(
            "COPY {copies:?}: expected [{copy}], the agent xtask image builds"
        ));
    }
    let ignore: Vec<&str> = dockerignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let only = format!("!{}", want.binary);
    if ignore != ["*", only.as_str()] {
        problems.push(format!(
            ".dockerignore {ignore:?}: expected [\"*\", \"{only}\"], the agent and nothing else"
        ));
    }
    problems
}

#[test]
fn dockerfile_packages_what_xtask_builds_with_the_tested_tools() {
    let problems = dockerfile_problems(&read("Dockerfile"), &read(".dockerignore"), &expected());
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn dockerfile_ships_the_agent_and_the_inspection_tools() {
    let all = instructions(&read("Dockerfile"));
    let last = |kw: &str| {
        all.iter()
            .rfind(|i| i.keyword == kw)
            .map(|i| i.text.clone())
    };
    assert_eq!(
        last("ENTRYPOINT").as_deref(),
        Some(r#"["/usr/local/bin/node-agent"]"#)
    );
    let tools: Vec<String> = all
        .iter()
        .filter_map(|i| apt_packages(&i.text))
        .flatten()
        .collect();
    assert!(
        tools.contains(&"bpftool".into()) && tools.contains(&"iproute2".into()),
        "{tools:?}"
    );
}

#[test]
fn the_dockerfile_check_fails_when_the_two_drift() {
    let want = expected();
    let good = read("Dockerfile");
    let ignore = read(".dockerignore");
    assert!(dockerfile_problems(&good, &ignore, &want).is_empty());
    let drifted = [
        // Another base, or one hard-wired past the stand-in.
        good.replace("debian:bookworm-slim\n", "debian:trixie-slim\n"),
        good.replace(
            "FROM ${BASE}",
            "FROM docker.io/library/debian:bookworm-slim",
        ),
        // A build stage back in.
        good.replace(
            "ARG BASE=",
            "FROM docker.io/library/rust:1.95-bookworm AS build\nRUN cargo build\nARG BASE=",
        ),
        // Runtime packages: a compiler, one the tests never ran, one missing.
        good.replace("bpftool iproute2", "bpftool llvm-22-dev iproute2"),
        good.replace("bpftool iproute2", "bpftool curl iproute2"),
        good.replace("bpftool iproute2 ", "bpftool "),
        // Another route protocol number.
        good.replace("\"201 node-agent\"", "\"200 node-agent\""),
        // Another binary than the one xtask builds (and the tests ran).
        good.replace(
            "COPY target/release/node-agent",
            "COPY target/debug/node-agent",
        ),
        // A step that mirrors nothing, one that names an unknown step, one more RUN.
        good.replace("# mirrors: runtime:route-protocol\n", ""),
        good.replace(
            "# mirrors: runtime:route-protocol",
            "# mirrors: runtime:route-protocols",
        ),
        good.replace("ENTRYPOINT", "RUN rm -rf /usr/share\nENTRYPOINT"),
    ];
    for (i, d) in drifted.iter().enumerate() {
        assert_ne!(d, &good, "drift case {i} did not change the Dockerfile");
        assert!(
            !dockerfile_problems(d, &ignore, &want).is_empty(),
            "drift case {i} was not caught"
        );
    }
    // A build context that lets the whole workspace in, or another binary.
    for bad in [
        ignore.replace("*\n", ""),
        ignore.replace("release", "debug"),
    ] {
        assert_ne!(bad, ignore);
        assert!(!dockerfile_problems(&good, &bad, &want).is_empty(), "{bad}");
    }
    // And changes on xtask's side: another registry base, a debug build, setup without bpftool.
    let src = Sources::read();
    let moved = [
        Sources {
            image: src
                .image
                .replace("debian:bookworm-slim\"", "debian:trixie-slim\""),
            ..Sources::read()
        },
        Sources {
            image: src.image.replacen("\"--release\",\n", "", 1),
            ..Sources::read()
        },
        Sources {
            setup: src.setup.replace("\"bpftool\",\n", ""),
            ..Sources::read()
        },
    ];
    for (i, s) in moved.into_iter().enumerate() {
        assert!(
            s.image != src.image || s.setup != src.setup,
            "xtask drift case {i} changed nothing"
        );
        // Either the derivation refuses it (a debug build is not what BINARY names) or the
        // Dockerfile no longer fits.
        let caught = match expected_from(&s) {
            Err(_) => true,
            Ok(want) => !dockerfile_problems(&good, &ignore, &want).is_empty(),
        };
        assert!(caught, "xtask drift case {i} was not caught");
    }
}

// ---------------------------------------------------------------------------------------------
// The alerts: deploy/monitoring/

const RULES: &str = "deploy/monitoring/rules.yaml";
const RULES_TEST: &str = "deploy/monitoring/rules_test.yaml";
const PROMETHEUS_RULE: &str = "deploy/monitoring/prometheusrule.yaml";
const METRICS_DOC: &str = "docs/metrics.md";
/// How the generated files are regenerated (the expect-test convention).
const REGENERATE: &str = "UPDATE_EXPECT=1 cargo test -p node-agent-tests --test deploy";

/// A Prometheus rule file (`rule_files:`), alerting rules only.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    groups: Vec<RuleGroup>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleGroup {
    name: String,
    rules: Vec<AlertRule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AlertRule {
    alert: String,
    expr: String,
    #[serde(rename = "for")]
    for_: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

/// `monitoring.coreos.com/v1` `PrometheusRule`: its spec is a rule file.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PrometheusRule {
    api_version: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: RuleFile,
}

fn alerts() -> Vec<AlertRule> {
    let file: RuleFile = load(RULES);
    file.groups.into_iter().flat_map(|g| g.rules).collect()
}

/// prometheusrule.yaml as generated from the text of rules.yaml: a fixed head, then the rule
/// file (its comments included) as the spec.
fn prometheus_rule_from(rules: &str) -> String {
    let body = rules
        .lines()
        .skip_while(|l| l.starts_with('#') || l.trim().is_empty());
    let mut out = format!(
        "# Generated from rules.yaml by tests/tests/it/deploy.rs: edit rules.yaml, then run\n\
         # `{REGENERATE}`.\n\
         # The alerts for the Prometheus operator. Its Prometheus picks rules by label\n\
         # (`ruleSelector`); add the label yours selects (docs/metrics.md).\n\
         apiVersion: monitoring.coreos.com/v1\n\
         kind: PrometheusRule\n\
         metadata:\n  name: node-agent\n  namespace: node-agent\n  labels:\n    \
         app.kubernetes.io/name: node-agent\n\
         spec:\n"
    );
    for line in body {
        if !line.is_empty() {
            out.push_str("  ");
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

const TABLE_START: &str = "<!-- The table is generated from deploy/monitoring/rules.yaml by \
                           tests/tests/it/deploy.rs; edit the rules, not the table. -->";
const TABLE_END: &str = "<!-- End of the generated table. -->";

/// The alert table of docs/metrics.md, from the rules.
fn alert_table(alerts: &[AlertRule]) -> String {
    let cell = |s: &str| s.replace('|', "\\|").replace('\n', " ");
    let mut out = format!(
        "{TABLE_START}\n\n| alert | expression (PromQL) | for | severity | why |\n\
         | --- | --- | --- | --- | --- |\n"
    );
    for a in alerts {
        out.push_str(&format!(
            "| `{}` | `{}` | {} | {} | {} |\n",
            a.alert,
            cell(&a.expr),
            a.for_,
            a.labels["severity"],
            cell(&a.annotations["description"])
        ));
    }
    out.push('\n');
    out.push_str(TABLE_END);
    out
}

/// `doc` with its generated table replaced by `table`.
fn with_table(doc: &str, table: &str) -> String {
    let start = doc
        .find(TABLE_START)
        .unwrap_or_else(|| panic!("{METRICS_DOC} has no `{TABLE_START}`"));
    let end = doc[start..]
        .find(TABLE_END)
        .map(|e| start + e + TABLE_END.len())
        .unwrap_or_else(|| panic!("{METRICS_DOC} has no `{TABLE_END}`"));
    format!("{}{table}{}", &doc[..start], &doc[end..])
}

/// Compares a generated file with what is on disk; with UPDATE_EXPECT set, writes it instead.
fn check_generated(rel: &str, want: &str) {
    let have = read(rel);
    if have == want {
        return;
    }
    if std::env::var_os("UPDATE_EXPECT").is_some() {
        std::fs::write(root().join(rel), want).unwrap();
        return;
    }
    panic!("{rel} is not what {RULES} generates; run `{REGENERATE}`. Expected:\n{want}");
}

#[test]
fn prometheus_rule_and_docs_table_are_generated_from_the_rules() {
    let rules = read(RULES);
    check_generated(PROMETHEUS_RULE, &prometheus_rule_from(&rules));
    check_generated(
        METRICS_DOC,
        &with_table(&read(METRICS_DOC), &alert_table(&alerts())),
    );
    // The generated manifest is a PrometheusRule carrying exactly the rule file.
    let pr: PrometheusRule = load(PROMETHEUS_RULE);
    assert_eq!(pr.api_version, "monitoring.coreos.com/v1");
    assert_eq!(pr.kind, "PrometheusRule");
    let k = kustomization_in("monitoring/");
    assert_eq!(k.resources, ["prometheusrule.yaml"]);
    assert_eq!(k.namespace, kustomization().namespace);
    let spec: serde_json::Value = load::<serde_json::Value>(PROMETHEUS_RULE)["spec"].clone();
    assert_eq!(spec, load::<serde_json::Value>(RULES));
    assert_eq!(pr.metadata.name.as_deref(), Some("node-agent"));
    let groups: Vec<&str> = pr.spec.groups.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(groups, ["node-agent"]);
}

#[test]
fn the_generators_follow_the_rules() {
    // Another `for` in the rules shows in the table, another expression in the manifest.
    let rules = read(RULES);
    let changed = rules.replacen("for: 10m", "for: 20m", 1);
    assert_ne!(changed, rules);
    assert_ne!(prometheus_rule_from(&changed), prometheus_rule_from(&rules));
    let mut a = alerts();
    let before = alert_table(&a);
    a[0].for_ = "20m".into();
    assert_ne!(alert_table(&a), before);
    assert!(alert_table(&a).contains("| 20m |"));
    let doc = read(METRICS_DOC);
    assert_ne!(with_table(&doc, "x"), doc);
}

#[test]
fn every_alert_has_a_severity_a_summary_and_a_why() {
    let alerts = alerts();
    assert!(!alerts.is_empty());
    let mut names = BTreeSet::new();
    for a in &alerts {
        assert!(names.insert(&a.alert), "{} twice", a.alert);
        assert!(a.alert.starts_with("NodeAgent"), "{}", a.alert);
        let severity = a.labels.get("severity").map(String::as_str);
        assert!(
            matches!(severity, Some("warning" | "critical")),
            "{}: severity {severity:?}",
            a.alert
        );
        let keys: Vec<&str> = a.annotations.keys().map(String::as_str).collect();
        assert_eq!(keys, ["description", "summary"], "{}", a.alert);
        assert!(
            a.annotations["summary"].contains("{{ $labels.instance }}"),
            "{}: the summary names the node",
            a.alert
        );
    }
}

/// The agent's metric names as exposed (`_total` on counters, `_bucket`, `_sum` and `_count` of
/// histograms), each family with one series so that labelled ones show too.
fn exposed_metrics() -> BTreeSet<String> {
    use node_agent::telemetry::metrics::{KindLabel, OpLabels, ResultLabel, StateLabel};
    let m = node_agent::telemetry::Metrics::default();
    drop(m.nodes.get_or_create(&StateLabel {
        state: "live".into(),
    }));
    drop(m.kernel_objects.get_or_create(&KindLabel {
        kind: "route".into(),
    }));
    drop(m.operations.get_or_create(&OpLabels {
        kind: "route".into(),
        op: "upsert".into(),
        result: "ok".into(),
    }));
    drop(m.checkpoint_writes.get_or_create(&ResultLabel {
        result: "ok".into(),
    }));
    drop(m.drift_repaired.get_or_create(&KindLabel {
        kind: "route".into(),
    }));
    families(&m.encode())
}

/// The sample names of the families in an exposition (`# TYPE` lines).
fn families(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
        match kind {
            "counter" => drop(out.insert(format!("{name}_total"))),
            "histogram" => {
                for s in ["bucket", "sum", "count"] {
                    out.insert(format!("{name}_{s}"));
                }
            }
            _ => drop(out.insert(name.to_owned())),
        }
    }
    out
}

/// The `node_agent_*` metric names in a PromQL expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| t.starts_with("node_agent_"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn alerts_read_metrics_the_agent_exposes() {
    let exposed = exposed_metrics();
    assert!(
        exposed.contains("node_agent_plan_operations_total"),
        "{exposed:?}"
    );
    assert!(exposed.contains("node_agent_reconcile_duration_seconds_bucket"));
    for a in alerts() {
        let names = metric_names(&a.expr);
        assert!(!names.is_empty(), "{} reads no node_agent_ metric", a.alert);
        for n in names {
            assert!(
                exposed.contains(&n),
                "{} reads {n}, which the agent does not expose (a labelled family must get a \
                 series in exposed_metrics()): {exposed:?}",
                a.alert
            );
        }
    }
    assert_eq!(
        metric_names("histogram_quantile(0.99, rate(node_agent_x_bucket{le=\"1\"}[5m])) > 5"),
        BTreeSet::from(["node_agent_x_bucket".to_string()])
    );
}

/// The test cases of rules_test.yaml, by group: the input series' metric names, and for each
/// alert name whether a check expects it to fire and whether one expects it quiet.
struct Cases {
    healthy_inputs: BTreeSet<String>,
    healthy_checks_alerts: bool,
    fires: BTreeSet<String>,
    quiet: BTreeSet<String>,
}

fn cases(text: &str) -> Cases {
    let v: serde_json::Value = serde_saphyr::from_str(text).unwrap();
    let rule_files: Vec<&str> = v["rule_files"]
        .as_array()
        .expect("rule_files")
        .iter()
        .filter_map(|f| f.as_str())
        .collect();
    assert_eq!(rule_files, ["rules.yaml"]);
    let mut c = Cases {
        healthy_inputs: BTreeSet::new(),
        healthy_checks_alerts: false,
        fires: BTreeSet::new(),
        quiet: BTreeSet::new(),
    };
    for group in v["tests"].as_array().expect("tests") {
        if group["name"].as_str() == Some("healthy agent") {
            for s in group["input_series"].as_array().unwrap() {
                let series = s["series"].as_str().unwrap();
                c.healthy_inputs
                    .insert(series.split('{').next().unwrap().to_owned());
            }
            // ALERTS empty at every check: nothing pending or firing.
            let checks = group["promql_expr_test"].as_array().unwrap();
            c.healthy_checks_alerts = checks.len() >= 2
                && checks.iter().all(|t| {
                    t["expr"].as_str() == Some("ALERTS")
                        && t["exp_samples"].as_array().is_some_and(|s| s.is_empty())
                });
            continue;
        }
        for t in group["alert_rule_test"].as_array().into_iter().flatten() {
            let name = t["alertname"].as_str().unwrap().to_owned();
            match t["exp_alerts"].as_array() {
                Some(e) if !e.is_empty() => c.fires.insert(name),
                _ => c.quiet.insert(name),
            };
        }
    }
    c
}

#[test]
fn every_alert_has_a_test_case_and_the_healthy_agent_covers_it() {
    let c = cases(&read(RULES_TEST));
    assert!(
        c.healthy_checks_alerts,
        "the `healthy agent` group must check that ALERTS stays empty"
    );
    for a in alerts() {
        assert!(
            c.fires.contains(&a.alert),
            "{RULES_TEST}: no case where {} fires",
            a.alert
        );
        assert!(
            c.quiet.contains(&a.alert),
            "{RULES_TEST}: no case where {} stays quiet (before its `for`)",
            a.alert
        );
        for n in metric_names(&a.expr) {
            assert!(
                c.healthy_inputs.contains(&n),
                "{RULES_TEST}: the healthy agent has no {n}, so it cannot show that {} stays \
                 quiet",
                a.alert
            );
        }
    }
}

/// `promtool ARGS` in `dir`: its success and output, or `None` (after a visible skip) when it
/// is not installed.
fn promtool(test: &str, dir: &Path, args: &[&str]) -> Option<(bool, String)> {
    if node_agent_tests::which("promtool").is_none() {
        node_agent_tests::skip(
            test,
            "needs promtool (Debian's `prometheus`; `cargo xtask test` installs it)",
        );
        return None;
    }
    let out = Command::new("promtool")
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap();
    Some((
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    const NAME: &str = "alert_rules_pass_promtool_check_and_their_unit_tests";
    let dir = root().join("deploy/monitoring");
    let Some((ok, out)) = promtool(NAME, &dir, &["check", "rules", "rules.yaml"]) else {
        return;
    };
    assert!(ok, "promtool check rules:\n{out}");
    let n = alerts().len();
    assert!(out.contains(&format!("SUCCESS: {n} rules found")), "{out}");
    let (ok, out) = promtool(NAME, &dir, &["test", "rules", "rules_test.yaml"]).unwrap();
    assert!(ok, "promtool test rules:\n{out}");
}

/// The unit tests have teeth: rules broken on purpose, in a copy, fail them.
#[test]
fn the_alert_unit_tests_fail_when_the_rules_break() {
    const NAME: &str = "the_alert_unit_tests_fail_when_the_rules_break";
    let rules = read(RULES);
    let broken = [
        // Fires too early.
        rules.replacen("for: 10m", "for: 1m", 1),
        // Fires on a healthy agent.
        rules.replace(
            "node_agent_node_map_fill_ratio > 0.8",
            "node_agent_node_map_fill_ratio > 0",
        ),
        // Never fires: a metric the agent does not have.
        rules.replace("node_agent_brake_held == 1", "node_agent_brake_hold == 1"),
        // Another summary.
        rules.replace("holds deletions\"", "holds deletions!\""),
    ];
    let dir = std::env::temp_dir().join(format!("node-agent-rules-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("rules_test.yaml"), read(RULES_TEST)).unwrap();
    for (i, b) in broken.iter().enumerate() {
        assert_ne!(b, &rules, "case {i} changed nothing");
        std::fs::write(dir.join("rules.yaml"), b).unwrap();
        let Some((ok, out)) = promtool(NAME, &dir, &["test", "rules", "rules_test.yaml"]) else {
            break;
        };
        assert!(!ok, "broken rules case {i} passed the unit tests:\n{out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// docs/metrics.md: the recorded `/metrics` output holds every family the agent exposes, and
/// the table of metrics lists each of them.
#[test]
fn the_metrics_doc_shows_every_metric_the_agent_exposes() {
    let doc = read(METRICS_DOC);
    let exposed = exposed_metrics();
    let recorded = doc
        .split("```text\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the recorded /metrics output");
    assert_eq!(
        families(recorded),
        exposed,
        "{METRICS_DOC}: the recorded output is not the agent's metrics; record it again"
    );
    let table: BTreeSet<String> = doc
        .split("## Every metric")
        .nth(1)
        .expect("## Every metric")
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect();
    let histograms: BTreeSet<String> = exposed
        .iter()
        .filter_map(|n| n.strip_suffix("_bucket"))
        .map(str::to_owned)
        .collect();
    let want: BTreeSet<String> = exposed
        .iter()
        .filter(|n| {
            !histograms
                .iter()
                .any(|h| n.starts_with(h.as_str()) && n.len() > h.len())
        })
        .cloned()
        .chain(histograms.iter().cloned())
        .collect();
    let table: BTreeSet<String> = table
        .into_iter()
        .filter(|n| n.starts_with("node_agent_"))
        .collect();
    assert_eq!(table, want, "{METRICS_DOC}: the table of metrics");
}

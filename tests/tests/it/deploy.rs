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
//!
//! | module | what |
//! | --- | --- |
//! | `manifests` | the kustomizations, the DaemonSet against the real CLI, RBAC, resources |
//! | `dockerfile` | the Dockerfile and .dockerignore against what xtask builds (`xtask::dockerfile`) |
//! | `alerts` | the alert rules, their tests (promtool) and the files generated from them (`xtask::alerts`) |

mod alerts;
mod dockerfile;
mod manifests;

use node_agent_tests::fixture::workspace_root;
use serde::Deserialize;

// ---------------------------------------------------------------------------------------------
// Loading

fn read(rel: &str) -> String {
    let path = workspace_root().join(rel);
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

/// The kustomization of `deploy/<dir>` (`dir` empty or ending in `/`).
fn kustomization_in(dir: &str) -> Kustomization {
    let k: Kustomization = load(&format!("deploy/{dir}kustomization.yaml"));
    assert_eq!(k.api_version, "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k.kind, "Kustomization");
    k
}

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

//! The alerts in `deploy/monitoring/`: `promtool check rules` and `promtool test rules`, the
//! metrics they read, and the PrometheusRule and the docs' alert table, which are generated from
//! them (`xtask::alerts`).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use node_agent_tests::fixture::workspace_root;
use serde::Deserialize;
use xtask::alerts::{
    AlertRule, METRICS_DOC, PROMETHEUS_RULE, REGENERATE, RULES, RULES_TEST, RuleFile, alert_table,
    prometheus_rule_from, with_table,
};

use super::{kustomization, kustomization_in, load, read};

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

/// Compares a generated file with what is on disk; with UPDATE_EXPECT set, writes it instead.
fn check_generated(rel: &str, want: &str) {
    let have = read(rel);
    if have == want {
        return;
    }
    if std::env::var_os("UPDATE_EXPECT").is_some() {
        std::fs::write(workspace_root().join(rel), want).unwrap();
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
    Some((out.status.success(), node_agent_tests::output_text(&out)))
}

#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let name = node_agent_tests::test_name!();
    let dir = workspace_root().join("deploy/monitoring");
    let Some((ok, out)) = promtool(name, &dir, &["check", "rules", "rules.yaml"]) else {
        return;
    };
    assert!(ok, "promtool check rules:\n{out}");
    let n = alerts().len();
    assert!(out.contains(&format!("SUCCESS: {n} rules found")), "{out}");
    let (ok, out) = promtool(name, &dir, &["test", "rules", "rules_test.yaml"]).unwrap();
    assert!(ok, "promtool test rules:\n{out}");
}

/// The unit tests have teeth: rules broken on purpose, in a copy, fail them.
#[test]
fn the_alert_unit_tests_fail_when_the_rules_break() {
    let name = node_agent_tests::test_name!();
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
        let Some((ok, out)) = promtool(name, &dir, &["test", "rules", "rules_test.yaml"]) else {
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

//! The files generated from the alert rules (`deploy/monitoring/rules.yaml`): the
//! PrometheusRule manifest and the alert table of `docs/metrics.md`. Pure text in, text out: the
//! deploy tests compare the results with the files on disk (and write them with
//! `UPDATE_EXPECT=1`), so a generator and its check cannot drift apart.

use std::collections::BTreeMap;

use serde::Deserialize;

pub const RULES: &str = "deploy/monitoring/rules.yaml";
pub const RULES_TEST: &str = "deploy/monitoring/rules_test.yaml";
pub const PROMETHEUS_RULE: &str = "deploy/monitoring/prometheusrule.yaml";
pub const METRICS_DOC: &str = "docs/metrics.md";
/// How the generated files are regenerated (the expect-test convention).
pub const REGENERATE: &str = "UPDATE_EXPECT=1 cargo test -p node-agent-tests --test deploy";

/// A Prometheus rule file (`rule_files:`), alerting rules only.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleFile {
    pub groups: Vec<RuleGroup>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleGroup {
    pub name: String,
    pub rules: Vec<AlertRule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlertRule {
    pub alert: String,
    pub expr: String,
    #[serde(rename = "for")]
    pub for_: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

/// prometheusrule.yaml as generated from the text of rules.yaml: a fixed head, then the rule
/// file (its comments included) as the spec.
pub fn prometheus_rule_from(rules: &str) -> String {
    let body = rules
        .lines()
        .skip_while(|l| l.starts_with('#') || l.trim().is_empty());
    // The head names the test that checks and writes the file: that is where an operator who
    // edited the rules is sent.
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

pub const TABLE_START: &str = "<!-- The table is generated from deploy/monitoring/rules.yaml by \
                               tests/tests/it/deploy.rs; edit the rules, not the table. -->";
pub const TABLE_END: &str = "<!-- End of the generated table. -->";

/// The alert table of docs/metrics.md, from the rules.
pub fn alert_table(alerts: &[AlertRule]) -> String {
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

/// `doc` with its generated table replaced by `table`; panics naming the marker it lacks.
pub fn with_table(doc: &str, table: &str) -> String {
    let start = doc
        .find(TABLE_START)
        .unwrap_or_else(|| panic!("{METRICS_DOC} has no `{TABLE_START}`"));
    let end = doc[start..]
        .find(TABLE_END)
        .map(|e| start + e + TABLE_END.len())
        .unwrap_or_else(|| panic!("{METRICS_DOC} has no `{TABLE_END}`"));
    format!("{}{table}{}", &doc[..start], &doc[end..])
}

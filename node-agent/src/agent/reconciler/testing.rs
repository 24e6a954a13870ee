//! What the reconciler's tests share: a reconciler over the fake kernel, synced on a few nodes.

use std::sync::Arc;
use std::time::Duration;

use state::checkpoint::Checkpoint;
use state::objects::ObjectKind;

pub use super::Reconciler;
pub use crate::agent::config::AgentConfig;
pub use crate::kernel::fake::FakeKernel;
use crate::source::SourceEvent;
use crate::telemetry::Telemetry;

pub use state::testing::raw;

pub fn config() -> AgentConfig {
    AgentConfig::new("local", "/nonexistent-state", "/nonexistent-bpffs")
}

pub fn reconciler(nodes: &[(&str, u8)]) -> Reconciler<FakeKernel> {
    reconciler_with(config(), FakeKernel::default(), nodes)
}

/// A reconciler over `kernel`, synced on the local node and `nodes` (`10.0.0.<i>`,
/// `10.1.<i>.0/24`).
pub fn reconciler_with(
    config: AgentConfig,
    kernel: FakeKernel,
    nodes: &[(&str, u8)],
) -> Reconciler<FakeKernel> {
    restarted(config, None, kernel, nodes)
}

/// A reconciler restarted from `record` over `kernel`, synced on the local node and `nodes`.
pub fn restarted(
    config: AgentConfig,
    record: Option<Checkpoint>,
    kernel: FakeKernel,
    nodes: &[(&str, u8)],
) -> Reconciler<FakeKernel> {
    let telemetry = Arc::new(Telemetry::new(Duration::MAX));
    let mut rec = Reconciler::new(config, record, kernel, telemetry);
    relist(&mut rec, nodes);
    rec
}

/// A full list of the local node and `nodes` (`10.0.0.<i>`, `10.1.<i>.0/24`): whether a
/// reconcile is due.
pub fn relist(rec: &mut Reconciler<FakeKernel>, nodes: &[(&str, u8)]) -> bool {
    rec.on_event(SourceEvent::Init);
    rec.on_event(SourceEvent::InitApply(raw(
        "local",
        &["10.0.0.100"],
        &["10.1.100.0/24"],
    )));
    for (n, i) in nodes {
        rec.on_event(SourceEvent::InitApply(raw(
            n,
            &[&format!("10.0.0.{i}")],
            &[&format!("10.1.{i}.0/24")],
        )));
    }
    rec.on_event(SourceEvent::InitDone)
}

/// Ten nodes, `n01` to `n10`, numbered 1 to 10.
pub fn ten() -> Vec<(&'static str, u8)> {
    const NAMES: [&str; 10] = [
        "n01", "n02", "n03", "n04", "n05", "n06", "n07", "n08", "n09", "n10",
    ];
    NAMES.into_iter().zip(1..).collect()
}

pub fn metric(rec: &Reconciler<FakeKernel>, series: &str) -> Option<f64> {
    let text = rec.telemetry.metrics.encode();
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

pub fn count(rec: &mut Reconciler<FakeKernel>, kind: ObjectKind) -> usize {
    rec.kernel()
        .ours
        .values()
        .filter(|o| o.kind() == kind)
        .count()
}

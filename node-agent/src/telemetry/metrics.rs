//! The Prometheus metrics, all prefixed `node_agent_`. `docs/metrics.md` lists each one and what to alert on.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// `live` or `pending_delete`.
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// `map_entry`, `route`, `xfrm_state`, `xfrm_policy` ([`state::objects::ObjectKind::name`]).
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub kind: String,
    /// `upsert` (a create or an in-place replace) or `delete`.
    pub op: String,
    /// `ok` or `error`.
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct XfrmStatLabel {
    /// The kernel's name of the counter, e.g. `XfrmOutPolBlock`.
    name: String,
}

/// The kernel's xfrm counters, read from `/proc/net/xfrm_stat` at each scrape
/// (`node_agent_xfrm_stat_total{name=...}`). Nothing is exported where the kernel keeps none.
#[derive(Debug)]
struct XfrmStatCollector;

impl Collector for XfrmStatCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(Some(stats)) = crate::backends::xfrm::stats::read() else {
            return Ok(());
        };
        let counter = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "xfrm_stat",
            "The kernel's xfrm counters (/proc/net/xfrm_stat), by the kernel's name: XfrmOutPolBlock counts packets marked for encryption that the block guard dropped",
            None,
            counter.metric_type(),
        )?;
        for (name, value) in stats {
            let label = XfrmStatLabel { name };
            ConstCounter::new(value).encode(family.encode_family(&label)?)?;
        }
        Ok(())
    }
}

#[derive(Debug)]
pub struct Metrics {
    pub registry: Registry,
    pub nodes: Family<StateLabel, Gauge>,
    pub kernel_objects: Family<KindLabel, Gauge>,
    pub operations: Family<OpLabels, Counter>,
    pub reconcile_duration: Histogram,
    pub brake_held: Gauge,
    pub brake_held_nodes: Gauge,
    pub local_node_missing: Gauge,
    pub conflicts: Gauge,
    pub id_exhausted: Gauge,
    pub id_reuses: Family<KindLabel, Counter>,
    pub checkpoint_writes: Family<ResultLabel, Counter>,
    pub checkpoint_stale_seconds: Gauge<f64, AtomicU64>,
    pub drift_repaired: Family<KindLabel, Counter>,
    pub source_failing: Gauge,
    pub source_synced: Gauge,
    pub source_revision: Gauge,
    pub source_relists: Counter,
    pub source_errors: Counter,
    pub node_input_errors: Gauge,
    pub node_map_fill_ratio: Gauge<f64, AtomicU64>,
    pub ipsec_send_spi: Gauge,
    pub ipsec_send_per_sender_spi: Gauge,
    pub ipsec_keys_in_use: Gauge,
    pub ipsec_key_file_error: Gauge,
}

impl Default for Metrics {
    /// Every metric registered, one call each, in the order of the exposition: long, but one list
    /// to read against the table of docs/metrics.md; split, it would only be scattered.
    fn default() -> Self {
        let mut registry = Registry::with_prefix("node_agent");
        let m = Self {
            nodes: Family::default(),
            kernel_objects: Family::default(),
            operations: Family::default(),
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            brake_held: Gauge::default(),
            brake_held_nodes: Gauge::default(),
            local_node_missing: Gauge::default(),
            conflicts: Gauge::default(),
            id_exhausted: Gauge::default(),
            id_reuses: Family::default(),
            checkpoint_writes: Family::default(),
            checkpoint_stale_seconds: Gauge::default(),
            drift_repaired: Family::default(),
            source_failing: Gauge::default(),
            source_synced: Gauge::default(),
            source_revision: Gauge::default(),
            source_relists: Counter::default(),
            source_errors: Counter::default(),
            node_input_errors: Gauge::default(),
            node_map_fill_ratio: Gauge::default(),
            ipsec_send_spi: Gauge::default(),
            ipsec_send_per_sender_spi: Gauge::default(),
            ipsec_keys_in_use: Gauge::default(),
            ipsec_key_file_error: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register(
            "nodes",
            "Remote nodes by state (live, pending_delete)",
            m.nodes.clone(),
        );
        registry.register(
            "kernel_objects",
            "Objects of ours in the kernel by kind, at the last dump",
            m.kernel_objects.clone(),
        );
        registry.register(
            "plan_operations",
            "Kernel operations applied, by kind, op and result",
            m.operations.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time of one reconcile: dump, plan, apply",
            m.reconcile_duration.clone(),
        );
        registry.register(
            "brake_held",
            "1 while the mass-deletion brake holds removals (not for a list without the local node)",
            m.brake_held.clone(),
        );
        registry.register(
            "brake_held_nodes",
            "Known remote nodes whose removal the brake holds",
            m.brake_held_nodes.clone(),
        );
        registry.register(
            "local_node_missing",
            "1 while the node list lacks the local node: no view of this cluster, nothing changes",
            m.local_node_missing.clone(),
        );
        registry.register(
            "conflicts",
            "Conflicts at the last plan: nodes held over an address or pod CIDR another node keeps, and objects not written over a foreign object",
            m.conflicts.clone(),
        );
        registry.register(
            "node_ids_exhausted",
            "Nodes held because no node ID is free (all in use or cooling down)",
            m.id_exhausted.clone(),
        );
        registry.register(
            "node_id_reuses",
            "Freed node IDs handed out again, by kind: cooled (after the cool-down) or early (past the floor, every ID in use or cooling)",
            m.id_reuses.clone(),
        );
        registry.register(
            "checkpoint_writes",
            "Checkpoint writes by result (ok, error)",
            m.checkpoint_writes.clone(),
        );
        registry.register(
            "checkpoint_stale_seconds",
            "How long the record has had changes the checkpoint file lacks (0 when written)",
            m.checkpoint_stale_seconds.clone(),
        );
        registry.register(
            "drift_repaired",
            "Objects of ours found changed or missing in the kernel by a resync and repaired, by kind",
            m.drift_repaired.clone(),
        );
        registry.register(
            "source_failing",
            "1 while the node source fails after its last success (API errors, unreachable)",
            m.source_failing.clone(),
        );
        registry.register(
            "source_synced",
            "1 once the node source completed its first full list",
            m.source_synced.clone(),
        );
        registry.register(
            "source_revision",
            "The newest Kubernetes resourceVersion the kernel reflects: planned from by the last finished reconcile, or taken in with nothing to change while no reconcile waits (0 until then; where the API server's versions are numbers)",
            m.source_revision.clone(),
        );
        registry.register(
            "source_relists",
            "Full lists completed by the node source",
            m.source_relists.clone(),
        );
        registry.register(
            "source_errors",
            "Errors reported by the node source (API errors, parse errors)",
            m.source_errors.clone(),
        );
        registry.register(
            "node_input_errors",
            "Nodes skipped or held for malformed input, a full map or no free ID (conflicts are node_agent_conflicts)",
            m.node_input_errors.clone(),
        );
        registry.register(
            "node_map_fill_ratio",
            "Entries in the node-ID map over its capacity",
            m.node_map_fill_ratio.clone(),
        );
        registry.register(
            "ipsec_send_spi",
            "The SPI this node sends with (0 without IPsec)",
            m.ipsec_send_spi.clone(),
        );
        registry.register(
            "ipsec_send_per_sender_spi",
            "1 while this node sends with a key of the per-sender SPI layout, 0 in the key layout or without IPsec",
            m.ipsec_send_per_sender_spi.clone(),
        );
        registry.register(
            "ipsec_keys_in_use",
            "IPsec keys with states: 1, or 2 (more if rotations overlap) while a rotation is under way",
            m.ipsec_keys_in_use.clone(),
        );
        registry.register(
            "ipsec_key_file_error",
            "1 while the IPsec key file as it is now cannot be used (the keys read before stay in use)",
            m.ipsec_key_file_error.clone(),
        );
        registry.register_collector(Box::new(XfrmStatCollector));
        // Every kind shows from the start, so a rate over it is defined before the first repair.
        for kind in state::objects::ObjectKind::ALL {
            drop(m.drift_repaired.get_or_create(&KindLabel {
                kind: kind.name().into(),
            }));
        }
        for kind in ["cooled", "early"] {
            drop(m.id_reuses.get_or_create(&KindLabel { kind: kind.into() }));
        }
        Self { registry, ..m }
    }
}

impl Metrics {
    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

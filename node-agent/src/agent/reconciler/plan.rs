//! Planning: a full plan of the whole cluster, or an event-sized one of the few nodes a source
//! event changed, where one will do.

use std::collections::BTreeSet;
use std::time::Duration;

use state::inventory::Inventory;
use state::node::AddressKind;
use state::plan::{ClaimIndex, LiveView, Plan, PlanConfig, PlanInput};

use super::Reconciler;
use crate::kernel::Kernel;

/// What event-sized plans need of the last plan.
#[derive(Default)]
pub(super) struct EventPlans {
    /// Which records claim what, for event-sized plans: built from a steady record, kept
    /// across their splices, dropped when a full plan replaces the record.
    pub claims: Option<ClaimIndex>,
    /// The last plan was steady ([`Plan::steady`]) and applied without a failure, with this
    /// configuration, leaving these nodes unsettled: a change to a few nodes under the same
    /// configuration may be planned event-sized, with the unsettled nodes beside it.
    steady: Option<Steady>,
}

/// What the last steady plan left: its configuration and its unsettled nodes.
struct Steady {
    config: PlanConfig,
    unsettled: Vec<String>,
}

impl EventPlans {
    /// After the apply of `plan`, made under `config`: whether the next event may be planned
    /// event-sized (the plan was steady, and applied without a failure, `clean`).
    pub(super) fn after(&mut self, plan: &Plan, config: PlanConfig, clean: bool) {
        self.steady = match &plan.steady {
            Some(unsettled) if clean => Some(Steady {
                config,
                unsettled: unsettled.clone(),
            }),
            _ => None,
        };
    }
}

impl<K: Kernel> Reconciler<K> {
    /// The planner's configuration with what the live view says of the local node, and what
    /// the host held at the last dump.
    pub(super) fn plan_config(&self) -> PlanConfig {
        let mut config = self.plan_config.clone();
        config.host = self.host.clone();
        config.local_boot_id = self
            .live
            .get(&self.config.node_name)
            .map_or_else(String::new, |n| n.boot_id.to_string());
        let local = self.live.get(&self.config.node_name);
        config.local_addresses = local.map_or_else(Vec::new, |n| {
            n.addresses
                .iter()
                .filter(|a| a.kind == AddressKind::InternalIP)
                .map(|a| a.ip)
                .collect()
        });
        config.local_pod_cidrs = local.map_or_else(Vec::new, |n| n.pod_cidrs.to_vec());
        config
    }

    fn input<'a>(
        &'a self,
        live: &'a LiveView,
        inventory: &'a Inventory,
        now: Duration,
        config: &'a PlanConfig,
    ) -> PlanInput<'a> {
        PlanInput {
            record: self.books.record.as_ref(),
            live,
            inventory,
            allocator: &self.books.ids,
            brake: &self.brake.memory,
            confirmed_hold: self.brake.confirmed.as_deref(),
            now,
            config,
        }
    }

    /// The plan of a reconcile: event-sized for the nodes `names` a source event changed where
    /// one will do ([`Self::plan_event`]), else a full one.
    pub(super) fn plan_for(
        &mut self,
        names: Option<&BTreeSet<String>>,
        inventory: &Inventory,
        now: Duration,
        config: &PlanConfig,
    ) -> Plan {
        match names.and_then(|n| self.plan_event(n, inventory, now, config)) {
            Some(plan) => plan,
            None => self.make_plan(inventory, now, config),
        }
    }

    /// A full plan.
    pub(super) fn make_plan(
        &mut self,
        inventory: &Inventory,
        now: Duration,
        config: &PlanConfig,
    ) -> Plan {
        // The record this plan implies replaces the indexed one; at scale the index would add
        // to the full plan's peak memory.
        self.events.claims = None;
        let view = self.live.view();
        state::plan::plan(&self.input(&view, inventory, now, config))
    }

    /// The event-sized plan for a change to the nodes `names`, where one will do: the last plan
    /// was steady under the same configuration, the view is the one it left, and the change
    /// with the nodes that plan left unsettled is small next to the cluster (a large one costs
    /// a full plan's work anyway).
    fn plan_event(
        &mut self,
        names: &BTreeSet<String>,
        inventory: &Inventory,
        now: Duration,
        config: &PlanConfig,
    ) -> Option<Plan> {
        let steady = self
            .events
            .steady
            .as_ref()
            .filter(|s| s.config == *config)?;
        let mut touched = names.clone();
        touched.extend(steady.unsettled.iter().cloned());
        let known = self.books.record.as_ref().map_or(0, |r| r.nodes.len());
        if touched.len() > (known / 8).max(16) {
            return None;
        }
        self.prepare_event_plans();
        let index = self.events.claims.as_ref()?;
        let view = self.live.view_of(&touched);
        state::plan::plan_scoped(&self.input(&view, inventory, now, config), index, &touched)
    }

    /// Builds what event-sized plans need of a steady record, if it is not there yet: the
    /// daemon calls this after each reconcile, so that building it after a full plan (tens of
    /// milliseconds at 65,000 nodes) is not part of the next event's latency.
    pub fn prepare_event_plans(&mut self) {
        if self.events.steady.is_some() && self.events.claims.is_none() {
            self.events.claims = self.books.record.as_ref().map(ClaimIndex::of);
        }
    }
}

#[cfg(test)]
mod tests {
    use state::objects::ObjectKind;
    use state::plan::{ClaimIndex, HostAddresses, OnLink};

    use super::super::testing::*;
    use crate::source::SourceEvent;

    #[tokio::test(flavor = "current_thread")]
    async fn after_a_settled_reconcile_an_event_is_planned_event_sized_and_the_record_follows() {
        let mut rec = reconciler(&[("a", 1), ("b", 2)]);
        let first = rec.reconcile().await.unwrap();
        assert!(first.plan.scope.is_none() && first.plan.settled);
        rec.on_event(SourceEvent::Apply(raw(
            "c",
            &["10.0.0.3"],
            &["10.1.3.0/24"],
        )));
        let out = rec.reconcile_event().await.unwrap();
        assert_eq!(out.plan.scope.as_deref(), Some(&["c".to_string()][..]));
        assert!(out.record_changed);
        // A conflict with an untouched node brings that node into the plan, and is reported.
        rec.on_event(SourceEvent::Apply(raw(
            "d",
            &["10.0.0.4"],
            &["10.1.1.0/24"],
        )));
        let out = rec.reconcile_event().await.unwrap();
        let scope = out.plan.scope.clone().expect("event-sized");
        assert_eq!(scope, ["d", "a"]);
        assert_eq!(out.plan.errors.len(), 1, "{:?}", out.plan.errors);
        assert!(!out.plan.settled);
        assert_eq!(out.plan.steady, Some(vec!["d".to_string()]));
        // With the conflict standing, the next event is planned event-sized with the held node
        // (and what it conflicts with) beside it: the conflict is reported again.
        rec.on_event(SourceEvent::Apply(raw(
            "e",
            &["10.0.0.5"],
            &["10.1.5.0/24"],
        )));
        let out = rec.reconcile_event().await.unwrap();
        let scope = out.plan.scope.clone().expect("event-sized");
        assert_eq!(scope, ["d", "e", "a"]);
        assert_eq!(out.plan.errors.len(), 1, "{:?}", out.plan.errors);
        let names: Vec<&str> = rec
            .record()
            .unwrap()
            .nodes
            .iter()
            .map(|n| n.name.as_str())
            .collect();
        assert_eq!(names, ["a", "b", "c", "e"], "d is held and has no record");
        // The record the event-sized plans left is the one a full plan makes.
        let full = rec.plan().await.unwrap();
        assert!(full.is_empty());
        assert!(rec.record().unwrap().same_content(&full.checkpoint));
        assert_eq!(count(&mut rec, ObjectKind::Route), 4);
    }

    /// What the host holds is read with every dump and kept for event-sized plans: a node on a
    /// host address, or with a pod CIDR over the host's link, is held in either.
    #[tokio::test(flavor = "current_thread")]
    async fn the_hosts_addresses_and_links_are_read_with_each_dump_and_kept_for_events() {
        let kernel = FakeKernel {
            host: HostAddresses {
                addresses: vec!["10.0.0.100".parse().unwrap(), "10.0.0.50".parse().unwrap()],
                on_link: vec![OnLink {
                    prefix: "10.0.0.0/24".parse().unwrap(),
                    device: "gw0".into(),
                }],
            },
            ..FakeKernel::default()
        };
        let mut rec = reconciler_with(config(), kernel, &[("a", 1), ("b", 2)]);
        let first = rec.reconcile().await.unwrap();
        assert!(first.plan.errors.is_empty(), "{:?}", first.plan.errors);
        assert_eq!(rec.kernel().host_reads, 1);
        rec.on_event(SourceEvent::Apply(raw(
            "c",
            &["10.0.0.50"],
            &["10.1.3.0/24"],
        )));
        let out = rec.reconcile_event().await.unwrap();
        assert!(out.plan.scope.is_some(), "event-sized");
        let text: Vec<String> = out.plan.errors.iter().map(ToString::to_string).collect();
        assert!(
            matches!(&text[..], [t] if t.starts_with("node c: address 10.0.0.50 belongs to the local node")),
            "{text:?}"
        );
        rec.on_event(SourceEvent::Apply(raw(
            "d",
            &["10.0.0.4"],
            &["10.0.0.128/25"],
        )));
        let out = rec.reconcile_event().await.unwrap();
        let text: Vec<String> = out.plan.errors.iter().map(ToString::to_string).collect();
        assert!(
            text.iter().any(|t| t.starts_with(
                "node d: pod CIDR 10.0.0.128/25 overlaps the host's on-link prefix 10.0.0.0/24 on gw0"
            )),
            "{text:?}"
        );
        assert_eq!(rec.kernel().host_reads, 1, "no dump, no read");
        assert_eq!(count(&mut rec, ObjectKind::Route), 2, "a's and b's only");
        assert_eq!(count(&mut rec, ObjectKind::MapEntry), 2);
        // The host lets go of the address: the next dump reads it so, and c is programmed.
        rec.kernel().host.addresses.pop();
        let out = rec.reconcile().await.unwrap();
        assert_eq!(rec.kernel().host_reads, 2);
        assert_eq!(out.plan.errors.len(), 1, "d only: {:?}", out.plan.errors);
        assert_eq!(count(&mut rec, ObjectKind::Route), 3);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_claim_index_follows_the_record_across_event_sized_plans_and_goes_with_a_full_one()
    {
        // Through nexthops, a readdressed node's routes stay as they are: its event stays
        // event-sized.
        let kernel = FakeKernel {
            nexthops: true,
            ..FakeKernel::default()
        };
        let mut rec = reconciler_with(config(), kernel, &[("a", 1), ("b", 2), ("c", 3)]);
        rec.reconcile().await.unwrap();
        assert!(
            rec.events.claims.is_none(),
            "built when an event needs it, or by the daemon"
        );
        rec.prepare_event_plans();
        let events = [
            SourceEvent::Apply(raw("d", &["10.0.0.4"], &["10.1.4.0/24"])),
            SourceEvent::Apply(raw("b", &["10.0.0.12"], &["10.1.2.0/24"])),
            SourceEvent::Delete("a".into()),
        ];
        for ev in events {
            rec.on_event(ev);
            let out = rec.reconcile_event().await.unwrap();
            assert!(out.plan.scope.is_some() && out.plan.settled);
            let record = rec.record().unwrap();
            assert_eq!(rec.events.claims.as_ref(), Some(&ClaimIndex::of(record)));
        }
        rec.reconcile().await.unwrap();
        assert!(
            rec.events.claims.is_none(),
            "a full plan replaced the record"
        );
    }
}

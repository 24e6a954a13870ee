//! Where the IPsec key rotation stands: the keys the next plan writes states for, the one it
//! sends with, and when the rotation moves on by itself.

use std::time::Duration;

use state::objects::SpiLayout;
use state::rotation::rotation;

use super::Reconciler;
use crate::kernel::Kernel;
use crate::telemetry::reconcile::RECONCILER;

/// What the last plan made of the IPsec key file.
pub(super) struct KeysUsed {
    digest: [u8; 32],
    /// The file as it was then could not be used.
    unusable: bool,
    /// Since the Unix epoch.
    next_change: Option<Duration>,
    /// The abrupt switch was already reported for this file.
    abrupt_reported: bool,
    /// The SPI sent with and the SPIs with states: a change is a step of a rotation, logged.
    spis: (u8, Vec<u8>),
    /// The SPI layout of each key with states: one that changes under the same SPI is logged.
    layouts: Vec<(u8, SpiLayout)>,
}

impl<K: Kernel> Reconciler<K> {
    /// Reads the IPsec keys again and works out where the rotation stands at `now`: the keys
    /// the next plan writes states for, and the one it sends with. Before a plan of the whole
    /// cluster (`full`), the key book may forget derived keys no plan asks for any more; an
    /// event-sized plan asks for a few pairs only, so it leaves the book as it is.
    pub(super) fn refresh_ipsec(&mut self, now: Duration, full: bool) {
        let Some(read) = self.kernel.ipsec_keys() else {
            self.plan_config.ipsec = None;
            return;
        };
        self.telemetry.set_key_file_error(read.error.clone());
        let seen = self
            .books
            .record
            .as_ref()
            .map_or(&[][..], |c| &c.ipsec_keys[..]);
        if full {
            read.tags.plan_begins();
        }
        let r = rotation(&read.keys, seen, now, self.config.key_delays, read.tags);
        let same_file = self.keys.as_ref().is_some_and(|k| k.digest == read.digest);
        let reported = same_file && self.keys.as_ref().is_some_and(|k| k.abrupt_reported);
        if r.abrupt && !reported {
            tracing::warn!(
                target: RECONCILER,
                spi = r.ipsec.send_spi,
                "none of the IPsec keys in the key file was seen before: the key this node sent \
                 with is gone from the file, so it sends with the newest key at once, and nodes \
                 that have not read the new file yet drop its traffic until they do. Rotate by \
                 appending the new key and keeping the old line until the rotation completes"
            );
        }
        let spis = (
            r.ipsec.send_spi,
            r.ipsec.keys.iter().map(|k| k.spi).collect::<Vec<_>>(),
        );
        if self.keys.as_ref().is_none_or(|k| k.spis != spis) {
            tracing::info!(
                target: RECONCILER,
                send_spi = spis.0,
                keys = ?spis.1,
                next_step_s = r.next_change.map(|t| t.saturating_sub(now).as_secs_f32()),
                "IPsec keys: sending with SPI {}, states for {:?}",
                spis.0,
                spis.1
            );
        }
        let layouts: Vec<(u8, SpiLayout)> =
            r.ipsec.keys.iter().map(|k| (k.spi, k.layout)).collect();
        let before = self.keys.as_ref().map_or(&[][..], |k| &k.layouts[..]);
        for (spi, layout) in &layouts {
            if let Some((_, was)) = before.iter().find(|(s, l)| s == spi && l != layout) {
                tracing::warn!(
                    target: RECONCILER,
                    spi,
                    "the SPI layout of IPsec key {spi} changed from {} to {} in place: each node \
                     switches as it reads the key file, and until every node has, they drop each \
                     other's traffic. Switch layouts with a new key (docs/ipsec.md)",
                    was.name(),
                    layout.name()
                );
            }
        }
        self.telemetry.record_keys(&r.ipsec);
        self.keys = Some(KeysUsed {
            layouts,
            digest: read.digest,
            unusable: read.error.is_some(),
            next_change: r.next_change,
            abrupt_reported: r.abrupt || reported,
            spis,
        });
        self.plan_config.ipsec = Some(r.ipsec);
    }

    /// Whether the IPsec key file changed since the last plan (read again now): new keys, or
    /// a file that became unusable or usable again (readiness says so at the next reconcile).
    pub fn keys_changed(&mut self) -> bool {
        let now = self
            .kernel
            .ipsec_keys()
            .map(|r| (r.digest, r.error.is_some()));
        now != self.keys.as_ref().map(|k| (k.digest, k.unusable))
    }

    /// When the IPsec key rotation moves on by itself (since the Unix epoch), if it will.
    pub fn next_rotation_change(&self) -> Option<Duration> {
        self.keys.as_ref().and_then(|k| k.next_change)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::Arc;
    use std::time::Duration;

    use state::objects::{KernelObject, ObjectKind, SpiLayout};

    use super::super::testing::*;

    fn keys(spis: &[u8], digest: u8) -> crate::kernel::KeyRead {
        crate::kernel::KeyRead {
            keys: spis
                .iter()
                .map(|spi| state::rotation::FileKey {
                    spi: *spi,
                    tag: state::objects::KeyTag(u64::from(*spi)),
                    layout: state::objects::SpiLayout::Key,
                })
                .collect(),
            digest: [digest; 32],
            error: None,
            tags: Arc::new(state::plan::GlobalTags),
        }
    }

    fn sent_with(rec: &mut Reconciler<FakeKernel>) -> Vec<u8> {
        let mut spis: Vec<u8> = rec
            .kernel()
            .ours
            .values()
            .filter_map(|o| match o {
                KernelObject::PodCidrEntry(e) => Some(e.spi),
                _ => None,
            })
            .collect();
        spis.dedup();
        spis
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_appended_key_gets_states_at_once_and_a_replaced_file_switches_at_once() {
        let mut rec = reconciler(&[("a", 1), ("b", 2)]);
        rec.kernel().keys = Some(keys(&[3], 1));
        rec.reconcile().await.unwrap();
        assert_eq!(
            count(&mut rec, ObjectKind::XfrmState),
            4,
            "2 nodes, in and out"
        );
        assert_eq!(count(&mut rec, ObjectKind::PodCidrEntry), 2);
        assert_eq!(count(&mut rec, ObjectKind::XfrmGuard), 2, "IPv4 only");
        assert_eq!(sent_with(&mut rec), [3]);
        let seen = rec.record().unwrap().ipsec_keys.clone();
        assert_eq!(seen.iter().map(|k| k.spi).collect::<Vec<_>>(), [3]);
        assert_eq!(metric(&rec, "node_agent_ipsec_send_spi"), Some(3.0));

        // A line appended: the daemon's poll sees the change; both keys get states, the
        // traffic stays on 3 until the propagation delay has passed.
        rec.kernel().keys = Some(keys(&[3, 4], 2));
        assert!(rec.keys_changed());
        rec.reconcile().await.unwrap();
        assert_eq!(count(&mut rec, ObjectKind::XfrmState), 8);
        assert_eq!(sent_with(&mut rec), [3]);
        assert_eq!(metric(&rec, "node_agent_ipsec_keys_in_use"), Some(2.0));
        let next = rec.next_rotation_change().unwrap();
        let in_90s = rec.now() + Duration::from_secs(90);
        assert!(
            next <= in_90s && next + Duration::from_secs(5) > in_90s,
            "{next:?}"
        );
        assert!(!rec.keys_changed(), "nothing new in the file");

        // The file replaced by one new key: nothing to wait for, the old key is unusable.
        rec.kernel().keys = Some(keys(&[5], 3));
        rec.reconcile().await.unwrap();
        assert_eq!(sent_with(&mut rec), [5]);
        assert_eq!(count(&mut rec, ObjectKind::XfrmState), 4);
        assert_eq!(rec.next_rotation_change(), None);
    }

    /// `per-sender-spi` added to an existing line takes effect at once (there is no record of
    /// a key's layout to rotate from): what docs/ipsec.md warns against, and the agent logs.
    #[tokio::test(flavor = "current_thread")]
    async fn a_layout_changed_in_place_rewrites_the_keys_states_at_once() {
        let mut rec = reconciler(&[("a", 1)]);
        rec.kernel().keys = Some(keys(&[3], 1));
        rec.reconcile().await.unwrap();
        let layouts = |rec: &mut Reconciler<FakeKernel>| {
            let mut l: Vec<_> = rec
                .kernel()
                .ours
                .values()
                .filter_map(|o| match o {
                    KernelObject::XfrmState(s) => Some((s.spi.key(), s.spi.layout())),
                    _ => None,
                })
                .collect();
            l.dedup();
            l
        };
        assert_eq!(layouts(&mut rec), [(3, SpiLayout::Key)]);
        let mut per_sender = keys(&[3], 2);
        per_sender.keys[0].layout = SpiLayout::PerSender;
        rec.kernel().keys = Some(per_sender);
        rec.reconcile().await.unwrap();
        assert_eq!(layouts(&mut rec), [(3, SpiLayout::PerSender)]);
        assert_eq!(
            count(&mut rec, ObjectKind::XfrmState),
            2,
            "replaced, not added"
        );
        assert_eq!(
            metric(&rec, "node_agent_ipsec_send_per_sender_spi"),
            Some(1.0)
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_unusable_key_file_keeps_the_keys_and_says_so_in_readiness() {
        let mut rec = reconciler(&[("a", 1)]);
        rec.kernel().keys = Some(keys(&[3], 1));
        rec.reconcile().await.unwrap();
        let mut bad = keys(&[3], 1);
        bad.error = Some("IPsec key file /k line 2: SPI must be a decimal number 1..=15".into());
        rec.kernel().keys = Some(bad);
        assert!(rec.keys_changed(), "a file gone bad is news for readiness");
        let outcome = rec.reconcile().await.unwrap();
        assert!(outcome.plan.is_empty(), "nothing changes");
        assert_eq!(metric(&rec, "node_agent_ipsec_key_file_error"), Some(1.0));
        rec.telemetry.set_reconciled(Ok(()));
        let ready = rec.telemetry.ready().unwrap();
        assert!(
            ready.contains("IPsec key file unusable") && ready.contains("line 2"),
            "{ready}"
        );
        rec.kernel().keys = Some(keys(&[3], 1));
        rec.reconcile().await.unwrap();
        assert_eq!(metric(&rec, "node_agent_ipsec_key_file_error"), Some(0.0));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn turning_ipsec_off_removes_every_ipsec_object() {
        let mut rec = reconciler(&[("a", 1)]);
        rec.kernel().keys = Some(keys(&[3], 1));
        rec.reconcile().await.unwrap();
        rec.kernel().keys = None;
        rec.reconcile().await.unwrap();
        let kinds: BTreeSet<ObjectKind> = rec.kernel().ours.values().map(|o| o.kind()).collect();
        assert_eq!(
            kinds,
            BTreeSet::from([ObjectKind::MapEntry, ObjectKind::Route])
        );
        assert!(rec.record().unwrap().ipsec_keys.is_empty());
    }
}

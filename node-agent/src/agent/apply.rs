//! Applying a plan to the kernel, in phases.
//!
//! Deletes go first (users before what they use), so map room and identities are free before
//! anything new takes them. Then the datapath's entries (the node-ID map's and, with IPsec, the
//! pod-CIDR map's) and the guards. Then every other object, but only of nodes whose entries all
//! went in: a node the datapath cannot identify, or whose traffic it cannot mark for
//! encryption, gets no route or xfrm object either (invariant 17), so its pod traffic is never
//! routed in the clear. Last, the deletes that must wait until no route of ours uses what they
//! delete (the nexthops, [`state::objects::ObjectKind::deleted_last`]).

use std::collections::BTreeSet;

use state::objects::{ObjectKind, Op};
use state::plan::Plan;

use super::kernel::Kernel;
use crate::backends::OpError;

/// One operation and what became of it.
#[derive(Debug)]
pub struct OpResult {
    pub op: Op,
    /// The node it was for; `None` for orphans.
    pub node: Option<String>,
    pub result: Result<(), OpError>,
}

/// Applies `ops` through the kernel, pairing each result with its op and node.
async fn run<K: Kernel>(kernel: &mut K, ops: Vec<(Op, Option<&str>)>, out: &mut Vec<OpResult>) {
    if ops.is_empty() {
        return;
    }
    let plain: Vec<Op> = ops.iter().map(|(op, _)| op.clone()).collect();
    let results = kernel.apply(&plain).await;
    for ((op, node), result) in ops.into_iter().zip(results) {
        out.push(OpResult {
            op,
            node: node.map(str::to_owned),
            result,
        });
    }
}

/// Applies every operation of `plan`; one result per operation, in the order they ran.
pub async fn apply_plan<K: Kernel>(kernel: &mut K, plan: &Plan) -> Vec<OpResult> {
    let mut out = Vec::with_capacity(plan.deletes.len() + plan.upserts.len());
    run(kernel, plan.delete_ops(), &mut out).await;
    let (entries, rest): (Vec<_>, Vec<_>) = plan.upsert_ops().into_iter().partition(|(op, _)| {
        let kind = op.object().kind();
        kind.is_datapath_entry() || kind == ObjectKind::XfrmGuard
    });
    let before = out.len();
    run(
        kernel,
        entries.into_iter().map(|(op, n)| (op, Some(n))).collect(),
        &mut out,
    )
    .await;
    let unmapped: BTreeSet<String> = out[before..]
        .iter()
        .filter(|r| r.result.is_err())
        .filter_map(|r| r.node.clone())
        .collect();
    let (skipped, rest): (Vec<_>, Vec<_>) = rest
        .into_iter()
        .partition(|(_, node)| unmapped.contains(*node));
    run(
        kernel,
        rest.into_iter().map(|(op, n)| (op, Some(n))).collect(),
        &mut out,
    )
    .await;
    run(kernel, plan.late_delete_ops(), &mut out).await;
    out.extend(skipped.into_iter().map(|(op, node)| OpResult {
        op,
        node: Some(node.to_owned()),
        result: Err(OpError::Skipped),
    }));
    out
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::time::Duration;

    use state::inventory::Inventory;
    use state::node::{AddressKind, Node, NodeAddress};
    use state::objects::ObjectId;
    use state::plan::{BrakeMemory, LiveView, PlanConfig, PlanInput, plan};

    use super::*;
    use crate::agent::kernel::fake::FakeKernel;

    fn node(name: &str, ip: &str, cidr: &str) -> Node {
        Node {
            name: name.into(),
            uid: format!("uid-{name}"),
            addresses: vec![NodeAddress {
                kind: AddressKind::InternalIP,
                ip: ip.parse().unwrap(),
            }],
            pod_cidrs: vec![cidr.parse().unwrap()],
            boot_id: String::new(),
            node_id: None,
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_node_whose_map_entry_fails_gets_no_route() {
        let cfg = PlanConfig {
            local_node: "local".into(),
            ..PlanConfig::default()
        };
        let live = LiveView {
            nodes: vec![
                node("local", "10.0.0.100", "10.1.100.0/24"),
                node("a", "10.0.0.1", "10.1.1.0/24"),
                node("b", "10.0.0.2", "10.1.2.0/24"),
            ],
            synced: true,
            ..LiveView::default()
        };
        let p = plan(&PlanInput {
            record: None,
            live: &live,
            inventory: &Inventory::new(),
            allocator: &Default::default(),
            brake: &BrakeMemory::default(),
            confirmed_hold: None,
            now: Duration::from_secs(1000),
            config: &cfg,
        });
        let mut k = FakeKernel::default();
        let a_ip: IpAddr = "10.0.0.1".parse().unwrap();
        k.faults.ids.push(ObjectId::MapEntry { ip: a_ip });
        let results = apply_plan(&mut k, &p).await;
        let a: Vec<_> = results
            .iter()
            .filter(|r| r.node.as_deref() == Some("a"))
            .collect();
        assert_eq!(a.len(), 3, "map entry, nexthop, route");
        assert!(matches!(a[0].result, Err(OpError::Kernel { .. })));
        assert!(matches!(a[1].result, Err(OpError::Skipped)));
        assert!(matches!(a[2].result, Err(OpError::Skipped)));
        assert!(
            !k.applied
                .iter()
                .any(|op| op.object().kind() == ObjectKind::Route
                    && op.object().to_string().contains("10.1.1.0/24")),
            "no route for a: {:?}",
            k.applied
        );
        assert_eq!(k.ours.len(), 3, "b is programmed in full");
    }
}

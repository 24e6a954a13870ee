//! Random cluster histories against a model kernel.
//!
//! A history is a sequence of steps; each changes the cluster (nodes added, deleted, readdressed,
//! renamed; freed IPs and CIDRs are recycled by later adds since they are drawn from small pools)
//! and then does one thing with the agent: reconcile fully, stay down, crash after applying a
//! prefix of its plan (no checkpoint written), or lose or corrupt its checkpoint. The checkpoint
//! goes through the real encoder and decoder.
//!
//! Properties, 256 cases each by default (`PROPTEST_CASES` overrides; about 2 s in a debug build):
//! - no plan ever deletes an object a live node desires (invariant 3);
//! - after a final restart and one full reconcile (synced, force-prune) the model kernel holds
//!   exactly the desired objects of the live nodes, each live node has an ID of its own;
//! - a second reconcile plans nothing (invariant 10).

mod common;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use state::checkpoint::{Checkpoint, decode, encode};
use state::desired::{desired_objects, global_objects};
use state::inventory::Inventory;
use state::node::{AddressKind, Node, NodeAddress};
use state::objects::{KernelObject, KeyTag, ObjectId, Op};
use state::plan::{BrakeMemory, IpsecConfig, LiveView, Plan, PlanConfig, PlanInput, plan};
use state::testing::ModelKernel;

const POOL: usize = 16;
/// The local node's address and CIDR slot, outside the pool remote nodes draw from.
const LOCAL_SLOT: usize = 199;
const NAMES: usize = 10;

#[derive(Clone, Debug)]
enum Event {
    Add {
        name: usize,
        ip: usize,
        dual: bool,
        cidr: usize,
    },
    Delete {
        pick: usize,
    },
    Readdress {
        pick: usize,
        ip: usize,
        cidr: usize,
    },
    /// New addresses, the same pod CIDRs: the routes stay, their nexthops change.
    Move {
        pick: usize,
        ip: usize,
    },
    Rename {
        pick: usize,
        name: usize,
    },
    Nothing,
}

#[derive(Clone, Debug)]
enum Agent {
    Reconcile,
    Down,
    /// Applies this many permille of the plan's ops, then dies before writing the checkpoint.
    Crash(u16),
    LoseCheckpoint,
    CorruptCheckpoint(usize),
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        3 => (0..NAMES, 0..POOL, any::<bool>(), 0..POOL)
            .prop_map(|(name, ip, dual, cidr)| Event::Add { name, ip, dual, cidr }),
        2 => (0..NAMES).prop_map(|pick| Event::Delete { pick }),
        1 => (0..NAMES, 0..POOL, 0..POOL).prop_map(|(pick, ip, cidr)| Event::Readdress { pick, ip, cidr }),
        1 => (0..NAMES, 0..POOL).prop_map(|(pick, ip)| Event::Move { pick, ip }),
        1 => (0..NAMES, 0..NAMES).prop_map(|(pick, name)| Event::Rename { pick, name }),
        1 => Just(Event::Nothing),
    ]
}

fn agent() -> impl Strategy<Value = Agent> {
    prop_oneof![
        4 => Just(Agent::Reconcile),
        3 => Just(Agent::Down),
        2 => (0u16..1000).prop_map(Agent::Crash),
        1 => Just(Agent::LoseCheckpoint),
        1 => any::<usize>().prop_map(Agent::CorruptCheckpoint),
    ]
}

fn v4(i: usize) -> IpAddr {
    format!("10.0.0.{}", i + 1).parse().unwrap()
}
fn v6(i: usize) -> IpAddr {
    format!("fd00::{}", i + 1).parse().unwrap()
}

/// The cluster: live nodes by name.
#[derive(Default)]
struct Cluster(BTreeMap<String, Node>);

impl Cluster {
    fn used_ips(&self) -> HashSet<IpAddr> {
        self.0.values().flat_map(|n| n.ips()).collect()
    }
    fn free_slot(&self, start: usize) -> Option<usize> {
        let used = self.used_ips();
        (0..POOL)
            .map(|k| (start + k) % POOL)
            .find(|i| !used.contains(&v4(*i)) && !used.contains(&v6(*i)))
    }
    fn free_cidr(&self, start: usize) -> Option<usize> {
        let used: HashSet<_> = self.0.values().flat_map(|n| n.pod_cidrs.clone()).collect();
        (0..POOL)
            .map(|k| (start + k) % POOL)
            .find(|i| !used.contains(&cidr4(*i)))
    }
    fn free_name(&self, start: usize) -> Option<String> {
        (0..NAMES)
            .map(|k| format!("n{}", (start + k) % NAMES))
            .find(|n| !self.0.contains_key(n))
    }
    fn pick(&self, i: usize) -> Option<String> {
        (!self.0.is_empty()).then(|| self.0.keys().nth(i % self.0.len()).unwrap().clone())
    }
    fn apply(&mut self, e: &Event) {
        match *e {
            Event::Add {
                name,
                ip,
                dual,
                cidr,
            } => {
                let (Some(name), Some(ip), Some(cidr)) = (
                    self.free_name(name),
                    self.free_slot(ip),
                    self.free_cidr(cidr),
                ) else {
                    return;
                };
                self.0.insert(name.clone(), make(&name, ip, dual, cidr));
            }
            Event::Delete { pick } => {
                if let Some(n) = self.pick(pick) {
                    self.0.remove(&n);
                }
            }
            Event::Readdress { pick, ip, cidr } => {
                let Some(name) = self.pick(pick) else { return };
                let old = self.0.remove(&name).unwrap();
                let dual = old.addresses.len() > 1;
                match (self.free_slot(ip), self.free_cidr(cidr)) {
                    (Some(ip), Some(cidr)) => {
                        self.0.insert(name.clone(), make(&name, ip, dual, cidr));
                    }
                    _ => {
                        self.0.insert(name, old);
                    }
                }
            }
            Event::Move { pick, ip } => {
                let Some(name) = self.pick(pick) else { return };
                let Some(ip) = self.free_slot(ip) else { return };
                let n = self.0.get_mut(&name).unwrap();
                n.addresses[0].ip = v4(ip);
                if let Some(a) = n.addresses.get_mut(1) {
                    a.ip = v6(ip);
                }
            }
            Event::Rename { pick, name } => {
                let (Some(old), Some(new)) = (self.pick(pick), self.free_name(name)) else {
                    return;
                };
                let mut n = self.0.remove(&old).unwrap();
                n.name = new.clone();
                self.0.insert(new, n);
            }
            Event::Nothing => {}
        }
    }
}

fn cidr4(i: usize) -> ipnet::IpNet {
    format!("10.1.{}.0/24", i + 1).parse().unwrap()
}

fn make(name: &str, ip: usize, dual: bool, cidr: usize) -> Node {
    let mut addresses = vec![NodeAddress {
        kind: AddressKind::InternalIP,
        ip: v4(ip),
    }];
    let mut pod_cidrs = vec![cidr4(cidr)];
    if dual {
        addresses.push(NodeAddress {
            kind: AddressKind::InternalIP,
            ip: v6(ip),
        });
        pod_cidrs.push(format!("fd01:{:x}::/64", cidr + 1).parse().unwrap());
    }
    Node {
        name: name.into(),
        uid: format!("uid-{name}").into(),
        addresses: addresses.into(),
        pod_cidrs: pod_cidrs.into(),
        boot_id: Default::default(),
        node_id: None,
    }
}

struct World {
    cluster: Cluster,
    kernel: ModelKernel,
    stored: Option<Vec<u8>>,
    now: Duration,
}

impl World {
    fn restored(&self) -> Option<Checkpoint> {
        self.stored.as_deref().and_then(|b| decode(b).ok())
    }

    fn plan(&self, cfg: &PlanConfig) -> Plan {
        let restored = self.restored();
        let mut nodes: Vec<Node> = self.cluster.0.values().cloned().collect();
        nodes.push(make("local", LOCAL_SLOT, true, LOCAL_SLOT));
        let live = LiveView {
            nodes: nodes.into_iter().map(Arc::new).collect(),
            malformed: Vec::new(),
            synced: true,
            relists: 1,
        };
        let inventory = self.kernel.inventory();
        let allocator = restored.as_ref().map(|c| c.ids.clone()).unwrap_or_default();
        let brake = BrakeMemory::restored(restored.as_ref(), None, &allocator);
        let p = plan(&PlanInput {
            record: restored.as_ref(),
            live: &live,
            inventory: &inventory,
            allocator: &allocator,
            brake: &brake,
            confirmed_hold: None,
            now: self.now,
            config: cfg,
        });
        // Invariant 3 at every step: no delete hits an object a live node desires.
        let desired = desired_ids(&p.checkpoint, &self.cluster, cfg, &inventory);
        for d in &p.deletes {
            assert!(
                !desired.contains(&d.object.id()),
                "deleted a live node's object: {d:?}"
            );
            // A live address keeps its entry, unless the entry carries the ID of a node that
            // does not have that address: a held node keeps what it had, never an entry that
            // leads to someone else.
            if let KernelObject::MapEntry(e) = &d.object {
                let anothers = p.checkpoint.nodes.iter().any(|n| {
                    n.node_id == Some(e.node_id) && !n.addresses.iter().any(|a| a.ip == e.ip)
                });
                assert!(
                    !self.cluster.used_ips().contains(&e.ip) || anothers,
                    "deleted a live IP's entry: {d:?}"
                );
            }
        }
        p
    }

    /// Applies a plan's ops to the model kernel, strictly (nothing refused, no replace or delete
    /// of nothing, no nexthop deleted under routes), making sure each nexthop replace is made
    /// before it breaks.
    fn apply(&mut self, ops: &[Op]) {
        for op in ops {
            if let Op::Replace(o) = op {
                self.no_nexthop_moved_under_its_routes(self.kernel.ours.get(&o.id()), o);
            }
            self.kernel.apply(std::slice::from_ref(op));
        }
    }

    /// Make before break: a nexthop that routes use gets another gateway in place (which makes
    /// the kernel walk every IPv4 route) only where the other ID of its pair is not free, as
    /// a crash between its steps leaves it.
    fn no_nexthop_moved_under_its_routes(
        &self,
        before: Option<&KernelObject>,
        after: &KernelObject,
    ) {
        let (Some(KernelObject::Nexthop(old)), KernelObject::Nexthop(new)) = (before, after) else {
            return;
        };
        let used = self
            .kernel
            .ours
            .values()
            .any(|r| r.uses() == Some(after.id()));
        let other = ObjectId::Nexthop {
            id: new.id().other().expect("ours"),
        };
        assert!(
            old.gateway == new.gateway || !used || self.kernel.ours.contains_key(&other),
            "{after} replaced under its routes, with its other ID free"
        );
    }

    fn reconcile(&mut self, cfg: &PlanConfig) -> Plan {
        let p = self.plan(cfg);
        self.apply(&p.ops());
        self.stored = Some(encode(&p.checkpoint_after(&[])).unwrap());
        p
    }
}

/// What the record's live nodes should have, with their nexthops where `kernel` puts them.
fn desired_of(
    cp: &Checkpoint,
    cluster: &Cluster,
    cfg: &PlanConfig,
    kernel: &Inventory,
) -> BTreeMap<ObjectId, KernelObject> {
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for n in &cp.nodes {
        if let (Some(id), Some(live)) = (n.node_id, cluster.0.get(&n.name))
            && live.addresses == n.addresses
        {
            desired_objects(live, id, cfg, kernel, &mut out, &mut problems);
        }
    }
    assert!(problems.is_empty(), "{problems:?}");
    out.extend(global_objects(cfg));
    out.into_iter().map(|o| (o.id(), o)).collect()
}

fn desired_ids(
    cp: &Checkpoint,
    cluster: &Cluster,
    cfg: &PlanConfig,
    kernel: &Inventory,
) -> HashSet<ObjectId> {
    desired_of(cp, cluster, cfg, kernel).into_keys().collect()
}

fn config(ipsec: bool) -> PlanConfig {
    PlanConfig {
        local_node: "local".into(),
        local_addresses: vec![v4(LOCAL_SLOT), v6(LOCAL_SLOT)],
        local_pod_cidrs: make("local", LOCAL_SLOT, true, LOCAL_SLOT)
            .pod_cidrs
            .to_vec(),
        ipsec: ipsec.then(|| IpsecConfig::single(1, KeyTag(1))),
        id_cooldown: Duration::from_secs(30),
        ..PlanConfig::default()
    }
}

fn run_history(steps: &[(Event, Agent)], ipsec: bool) -> Result<(), TestCaseError> {
    let cfg = config(ipsec);
    let mut w = World {
        cluster: Cluster::default(),
        kernel: ModelKernel::default(),
        stored: None,
        now: Duration::from_secs(1_000),
    };
    for (e, a) in steps {
        w.now += Duration::from_secs(10);
        w.cluster.apply(e);
        match a {
            Agent::Reconcile => {
                w.reconcile(&cfg);
            }
            Agent::Down => {}
            Agent::Crash(permille) => {
                let p = w.plan(&cfg);
                let ops = p.ops();
                let n = ops.len() * *permille as usize / 1000;
                w.apply(&ops[..n]);
            }
            Agent::LoseCheckpoint => w.stored = None,
            Agent::CorruptCheckpoint(at) => {
                if let Some(b) = &mut w.stored {
                    let i = at % b.len();
                    b[i] ^= 0x5A;
                }
            }
        }
    }
    // Restart, one full reconcile with the brake released.
    let forced = PlanConfig {
        force_prune: true,
        ..cfg.clone()
    };
    w.now += Duration::from_secs(10);
    let p = w.reconcile(&forced);
    prop_assert!(p.errors.is_empty(), "{:?}", p.errors);
    let cp = w.restored().expect("just written");
    let names: BTreeSet<&str> = cp.nodes.iter().map(|n| n.name.as_str()).collect();
    let live: BTreeSet<&str> = w.cluster.0.keys().map(String::as_str).collect();
    prop_assert_eq!(names, live);
    let ids: HashSet<_> = cp.nodes.iter().map(|n| n.node_id.expect("ID")).collect();
    prop_assert_eq!(ids.len(), cp.nodes.len(), "IDs are unique");
    prop_assert!(cp.pending_deletes.is_empty());
    let kernel = w.kernel.inventory();
    prop_assert_eq!(&w.kernel.ours, &desired_of(&cp, &w.cluster, &cfg, &kernel));
    // And nothing more to do.
    w.now += Duration::from_secs(10);
    let again = w.plan(&forced);
    prop_assert!(again.is_empty(), "second reconcile: {:?}", again.ops());
    prop_assert!(again.allocations.is_empty() && again.frees.is_empty());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(), ..ProptestConfig::default() })]

    #[test]
    fn random_histories_converge_to_exactly_the_live_nodes(
        steps in proptest::collection::vec((event(), agent()), 1..40)
    ) {
        run_history(&steps, false)?;
    }

    #[test]
    fn random_histories_converge_with_ipsec(
        steps in proptest::collection::vec((event(), agent()), 1..40)
    ) {
        run_history(&steps, true)?;
    }
}

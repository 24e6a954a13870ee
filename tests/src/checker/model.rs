//! The invariant checker's world: a seeded random source, the cluster as it really is, the list
//! the agent is shown, and the steps of a history.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::agent::TestNode;
pub use state::testing::Rng;

/// Address and pod CIDR slots: a node draws one slot for its addresses and one for its CIDRs, so
/// freed slots come back (recycled IPs and CIDRs) as the history goes on. Every address is on
/// the sandbox's link (10.88.0.0/16, fd00:88::/64).
pub fn slot_ipv4(slot: usize) -> String {
    format!("10.88.{}.{}", 7 + slot / 200, 10 + slot % 200)
}
pub fn slot_ipv6(slot: usize) -> String {
    format!("fd00:88::7:{:x}", slot + 10)
}
/// The ExternalIP of the `generation`th node made (one in three has one): a range of its own,
/// one address per node ever made, so that no two nodes share one (crash torture's exactness
/// assumes a cluster without conflicts).
pub fn external_ip(generation: u32) -> String {
    format!("10.89.{}.{}", generation / 200, 10 + generation % 200)
}
pub fn slot_cidr4(slot: usize) -> String {
    format!("10.{}.{}.0/24", 130 + slot / 250, slot % 250 + 1)
}
pub fn slot_cidr6(slot: usize) -> String {
    format!("fd00:130:{:x}::/64", slot + 1)
}

/// What changes in the cluster before a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Nothing,
    /// `ops` plain changes (adds, deletes, readdressing, recycled IPs) drawn from `seed`.
    Churn {
        seed: u64,
        ops: usize,
    },
    Add {
        name: usize,
        slot: usize,
        cidr: usize,
        dual: bool,
    },
    Delete {
        pick: usize,
    },
    Readdress {
        pick: usize,
        slot: usize,
        cidr: usize,
    },
    /// Delete a node and give its addresses to a new one.
    RecycleIps {
        pick: usize,
        name: usize,
        cidr: usize,
    },
    Rename {
        pick: usize,
        name: usize,
    },
    /// A node claims another node's IPv4 address too.
    ClaimAddress {
        pick: usize,
        from: usize,
    },
    /// A node claims another node's pod CIDR instead of its own.
    ClaimCidr {
        pick: usize,
        from: usize,
    },
    /// A node's record stops validating.
    Malform {
        pick: usize,
    },
    /// A node has no addresses (it is registering again).
    Unaddress {
        pick: usize,
    },
    /// A node's pod CIDR becomes one the address policy refuses ([`SPECIAL_CIDRS`]).
    SpecialCidr {
        pick: usize,
        which: usize,
    },
    /// A node is listed twice: a second item of its name (another UID, the same addresses)
    /// after every other node.
    Duplicate {
        pick: usize,
    },
    /// Every broken node is mended.
    Mend,
    /// A foreign (`proto static`) route appears at a pod CIDR slot.
    PlantForeign {
        cidr: usize,
    },
    /// The foreign routes go away.
    ClearForeign,
}

/// Pod CIDRs the address policy refuses, both families: link-local (the cloud's metadata
/// address), loopback, multicast, reserved, a default route, 6to4.
pub const SPECIAL_CIDRS: &[&str] = &[
    "169.254.169.0/24",
    "127.0.0.0/24",
    "224.1.0.0/24",
    "240.0.0.0/24",
    "0.0.0.0/0",
    "fe80::/64",
    "ff00::/8",
    "::/0",
    "2002::/16",
];

/// What the agent is shown this step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum View {
    /// The cluster as it is.
    Full,
    /// Only some of it (a broken proxy, a partial page): keeps `pct` percent of the nodes.
    Partial { pct: u64 },
    /// Another cluster's nodes (new names, or the same names with other UIDs), local node
    /// included.
    WrongCluster { same_names: bool },
    /// The list lacks the local node.
    NoLocal,
}

/// What the agent does this step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// `run --once`, a restart.
    Once,
    /// `run --once --force-prune`.
    OnceForced,
    /// In the event-sized mode, the daemon, and an operator confirms the hold it comes to rest
    /// with (`node-agent prune confirm`), once; elsewhere a plain `run --once`.
    Confirmed,
    /// The daemon, killed with SIGKILL after `ms` milliseconds.
    KilledDaemon { ms: u64 },
    /// The daemon, killed `us` microseconds after it logs a finished reconcile: between the
    /// kernel apply and the checkpoint write, or during the write.
    KilledAfterApply { us: u64 },
    /// The checkpoint is deleted, then `run --once`.
    LoseCheckpoint,
    /// The checkpoint has a byte flipped, then `run --once`.
    CorruptCheckpoint { at: usize },
    /// The kernel's records (the ring of recent removals and the freed IDs) are unpinned, as
    /// an agent that never made them would leave the kernel, then `run --once`.
    LoseKernelRecords,
    /// `run --once` while the nodes file is written in place: first cut at an item boundary (a
    /// valid, shorter list keeping `pct` percent of the items), the whole list a moment later,
    /// as a writer that pauses would. The run must take the whole list: a read that drops nodes
    /// waits for the file to settle.
    TornWrite { pct: u64 },
    /// The daemon runs `ms` milliseconds while its source never completes a list, then is
    /// stopped with SIGTERM. `how` picks the way the source fails, among [`FILE_FAILURES`] or
    /// [`API_FAILURES`]. The step's changes are made all the same. Until a first full list,
    /// nothing may be deleted (invariant 1).
    Unsynced { ms: u64, how: usize },
    /// `run --once` cut by the agent's own test cut (`NODE_AGENT_TEST_CUT`) at the `at`th point
    /// of `sequence`: before its `at`th kernel operation (`ops`) or its checkpoint write
    /// (`checkpoint`, after every kernel write of the run), ended there (`kill`) or failed there.
    /// A run with fewer points than `at` is not cut.
    Cut {
        sequence: &'static str,
        at: u64,
        kill: bool,
    },
}

/// How a nodes file keeps a source from its first list: cut inside an item (no parse takes
/// it), or not there.
pub const FILE_FAILURES: [&str; 2] = ["cut", "absent"];
/// How the API server keeps a watcher from its first list: every request answered `500`,
/// `403` (RBAC), `401` (a revoked token), or every connection closed at once (the server down).
pub const API_FAILURES: [&str; 4] = ["500", "403", "401", "closed"];

/// The cool-down of the small ID space mode (its `--test-id-cooldown` in [`Modes::args`]).
pub const SMALL_ID_COOLDOWN: Duration = Duration::from_secs(3);

/// The agent's modes, drawn for each history and printed with it: each is a way the agent runs
/// that changes which code a history exercises.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Modes {
    /// `--route-nexthops false`: routes carry their gateways.
    pub nexthops_off: bool,
    /// A node-ID map of 4 entries that grows online as the cluster does.
    pub growth: bool,
    /// The brake held at `--max-prune-ratio 1` (crash torture's setting): every removal goes
    /// through.
    pub brake_off: bool,
    /// An ID space of 12 for up to 10 nodes, with a 3 s cool-down and a 1 s reuse floor: IDs
    /// run out, cool down and come back within a history.
    pub small_ids: bool,
    /// The daemon behind the Kubernetes API-server stand-in, each step's changes arriving as
    /// watch events while it runs: its plans are event-sized. Not with the small ID space, whose
    /// oracle needs the nodes a run reports waiting for an ID (a one-shot run's report).
    pub events: bool,
    /// `--include-external-ips`: a node's ExternalIPs are mapped and claimed like its
    /// InternalIPs. Without it the agent ignores them, and so does the oracle.
    pub external_ips: bool,
    /// IPsec on (`--ipsec-key-file`, a pod bridge): xfrm states and policies, and the pod-CIDR
    /// map, under the same invariants; only where the kernel has ESP (the VM tier).
    pub ipsec: bool,
    /// With IPsec, the key in the per-sender SPI layout.
    pub per_sender: bool,
}

/// The checker's IPsec key files (one global key, in each SPI layout): the same for every
/// history and for the differential oracle's fresh agent.
pub const IPSEC_KEY_FILES: [(&str, &str); 2] = [
    (
        "/run/node-agent-checker-key",
        "3 rfc4106(gcm(aes)) 0x0102030405060708090a0b0c0d0e0f1011121314 128\n",
    ),
    (
        "/run/node-agent-checker-key-per-sender",
        "3 rfc4106(gcm(aes)) 0x0102030405060708090a0b0c0d0e0f1011121314 128 per-sender-spi\n",
    ),
];

impl Modes {
    /// The modes of a history of `p`: half of the histories in each mode. Crash torture keeps
    /// its brake off (its oracle is exactness after every restart).
    pub fn draw(rng: &mut Rng, p: &Profile) -> Self {
        let nexthops_off = rng.chance(50);
        let growth = rng.chance(50);
        let brake_off = p.torture || rng.chance(30);
        let small_ids = !p.torture && rng.chance(40);
        let events = !p.torture && !small_ids && rng.chance(60);
        let external_ips = rng.chance(30);
        Self {
            nexthops_off,
            growth,
            brake_off,
            small_ids,
            events,
            external_ips,
            ipsec: p.ipsec,
            // Drawn only with IPsec, so that the other profiles' seeds replay as before.
            per_sender: p.ipsec && rng.chance(50),
        }
    }

    /// `list` as the agent in these modes reads it, for the oracle: where ExternalIPs are read
    /// they are addresses of the node's own after its InternalIPs (mapped and claimed alike,
    /// and still named in `external`, since routes go via InternalIPs only); where they are not,
    /// they are nothing.
    pub fn as_read(&self, list: &[TestNode]) -> Vec<TestNode> {
        list.iter()
            .cloned()
            .map(|mut n| {
                if self.external_ips {
                    n.ips.extend(n.external.clone());
                } else {
                    n.external.clear();
                }
                n
            })
            .collect()
    }

    /// The agent's arguments for these modes.
    pub fn args(&self) -> Vec<&'static str> {
        let mut a = Vec::new();
        if self.nexthops_off {
            a.extend(["--route-nexthops", "false"]);
        }
        if self.growth {
            a.extend(["--node-map-max", "4"]);
        }
        if self.brake_off {
            a.extend(["--max-prune-ratio", "1"]);
        }
        if self.external_ips {
            a.push("--include-external-ips");
        }
        if self.small_ids {
            a.extend(["--max-node-id", "12", "--test-id-cooldown", "3s"]);
            a.extend(["--id-reuse-floor", "1s"]);
        }
        if self.ipsec {
            let key = IPSEC_KEY_FILES[usize::from(self.per_sender)].0;
            a.extend(["--ipsec-key-file", key, "--pod-iface", "cni0"]);
        }
        a
    }

    /// What these modes need in a sandbox before the agent runs: with IPsec, the key files
    /// and the pod bridge.
    pub fn prepare_sandbox(&self) {
        if !self.ipsec {
            return;
        }
        for (path, text) in IPSEC_KEY_FILES {
            crate::write_private(std::path::Path::new(path), text.as_bytes());
        }
        crate::ip(&["link", "add", "cni0", "type", "bridge"]);
        crate::ip(&["link", "set", "cni0", "up"]);
    }

    /// The brake's ratio in these modes (the agent's default is 0.5).
    pub fn max_ratio(&self) -> f64 {
        if self.brake_off { 1.0 } else { 0.5 }
    }

    /// Their names, as the coverage line prints them.
    pub fn names(&self) -> Vec<&'static str> {
        let mut n = vec![if self.events { "event-sized" } else { "full" }];
        if self.nexthops_off {
            n.push("nexthops-off");
        }
        if self.growth {
            n.push("growth");
        }
        if self.small_ids {
            n.push("small-id-space");
        }
        if self.external_ips {
            n.push("external-ips");
        }
        if self.ipsec {
            n.push("ipsec");
            if self.per_sender {
                n.push("per-sender-spi");
            }
        }
        n.push(if self.brake_off {
            "brake-off"
        } else {
            "brake-on"
        });
        n
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub change: Change,
    pub view: View,
    pub action: Action,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} / {:?} / {:?}", self.change, self.view, self.action)
    }
}

/// What histories look like.
#[derive(Clone, Copy, Debug)]
pub struct Profile {
    /// Node names and address slots to draw from.
    pub names: usize,
    pub slots: usize,
    /// Crash torture: rounds of churn, a daemon killed at a random moment, a restart that must
    /// converge exactly; rather than random steps of every kind.
    pub torture: bool,
    /// Percent of steps that break something (claims, malformed, unaddressed, foreign routes).
    pub trouble: u64,
    /// Percent of steps that show the agent a distorted list.
    pub distortion: u64,
    /// Percent of steps run by a daemon that is killed.
    pub kills: u64,
    /// Percent of steps that lose or corrupt the checkpoint.
    pub lost: u64,
    /// Percent of steps whose run is cut at a kernel operation or its checkpoint write.
    pub cuts: u64,
    /// Percent of steps whose nodes file is written in place, torn at an item boundary.
    pub torn: u64,
    /// Percent of steps run by a daemon whose source never completes a list.
    pub unsynced: u64,
    /// Percent of steps whose hold an operator confirms.
    pub confirms: u64,
    /// Every history with IPsec (the VM tier, where the kernel has ESP).
    pub ipsec: bool,
}

impl Profile {
    pub const INVARIANTS: Self = Self {
        names: 10,
        slots: 14,
        torture: false,
        trouble: 25,
        distortion: 20,
        kills: 10,
        lost: 8,
        cuts: 15,
        torn: 5,
        unsynced: 4,
        confirms: 25,
        ipsec: false,
    };

    /// The invariants' profile with IPsec on in every history.
    pub const IPSEC: Self = Self {
        ipsec: true,
        ..Self::INVARIANTS
    };

    /// A cluster large enough that the apply takes a while, churned by a tenth each round; the
    /// brake (not what this is about) let through.
    pub const TORTURE: Self = Self {
        names: 120,
        slots: 160,
        torture: true,
        trouble: 0,
        distortion: 0,
        kills: 100,
        lost: 0,
        cuts: 0,
        torn: 0,
        unsynced: 0,
        confirms: 0,
        ipsec: false,
    };
}

/// A history of `n` steps for `p`.
pub fn history(rng: &mut Rng, p: Profile, n: usize) -> Vec<Step> {
    if !p.torture {
        return (0..n).map(|_| step(rng, p)).collect();
    }
    // A first round programs the cluster; every round after churns it, kills a daemon, and
    // restarts once to converge.
    let mut steps = vec![Step {
        change: Change::Churn {
            seed: rng.next_u64(),
            ops: p.names * 2 / 3,
        },
        view: View::Full,
        action: Action::Once,
    }];
    while steps.len() < n {
        let kill = match rng.below(3) {
            0 => Action::KilledDaemon {
                ms: 20 + rng.below(600) as u64,
            },
            1 => Action::KilledAfterApply { us: 0 },
            _ => Action::KilledAfterApply {
                us: rng.below(3000) as u64,
            },
        };
        steps.push(Step {
            change: Change::Churn {
                seed: rng.next_u64(),
                ops: p.names / 10,
            },
            view: View::Full,
            action: kill,
        });
        steps.push(Step {
            change: Change::Nothing,
            view: View::Full,
            action: Action::Once,
        });
    }
    steps
}

pub fn step(rng: &mut Rng, p: Profile) -> Step {
    let (names, slots) = (p.names, p.slots);
    let change = if rng.chance(p.trouble) {
        match rng.below(8) {
            0 => Change::ClaimAddress {
                pick: rng.below(99),
                from: rng.below(99),
            },
            1 => Change::ClaimCidr {
                pick: rng.below(99),
                from: rng.below(99),
            },
            2 => Change::Malform {
                pick: rng.below(99),
            },
            3 => Change::Unaddress {
                pick: rng.below(99),
            },
            4 | 5 => Change::PlantForeign {
                cidr: rng.below(slots),
            },
            6 => Change::ClearForeign,
            _ => Change::Mend,
        }
    } else {
        match rng.below(10) {
            0..=3 => Change::Add {
                name: rng.below(names),
                slot: rng.below(slots),
                cidr: rng.below(slots),
                dual: rng.chance(50),
            },
            4 | 5 => Change::Delete {
                pick: rng.below(99),
            },
            6 => Change::Readdress {
                pick: rng.below(99),
                slot: rng.below(slots),
                cidr: rng.below(slots),
            },
            7 => Change::RecycleIps {
                pick: rng.below(99),
                name: rng.below(names),
                cidr: rng.below(slots),
            },
            8 => Change::Rename {
                pick: rng.below(99),
                name: rng.below(names),
            },
            _ => Change::Nothing,
        }
    };
    let view = if rng.chance(p.distortion) {
        match rng.below(4) {
            0 => View::Partial {
                pct: 10 + rng.below(30) as u64,
            },
            1 => View::WrongCluster { same_names: false },
            2 => View::WrongCluster { same_names: true },
            _ => View::NoLocal,
        }
    } else {
        View::Full
    };
    let action = if rng.chance(p.kills) {
        Action::KilledDaemon {
            ms: 30 + rng.below(400) as u64,
        }
    } else if rng.chance(p.cuts) {
        // Most land inside the apply; a quarter between the apply and the checkpoint write, and
        // some in a map growth's steps (where one happens).
        match rng.below(5) {
            0 => Action::Cut {
                sequence: "checkpoint",
                at: 1,
                kill: rng.chance(70),
            },
            1 => Action::Cut {
                sequence: "growth",
                at: 1 + rng.below(10) as u64,
                kill: rng.chance(60),
            },
            _ => Action::Cut {
                sequence: "ops",
                at: 1 + rng.below(6) as u64,
                kill: rng.chance(60),
            },
        }
    } else if rng.chance(p.lost) {
        let pick = rng.below(3);
        if pick == 0 {
            Action::LoseCheckpoint
        } else if pick == 1 {
            Action::LoseKernelRecords
        } else {
            Action::CorruptCheckpoint {
                at: rng.below(4096),
            }
        }
    } else if rng.chance(p.unsynced) {
        Action::Unsynced {
            ms: 200 + rng.below(800) as u64,
            how: rng.below(12),
        }
    } else if rng.chance(p.torn) {
        Action::TornWrite {
            pct: 20 + rng.below(60) as u64,
        }
    } else if rng.chance(p.confirms) {
        Action::Confirmed
    } else if rng.chance(10) {
        Action::OnceForced
    } else {
        Action::Once
    };
    Step {
        change,
        view,
        action,
    }
}

/// The cluster as it really is, and the foreign routes around it.
#[derive(Clone, Debug, Default)]
pub struct Truth {
    /// Node names and address slots to draw from.
    pub names: usize,
    pub slots: usize,
    pub nodes: BTreeMap<String, TestNode>,
    /// Pod CIDR slots with a foreign route.
    pub foreign: Vec<usize>,
    /// Nodes listed twice.
    pub duplicates: std::collections::BTreeSet<String>,
    /// Bumped for every node created, so UIDs are never reused.
    pub generation: u32,
}

fn name(i: usize) -> String {
    format!("n{i:03}")
}

fn make(name: &str, slot: usize, cidr: usize, dual: bool, generation: u32) -> TestNode {
    let mut n = TestNode {
        name: name.into(),
        ips: vec![slot_ipv4(slot)],
        cidrs: vec![slot_cidr4(cidr)],
        uid: Some(format!("{name}-{generation}")),
        ..TestNode::default()
    };
    if generation.is_multiple_of(3) {
        n.external.push(external_ip(generation));
    }
    if dual {
        n.ips.push(slot_ipv6(slot));
        n.cidrs.push(slot_cidr6(cidr));
    }
    n
}

impl Truth {
    pub fn new(p: &Profile) -> Self {
        Self {
            names: p.names,
            slots: p.slots,
            ..Self::default()
        }
    }

    fn pick(&self, i: usize) -> Option<String> {
        (!self.nodes.is_empty())
            .then(|| self.nodes.keys().nth(i % self.nodes.len()).unwrap().clone())
    }

    fn used(&self, f: impl Fn(&TestNode) -> Vec<String>) -> Vec<String> {
        self.nodes.values().flat_map(f).collect()
    }

    /// A free slot from `start` on: its address is nobody's.
    fn free_slot(&self, start: usize) -> Option<usize> {
        let used = self.used(|n| n.ips.clone());
        (0..self.slots)
            .map(|k| (start + k) % self.slots)
            .find(|s| !used.contains(&slot_ipv4(*s)))
    }

    fn free_cidr(&self, start: usize) -> Option<usize> {
        let used = self.used(|n| n.cidrs.clone());
        (0..self.slots)
            .map(|k| (start + k) % self.slots)
            .find(|s| !used.contains(&slot_cidr4(*s)))
    }

    fn free_name(&self, start: usize) -> Option<String> {
        (0..self.names)
            .map(|k| name((start + k) % self.names))
            .find(|n| !self.nodes.contains_key(n))
    }

    pub fn apply(&mut self, c: &Change) {
        match *c {
            Change::Nothing => {}
            Change::Churn { seed, ops } => {
                let mut rng = Rng::new(seed);
                for _ in 0..ops {
                    let plain = match rng.below(6) {
                        0 | 1 => Change::Add {
                            name: rng.below(self.names),
                            slot: rng.below(self.slots),
                            cidr: rng.below(self.slots),
                            dual: rng.chance(50),
                        },
                        2 => Change::Delete {
                            pick: rng.below(999),
                        },
                        3 => Change::Readdress {
                            pick: rng.below(999),
                            slot: rng.below(self.slots),
                            cidr: rng.below(self.slots),
                        },
                        4 => Change::RecycleIps {
                            pick: rng.below(999),
                            name: rng.below(self.names),
                            cidr: rng.below(self.slots),
                        },
                        _ => Change::Nothing,
                    };
                    self.apply(&plain);
                }
            }
            Change::Add {
                name,
                slot,
                cidr,
                dual,
            } => {
                let (Some(name), Some(slot), Some(cidr)) = (
                    self.free_name(name),
                    self.free_slot(slot),
                    self.free_cidr(cidr),
                ) else {
                    return;
                };
                self.generation += 1;
                let n = make(&name, slot, cidr, dual, self.generation);
                self.nodes.insert(name, n);
            }
            Change::Delete { pick } => {
                if let Some(n) = self.pick(pick) {
                    self.nodes.remove(&n);
                }
            }
            Change::Readdress { pick, slot, cidr } => {
                let (Some(n), Some(slot), Some(cidr)) =
                    (self.pick(pick), self.free_slot(slot), self.free_cidr(cidr))
                else {
                    return;
                };
                let old = &self.nodes[&n];
                let dual = old.ips.len() > 1;
                let (uid, external) = (old.uid.clone(), old.external.clone());
                let mut new = make(&n, slot, cidr, dual, 0);
                // The same node, readdressed: its UID and its ExternalIP stay.
                new.uid = uid;
                new.external = external;
                self.nodes.insert(n, new);
            }
            Change::RecycleIps { pick, name, cidr } => {
                let Some(old) = self.pick(pick) else { return };
                let gone = self.nodes.remove(&old).unwrap();
                let (Some(name), Some(cidr)) = (self.free_name(name), self.free_cidr(cidr)) else {
                    return;
                };
                self.generation += 1;
                let mut n = make(&name, 0, cidr, gone.cidrs.len() > 1, self.generation);
                n.ips = gone.ips;
                self.nodes.insert(name, n);
            }
            Change::Rename { pick, name } => {
                let (Some(old), Some(new)) = (self.pick(pick), self.free_name(name)) else {
                    return;
                };
                let mut n = self.nodes.remove(&old).unwrap();
                n.name = new.clone();
                self.generation += 1;
                n.uid = Some(format!("{new}-{}", self.generation));
                self.nodes.insert(new, n);
            }
            Change::ClaimAddress { pick, from } => {
                let (Some(a), Some(b)) = (self.pick(pick), self.pick(from)) else {
                    return;
                };
                let Some(ip) = self.nodes[&b].ips.first().cloned() else {
                    return;
                };
                if a != b && !ip.contains(':') && !self.nodes[&a].ips.contains(&ip) {
                    self.nodes.get_mut(&a).unwrap().ips.push(ip);
                }
            }
            Change::ClaimCidr { pick, from } => {
                let (Some(a), Some(b)) = (self.pick(pick), self.pick(from)) else {
                    return;
                };
                let Some(cidr) = self.nodes[&b].cidrs.first().cloned() else {
                    return;
                };
                if a != b {
                    self.nodes.get_mut(&a).unwrap().cidrs[0] = cidr;
                }
            }
            Change::Malform { pick } => {
                if let Some(n) = self.pick(pick) {
                    self.nodes.get_mut(&n).unwrap().ips = vec!["not-an-ip".into()];
                }
            }
            Change::Unaddress { pick } => {
                if let Some(n) = self.pick(pick) {
                    self.nodes.get_mut(&n).unwrap().ips.clear();
                }
            }
            Change::SpecialCidr { pick, which } => {
                if let Some(n) = self.pick(pick) {
                    self.nodes.get_mut(&n).unwrap().cidrs = vec![SPECIAL_CIDRS[which].into()];
                }
            }
            Change::Duplicate { pick } => {
                if let Some(n) = self.pick(pick) {
                    self.duplicates.insert(n);
                }
            }
            Change::Mend => self.mend(),
            Change::PlantForeign { cidr } => {
                if !self.foreign.contains(&cidr) {
                    self.foreign.push(cidr);
                }
            }
            Change::ClearForeign => self.foreign.clear(),
        }
    }

    /// Drops every broken node: malformed, without addresses, or claiming what another node
    /// claims (the later name goes). What is left is a cluster without conflicts.
    pub fn mend(&mut self) {
        self.duplicates.clear();
        let mut seen: Vec<String> = Vec::new();
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        for n in names {
            let node = &self.nodes[&n];
            let broken = !super::oracle::is_valid(node)
                || node.ips.iter().chain(&node.cidrs).any(|r| seen.contains(r));
            if broken {
                self.nodes.remove(&n);
            } else {
                seen.extend(node.ips.iter().chain(&node.cidrs).cloned());
            }
        }
    }

    /// The list the agent is shown under `view`, the local node included unless the view
    /// leaves it out.
    pub fn list(&self, view: &View, rng: &mut Rng) -> Vec<TestNode> {
        let mut out = Vec::new();
        if *view != View::NoLocal {
            out.push(crate::agent::local_node());
        }
        match view {
            View::Full | View::NoLocal => {
                out.extend(self.nodes.values().cloned());
                // A second item of a name, after every other: the first stands.
                for (i, name) in self.duplicates.iter().enumerate() {
                    if let Some(n) = self.nodes.get(name) {
                        out.push(TestNode {
                            uid: Some(format!("{name}-duplicate-{i}")),
                            ..n.clone()
                        });
                    }
                }
            }
            View::Partial { pct } => {
                out.extend(self.nodes.values().filter(|_| rng.chance(*pct)).cloned())
            }
            View::WrongCluster { same_names } => {
                for (i, n) in self.nodes.values().enumerate() {
                    out.push(TestNode {
                        name: if *same_names {
                            n.name.clone()
                        } else {
                            format!("other-{i}")
                        },
                        ips: vec![format!("10.88.9.{}", i + 10)],
                        cidrs: vec![format!("10.131.{}.0/24", i + 1)],
                        uid: Some(format!("other-cluster-{i}")),
                        ..TestNode::default()
                    });
                }
                for i in self.nodes.len()..self.nodes.len() + 3 {
                    out.push(TestNode {
                        name: format!("other-{i}"),
                        ips: vec![format!("10.88.9.{}", i + 10)],
                        cidrs: vec![format!("10.131.{}.0/24", i + 1)],
                        uid: Some(format!("other-cluster-{i}")),
                        ..TestNode::default()
                    });
                }
            }
        }
        out
    }
}

//! VM tier: IPsec that encrypts, between node namespaces on one wire, each with its own agent
//! (`node_agent_tests::cluster`). The host kernel of the development machines has no ESP: there
//! each test prints why it skipped; in the guest (`NODE_AGENT_VM=1`) a missing ESP fails.
//!
//! Every test captures the wire and requires that no pod packet ever crosses it in the clear,
//! and prints what it saw.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use node_agent::backends::xfrm::{KeyBook, XfrmBackend};
use node_agent_tests::agent::{TestNode, wait_for};
use node_agent_tests::cluster::{
    self, Capture, Cluster, LongPing, SimNode, Timeline, ping, tcp_transfer, write_keys,
};
use node_agent_tests::{report, runtime, skip_without_esp};
use state::objects::{Spi, SpiLayout};

/// Key 3 in the key SPI layout (what every release sends), and key 4 in either layout.
const KEY3: (u8, &str, SpiLayout) = (
    3,
    "0102030405060708090a0b0c0d0e0f1011121314",
    SpiLayout::Key,
);
const KEY4: (u8, &str, SpiLayout) = (
    4,
    "a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4",
    SpiLayout::Key,
);
const KEY4_PER_SENDER: (u8, &str, SpiLayout) = (4, KEY4.1, SpiLayout::PerSender);
const KEY3_PER_SENDER: (u8, &str, SpiLayout) = (3, KEY3.1, SpiLayout::PerSender);
/// Per node and peer: an IN and an OUT state for each family.
const STATES_PER_PEER: usize = 4;

/// Why this kernel cannot run the test, or `None` when it has ESP. In the guest, a kernel
/// without ESP is a failure.
fn esp_missing(name: &str) -> bool {
    let why = runtime().block_on(async {
        let x = XfrmBackend::new(KeyBook::default()).ok()?;
        x.probe_esp().await.err().map(|e| e.to_string())
    });
    match why {
        None => false,
        Some(why) => {
            skip_without_esp(name, &why);
            true
        }
    }
}

/// Runs `body` on a cluster where ESP works; skips where it cannot.
fn with_cluster(name: &str, body: impl FnOnce(&mut Cluster) + Send) {
    cluster::with_cluster(name, |name| !esp_missing(name), body);
}

fn assert_no_clear_pod_traffic(what: &str, cap: &Capture) {
    let seen = cap.seen();
    report(&format!(
        "ipsec: {what}: the wire saw {} ESP frames, {} pod frames in the clear, {} other frames",
        seen.esp, seen.clear_pod, seen.other
    ));
    assert_eq!(
        seen.clear_pod, 0,
        "{what}: pod traffic crossed the wire in the clear"
    );
}

/// The mark of the node's state toward `dst` (`ip xfrm state` prints it as `mark V/M`).
fn out_state_mark(n: &SimNode, dst: &str) -> String {
    state_mark(n, dst).unwrap_or_else(|text| panic!("{}: no state toward {dst}:\n{text}", n.name))
}

/// The mark of the node's state toward `dst`, or what `ip xfrm state` printed without one.
fn state_mark(n: &SimNode, dst: &str) -> Result<String, String> {
    let text = n.ip(&["xfrm", "state"]);
    let mut inside = false;
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with("src ") {
            inside = t.split_whitespace().nth(3) == Some(dst);
        } else if inside && let Some(m) = t.strip_prefix("mark ") {
            return Ok(m.to_owned());
        }
    }
    Err(text)
}

fn all_up(c: &Cluster, nodes: &[&SimNode], peers: usize, spi: u32) {
    for n in nodes {
        c.wait_states(n, peers * STATES_PER_PEER, spi, Duration::from_secs(30));
    }
}

#[test]
fn pod_traffic_crosses_the_wire_only_as_esp_and_a_missing_state_drops_it() {
    with_cluster(node_agent_tests::test_name!(), |c| {
        let a = c.add_node("node-a", 1);
        let b = c.add_node("node-b", 2);
        for n in [&a, &b] {
            write_keys(&n.key_file(), &[KEY3], true);
        }
        c.write_nodes(&[a.test_node(), b.test_node()]);
        // The resync that repairs a deleted state comes after the checks that it is missing.
        let flags = [
            "--resync-interval",
            "8s",
            "--ipsec-key-propagation-delay",
            "2s",
            "--ipsec-key-rotation-delay",
            "4s",
        ];
        let _agents = [&a, &b].map(|n| c.start_agent(n, &flags));
        all_up(c, &[&a, &b], 1, 3);

        let status = a.ipsec_status();
        assert_eq!(status["send_spi"], 3, "{status:#}");
        assert_eq!(status["keys"][0]["per_pair"], true, "{status:#}");
        assert_eq!(status["guards"].as_array().unwrap().len(), 4, "{status:#}");
        assert_eq!(status["nodes"][0]["name"], "node-b", "{status:#}");
        assert!(
            status["nodes_missing_states"]
                .as_array()
                .unwrap()
                .is_empty()
        );
        let text = String::from_utf8_lossy(
            &node_agent_tests::run(
                std::process::Command::new("ip")
                    .args(["netns", "exec", &a.ns()])
                    .arg(node_agent_tests::agent_bin())
                    .args(["ipsec", "status", "--state-dir"])
                    .arg(a.state_dir())
                    .arg("--bpffs")
                    .arg(a.bpffs()),
            )
            .stdout,
        )
        .into_owned();
        report(&format!(
            "ipsec: `node-agent ipsec status` on node-a:\n{text}"
        ));

        let cap = Capture::start();
        assert_eq!(ping(&a.pod_ns(), &b.pod4(), 5), (5, 5), "IPv4 ping");
        assert_eq!(ping(&a.pod_ns(), &b.pod6(), 5), (5, 5), "IPv6 ping");
        let mib = 1 << 20;
        let got = tcp_transfer(&a.pod_ns(), &b.pod_ns(), &b.pod4(), mib);
        assert_eq!(got, mib, "1 MiB over TCP");
        let encrypted = a.out_bytes();
        report(&format!(
            "ipsec: node-a's OUT states encrypted {encrypted} bytes"
        ));
        assert!(encrypted as usize > mib, "the state byte counters grow");
        assert!(cap.seen().esp > 0);
        assert_no_clear_pod_traffic("ping and 1 MiB of TCP", &cap);

        // node-b's OUT state on node-a deleted by hand: node-a's packets toward node-b's pods
        // are dropped, never sent in the clear, until the resync repairs the state. The checks
        // below must fit between two resyncs, so the delete follows one at once: a quiet agent
        // reconciles only at its resync, and each reconcile is one count of the histogram.
        let reconciles = || a.metric("node_agent_reconcile_duration_seconds_count");
        let before = reconciles();
        wait_for("a resync", Duration::from_secs(20), || {
            reconciles() > before
        });
        let mark = out_state_mark(&a, &b.ip4());
        let (value, mask) = mark.split_once('/').unwrap();
        a.ip(&[
            "xfrm",
            "state",
            "delete",
            "src",
            &a.ip4(),
            "dst",
            &b.ip4(),
            "proto",
            "esp",
            "spi",
            "3",
            "mark",
            value,
            "mask",
            mask,
        ]);
        let (sent, received) = ping(&a.pod_ns(), &b.pod4(), 2);
        report(&format!(
            "ipsec: without node-a's OUT state, {received} of {sent} pings got through"
        ));
        assert_eq!(received, 0, "no OUT state: dropped");
        assert_no_clear_pod_traffic("the OUT state deleted", &cap);
        let status = a.ipsec_status();
        assert_eq!(status["nodes_missing_states"][0], "node-b", "{status:#}");
        assert_eq!(status["nodes"][0]["missing"][0], "out ipv4", "{status:#}");
        assert!(
            status["xfrm_stat"]["XfrmOutNoStates"].as_u64() > Some(0),
            "the drops are counted: {status:#}"
        );
        c.wait_states(&a, STATES_PER_PEER, 3, Duration::from_secs(20));
        let repaired = a.metric("node_agent_drift_repaired_total{kind=\"xfrm_state\"}");
        assert!(repaired >= Some(1.0), "counted as drift: {repaired:?}");
        assert!(
            std::fs::read_to_string(a.log())
                .unwrap()
                .contains("until the IPsec key is rotated"),
            "the repair tells the operator to rotate the key:\n{}",
            a.log_tail(20)
        );
        // Written back under the same key, the state's sequence numbers start over, and
        // node-b's anti-replay window drops them; a key rotation gives both sides fresh states.
        let (sent, received) = ping(&a.pod_ns(), &b.pod4(), 2);
        report(&format!(
            "ipsec: after the repair, before a key rotation: {received} of {sent} pings got through"
        ));
        for n in [&a, &b] {
            write_keys(&n.key_file(), &[KEY3, KEY4], true);
        }
        for n in [&a, &b] {
            c.wait_states(n, STATES_PER_PEER, 4, Duration::from_secs(30));
        }
        assert_eq!(
            ping(&a.pod_ns(), &b.pod4(), 3),
            (3, 3),
            "traffic again on the new key"
        );
        assert_no_clear_pod_traffic("after the repair and the rotation", &cap);
    });
}

/// Sets the flag when dropped, also while unwinding from a panic.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A step of a rotation as the test sees it: what it is, and whether it shows yet.
type Step<'a> = (&'static str, Box<dyn Fn() -> bool + 'a>);

/// Marks on `t`, until `stop`, each step of a key rotation 3 -> 4 between `a` and `b` when the
/// kernel or the agent first shows it: so a lost ping can be laid beside them.
fn watch_rotation(a: &SimNode, b: &SimNode, t: &Timeline, stop: &AtomicBool) {
    let sends_4 = |n: &SimNode| n.metric("node_agent_ipsec_send_spi") == Some(4.0);
    let mut steps: Vec<Step> = vec![
        (
            "node-b has key 4's states",
            Box::new(|| b.spis().contains(&4)),
        ),
        ("node-a sends with SPI 4", Box::new(|| sends_4(a))),
        ("node-b sends with SPI 4", Box::new(|| sends_4(b))),
        (
            "node-a has no key 3 state",
            Box::new(|| !a.spis().contains(&3)),
        ),
        (
            "node-b has no key 3 state",
            Box::new(|| !b.spis().contains(&3)),
        ),
    ];
    while !stop.load(Ordering::Relaxed) && !steps.is_empty() {
        steps.retain(|(what, shown)| {
            let now = shown();
            if now {
                t.mark(what);
            }
            !now
        });
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The delays keep the contract `docs/ipsec.md` gives operators, with room for a guest under
/// TCG: the propagation delay exceeds the spread of the key file's arrival (1 s here) plus the
/// agent's 2 s look at it plus a reconcile, and the rotation delay exceeds how long node-a's
/// agent is away (the kill, then a start that takes 10 s or more in a loaded guest): a peer
/// retires the old key on its own schedule, and a node whose agent is down when that comes
/// still sends with it.
#[test]
fn a_key_rotation_to_the_per_sender_spi_layout_loses_almost_nothing_survives_a_kill_and_leaves_only_the_new_key()
 {
    with_cluster(node_agent_tests::test_name!(), |c| {
        let a = c.add_node("node-a", 1);
        let b = c.add_node("node-b", 2);
        for n in [&a, &b] {
            write_keys(&n.key_file(), &[KEY3], true);
        }
        c.write_nodes(&[a.test_node(), b.test_node()]);
        let delays = [
            "--ipsec-key-propagation-delay",
            "5s",
            "--ipsec-key-rotation-delay",
            "30s",
        ];
        let mut agent_a = c.start_agent(&a, &delays);
        let _agent_b = c.start_agent(&b, &delays);
        all_up(c, &[&a, &b], 1, 3);

        let cap = Capture::start();
        let t = Timeline::start();
        let stop = AtomicBool::new(false);
        let run = std::thread::scope(|s| {
            s.spawn(|| watch_rotation(&a, &b, &t, &stop));
            // The watcher stops however this closure ends: a failed wait must fail the test,
            // not leave the scope waiting for a step that never comes.
            let _stop = StopOnDrop(&stop);
            let pings = LongPing::start(&a.pod_ns(), &b.pod4(), "0.1");
            std::thread::sleep(Duration::from_secs(1));
            // The Secret reaches the two nodes a second apart.
            write_keys(&a.key_file(), &[KEY3, KEY4_PER_SENDER], true);
            t.mark("node-a's key file gets key 4");
            std::thread::sleep(Duration::from_secs(1));
            write_keys(&b.key_file(), &[KEY3, KEY4_PER_SENDER], true);
            t.mark("node-b's key file gets key 4");
            // The agent writes the new key's states one message at a time, so the wait is for
            // the whole set: a look between two of those writes sees both SPIs and 6 states.
            // Too many states, or too few for good, times the wait out.
            wait_for(
                "node-a receiving both keys: 4 states per family while rotating",
                Duration::from_secs(10),
                || {
                    let states = a.states();
                    let keys: BTreeSet<Option<u8>> = states
                        .iter()
                        .map(|s| Spi::from_wire(s.2).map(Spi::key))
                        .collect();
                    states.len() == 2 * STATES_PER_PEER
                        && keys == BTreeSet::from([Some(3), Some(4)])
                },
            );
            t.mark("node-a has states for 3 and 4");
            // node-a is killed in the middle of the rotation and comes back.
            agent_a.kill().unwrap();
            agent_a.wait().unwrap();
            t.mark("node-a's agent killed");
            std::thread::sleep(Duration::from_millis(500));
            let agent_a = c.start_agent(&a, &delays);
            t.mark("node-a's agent started again");
            for n in [&a, &b] {
                c.wait_states(n, STATES_PER_PEER, 4, Duration::from_secs(90));
            }
            t.mark("both nodes have only key 4's states");
            (pings.stop(), agent_a)
        });
        let (run, _agent_a) = run;
        let lost = run.sent - run.received;
        let steps = ["IPsec keys", "reconciled", "deleted"];
        report(&format!(
            "ipsec: key rotation 3 (key SPI layout) -> 4 (per-sender) with node-a killed half-way: {lost} of {} pings lost{}",
            run.sent,
            if lost == 0 {
                String::new()
            } else {
                format!(
                    " (sequence numbers {:?}, one every 0.1 s from +0)\n{t}\
                     node-a's xfrm errors: {}\nnode-b's xfrm errors: {}\n\
                     node-a's log:\n{}\nnode-b's log:\n{}",
                    run.lost,
                    a.xfrm_errors(),
                    b.xfrm_errors(),
                    a.log_grep(&steps),
                    b.log_grep(&steps)
                )
            }
        ));
        assert!(run.sent >= 50, "the ping ran ({} sent)", run.sent);
        assert!(
            lost <= 3,
            "a rotation loses no more than a few packets: {lost} of {} (above: when)",
            run.sent,
        );
        assert_no_clear_pod_traffic("a key rotation", &cap);
        assert_eq!(
            ping(&a.pod_ns(), &b.pod6(), 3),
            (3, 3),
            "IPv6 on the new key"
        );
        for n in [&a, &b] {
            assert_eq!(n.metric("node_agent_ipsec_send_spi"), Some(4.0));
            assert_eq!(n.metric("node_agent_ipsec_send_per_sender_spi"), Some(1.0));
            assert_eq!(n.metric("node_agent_ipsec_keys_in_use"), Some(1.0));
            let states = n.states();
            let per_sender = |s: &(String, String, u32)| {
                Spi::from_wire(s.2) == Some(Spi::new(4, SpiLayout::PerSender, s.0.parse().unwrap()))
            };
            assert!(
                states.iter().all(per_sender),
                "{}: every state's SPI is key 4 under its sender's tag: {states:?}",
                n.name
            );
            let status = n.ipsec_status();
            assert_eq!(
                status["nodes"][0]["sent_layout"], "per-sender",
                "{status:#}"
            );
            assert_eq!(status["keys"][1]["spi_layout"], "per-sender", "{status:#}");
        }
        report(&format!(
            "ipsec: node-a's states after the rotation (src, dst, SPI): {:?}",
            a.states()
        ));
    });
}

#[test]
fn a_node_deleted_while_the_agent_is_down_and_its_ip_recycled_leaves_nothing_behind() {
    with_cluster(node_agent_tests::test_name!(), |c| {
        let a = c.add_node("node-a", 1);
        let b = c.add_node("node-b", 2);
        // node-c exists only in the list; node-d later gets its addresses and CIDRs.
        let node_c = TestNode {
            name: "node-c".into(),
            ips: vec!["192.168.77.3".into(), "fd00:77::3".into()],
            cidrs: vec!["10.244.3.0/24".into(), "fd00:244:3::/64".into()],
            ..TestNode::default()
        };
        // A global key here (the other tests use per-pair keys), in the per-sender SPI layout
        // from the start: a recycled address must not let node-d inherit anything of node-c's
        // either way.
        for n in [&a, &b] {
            write_keys(&n.key_file(), &[KEY3_PER_SENDER], false);
        }
        c.write_nodes(&[a.test_node(), b.test_node(), node_c]);
        // Removing one of two remote nodes is half the cluster: above the brake's ratio.
        let ratio = ["--max-prune-ratio", "0.6"];
        let mut agent_a = c.start_agent(&a, &ratio);
        let _agent_b = c.start_agent(&b, &ratio);
        all_up(c, &[&a, &b], 2, 3);
        let c_mark = out_state_mark(&a, "192.168.77.3");

        let cap = Capture::start();
        let pings = LongPing::start(&a.pod_ns(), &b.pod4(), "0.1");
        agent_a.kill().unwrap();
        agent_a.wait().unwrap();
        // While node-a's agent is down: node-c goes, node-d comes up on its addresses.
        let d = c.add_node("node-d", 3);
        write_keys(&d.key_file(), &[KEY3_PER_SENDER], false);
        let mut node_d = d.test_node();
        node_d.uid = Some("uid-node-d-recycled".into());
        c.write_nodes(&[a.test_node(), b.test_node(), node_d]);
        let _agent_d = c.start_agent(&d, &ratio);
        c.wait_states(&d, 2 * STATES_PER_PEER, 3, Duration::from_secs(30));
        let _agent_a = c.start_agent(&a, &ratio);
        let toward_d = || {
            // Between the old states' delete and the new ones' create there are none.
            a.states().len() == 2 * STATES_PER_PEER
                && state_mark(&a, "192.168.77.3").is_ok_and(|m| m != c_mark)
        };
        let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_for(
                "node-a's states toward node-d",
                Duration::from_secs(30),
                toward_d,
            )
        }));
        assert!(
            waited.is_ok(),
            "node-a never programmed node-d: states {:?}\nagent log:\n{}",
            a.states(),
            a.log_tail(40)
        );
        let d_mark = out_state_mark(&a, "192.168.77.3");
        report(&format!(
            "ipsec: node-c's states had mark {c_mark}, node-d's have {d_mark}"
        ));
        let policies = a.ip(&["xfrm", "policy"]);
        let c_value = c_mark.split('/').next().unwrap();
        assert!(
            !policies.contains(c_value),
            "a policy of node-c is left:\n{policies}"
        );
        assert_eq!(
            ping(&a.pod_ns(), &d.pod4(), 3),
            (3, 3),
            "node-a reaches node-d's pod"
        );
        assert_eq!(ping(&a.pod_ns(), &d.pod6(), 3), (3, 3));
        let run = pings.stop();
        let (sent, received) = (run.sent, run.received);
        report(&format!(
            "ipsec: node-a -> node-b across the restart: {received} of {sent} pings answered"
        ));
        assert!(
            received + 3 >= sent,
            "the kernel kept encrypting while the agent was down: sequence numbers {:?} lost",
            run.lost
        );
        assert_no_clear_pod_traffic("a restart with churn", &cap);
    });
}

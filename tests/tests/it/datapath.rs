//! Kernel tier: the tc datapath and its pinned maps, in the real kernel.
//!
//! Each test runs in its own network and mount namespace with a private bpffs (see
//! `node_agent_tests::sandbox`); none of them can touch the host's network or bpffs.

use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use aya::programs::TcAttachType;
use node_agent::datapath::attach::Attachment;
use node_agent::datapath::{Datapath, DatapathConfig, DatapathError, node_ids_pin, node_stats_pin};
use node_agent::node_map::{NodeEntry, NodeMap, NodeStatsMap};
use node_agent_common::{NodeStats, NodeValue};
use node_agent_tests::require_sandbox;
use node_agent_tests::{VethPair, agent_bin, attached, ip, report, run, sandbox};

fn ipaddr(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn value(id: u16, spi: u8) -> NodeValue {
    NodeValue { id, spi, flags: 0 }
}

fn load(bpffs: &Path, ifaces: &[&str]) -> Datapath {
    let mut config = DatapathConfig::new(bpffs);
    config.ifaces = ifaces.iter().map(|s| (*s).to_owned()).collect();
    Datapath::load(&config).unwrap_or_else(|e| panic!("loading the datapath: {e}"))
}

#[test]
fn pinned_entries_are_read_intact_by_the_next_loader() {
    require_sandbox!("pinned_entries_are_read_intact_by_the_next_loader");
    sandbox(|sb| {
        let first = load(&sb.bpffs, &[]);
        let mut map = NodeMap::open(&node_ids_pin(&sb.bpffs)).unwrap();
        map.upsert(ipaddr("10.0.0.3"), value(103, 3)).unwrap();
        map.upsert(ipaddr("fd00::3"), value(104, 3)).unwrap();
        map.upsert(ipaddr("10.0.0.4"), value(105, 0)).unwrap();
        map.remove(ipaddr("10.0.0.4")).unwrap();
        map.remove(ipaddr("10.0.0.4"))
            .expect("removing an absent entry is not an error");
        drop(map);
        drop(first);

        // A second agent, as after a restart.
        let _second = load(&sb.bpffs, &[]);
        let dump = NodeMap::open(&node_ids_pin(&sb.bpffs))
            .unwrap()
            .dump()
            .unwrap();
        assert_eq!(
            dump.entries,
            vec![
                NodeEntry {
                    ip: ipaddr("10.0.0.3"),
                    node_id: 103,
                    spi: 3,
                    flags: 0
                },
                NodeEntry {
                    ip: ipaddr("fd00::3"),
                    node_id: 104,
                    spi: 3,
                    flags: 0
                },
            ]
        );
        assert!(dump.undecodable.is_empty());

        // The CLI reads the same pin.
        let out = run(Command::new(agent_bin())
            .args(["map", "dump", "--output", "json", "--bpffs"])
            .arg(&sb.bpffs));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json[0]["ip"], "10.0.0.3");
        assert_eq!(json[0]["node_id"], 103);
        assert_eq!(json[1]["ip"], "fd00::3");
        assert_eq!(json[1]["node_id"], 104);
        let text = run(Command::new(agent_bin())
            .args(["map", "dump", "--bpffs"])
            .arg(&sb.bpffs));
        let text = String::from_utf8(text.stdout).unwrap();
        assert!(
            text.contains("10.0.0.3") && text.contains("2 entries"),
            "{text}"
        );
    });
}

#[test]
fn incompatible_pin_is_refused_and_left_in_place() {
    require_sandbox!("incompatible_pin_is_refused_and_left_in_place");
    sandbox(|sb| {
        let pin = node_ids_pin(&sb.bpffs);
        std::fs::create_dir_all(pin.parent().unwrap()).unwrap();
        run(Command::new("bpftool")
            .args(["map", "create"])
            .arg(&pin)
            .args([
                "type", "hash", "key", "8", "value", "4", "entries", "16", "name", "node_ids",
            ]));
        let err = match Datapath::load(&DatapathConfig::new(&sb.bpffs)) {
            Err(e) => e,
            Ok(_) => panic!("an incompatible pin was accepted"),
        };
        assert!(matches!(err, DatapathError::PinMismatch { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains(&pin.display().to_string()),
            "names the pin: {msg}"
        );
        assert!(
            msg.contains("key 8 B") && msg.contains("key 20 B"),
            "both layouts: {msg}"
        );
        run(Command::new("bpftool")
            .args(["map", "show", "pinned"])
            .arg(&pin));
    });
}

#[test]
fn pin_with_another_capacity_is_refused() {
    require_sandbox!("pin_with_another_capacity_is_refused");
    sandbox(|sb| {
        let mut small = DatapathConfig::new(&sb.bpffs);
        small.node_map_max = 1024;
        drop(Datapath::load(&small).unwrap());
        let mut big = small.clone();
        big.node_map_max = 2048;
        let err = Datapath::load(&big)
            .err()
            .expect("a smaller pin was accepted");
        let msg = err.to_string();
        assert!(
            msg.contains("1024 entries") && msg.contains("2048 entries"),
            "{msg}"
        );
        // The original pin is untouched and still usable.
        drop(Datapath::load(&small).unwrap());
    });
}

#[test]
fn bpftool_dump_shows_field_names() {
    require_sandbox!("bpftool_dump_shows_field_names");
    sandbox(|sb| {
        let _dp = load(&sb.bpffs, &[]);
        let mut map = NodeMap::open(&node_ids_pin(&sb.bpffs)).unwrap();
        map.upsert(ipaddr("10.0.0.3"), value(103, 3)).unwrap();
        let out = run(Command::new("bpftool")
            .args(["-j", "map", "dump", "pinned"])
            .arg(node_ids_pin(&sb.bpffs)));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        // With BTF, `-j` adds the decoded key and value under "formatted".
        let entry = &json[0]["formatted"];
        assert_eq!(entry["key"]["family"], 4, "{json}");
        assert_eq!(entry["key"]["pad"], serde_json::json!([0, 0, 0]));
        assert_eq!(
            entry["key"]["ip"],
            serde_json::json!([10, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
        );
        assert_eq!(entry["value"]["id"], 103);
        assert_eq!(entry["value"]["spi"], 3);
        assert_eq!(entry["value"]["flags"], 0);
    });
}

/// Sends `n` datagrams to a closed port at `to` and waits after each for the peer's ICMP port
/// unreachable. Returns how many came back (as ECONNREFUSED) within the timeout.
fn probe(to: &str, n: usize, payload: &[u8]) -> usize {
    let to: SocketAddr = SocketAddr::new(ipaddr(to), 9);
    let bind: SocketAddr = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }
        .parse()
        .unwrap();
    let sock = UdpSocket::bind(bind).unwrap();
    sock.connect(to).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(400)))
        .unwrap();
    let mut refused = 0;
    let mut buf = [0u8; 64];
    for _ in 0..n {
        sock.send(payload).unwrap();
        match sock.recv(&mut buf) {
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => refused += 1,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            other => panic!("unexpected reply from {to}: {other:?}"),
        }
    }
    refused
}

fn stats(bpffs: &Path, id: u16) -> NodeStats {
    NodeStatsMap::open(&node_stats_pin(bpffs))
        .unwrap()
        .get(id)
        .unwrap()
}

/// Packets and bytes over every node ID: what an unknown peer must not change.
fn all_stats(bpffs: &Path) -> (u64, u64) {
    let map = NodeStatsMap::open(&node_stats_pin(bpffs)).unwrap();
    (0..=u16::MAX).fold((0, 0), |(p, b), id| {
        let s = map.get(id).unwrap();
        (p + s.rx_packets + s.tx_packets, b + s.rx_bytes + s.tx_bytes)
    })
}

struct Family {
    name: &'static str,
    peer: &'static str,
    unknown: &'static str,
    /// `ip` flag for this family's rules and routes.
    flag: &'static str,
    /// Ethernet + IP + UDP header bytes in front of the payload.
    headers: u64,
}

const V4: Family = Family {
    name: "IPv4",
    peer: VethPair::PEER_V4,
    unknown: VethPair::UNKNOWN_V4,
    flag: "-4",
    headers: 14 + 20 + 8,
};
const V6: Family = Family {
    name: "IPv6",
    peer: VethPair::PEER_V6,
    unknown: VethPair::UNKNOWN_V6,
    flag: "-6",
    headers: 14 + 40 + 8,
};

/// Drops every locally delivered packet whose mark is exactly `mark`: the rule sits in front
/// of the `local` table, whose rule is moved behind it, and sends such packets to a table that
/// only prohibits. A probe answered before the rule and not after proves the mark was set.
fn drop_packets_marked(family: &Family, mark: u32) {
    let f = family.flag;
    ip(&[f, "rule", "add", "pref", "100", "lookup", "local"]);
    ip(&[f, "rule", "del", "pref", "0", "lookup", "local"]);
    let fwmark = format!("{mark:#x}/0xffffffff");
    ip(&[
        f, "rule", "add", "pref", "50", "fwmark", &fwmark, "lookup", "100",
    ]);
    ip(&[f, "route", "add", "prohibit", "default", "table", "100"]);
}

fn counts_and_marks(family: &Family, mark_mask: u32, expected_mark: u32) {
    sandbox(|sb| {
        VethPair::create();
        let mut config = DatapathConfig::new(&sb.bpffs);
        config.ifaces = vec!["va".into()];
        config.mark_mask = mark_mask;
        let _dp = Datapath::load(&config).unwrap();
        let mut map = NodeMap::open(&node_ids_pin(&sb.bpffs)).unwrap();
        map.upsert(ipaddr(family.peer), value(7, 0)).unwrap();

        let payload = [0xabu8; 16];
        let n = 5;
        assert_eq!(
            probe(family.peer, n, &payload),
            n,
            "{}: the peer answers every probe",
            family.name
        );
        let s = stats(&sb.bpffs, 7);
        assert_eq!(
            s.tx_packets, n as u64,
            "{}: egress counted per packet",
            family.name
        );
        assert_eq!(
            s.tx_bytes,
            n as u64 * (family.headers + payload.len() as u64)
        );
        assert_eq!(
            s.rx_packets, n as u64,
            "{}: each ICMP error counted on ingress",
            family.name
        );
        assert!(
            s.rx_bytes > s.rx_packets * family.headers,
            "{}: rx bytes {s:?}",
            family.name
        );

        // An unknown peer changes no counter at all.
        let before = all_stats(&sb.bpffs);
        assert_eq!(probe(family.unknown, 3, &payload), 3);
        assert_eq!(
            all_stats(&sb.bpffs),
            before,
            "{}: unknown peer counted",
            family.name
        );

        // The ingress mark: packets from the known peer carry it, those from the unknown do not.
        drop_packets_marked(family, expected_mark);
        assert_eq!(
            probe(family.peer, 2, &payload),
            0,
            "{}: marked replies dropped",
            family.name
        );
        assert_eq!(
            stats(&sb.bpffs, 7).rx_packets,
            n as u64 + 2,
            "counted before the drop"
        );
        assert_eq!(
            probe(family.unknown, 2, &payload),
            2,
            "{}: unknown peer unmarked",
            family.name
        );
    });
}

#[test]
fn ipv4_peer_is_counted_and_marked_and_unknown_peer_is_not() {
    require_sandbox!("ipv4_peer_is_counted_and_marked_and_unknown_peer_is_not");
    counts_and_marks(&V4, 0xFFFF_0000, 7 << 16);
}

#[test]
fn ipv6_peer_is_counted_and_marked_and_unknown_peer_is_not() {
    require_sandbox!("ipv6_peer_is_counted_and_marked_and_unknown_peer_is_not");
    counts_and_marks(&V6, 0xFFFF_0000, 7 << 16);
}

#[test]
fn mark_mask_is_configurable() {
    require_sandbox!("mark_mask_is_configurable");
    counts_and_marks(&V4, 0x0FFF_F000, 7 << 12);
}

#[test]
fn restart_keeps_the_programs_attached_and_the_next_agent_takes_them_over() {
    require_sandbox!("restart_keeps_the_programs_attached_and_the_next_agent_takes_them_over");
    sandbox(|sb| {
        VethPair::create();
        let first = load(&sb.bpffs, &["va"]);
        assert!(
            first
                .attachments()
                .iter()
                .all(|(_, _, a)| *a == Attachment::Created)
        );
        NodeMap::open(&node_ids_pin(&sb.bpffs))
            .unwrap()
            .upsert(ipaddr(VethPair::PEER_V4), value(9, 0))
            .unwrap();
        drop(first);

        // No agent running: the datapath still counts.
        assert_eq!(probe(VethPair::PEER_V4, 2, b"x"), 2);
        assert_eq!(
            stats(&sb.bpffs, 9).tx_packets,
            2,
            "program detached when the agent left"
        );

        let second = load(&sb.bpffs, &["va"]);
        assert_eq!(second.attachments().len(), 2);
        assert!(
            second
                .attachments()
                .iter()
                .all(|(_, _, a)| *a == Attachment::TakenOver)
        );
        for dir in [TcAttachType::Ingress, TcAttachType::Egress] {
            assert_eq!(
                attached("va", dir),
                1,
                "exactly one program per direction after takeover"
            );
        }
        assert_eq!(probe(VethPair::PEER_V4, 2, b"x"), 2);
        assert_eq!(
            stats(&sb.bpffs, 9).tx_packets,
            4,
            "counting continues after takeover"
        );
    });
}

#[test]
fn independent_loader_accepts_the_object_and_its_maps_carry_btf() {
    require_sandbox!("independent_loader_accepts_the_object_and_its_maps_carry_btf");
    let object = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/ebpf/node-agent.bpf.o");
    assert!(
        object.is_file(),
        "{} is missing: run `cargo xtask build-ebpf`",
        object.display()
    );
    sandbox(|sb| {
        let progs = sb.bpffs.join("progs");
        let maps = sb.bpffs.join("maps");
        std::fs::create_dir(&maps).unwrap();
        let out = run(Command::new("bpftool")
            .args(["-d", "prog", "loadall"])
            .arg(&object)
            .arg(&progs)
            .args(["type", "classifier", "pinmaps"])
            .arg(&maps));
        // libbpf's debug output brackets each program's verifier log with its name.
        let log = String::from_utf8_lossy(&out.stderr);
        let mut current = None;
        let mut seen = Vec::new();
        for line in log.lines() {
            if let Some(rest) = line.strip_prefix("libbpf: prog '")
                && line.contains("BEGIN PROG LOAD LOG")
            {
                current = rest.split('\'').next().map(str::to_owned);
            } else if let (Some(name), Some(rest)) = (&current, line.strip_prefix("processed ")) {
                let insns = rest.split_whitespace().next().unwrap();
                report(&format!("verifier: {name} processed {insns} insns"));
                seen.push(name.clone());
            }
        }
        seen.sort();
        assert_eq!(
            seen,
            ["tc_egress", "tc_ingress"],
            "verifier stats for both programs:\n{log}"
        );
        report(&format!(
            "object: {} bytes",
            std::fs::metadata(&object).unwrap().len()
        ));
        for map in ["NODE_IDS", "NODE_STATS", "AYA_LOGS"] {
            let out = run(Command::new("bpftool")
                .args(["-j", "map", "show", "pinned"])
                .arg(maps.join(map)));
            let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert!(
                info["btf_id"].as_u64().is_some_and(|id| id > 0),
                "{map} has no BTF: {info}"
            );
        }
    });
}

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
use node_agent::datapath::maps::{NodeEntry, NodeMap, NodeStatsMap};
use node_agent::datapath::records::freed_ids::{self, FreedIds};
use node_agent::datapath::records::recent_removals::{self, RecentRemovalsRecord};
use node_agent::datapath::{Datapath, DatapathConfig, DatapathError, node_ids_pin, node_stats_pin};
use node_agent_common::{NodeStats, NodeValue};
use node_agent_tests::require_sandbox;
use node_agent_tests::{VethPair, agent_bin, attached, ip, ip_batch, report, run, sandbox};
use state::checkpoint::RecentRemovals;
use state::ids::FreedId;
use state::objects::NodeId;

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
    require_sandbox!();
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
    require_sandbox!();
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

/// A pin of another capacity is no incompatibility: it is loaded at its own capacity (growing
/// it is the start's, `backends::load_datapath`), and left as it is.
#[test]
fn a_pin_of_another_capacity_is_loaded_at_its_own() {
    require_sandbox!();
    sandbox(|sb| {
        let mut small = DatapathConfig::new(&sb.bpffs);
        small.node_map_max = 1024;
        drop(Datapath::load(&small).unwrap());
        let mut big = small.clone();
        big.node_map_max = 2048;
        let dp = Datapath::load(&big).unwrap();
        assert_eq!(dp.capacity(), 1024);
        let pinned = node_agent::datapath::pins::MapLayout::of_pin(&node_ids_pin(&sb.bpffs));
        assert_eq!(pinned.unwrap().unwrap().max_entries, 1024);
    });
}

/// A freed-ID record pinned by an agent before the record was mappable (what `bpftool` makes
/// here: an array created without flags) is read as it is by a dry run, then replaced by a
/// mappable copy holding every slot, through a staging pin that a crashed attempt may have left.
#[test]
fn a_freed_id_record_from_before_it_was_mappable_is_copied_into_a_mappable_one() {
    require_sandbox!();
    sandbox(|sb| {
        let pin = freed_ids::pin(&sb.bpffs);
        std::fs::create_dir_all(pin.parent().unwrap()).unwrap();
        let old = |at: &Path| {
            run(Command::new("bpftool")
                .args(["map", "create"])
                .arg(at)
                .args([
                    "type",
                    "array",
                    "key",
                    "4",
                    "value",
                    "8",
                    "entries",
                    "65536",
                    "name",
                    "freed_ids",
                ]));
        };
        old(&pin);
        let slots = [(7u32, 1_700_000_000u64), (65_535, 1_700_000_123), (1, 42)];
        for (id, secs) in slots {
            let key = id.to_le_bytes().map(|b| b.to_string());
            let value = secs.to_le_bytes().map(|b| b.to_string());
            run(Command::new("bpftool")
                .args(["map", "update", "pinned"])
                .arg(&pin)
                .arg("key")
                .args(key)
                .arg("value")
                .args(value));
        }
        let expected: Vec<FreedId> = slots
            .iter()
            .map(|&(id, secs)| FreedId {
                id: NodeId::new(u16::try_from(id).unwrap()).unwrap(),
                freed_at: Duration::from_secs(secs),
            })
            .collect();
        let sorted = |mut v: Vec<FreedId>| {
            v.sort_by_key(|f| f.id);
            v
        };

        // A dry run reads the old record and changes nothing.
        let read = FreedIds::open(&pin).unwrap().read().unwrap();
        assert_eq!(sorted(read), sorted(expected.clone()));
        assert!(!freed_ids::is_mappable(&pin).unwrap());

        // An interrupted replacement left its staging pin.
        let staged = pin.with_file_name("freed_ids_next");
        old(&staged);
        let mut record = FreedIds::open_or_create(&pin).unwrap();
        assert!(
            freed_ids::is_mappable(&pin).unwrap(),
            "replaced by a mappable record"
        );
        assert!(!staged.exists(), "the staging pin is gone");
        assert_eq!(sorted(record.read().unwrap()), sorted(expected.clone()));

        // Writes land in the pinned record: another reader, and bpftool, see them.
        let later = FreedId {
            id: NodeId::new(9).unwrap(),
            freed_at: Duration::from_millis(1_800_000_000_500),
        };
        record.write(&[later]).unwrap();
        let again = FreedIds::open_or_create(&pin).unwrap().read().unwrap();
        let mut with_later = expected.clone();
        with_later.push(FreedId {
            freed_at: Duration::from_secs(1_800_000_001),
            ..later
        });
        assert_eq!(sorted(again), sorted(with_later));
        let out = run(Command::new("bpftool")
            .args(["--json", "map", "lookup", "pinned"])
            .arg(&pin)
            .args(["key", "9", "0", "0", "0"]));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let bytes: Vec<u8> = json["value"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| u8::from_str_radix(b.as_str().unwrap().trim_start_matches("0x"), 16).unwrap())
            .collect();
        assert_eq!(bytes, 1_800_000_001u64.to_le_bytes());

        // A new record is mappable from the start.
        std::fs::remove_file(&pin).unwrap();
        let fresh = FreedIds::open_or_create(&pin).unwrap();
        assert!(freed_ids::is_mappable(&pin).unwrap());
        assert!(fresh.read().unwrap().is_empty());
    });
}

/// The record of recent removals lives in the pinned map: a record this agent made says it
/// knows nothing yet; one that was there reads back every entry, oldest first, from another
/// opener; a full ring merges what it displaces inside the window; another layout is refused
/// and left alone.
#[test]
fn the_record_of_recent_removals_outlives_its_opener_and_refuses_another_layout() {
    require_sandbox!();
    sandbox(|sb| {
        let pin = recent_removals::pin(&sb.bpffs);
        std::fs::create_dir_all(pin.parent().unwrap()).unwrap();
        let at = |secs: u64, nodes: u32, objects: u32| RecentRemovals {
            at: Duration::new(1_800_000_000 + secs, 7),
            nodes,
            objects,
        };
        let mut record = RecentRemovalsRecord::open_or_create(&pin).unwrap();
        assert_eq!(record.read(), None, "made now: it knows nothing of before");
        let since = Duration::from_secs(1_800_000_000);
        record.push(at(1, 0, 12), since).unwrap();
        record.push(at(2, 3, 0), since).unwrap();
        let again = RecentRemovalsRecord::open_or_create(&pin).unwrap();
        assert_eq!(again.read(), Some(vec![at(1, 0, 12), at(2, 3, 0)]));

        // Fill the ring: the next entry takes the oldest slot and, inside the window, its counts.
        let mut record = again;
        for i in 2..recent_removals::SLOTS {
            record.push(at(u64::from(i) + 10, 1, 0), since).unwrap();
        }
        record.push(at(5_000, 1, 1), since).unwrap();
        let read = RecentRemovalsRecord::open(&pin).unwrap().read().unwrap();
        assert_eq!(read.len(), recent_removals::SLOTS as usize);
        assert_eq!(read.first(), Some(&at(2, 3, 0)), "the oldest went");
        assert_eq!(read.last(), Some(&at(5_000, 1, 13)), "into the newest");
        let objects: u32 = read.iter().map(|r| r.objects).sum();
        assert_eq!(objects, 13, "nothing lost");

        // Another layout under the name: refused, and left as it was.
        std::fs::remove_file(&pin).unwrap();
        run(Command::new("bpftool")
            .args(["map", "create"])
            .arg(&pin)
            .args([
                "type", "array", "key", "4", "value", "8", "entries", "16", "name", "other",
            ]));
        let refused = RecentRemovalsRecord::open_or_create(&pin)
            .err()
            .expect("refused");
        assert!(
            refused
                .to_string()
                .contains("is not the record of recent removals"),
            "{refused}"
        );
        assert_eq!(
            node_agent::datapath::pins::MapLayout::of_pin(&pin)
                .unwrap()
                .unwrap()
                .value_size,
            8
        );
        report("the record of recent removals: read back, ring merged, foreign layout refused");
    });
}

#[test]
fn bpftool_dump_shows_field_names() {
    require_sandbox!();
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
    require_sandbox!();
    counts_and_marks(&V4, 0xFFFF_0000, 7 << 16);
}

#[test]
fn ipv6_peer_is_counted_and_marked_and_unknown_peer_is_not() {
    require_sandbox!();
    counts_and_marks(&V6, 0xFFFF_0000, 7 << 16);
}

#[test]
fn mark_mask_is_configurable() {
    require_sandbox!();
    counts_and_marks(&V4, 0x0FFF_F000, 7 << 12);
}

#[test]
fn restart_keeps_the_programs_attached_and_the_next_agent_takes_them_over() {
    require_sandbox!();
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

/// Whether this kernel has tcx links (6.6): without them the classifier is a cls_bpf filter at
/// a fixed place.
fn has_tcx() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut parts = release.trim().split(['.', '-']);
    let mut next = || {
        parts
            .next()
            .and_then(|p| p.parse::<u32>().ok())
            .unwrap_or(0)
    };
    (next(), next()) >= (6, 6)
}

/// Someone else's filter where ours goes is never replaced: on a kernel without tcx links
/// (where ours is a cls_bpf filter at a fixed priority and handle, taken over by a replace at
/// that place) the agent says whose filter is there and attaches nothing; with tcx links ours
/// goes in beside it. Either way theirs stays.
#[test]
fn a_foreign_filter_at_the_classifiers_place_is_never_replaced() {
    require_sandbox!();
    sandbox(|sb| {
        VethPair::create();
        let tc = |args: &[&str]| run(Command::new("tc").args(args));
        tc(&["qdisc", "add", "dev", "va", "clsact"]);
        // A classic BPF filter of someone else's at our priority (0x4e41) and handle.
        tc(&[
            "filter",
            "add",
            "dev",
            "va",
            "ingress",
            "pref",
            "20033",
            "handle",
            "1",
            "bpf",
            "bytecode",
            "1,6 0 0 4294967295,",
            "classid",
            "1:1",
        ]);
        let theirs = || {
            let out = tc(&["filter", "show", "dev", "va", "ingress"]);
            String::from_utf8_lossy(&out.stdout).contains("bytecode '1,6 0 0 4294967295'")
        };
        let mut config = DatapathConfig::new(&sb.bpffs);
        config.ifaces = vec!["va".into()];
        let loaded = Datapath::load(&config);
        if has_tcx() {
            let d = loaded.unwrap_or_else(|e| panic!("beside theirs: {e}"));
            assert!(
                d.attachments()
                    .iter()
                    .all(|(_, _, a)| *a == Attachment::Created)
            );
        } else {
            let e = loaded.err().expect("theirs is not taken over").to_string();
            assert!(e.contains("not ours") && e.contains("bpf filter"), "{e}");
        }
        assert!(theirs(), "their filter stays");
    });
}

#[test]
fn independent_loader_accepts_the_object_and_its_maps_carry_btf() {
    require_sandbox!();
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
            ["tc_egress", "tc_ingress", "tc_pod"],
            "verifier stats for every program:\n{log}"
        );
        report(&format!(
            "object: {} bytes",
            std::fs::metadata(&object).unwrap().len()
        ));
        for map in ["NODE_IDS", "NODE_STATS", "POD_CIDRS", "AYA_LOGS"] {
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

/// Whether one UDP datagram from the calling thread reaches `to` (the peer answers a closed port
/// with ICMP port unreachable, seen as ECONNREFUSED); a drop on the way times out, a policy
/// route answers with another error.
fn reaches(to: &str) -> bool {
    let to: SocketAddr = SocketAddr::new(ipaddr(to), 9);
    let sock = UdpSocket::bind("0.0.0.0:0").unwrap();
    sock.connect(to).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut buf = [0u8; 16];
    (0..2).any(|_| {
        sock.send(b"probe").is_ok()
            && matches!(sock.recv(&mut buf), Err(e) if e.kind() == ErrorKind::ConnectionRefused)
    })
}

/// A node (this namespace) with a pod behind the bridge `cni0` (10.244.1.2) and a remote node
/// on the uplink `va` whose pod CIDR 10.244.2.0/24 it routes to; the remote "pod" 10.244.2.1
/// answers probes.
fn pod_behind_a_bridge() {
    VethPair::create();
    node_agent_tests::sysctl("net/ipv4/ip_forward", "1");
    ip(&["netns", "add", "pod"]);
    ip(&[
        "link", "add", "p1", "type", "veth", "peer", "name", "p0", "netns", "pod",
    ]);
    ip(&["link", "add", "cni0", "type", "bridge"]);
    ip(&["link", "set", "p1", "master", "cni0", "up"]);
    ip(&["addr", "add", "10.244.1.1/24", "dev", "cni0"]);
    ip(&["link", "set", "cni0", "up"]);
    ip(&["route", "add", "10.244.2.0/24", "via", VethPair::PEER_V4]);
    let pod = "link set lo up\nlink set p0 up\naddr add 10.244.1.2/24 dev p0\nroute add default via 10.244.1.1\n";
    node_agent_tests::ip_batch(&["-n", "pod"], pod);
    let peer = "addr add 10.244.2.1/32 dev lo\nroute add 10.244.1.0/24 via 10.99.0.1\n";
    node_agent_tests::ip_batch(&["-n", "peer"], peer);
}

#[test]
fn pod_traffic_toward_a_remote_pod_cidr_is_marked_and_the_block_guard_drops_it() {
    use node_agent::backends::Backend;
    use node_agent::backends::xfrm::{KeyBook, XfrmBackend};
    use node_agent::datapath::maps::PodCidrMap;
    use node_agent_tests::in_netns;
    use state::node::Family as IpFamily;
    use state::objects::{KernelObject, Op, XfrmDir, XfrmGuard, mark};

    require_sandbox!();
    sandbox(|sb| {
        pod_behind_a_bridge();
        let remote_pod = "10.244.2.1";
        assert!(
            in_netns("pod", || reaches(remote_pod)),
            "routed before anything is loaded"
        );
        let mut config = DatapathConfig::new(&sb.bpffs);
        config.ifaces = vec!["va".into()];
        config.pod_ifaces = vec!["cni0".into()];
        config.ipsec = true;
        let dp = Datapath::load(&config).unwrap();
        assert_eq!(
            dp.attachments().len(),
            3,
            "uplink both ways, the pod bridge on ingress"
        );
        let mut cidrs = PodCidrMap::open(&node_agent::datapath::pod_cidrs_pin(&sb.bpffs)).unwrap();
        let net = |s: &str| s.parse::<ipnet::IpNet>().unwrap();
        cidrs.upsert(net("10.244.0.0/16"), value(7, 3)).unwrap();
        cidrs.upsert(net("10.244.2.0/24"), value(9, 5)).unwrap();
        assert!(
            in_netns("pod", || reaches(remote_pod)),
            "a mark alone changes nothing"
        );

        // The /24 wins over the /16: packets carry node 9's OUT mark with SPI 5.
        let node9 = state::objects::NodeId::new(9).unwrap();
        let want = mark::encode(node9, 5, XfrmDir::Out);
        ip(&[
            "rule",
            "add",
            "pref",
            "50",
            "fwmark",
            &format!("{want:#x}/0xffffff00"),
            "prohibit",
        ]);
        assert!(!in_netns("pod", || reaches(remote_pod)), "marked {want:#x}");
        // SPI 0 means no IPsec toward the node: unmarked.
        cidrs.upsert(net("10.244.2.0/24"), value(9, 0)).unwrap();
        assert!(
            in_netns("pod", || reaches(remote_pod)),
            "SPI 0 is left unmarked"
        );
        ip(&["rule", "del", "pref", "50"]);

        // The block guard: traffic marked for encryption that no node policy takes is dropped.
        cidrs.upsert(net("10.244.2.0/24"), value(9, 5)).unwrap();
        node_agent_tests::runtime().block_on(async {
            let mut x = XfrmBackend::new(KeyBook::default()).unwrap();
            let [block, _] = XfrmGuard::all(IpFamily::V4);
            let r = x.apply(&[Op::Create(KernelObject::XfrmGuard(block))]).await;
            assert!(r.iter().all(Result::is_ok), "{r:?}");
        });
        let blocked_before = node_agent::backends::xfrm::stats::read().unwrap();
        assert!(
            !in_netns("pod", || reaches(remote_pod)),
            "dropped, never sent in the clear"
        );
        if let (Some(before), Some(after)) = (
            blocked_before,
            node_agent::backends::xfrm::stats::read().unwrap(),
        ) {
            let get = |s: &[(String, u64)]| {
                s.iter()
                    .find(|(n, _)| n == "XfrmOutPolBlock")
                    .map(|(_, v)| *v)
            };
            assert!(
                get(&after) > get(&before),
                "counted as XfrmOutPolBlock: {after:?}"
            );
        } else {
            report(
                "pod_traffic_toward_a_remote_pod_cidr_is_marked_and_the_block_guard_drops_it: this kernel keeps no xfrm statistics; the drop is not counted",
            );
        }
        // Unmarked traffic never meets the guard.
        cidrs.remove(net("10.244.2.0/24")).unwrap();
        cidrs.remove(net("10.244.0.0/16")).unwrap();
        assert!(
            in_netns("pod", || reaches(remote_pod)),
            "unmarked traffic is not the guard's"
        );
    });
}

/// The interfaces a check of the attachments finds missing.
fn missing(dp: &mut Datapath) -> Vec<String> {
    dp.check_attachments();
    dp.pending()
}

#[test]
fn a_pod_interface_that_appears_later_gets_its_classifier_then() {
    require_sandbox!();
    sandbox(|sb| {
        let mut config = DatapathConfig::new(&sb.bpffs);
        config.pod_ifaces = vec!["cni7".into()];
        let mut dp = Datapath::load(&config).expect("loads without the bridge");
        assert_eq!(dp.pending(), ["cni7"]);
        assert_eq!(missing(&mut dp), ["cni7"], "still missing");
        ip(&["link", "add", "cni7", "type", "bridge"]);
        assert!(missing(&mut dp).is_empty());
        assert_eq!(attached("cni7", TcAttachType::Ingress), 1);
        assert!(
            dp.attachments()
                .iter()
                .any(|(i, d, _)| i == "cni7" && *d == TcAttachType::Ingress)
        );
    });
}

/// A pod interface deleted and made again under its name (a CNI reset) lost our classifier
/// with the old device: the next look finds the new device and attaches it again (until then
/// it is pending, and readiness names it). Left unattached, its pod traffic went unmarked,
/// past IPsec.
#[test]
fn a_pod_interface_deleted_and_made_again_gets_its_classifier_back() {
    require_sandbox!();
    sandbox(|sb| {
        ip(&["link", "add", "cni8", "type", "bridge"]);
        let mut config = DatapathConfig::new(&sb.bpffs);
        config.pod_ifaces = vec!["cni8".into()];
        let mut dp = Datapath::load(&config).unwrap();
        assert!(dp.pending().is_empty());
        assert_eq!(attached("cni8", TcAttachType::Ingress), 1);
        assert!(
            missing(&mut dp).is_empty(),
            "the same device: nothing to do"
        );
        ip(&["link", "del", "cni8"]);
        assert_eq!(missing(&mut dp), ["cni8"], "gone: pending again");
        ip(&["link", "add", "cni8", "type", "bridge"]);
        assert_eq!(attached("cni8", TcAttachType::Ingress), 0, "a new device");
        assert!(missing(&mut dp).is_empty());
        assert_eq!(attached("cni8", TcAttachType::Ingress), 1);
        // Made again between two looks: found by its new index.
        ip(&["link", "del", "cni8"]);
        ip(&["link", "add", "cni8", "type", "bridge"]);
        assert!(missing(&mut dp).is_empty());
        assert_eq!(attached("cni8", TcAttachType::Ingress), 1);
    });
}

/// An interface taken out of `--datapath-iface` loses our classifier at the next start (on
/// TCX kernels, where our links are pins of ours; a netlink filter of a kernel before them is
/// not found, and stays, as install.md says): it kept the classifier, and after the maps grew,
/// an old program reading a map no one updates.
#[test]
fn an_interface_no_longer_configured_loses_its_classifier() {
    require_sandbox!();
    sandbox(|sb| {
        for d in ["dk1", "dk2"] {
            ip(&["link", "add", d, "type", "bridge"]);
        }
        let mut config = DatapathConfig::new(&sb.bpffs);
        config.ifaces = vec!["dk1".into(), "dk2".into()];
        drop(Datapath::load(&config).unwrap());
        assert_eq!(attached("dk2", TcAttachType::Ingress), 1);
        config.ifaces = vec!["dk1".into()];
        let _dp = Datapath::load(&config).unwrap();
        assert_eq!(attached("dk1", TcAttachType::Ingress), 1);
        if aya::programs::SchedClassifier::query_tcx("dk1", TcAttachType::Ingress).is_err() {
            report(
                "SKIPPED an_interface_no_longer_configured_loses_its_classifier: no TCX on this \
                 kernel (netlink filters are not swept, as install.md says)",
            );
            return;
        }
        // The kernel detaches a link whose last reference went from a work queue: soon after.
        let detached =
            || attached("dk2", TcAttachType::Ingress) + attached("dk2", TcAttachType::Egress) == 0;
        let since = std::time::Instant::now();
        while !detached() && since.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(detached(), "dk2 keeps a classifier");
        assert_eq!(attached("dk1", TcAttachType::Ingress), 1);
    });
}

/// The child process of [`every_cut_of_a_map_growth_is_recovered_by_the_next_start`] and
/// [`every_cut_of_a_recovery_is_recovered_by_the_next_start`]: with `TXN_CHILD_BPFFS` set (in
/// the sandbox's namespaces, which it inherits), it loads the datapath at 4 entries and grows
/// it to 16 (`TXN_CHILD_ACTION=grow`) or starts as the agent does (`start`), under the cut
/// `NODE_AGENT_TEST_CUT` names; alone it says so and passes.
#[test]
fn child_cuts_a_pin_transaction() {
    let Ok(bpffs) = std::env::var("TXN_CHILD_BPFFS") else {
        eprintln!("a helper of the pin transaction tests; nothing to do alone");
        return;
    };
    let bpffs = Path::new(&bpffs);
    if std::env::var("TXN_CHILD_ACTION").as_deref() == Ok("start") {
        let capacity = node_agent::datapath::resolve_capacity(None, bpffs).unwrap();
        match Datapath::load(&txn_config(bpffs, capacity)) {
            Ok(_) => println!("TXN-CHILD started"),
            Err(e) => println!("TXN-CHILD failed: {e}"),
        }
        return;
    }
    let mut dp = Datapath::load(&txn_config(bpffs, 4)).unwrap();
    match dp.grow(16) {
        Ok(()) => println!("TXN-CHILD grown to {}", dp.capacity()),
        Err(e) => println!("TXN-CHILD failed: {e}"),
    }
}

fn txn_config(bpffs: &Path, capacity: u32) -> DatapathConfig {
    let mut config = DatapathConfig::new(bpffs);
    config.ifaces = vec!["tx0".into()];
    config.pod_ifaces = vec!["tx1".into()];
    config.node_map_max = capacity;
    config
}

/// The nodes and pod CIDRs of the growth cases: the node-ID map full at 4.
const TXN_NODES: [&str; 4] = ["10.77.0.1", "10.77.0.2", "fd00:77::3", "10.77.0.4"];
const TXN_CIDRS: [&str; 2] = ["10.244.1.0/24", "fd00:244:2::/64"];

/// The IDs of the maps each program attached to `iface` in `dir` reads.
fn attached_map_ids(iface: &str, dir: TcAttachType) -> Vec<Vec<u32>> {
    if let Ok((_, progs)) = aya::programs::SchedClassifier::query_tcx(iface, dir) {
        return progs
            .iter()
            .map(|p| p.map_ids().unwrap().unwrap_or_default())
            .collect();
    }
    // Netlink filters (kernels before TCX): their program IDs from bpftool.
    let out = run(Command::new("bpftool").args(["-j", "net", "show", "dev", iface]));
    let net: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let kind = format!(
        "clsact/{}",
        if dir == TcAttachType::Ingress {
            "ingress"
        } else {
            "egress"
        }
    );
    net[0]["tc"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["kind"] == kind.as_str())
        .map(|f| {
            let id = f["id"].as_u64().unwrap().to_string();
            let out = run(Command::new("bpftool").args(["-j", "prog", "show", "id", &id]));
            let prog: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            prog["map_ids"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|m| m.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

/// Checks that the pins under `bpffs` are consistent at `capacity` (no staging pin, no
/// intent), hold every node and pod CIDR, and are what every attached program reads.
fn check_converged(bpffs: &Path, capacity: u32, case: &str) {
    use aya::maps::MapInfo;
    use node_agent::datapath::maps::PodCidrMap;
    use node_agent::datapath::pins::MapLayout;
    use node_agent::datapath::{pin_dir, pod_cidrs_pin};

    let (ids, cidrs) = (node_ids_pin(bpffs), pod_cidrs_pin(bpffs));
    for pin in [&ids, &cidrs] {
        let layout = MapLayout::of_pin(pin).unwrap().unwrap();
        assert_eq!(layout.max_entries, capacity, "{case}: {}", pin.display());
    }
    let mut names: Vec<String> = std::fs::read_dir(pin_dir(bpffs))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["links", "node_ids", "node_stats", "pod_cidrs"],
        "{case}: no staging pin or intent left"
    );
    let mut nodes: Vec<String> = NodeMap::open(&ids)
        .unwrap()
        .dump()
        .unwrap()
        .entries
        .iter()
        .map(|n| n.ip.to_string())
        .collect();
    nodes.sort();
    let mut want: Vec<String> = TXN_NODES.iter().map(|s| (*s).to_owned()).collect();
    want.sort();
    assert_eq!(nodes, want, "{case}: every node in the live map");
    let n_cidrs = PodCidrMap::open(&cidrs)
        .unwrap()
        .dump()
        .unwrap()
        .entries
        .len();
    assert_eq!(
        n_cidrs,
        TXN_CIDRS.len(),
        "{case}: every pod CIDR in the live map"
    );
    let live = |pin: &Path| MapInfo::from_pin(pin).unwrap().id();
    let (live_ids, live_cidrs) = (live(&ids), live(&cidrs));
    let mut read = (false, false);
    for (iface, dir) in [
        ("tx0", TcAttachType::Ingress),
        ("tx0", TcAttachType::Egress),
        ("tx1", TcAttachType::Ingress),
    ] {
        let progs = attached_map_ids(iface, dir);
        assert_eq!(progs.len(), 1, "{case}: one classifier on {iface} {dir:?}");
        for id in &progs[0] {
            match MapInfo::from_id(*id).unwrap().name_as_str() {
                Some("NODE_IDS") => {
                    assert_eq!(
                        *id, live_ids,
                        "{case}: {iface} {dir:?} reads the live node-ID map"
                    );
                    read.0 = true;
                }
                Some("POD_CIDRS") => {
                    assert_eq!(
                        *id, live_cidrs,
                        "{case}: {iface} {dir:?} reads the live pod-CIDR map"
                    );
                    read.1 = true;
                }
                _ => {}
            }
        }
    }
    assert_eq!(read, (true, true), "{case}: the datapath reads both maps");
}

/// The maps at 4 entries with every node and pod CIDR, nothing else pinned but the links.
fn txn_setup(bpffs: &Path) {
    use node_agent::datapath::maps::PodCidrMap;
    use node_agent::datapath::pin_dir;

    // The maps of the last case go (the links stay, and the next load takes them over).
    for e in std::fs::read_dir(pin_dir(bpffs)).into_iter().flatten() {
        let e = e.unwrap();
        if e.file_name() != "links" {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    let dp = Datapath::load(&txn_config(bpffs, 4)).unwrap();
    let mut map = NodeMap::open(&node_ids_pin(bpffs)).unwrap();
    for (i, n) in TXN_NODES.iter().enumerate() {
        map.upsert(ipaddr(n), value(i as u16 + 1, 1)).unwrap();
    }
    let mut cidrs = PodCidrMap::open(&node_agent::datapath::pod_cidrs_pin(bpffs)).unwrap();
    for (i, c) in TXN_CIDRS.iter().enumerate() {
        cidrs
            .upsert(c.parse().unwrap(), value(i as u16 + 1, 1))
            .unwrap();
    }
    drop((dp, map, cidrs));
}

/// Runs [`child_cuts_a_pin_transaction`] doing `action` under the cut `what:step:how`, checks
/// how it ended, and returns the name of the step cut (`None`: there is no such step, and the
/// child did all of `action`) and the case's name.
fn txn_child(
    bpffs: &Path,
    action: &str,
    what: &str,
    step: u32,
    how: &str,
) -> (Option<String>, String) {
    use node_agent::runtime::cut::{CUT_ENV, CUT_EXIT};

    let out = node_agent_tests::child_test("datapath::child_cuts_a_pin_transaction")
        .arg("--test-threads=1")
        .env("TXN_CHILD_BPFFS", bpffs)
        .env("TXN_CHILD_ACTION", action)
        .env(CUT_ENV, format!("{what}:{step}:{how}"))
        .output()
        .unwrap();
    let text = node_agent_tests::output_text(&out);
    let cut = text
        .lines()
        .find_map(|l| {
            l.split_once(&format!("{CUT_ENV}: {what} step {step} ("))
                .and_then(|(_, rest)| rest.split_once(')'))
        })
        .map(|(name, _)| name.to_owned());
    let case = format!(
        "{what} step {step} ({}) {how}",
        cut.as_deref().unwrap_or("-")
    );
    match (&cut, how) {
        (Some(_), "kill") => assert_eq!(out.status.code(), Some(CUT_EXIT), "{case}:\n{text}"),
        // A failed step after the new maps were complete is finished at once by the recovery.
        (Some(_), _) => assert!(
            out.status.success()
                && (text.contains("TXN-CHILD failed") || text.contains("TXN-CHILD grown to 16")),
            "{case}:\n{text}"
        ),
        (None, _) => assert!(
            out.status.success()
                && (text.contains("TXN-CHILD grown to 16") || text.contains("TXN-CHILD started")),
            "{case}:\n{text}"
        ),
    }
    (cut, case)
}

/// The next start, as the agent's (the capacity the pins will have, then the load), must
/// converge; the maps then grow from there, and the start after finds them grown. Returns the
/// capacity the start found.
fn txn_converges(bpffs: &Path, case: &str) -> u32 {
    let capacity = node_agent::datapath::resolve_capacity(None, bpffs).unwrap();
    let mut dp = Datapath::load(&txn_config(bpffs, capacity))
        .unwrap_or_else(|e| panic!("{case}: the next start: {e}"));
    check_converged(bpffs, capacity, case);
    dp.grow(16)
        .unwrap_or_else(|e| panic!("{case}: growing after the start: {e}"));
    check_converged(bpffs, 16, case);
    drop(dp);
    drop(Datapath::load(&txn_config(bpffs, 16)).unwrap());
    check_converged(bpffs, 16, case);
    capacity
}

/// One case: a child process growing the maps from 4 to 16 killed (or failed) at step `step`,
/// then a start. `None` when the growth has no such step.
fn growth_case(bpffs: &Path, step: u32, how: &str) -> Option<(String, u32)> {
    txn_setup(bpffs);
    let (cut, case) = txn_child(bpffs, "grow", "growth", step, how);
    let cut = cut?;
    Some((cut, txn_converges(bpffs, &case)))
}

/// A map growth is a pin transaction (`datapath/txn.rs`): killed or failed at each of its
/// steps in turn (a child process ends at once, or the step's syscall is refused), it is
/// finished or undone by the next start, which converges: both maps at one capacity, no
/// staging pin or intent left, every node in the live map, and every attached program reading
/// the live pins. The steps are counted, not listed here: a growth that gains a step is
/// covered by the same loop.
#[test]
fn every_cut_of_a_map_growth_is_recovered_by_the_next_start() {
    require_sandbox!();
    sandbox(|sb| {
        for d in ["tx0", "tx1"] {
            ip(&["link", "add", d, "type", "bridge"]);
        }
        let since = std::time::Instant::now();
        let mut covered = Vec::new();
        for how in ["kill", "fail"] {
            let mut step = 1;
            while let Some((name, capacity)) = growth_case(&sb.bpffs, step, how) {
                let way = if capacity == 16 { "forward" } else { "back" };
                covered.push(format!("{step}:{how}:{way}"));
                report(&format!(
                    "growth step {step} ({name}) {how}: rolled {way}, converged"
                ));
                step += 1;
            }
        }
        let steps = covered.len() / 2;
        assert!(steps >= 8, "the growth has its steps: {covered:?}");
        assert_eq!(
            covered.iter().filter(|c| c.contains(":kill:")).count(),
            steps,
            "as many steps killed as failed: {covered:?}"
        );
        report(&format!(
            "growth: {steps} step boundaries x {{kill, fail}} = {} cases, all converged ({:.1} s)",
            covered.len(),
            since.elapsed().as_secs_f64()
        ));
    });
}

/// Pins of unequal capacities, as a start can meet them: a growth from 4 to 16 killed before
/// its first rename (both staging pins complete, the intent `filled`, the new programs
/// attached), then by hand its intent unpinned, the staging pin of map `large` renamed over the
/// live one, and the other staging pin unpinned unless `keep`.
fn unequal_case(bpffs: &Path, large: &str, keep: bool) {
    use node_agent::datapath::pin_dir;
    use node_agent::datapath::txn::{intent_pin, staging};

    txn_setup(bpffs);
    let (cut, case) = txn_child(bpffs, "grow", "growth", 8, "kill");
    assert!(
        cut.as_deref()
            .is_some_and(|c| c.contains("staging pod-CIDR pin over the live one")),
        "{case}"
    );
    std::fs::remove_file(intent_pin(bpffs)).unwrap();
    for map in ["node_ids", "pod_cidrs"] {
        let live = pin_dir(bpffs).join(map);
        if map == large {
            std::fs::rename(staging(&live), &live).unwrap();
        } else if !keep {
            std::fs::remove_file(staging(&live)).unwrap();
        }
    }
}

/// Live node-ID and pod-CIDR pins of unequal capacities, each with every entry, whatever left
/// them so (a growth cut between its renames without a pin transaction leaves the staging
/// node-ID pin too, which the recovery unpins): a start loads each at its own capacity and
/// grows both to the larger of theirs and the configured one, and converges.
#[test]
fn a_start_grows_live_pins_of_unequal_capacities_to_the_larger() {
    require_sandbox!();
    sandbox(|sb| {
        for d in ["tx0", "tx1"] {
            ip(&["link", "add", d, "type", "bridge"]);
        }
        // The map at 16 (the other at 4), whether the other's staging pin at 16 is left, the
        // configured capacity (`None`: the flag left out), and the capacity both pins end at.
        let states = [
            ("pod_cidrs", false, None, 16),
            ("pod_cidrs", true, Some(8), 16),
            ("node_ids", false, Some(32), 32),
        ];
        for (large, keep, requested, want) in states {
            let state = format!(
                "{large} at 16, the other at 4{}, --node-map-max {requested:?}",
                if keep {
                    " with its staging pin at 16"
                } else {
                    ""
                }
            );
            unequal_case(&sb.bpffs, large, keep);
            let capacity = node_agent::datapath::resolve_capacity(requested, &sb.bpffs).unwrap();
            assert_eq!(capacity, want, "{state}: the capacity to run with");
            let dp = node_agent::backends::load_datapath(&txn_config(&sb.bpffs, capacity))
                .unwrap_or_else(|e| panic!("{state}: the start: {e}"));
            assert_eq!(dp.capacity(), want, "{state}");
            check_converged(&sb.bpffs, want, &state);
            drop(dp);
            report(&format!(
                "unequal capacities: {state}: both at {want}, converged"
            ));
        }
        report(&format!(
            "unequal capacities: {} states recovered",
            states.len()
        ));
    });
}

/// The recovery of a pin transaction is cut too: a growth killed at `growth_step`, then a start
/// killed (or failed) at each step of its recovery, then a start that must converge.
fn recovery_case(bpffs: &Path, growth_step: u32, step: u32, how: &str) -> Option<(String, u32)> {
    txn_setup(bpffs);
    let (cut, _) = txn_child(bpffs, "grow", "growth", growth_step, "kill");
    assert!(cut.is_some(), "the growth has a step {growth_step}");
    let (cut, case) = txn_child(bpffs, "start", "recovery", step, how);
    let cut = cut?;
    let case = format!("growth step {growth_step} kill, {case}");
    Some((cut, txn_converges(bpffs, &case)))
}

/// A recovery cut short (a crash, or a failed unpin or rename, at each of its steps) is
/// finished by the start after, rolling back (a growth killed before its maps were recorded
/// complete, both staging pins there) or forward (killed before its first rename).
#[test]
fn every_cut_of_a_recovery_is_recovered_by_the_next_start() {
    require_sandbox!();
    sandbox(|sb| {
        for d in ["tx0", "tx1"] {
            ip(&["link", "add", d, "type", "bridge"]);
        }
        let since = std::time::Instant::now();
        let mut cases = 0;
        let mut ways = Vec::new();
        // Step 6 attaches the new programs (both staging pins are there); step 8 renames first.
        for (growth_step, want) in [(6, 4), (8, 16)] {
            let mut steps = 0;
            for how in ["kill", "fail"] {
                let mut step = 1;
                while let Some((name, capacity)) = recovery_case(&sb.bpffs, growth_step, step, how)
                {
                    assert_eq!(
                        capacity, want,
                        "growth step {growth_step}: rolled the wrong way"
                    );
                    report(&format!(
                        "recovery after growth step {growth_step} kill, step {step} ({name}) {how}: converged"
                    ));
                    step += 1;
                    cases += 1;
                }
                steps = step - 1;
            }
            ways.push(format!(
                "{steps} steps rolling {}",
                if want == 16 { "forward" } else { "back" }
            ));
        }
        assert!(cases >= 12, "the recoveries have their steps");
        report(&format!(
            "recovery: ({}) x {{kill, fail}} = {cases} cases, all converged ({:.1} s)",
            ways.join(" + "),
            since.elapsed().as_secs_f64()
        ));
    });
}

#[test]
fn the_maps_grow_online_while_packets_flow_and_no_lookup_misses() {
    require_sandbox!();
    sandbox(|sb| {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};

        use node_agent::datapath::maps::PodCidrMap;
        use node_agent::datapath::node_ids_layout;
        use node_agent::datapath::pins::MapLayout;

        VethPair::create();
        let mut config = DatapathConfig::new(&sb.bpffs);
        config.ifaces = vec!["va".into()];
        config.node_map_max = 4;
        let mut dp = Datapath::load(&config).unwrap();
        let pin = node_ids_pin(&sb.bpffs);
        let mut map = NodeMap::open(&pin).unwrap();
        map.upsert(ipaddr(VethPair::PEER_V4), value(7, 0)).unwrap();
        for i in 1..=3u8 {
            map.upsert(IpAddr::from([10, 77, 0, i]), value(u16::from(i), 0))
                .unwrap();
        }
        assert!(
            map.upsert(ipaddr("10.77.0.9"), value(9, 0)).is_err(),
            "the map is full at 4"
        );
        let cidr_pin = node_agent::datapath::pod_cidrs_pin(&sb.bpffs);
        PodCidrMap::open(&cidr_pin)
            .unwrap()
            .upsert("10.244.7.0/24".parse().unwrap(), value(7, 1))
            .unwrap();

        // Packets to the peer leave through the egress classifier the whole time, and each one
        // is counted under the peer's node ID only if its lookup found the entry.
        let stop = Arc::new(AtomicBool::new(false));
        let sender = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let sock = UdpSocket::bind("0.0.0.0:0").unwrap();
                sock.connect((ipaddr(VethPair::PEER_V4), 9)).unwrap();
                let mut sent = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // A refusal (the peer's ICMP answer to an earlier datagram) is not a send.
                    if sock.send(&[0xab; 16]).is_ok() {
                        sent += 1;
                    }
                }
                sent
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        dp.grow(16).unwrap_or_else(|e| panic!("growing: {e}"));
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, Ordering::Relaxed);
        let sent = sender.join().unwrap();
        let counted = stats(&sb.bpffs, 7).tx_packets;
        println!("grow: {sent} packets sent across the swap, {counted} classified");
        assert!(sent > 100, "the sender ran: {sent}");
        assert_eq!(counted, sent, "every packet's lookup found the peer");

        // The pins are the grown maps, with every entry; the attached programs read them.
        assert_eq!(MapLayout::of_pin(&pin).unwrap(), Some(node_ids_layout(16)));
        let mut map = NodeMap::open(&pin).unwrap();
        assert_eq!(map.dump().unwrap().entries.len(), 4);
        assert_eq!(
            PodCidrMap::open(&cidr_pin)
                .unwrap()
                .dump()
                .unwrap()
                .entries
                .len(),
            1
        );
        for i in 4..=9u8 {
            map.upsert(IpAddr::from([10, 77, 0, i]), value(u16::from(i), 0))
                .unwrap();
        }
        map.upsert(ipaddr(VethPair::PEER_V4), value(8, 0)).unwrap();
        // (Sent without waiting for answers: the peer's ICMP replies are rate-limited by now.)
        let sock = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..3 {
            sock.send_to(&[0xab; 16], (ipaddr(VethPair::PEER_V4), 9))
                .unwrap();
        }
        assert_eq!(
            stats(&sb.bpffs, 8).tx_packets,
            3,
            "the new programs read the new map"
        );
        assert_eq!(
            attached("va", TcAttachType::Egress),
            1,
            "one classifier, taken over"
        );
        assert_eq!(dp.capacity(), 16);
        // A restart finds the grown pins and keeps them.
        drop(dp);
        config.node_map_max = 16;
        drop(Datapath::load(&config).unwrap());
    });
}

/// Every kind of interface the agent attaches to (the uplink, a second uplink, a pod
/// interface) is deleted under a running daemon, named in readiness while it is gone, made
/// again under its name, and gets its classifiers back, on TCX kernels (links, whose stale
/// pins go) and netlink-filter ones (clsact made again); then each is deleted and made again
/// at once, between two checks, and found by its new index. Before the one attach reconciler
/// an uplink made again never got its classifiers back until a restart.
#[test]
fn every_interface_kind_deleted_and_made_again_under_a_daemon_gets_its_classifiers_back() {
    require_sandbox!();
    use node_agent_tests::agent::{AgentEnv, cluster, http_get, wait_for};
    const ADDR: &str = "127.0.0.1:9965";
    const WAIT: Duration = Duration::from_secs(30);
    let readyz = || http_get(ADDR, "/readyz").unwrap_or((0, String::new()));
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        // The uplink gw0 is a veth with the nodes' gateways on-link (AgentEnv); make it again
        // the same way.
        let make_gw0 = || {
            ip_batch(
                &[],
                "link add gw0 type veth peer name gw1\naddr add 10.88.0.1/16 dev gw0\n\
                 link set gw0 up\nlink set gw1 up\n",
            )
        };
        let make_bridge = |name: &str| ip(&["link", "add", name, "type", "bridge"]);
        make_bridge("up2");
        make_bridge("cni9");
        env.write_nodes(&cluster(2));
        let _daemon = env.spawn(&[
            "--metrics-addr",
            ADDR,
            "--datapath-iface",
            "up2",
            "--pod-iface",
            "cni9",
        ]);
        let settled = || {
            let (code, body) = readyz();
            code == 200 && !body.contains("has no classifier")
        };
        if std::panic::catch_unwind(|| {
            wait_for(
                "readiness naming no interface",
                Duration::from_secs(90),
                settled,
            )
        })
        .is_err()
        {
            panic!(
                "readiness: {:?}\nagent log:\n{}",
                readyz(),
                std::fs::read_to_string(env.log()).unwrap_or_default()
            );
        }
        let both = [TcAttachType::Ingress, TcAttachType::Egress];
        let pod = [TcAttachType::Ingress];
        let kinds: [(&str, &str, &[TcAttachType]); 3] = [
            ("uplink", "gw0", &both),
            ("uplink", "up2", &both),
            ("pod interface", "cni9", &pod),
        ];
        let make = |iface: &str| match iface {
            "gw0" => make_gw0(),
            bridge => {
                make_bridge(bridge);
            }
        };
        let tcx = has_tcx();
        let links = node_agent::datapath::pin_dir(&sb.bpffs).join("links");
        let pins = || {
            let mut p: Vec<String> = std::fs::read_dir(&links)
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            p.sort();
            p
        };
        let all_pins = [
            "cni9-pod",
            "gw0-egress",
            "gw0-ingress",
            "up2-egress",
            "up2-ingress",
        ];
        let back = |iface: &str, dirs: &[TcAttachType]| {
            wait_for(
                &format!("{iface}'s classifiers back on the new device"),
                WAIT,
                || dirs.iter().all(|d| attached(iface, *d) == 1),
            );
        };
        for (kind, iface, dirs) in kinds {
            back(iface, dirs);
            let line = format!("{kind} {iface} has no classifier: no such interface");
            ip(&["link", "del", iface]);
            wait_for(
                &format!("readiness to name {kind} {iface} while it is gone"),
                WAIT,
                || readyz().1.contains(&line),
            );
            if tcx {
                // The links went with the device: their pins too.
                wait_for(&format!("{iface}'s stale link pins unpinned"), WAIT, || {
                    !pins().iter().any(|p| p.starts_with(&format!("{iface}-")))
                });
            }
            make(iface);
            back(iface, dirs);
            wait_for(&format!("readiness no longer naming {iface}"), WAIT, || {
                !readyz()
                    .1
                    .contains(&format!("{kind} {iface} has no classifier"))
            });
            if tcx {
                assert_eq!(pins(), all_pins, "one pin per attachment, none stale");
            }
            // Deleted and made again at once: the same name, another device, found by its index.
            // By `ip`: /sys shows the namespace it was mounted in, not the sandbox's.
            let ifindex = |iface: &str| {
                let o = ip(&["-j", "link", "show", iface]);
                let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
                v[0]["ifindex"].as_u64().unwrap()
            };
            let before = ifindex(iface);
            ip(&["link", "del", iface]);
            make(iface);
            let after = ifindex(iface);
            assert_ne!(before, after, "{iface} made again is another device");
            back(iface, dirs);
        }
        wait_for("readiness naming no interface again", WAIT, settled);
        if tcx {
            assert_eq!(pins(), all_pins, "one pin per attachment, none stale");
        }
        report(&format!(
            "attach: 3 interface kinds (uplink gw0, second uplink up2, pod interface cni9) x \
             (delete, named in readiness, make again; delete and make again at once), {}",
            if tcx { "tcx" } else { "netlink filters" }
        ));
    });
}

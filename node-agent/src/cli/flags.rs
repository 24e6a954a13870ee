//! The values the command line's flags allow: every flag that takes a number, a ratio, a
//! duration, an address or a name is read by a parser here, so what each allows reads in one
//! place (issue 29). A value outside is refused when the flags are read, before anything runs,
//! with an error that names the flag (clap's part), the value and the allowed range.

use std::time::Duration;

/// The longest duration any setting takes: deadlines are computed from these by addition, and
/// a duration of centuries would overflow them (a panic) instead of being refused here.
pub(super) const LONGEST: Duration = Duration::from_secs(366 * 24 * 3600);

/// The values a flag that takes a number, a ratio or a duration allows, and why the others are
/// refused. Every such flag's value parser is one of the constants below (through
/// [`Allowed::parse`], or a parser of a set that starts with one), so the ranges read here, in
/// one place, and a value outside one is refused when the flags are read: the error names the
/// value and the range, and clap adds the flag. Relations between two flags, which no single
/// value shows, are [`super::run::AgentArgs::check_relations`]'s.
pub(super) struct Allowed<T> {
    least: T,
    most: T,
    /// Why a smaller value is refused.
    below: &'static str,
    /// Why a larger value is refused.
    above: &'static str,
}

/// A duration from `least` up to a year.
pub(super) const fn duration_from(least: Duration, below: &'static str) -> Allowed<Duration> {
    Allowed {
        least,
        most: LONGEST,
        below,
        above: "a longer one would overflow the deadlines computed from it",
    }
}

pub(super) const NODES_FILE_POLL: Allowed<Duration> = duration_from(
    Duration::from_millis(10),
    "a shorter poll keeps the agent busy looking",
);
pub(super) const NODES_FILE_SETTLE: Allowed<Duration> = duration_from(
    Duration::from_millis(100),
    "a shorter settle period takes the list of a file read while its writer pauses, which may \
     lack nodes, and prunes them",
);
pub(super) const RELIST_INTERVAL: Allowed<Duration> = duration_from(
    Duration::from_millis(100),
    "a shorter period keeps the agent busy listing",
);
pub(super) const RESYNC_INTERVAL: Allowed<Duration> = duration_from(
    Duration::from_millis(100),
    "a shorter period keeps the agent busy dumping the kernel",
);
pub(super) const PRUNE_CONFIRM_DELAY: Allowed<Duration> = duration_from(
    Duration::from_secs(1),
    "the brake counts removals together over this window, and a shorter one lets a mass \
     deletion through in small steps",
);
pub(super) const ID_COOLDOWN: Allowed<Duration> = duration_from(
    Duration::from_secs(120),
    "a freed ID is reused only once nothing can carry it for its old node anymore, and a \
     segment its peer retransmits may for 120 s (TCP_RTO_MAX); --id-reuse-floor is the early \
     reuse at the edge of the ID space",
);
/// The hidden test flag's: none below the cool-down's least, which is the point of it.
pub(super) const TEST_ID_COOLDOWN: Allowed<Duration> =
    duration_from(Duration::ZERO, "a duration cannot be negative");
pub(super) const ID_REUSE_FLOOR: Allowed<Duration> = duration_from(
    Duration::from_secs(1),
    "an ID handed out again at once may still be carried by packets queued for its old node",
);
pub(super) const IPSEC_KEY_PROPAGATION_DELAY: Allowed<Duration> = duration_from(
    Duration::from_secs(1),
    "a new key sent with at once is dropped by every peer that has not read it yet",
);
pub(super) const IPSEC_KEY_ROTATION_DELAY: Allowed<Duration> = duration_from(
    Duration::from_secs(1),
    "the old key's states would go while peers still send with it",
);
pub(super) const CHECKPOINT_INTERVAL: Allowed<Duration> = duration_from(Duration::ZERO, "");
pub(super) const DEBOUNCE: Allowed<Duration> = duration_from(Duration::ZERO, "");
pub(super) const SYNC_TIMEOUT: Allowed<Duration> = duration_from(
    Duration::from_secs(1),
    "a shorter deadline gives up before a first list can arrive",
);
pub(super) const NODE_MAP_MAX: Allowed<u64> = Allowed {
    least: 1,
    most: node_agent_common::MAX_NODE_MAP_MAX as u64,
    below: "a map holds one entry at least",
    above: "the agent makes no larger map (a node takes one entry per address)",
};
pub(super) const MAX_NODE_ID: Allowed<u64> = Allowed {
    least: 2,
    most: state::ids::MAX_ID as u64,
    below: "0 is the local node's ID, and 1 leaves a single ID: no edge of the ID space to reach",
    above: "node IDs are 16 bits",
};
pub(super) const MAX_PRUNE_RATIO: Allowed<f64> = Allowed {
    least: 0.0,
    most: 1.0,
    below: "it is a share of the known nodes",
    above: "it is a share of the known nodes",
};
pub(super) const ROUTE_PROTOCOL: Allowed<u64> = Allowed {
    least: 0,
    most: u8::MAX as u64,
    below: "",
    above: "a route protocol is one byte",
};
pub(super) const ROUTE_TABLE: Allowed<u64> = Allowed {
    least: 0,
    most: u32::MAX as u64,
    below: "",
    above: "a route table is 32 bits",
};
pub(super) const MARK_MASK: Allowed<u64> = Allowed {
    least: 0,
    most: u32::MAX as u64,
    below: "",
    above: "skb->mark is 32 bits",
};
pub(super) const METRICS_PORT: Allowed<u64> = Allowed {
    least: 1,
    most: u16::MAX as u64,
    below: "port 0 listens on a port chosen at random, which no probe knows",
    above: "a port is 16 bits",
};

/// A value a range bounds: how it is read and shown.
pub(super) trait Bounded: Copy + PartialOrd {
    /// Reads a value; one too large to represent reads as the largest, for the range to refuse.
    fn read(s: &str) -> Result<Self, String>;
    fn show(self) -> String;
}

impl<T: Bounded> Allowed<T> {
    pub(super) fn parse(&self, s: &str) -> Result<T, String> {
        use std::cmp::Ordering::{Greater, Less};
        let v = T::read(s.trim())?;
        // NaN compares with nothing: it is outside.
        let why = match (v.partial_cmp(&self.least), v.partial_cmp(&self.most)) {
            (Some(Less) | None, _) => self.below,
            (_, Some(Greater) | None) => self.above,
            _ => return Ok(v),
        };
        Err(format!(
            "{s:?} is outside the allowed range, {}: {why}",
            self.range()
        ))
    }

    pub(super) fn range(&self) -> String {
        format!("{} to {}", self.least.show(), self.most.show())
    }
}

impl Allowed<u64> {
    /// A whole number in range, as the flag's type (every range's ends fit its type).
    pub(super) fn int<T: TryFrom<u64>>(&self, s: &str) -> Result<T, String> {
        let v = self.parse(s)?;
        T::try_from(v).map_err(|_| format!("{s:?} is outside the allowed range, {}", self.range()))
    }
}

impl Bounded for Duration {
    /// `100ms`, `30s`, `5m`, `1h`; a bare number is seconds.
    fn read(s: &str) -> Result<Self, String> {
        let split = s
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let n: f64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a duration like 30s or 5m"))?;
        let secs = match unit {
            "ms" => n / 1000.0,
            "" | "s" => n,
            "m" => n * 60.0,
            "h" => n * 3600.0,
            _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s, m or h)")),
        };
        Ok(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
    }

    fn show(self) -> String {
        let (secs, millis) = (self.as_secs(), self.subsec_millis());
        if self == LONGEST {
            "a year".to_owned()
        } else if self.is_zero() {
            "0".to_owned()
        } else if millis != 0 || secs == 0 {
            format!("{}ms", self.as_millis())
        } else if secs % 3600 == 0 {
            format!("{}h", secs / 3600)
        } else if secs % 60 == 0 {
            format!("{}m", secs / 60)
        } else {
            format!("{secs}s")
        }
    }
}

impl Bounded for u64 {
    /// Decimal, or hexadecimal after `0x`.
    fn read(s: &str) -> Result<Self, String> {
        let (digits, radix) = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
            Some(hex) => (hex, 16),
            None => (s, 10),
        };
        match u64::from_str_radix(digits, radix) {
            Ok(v) => Ok(v),
            Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => Ok(u64::MAX),
            Err(_) => Err(format!("{s:?} is not a whole number")),
        }
    }

    fn show(self) -> String {
        self.to_string()
    }
}

impl Bounded for f64 {
    fn read(s: &str) -> Result<Self, String> {
        s.parse()
            .map_err(|_| format!("{s:?} is not a number like 0.5"))
    }

    fn show(self) -> String {
        self.to_string()
    }
}

/// `n1, n2-n3, ...`: sorted numbers, runs joined.
fn listed(numbers: impl IntoIterator<Item = u32>) -> String {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for n in numbers {
        match runs.last_mut() {
            Some((_, last)) if last.checked_add(1) == Some(n) => *last = n,
            _ => runs.push((n, n)),
        }
    }
    runs.iter()
        .map(|&(a, b)| match a == b {
            true => a.to_string(),
            false => format!("{a}-{b}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// An interface name as the kernel takes one (`dev_valid_name`): at most 15 bytes, not `.`
/// or `..`, without `/`, `:` or white space. The name becomes part of pin paths under the
/// bpffs, where `../x` would reach a pin that is not ours.
pub(super) fn parse_iface(s: &str) -> Result<String, String> {
    let valid = !s.is_empty()
        && s.len() <= 15
        && s != "."
        && s != ".."
        && !s
            .bytes()
            .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace());
    match valid {
        true => Ok(s.to_owned()),
        false => Err(format!(
            "{s:?} is no interface name (at most 15 bytes, not . or .., no /, : or white space)"
        )),
    }
}

/// Protocol numbers other route sources write (`RTPROT_*` in the kernel's `rtnetlink.h`,
/// iproute2's `rt_protos`, and Kubernetes networking's own): with one of them, the agent would
/// take the host's default route (kernel, boot, static, DHCP) or a routing daemon's or another
/// CNI's routes for orphans of its own and delete them.
pub(super) const ROUTE_PROTOCOLS_IN_USE: &[(u8, &str)] = &[
    (0, "unspec"),
    (1, "redirect"),
    (2, "kernel"),
    (3, "boot"),
    (4, "static"),
    (8, "gated"),
    (9, "ra"),
    (10, "mrt"),
    (11, "zebra"),
    (12, "bird"),
    (13, "dnrouted"),
    (14, "xorp"),
    (15, "ntk"),
    (16, "dhcp"),
    (17, "mrouted"),
    (18, "keepalived"),
    (42, "babel"),
    // Calico's Felix writes its workload, IPIP/VXLAN and blackhole routes as `proto 80`.
    (80, "Calico Felix"),
    (99, "openr"),
    (186, "bgp"),
    (187, "isis"),
    (188, "ospf"),
    (189, "rip"),
    (192, "eigrp"),
];

pub(super) fn parse_route_protocol(s: &str) -> Result<u8, String> {
    let p: u8 = ROUTE_PROTOCOL.int(s)?;
    match ROUTE_PROTOCOLS_IN_USE.iter().find(|(n, _)| *n == p) {
        Some((_, name)) => Err(format!(
            "{p} is the route protocol of {name} routes, which are not the agent's; allowed: {} \
             except {} (the numbers other route sources write); the default is {}",
            ROUTE_PROTOCOL.range(),
            listed(ROUTE_PROTOCOLS_IN_USE.iter().map(|(n, _)| u32::from(*n))),
            crate::backends::routes::DEFAULT_ROUTE_PROTOCOL
        )),
        None => Ok(p),
    }
}

/// Route tables the kernel reserves (`RT_TABLE_*` in `rtnetlink.h`): 0 is no table (a route
/// written there lands in main, and every dump of table 0 finds none of ours, so every run after
/// the first failed on its own routes), 253 and 255 are the kernel's default and local tables.
/// 254 (main) is the default and stays allowed.
pub(super) const ROUTE_TABLES_RESERVED: &[(u32, &str)] =
    &[(0, "unspec"), (253, "default"), (255, "local")];

pub(super) fn parse_route_table(s: &str) -> Result<u32, String> {
    let t: u32 = ROUTE_TABLE.int(s)?;
    match ROUTE_TABLES_RESERVED.iter().find(|(n, _)| *n == t) {
        Some((_, name)) => Err(format!(
            "{t} is the kernel's reserved {name} table, not one the agent may write; allowed: {} \
             except {}; the default is {}, main",
            ROUTE_TABLE.range(),
            listed(ROUTE_TABLES_RESERVED.iter().map(|(n, _)| *n)),
            crate::backends::routes::MAIN_TABLE
        )),
        None => Ok(t),
    }
}

/// The mark bits that carry the node ID: one run of at least 16 bits, as the datapath needs
/// (it checks again when it loads).
pub(super) fn parse_mark_mask(s: &str) -> Result<u32, String> {
    let m: u32 = MARK_MASK.int(s)?;
    // A mask with 16 bits set is not 0, so the shift is less than 32.
    if m.count_ones() >= 16 && (m >> m.trailing_zeros()).trailing_ones() == m.count_ones() {
        return Ok(m);
    }
    Err(format!(
        "{s:?} is not one run of at least 16 bits; allowed: masks of one run of 16 to 32 set bits \
         (node IDs are 16 bits), such as {:#010x}, the default",
        node_agent_common::DEFAULT_MARK_MASK
    ))
}

/// An address and port to listen on; port 0 (any port) is refused, since the kubelet probes a
/// port it was told.
pub(super) fn parse_metrics_addr(s: &str) -> Result<std::net::SocketAddr, String> {
    let port = s.rsplit_once(':').map_or("", |(_, p)| p);
    if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) {
        let _: u16 = METRICS_PORT.int(port).map_err(|e| format!("port {e}"))?;
    }
    s.parse().map_err(|_| {
        format!(
            "{s:?} is not an address and port like 127.0.0.1:9965; allowed ports: {}",
            METRICS_PORT.range()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::super::{Cli, Command};
    use super::*;

    /// `node-agent run --node-name n FLAG VALUE`, parsed as the binary parses it.
    fn cli(flag: &str, value: &str) -> Result<Cli, clap::Error> {
        use clap::Parser;
        Cli::try_parse_from(["node-agent", "run", "--node-name", "n", flag, value])
    }

    #[test]
    fn durations_parse_with_units() {
        let d = |s| Duration::read(s).unwrap();
        assert_eq!(d("100ms"), Duration::from_millis(100));
        assert_eq!(d("30s"), Duration::from_secs(30));
        assert_eq!(d("5m"), Duration::from_secs(300));
        assert_eq!(d("2"), Duration::from_secs(2));
        assert_eq!(d("8784h"), LONGEST);
        assert_eq!(d("99999999999999999999999999"), Duration::MAX);
        assert!(Duration::read("5 parsecs").is_err());
        assert!(Duration::read("NaN").is_err());
        for (d, shown) in [
            (Duration::ZERO, "0"),
            (Duration::from_millis(10), "10ms"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_secs(1), "1s"),
            (Duration::from_secs(120), "2m"),
            (Duration::from_secs(7200), "2h"),
            (LONGEST, "a year"),
        ] {
            assert_eq!(d.show(), shown);
        }
        assert_eq!(u64::read("0xffff0000"), Ok(0xffff_0000));
        assert_eq!(u64::read("99999999999999999999999"), Ok(u64::MAX));
        assert!(u64::read("0xnope").is_err());
        assert_eq!(listed([0, 1, 2, 4, 8, 9]), "0-2, 4, 8-9");
    }

    const HUGE: &str = "99999999999999999999999999";

    /// Every flag whose value has a range, by its long name: values just inside and just
    /// outside each end of the range, 0, and a huge value. Refused are those out of the flag's
    /// range and those that break a relation with another flag's default.
    const RANGED: &[(&str, &[&str], &[&str])] = &[
        (
            "--nodes-file-poll",
            &["10ms", "8784h"],
            &["9ms", "8785h", "0", HUGE],
        ),
        (
            "--nodes-file-settle",
            &["100ms", "200ms", "8784h"],
            &["99ms", "8785h", "0", HUGE],
        ),
        (
            "--relist-interval",
            &["100ms", "8784h"],
            &["99ms", "8785h", "0", HUGE],
        ),
        (
            "--node-map-max",
            &["1", "4", "4194304"],
            &["0", "4194305", "4294967295", HUGE],
        ),
        (
            "--mark-mask",
            &["0xffff0000", "0xffff", "0xffffffff", "4294901760"],
            &["0", "0x7fff0000", "0xff00ff00", "0x100000000", HUGE],
        ),
        (
            "--route-protocol",
            &["5", "7", "79", "81", "201", "255"],
            &["0", "4", "8", "80", "256", HUGE],
        ),
        (
            "--route-table",
            &["1", "252", "254", "256", "4294967295"],
            &["0", "253", "255", "4294967296", HUGE],
        ),
        (
            "--max-prune-ratio",
            &["0", "0.5", "1"],
            &["-0.1", "1.0001", "NaN", "inf", HUGE],
        ),
        (
            "--prune-confirm-delay",
            &["1s", "8784h"],
            &["999ms", "8785h", "0", HUGE],
        ),
        (
            "--resync-interval",
            &["100ms", "8784h"],
            &["99ms", "8785h", "0", HUGE],
        ),
        // Up to a year; the default floor (2m) is at most the cool-down.
        (
            "--id-cooldown",
            &["2m", "8784h"],
            &["119s", "8785h", "0", HUGE],
        ),
        // Up to the default cool-down (15m).
        (
            "--id-reuse-floor",
            &["1s", "15m"],
            &["999ms", "901s", "0", HUGE],
        ),
        (
            "--max-node-id",
            &["2", "3", "65535"],
            &["0", "1", "65536", HUGE],
        ),
        (
            "--test-id-cooldown",
            &["0s", "3s", "8784h"],
            &["8785h", HUGE],
        ),
        // Below the default rotation delay (5m).
        (
            "--ipsec-key-propagation-delay",
            &["1s", "299s"],
            &["999ms", "300s", "0", HUGE],
        ),
        // Above the default propagation delay (90s).
        (
            "--ipsec-key-rotation-delay",
            &["91s", "8784h"],
            &["90s", "8785h", "0", HUGE],
        ),
        (
            "--checkpoint-interval",
            &["0", "1h", "8784h"],
            &["8785h", HUGE],
        ),
        ("--debounce", &["0", "100ms", "8784h"], &["8785h", HUGE]),
        (
            "--sync-timeout",
            &["1s", "8784h"],
            &["999ms", "8785h", "0", HUGE],
        ),
        (
            "--metrics-addr",
            &["127.0.0.1:1", "127.0.0.1:65535", "[::1]:9965"],
            &[
                "127.0.0.1:0",
                "127.0.0.1:65536",
                "127.0.0.1",
                "127.0.0.1:99999999999999999999999",
            ],
        ),
    ];

    /// Relations between two flags, each way: (the flags, refused).
    const RELATIONS: &[(&[&str], bool)] = &[
        (&["--id-cooldown=2m", "--id-reuse-floor=2m"], false),
        (&["--id-cooldown=2m", "--id-reuse-floor=121s"], true),
        (&["--id-cooldown=1h", "--id-reuse-floor=1h"], false),
        (&["--id-cooldown=10m", "--id-reuse-floor=11m"], true),
        (&["--test-id-cooldown=0s", "--id-reuse-floor=1h"], false),
        (&["--test-id-cooldown=3s", "--id-reuse-floor=1s"], false),
        (
            &[
                "--ipsec-key-propagation-delay=1s",
                "--ipsec-key-rotation-delay=2s",
            ],
            false,
        ),
        (
            &[
                "--ipsec-key-propagation-delay=2s",
                "--ipsec-key-rotation-delay=2s",
            ],
            true,
        ),
    ];

    /// The flags that take a value without a range (paths, names, choices).
    const UNRANGED: &[&str] = &[
        "--log-format",
        "--nodes-file",
        "--kubeconfig",
        "--node-name",
        "--state-dir",
        "--bpffs",
        "--datapath-iface",
        "--pod-iface",
        "--node-map-grow",
        "--route-nexthops",
        "--ipsec-key-file",
        "--output",
    ];

    /// The command line with `args` after `node-agent SUB --node-name n`, and the relations
    /// `config` checks first.
    fn parsed(sub: &str, args: &[&str]) -> Result<(), String> {
        use clap::Parser;
        let line = ["node-agent", sub, "--node-name", "n"]
            .into_iter()
            .chain(args.iter().copied());
        let agent = match Cli::try_parse_from(line)
            .map_err(|e| e.to_string())?
            .command
        {
            Command::Run(r) => r.agent,
            Command::Plan(p) => p.agent,
            _ => unreachable!("{sub}"),
        };
        agent.check_relations().map_err(|e| e.to_string())
    }

    /// Issue 29: every flag of every subcommand that takes a value is in [`RANGED`] or in
    /// [`UNRANGED`]; each ranged one takes the values inside its range and refuses the others
    /// when the flags are read, naming the flag, the value and the allowed range; relations
    /// between flags are refused naming both.
    #[test]
    fn every_ranged_flag_refuses_exactly_the_values_outside_its_range() {
        use clap::CommandFactory;
        let mut cmd = Cli::command();
        cmd.build();
        // Every subcommand's flags, the nested ones included.
        let mut subs: Vec<&clap::Command> = vec![&cmd];
        let mut i = 0;
        while i < subs.len() {
            subs.extend(subs[i].get_subcommands());
            i += 1;
        }
        let mut walked = 0;
        for sub in &subs {
            for arg in sub.get_arguments().filter(|a| !a.is_positional()) {
                let Some(long) = arg.get_long() else { continue };
                if !arg.get_action().takes_values() {
                    continue;
                }
                let flag = format!("--{long}");
                let ranged = RANGED.iter().any(|(f, _, _)| *f == flag);
                assert!(
                    ranged || UNRANGED.contains(&flag.as_str()),
                    "{} {flag}: a flag with a value, in neither table",
                    sub.get_name()
                );
                walked += 1;
            }
        }

        let (mut accepted, mut refused) = (0, 0);
        for (flag, inside, outside) in RANGED {
            let subs: Vec<&str> = ["run", "plan"]
                .into_iter()
                .filter(|s| {
                    let sub = cmd.find_subcommand(s).unwrap();
                    sub.get_arguments()
                        .any(|a| a.get_long() == flag.strip_prefix("--"))
                })
                .collect();
            assert!(!subs.is_empty(), "{flag} is no flag of run or plan");
            for sub in subs {
                for v in *inside {
                    let arg = format!("{flag}={v}");
                    parsed(sub, &[&arg]).unwrap_or_else(|e| panic!("{sub} {arg}: {e}"));
                    accepted += 1;
                }
                for v in *outside {
                    let arg = format!("{flag}={v}");
                    let e = parsed(sub, &[&arg]).expect_err(&arg);
                    let named = match e.contains("must be") {
                        // A relation: both flags named, with their values.
                        true => e.contains(flag),
                        false => e.contains(flag) && e.contains(v) && e.contains("allowed"),
                    };
                    assert!(
                        named,
                        "{sub} {arg}: the error must name the flag, the value and the range: {e}"
                    );
                    refused += 1;
                }
            }
        }
        for (args, refuse) in RELATIONS {
            let flags: Vec<&str> = args.iter().map(|a| a.split('=').next().unwrap()).collect();
            match (parsed("run", args), refuse) {
                (Ok(()), false) => {}
                (Err(e), true) => {
                    assert!(flags.iter().all(|f| e.contains(f)), "{args:?}: {e}");
                }
                (r, _) => panic!("{args:?}: {r:?}"),
            }
        }
        println!(
            "flags: {} ranged flags x {} values ({accepted} accepted, {refused} refused, through \
             run and plan), {} relations; {walked} value flags of every subcommand walked, {} \
             unranged",
            RANGED.len(),
            RANGED
                .iter()
                .map(|(_, a, r)| a.len() + r.len())
                .sum::<usize>(),
            RELATIONS.len(),
            UNRANGED.len()
        );
    }

    /// Zero periods would spin and a zero window would switch the brake's counting off: the
    /// errors say why.
    #[test]
    fn durations_that_would_spin_or_disable_the_brake_say_why() {
        for flag in [
            "--resync-interval",
            "--relist-interval",
            "--nodes-file-poll",
        ] {
            let e = cli(flag, "0").unwrap_err().to_string();
            assert!(e.contains("busy"), "{flag}: {e}");
        }
        let e = cli("--prune-confirm-delay", "0").unwrap_err().to_string();
        assert!(e.contains("mass deletion"), "{e}");
        let e = cli("--id-cooldown", "100000h").unwrap_err().to_string();
        assert!(e.contains("a year") && e.contains("overflow"), "{e}");
        let e = cli("--id-cooldown", "0").unwrap_err().to_string();
        assert!(
            e.contains("2m to a year") && e.contains("TCP_RTO_MAX"),
            "{e}"
        );
    }

    /// A protocol number the kernel, a routing daemon or another CNI writes would make the
    /// host's default route (or theirs) look like an orphan of ours.
    #[test]
    fn route_protocols_other_sources_use_are_refused() {
        for taken in ["0", "2", "3", "4", "16", "80", "186"] {
            let e = parse_route_protocol(taken).unwrap_err();
            assert!(e.contains("not the agent's"), "{taken}: {e}");
        }
        assert!(parse_route_protocol("80").unwrap_err().contains("Calico"));
        assert_eq!(parse_route_protocol("201"), Ok(201));
        assert!(parse_route_protocol("256").is_err());
    }

    /// Every number of the flag tables is refused with its name, through the command line, and
    /// every number next to one is taken: the tables are the whole rule.
    #[test]
    fn the_flag_tables_refuse_exactly_their_numbers() {
        let mut refused = 0;
        for (n, name) in ROUTE_TABLES_RESERVED {
            let e = cli("--route-table", &n.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.contains("reserved") && e.contains(name), "{n}: {e}");
            refused += 1;
        }
        for t in [1u32, 252, 254, 256, 1000, u32::MAX] {
            assert_eq!(parse_route_table(&t.to_string()), Ok(t));
        }
        assert_eq!(parse_route_table("0xfe"), Ok(254));
        for (n, name) in ROUTE_PROTOCOLS_IN_USE {
            let e = cli("--route-protocol", &n.to_string())
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("not the agent's") && e.contains(name),
                "{n}: {e}"
            );
            refused += 1;
        }
        let taken: Vec<u8> = ROUTE_PROTOCOLS_IN_USE.iter().map(|(n, _)| *n).collect();
        let free = (0..=255u8).filter(|p| !taken.contains(p)).count();
        for p in (0..=255u8).filter(|p| !taken.contains(p)) {
            assert_eq!(parse_route_protocol(&p.to_string()), Ok(p));
        }
        println!(
            "flag tables: {} route tables and {} route protocols refused, the other {free} protocols accepted",
            ROUTE_TABLES_RESERVED.len(),
            ROUTE_PROTOCOLS_IN_USE.len()
        );
        assert_eq!(
            refused,
            ROUTE_TABLES_RESERVED.len() + ROUTE_PROTOCOLS_IN_USE.len()
        );
    }

    /// Interface names become pin paths: one that is no interface name (`../x`) is refused.
    #[test]
    fn interface_names_are_the_kernels() {
        for bad in [
            "",
            ".",
            "..",
            "../links/x",
            "a:b",
            "eth 0",
            "sixteen-bytes-ab",
        ] {
            assert!(parse_iface(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_iface("cni0").unwrap(), "cni0");
        assert_eq!(parse_iface("fifteen-bytes-a").unwrap(), "fifteen-bytes-a");
    }
}

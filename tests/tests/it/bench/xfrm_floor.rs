//! The xfrm floor of the IPsec benchmark: iproute2 adding, in one `ip -batch`, the states and
//! policies the agent writes for a cluster, in the per-sender SPI layout: the same endpoints,
//! SPIs, marks and key, one request at a time, in one process; in a kernel that holds the
//! cluster's routes, as the agent's does. That matters: every IPv6 policy the kernel adds or
//! deletes makes it walk the whole IPv6 routing table (the xfrm change bumps the IPv6 route
//! generation, and the FIB's serial numbers are updated route by route), so an IPv6 policy
//! costs time in proportion to the IPv6 routes there are. Measured in the guest: 270 µs per
//! policy without routes at 5,000 and 20,000 nodes; with the routes, 1.1 ms at 5,000 and 3.4 ms
//! at 20,000 (IPv4 policies: 240 µs either way).

use std::net::IpAddr;
use std::time::{Duration, Instant};

use node_agent_tests::agent::TestNode;
use node_agent_tests::{ip, ip_batch};
use state::objects::{NodeId, Spi, SpiLayout, XfrmDir, mark};

/// The link the cluster's routes go through while the floor runs (the benchmark's own).
const ROUTE_DEV: &str = "gw0";

/// What the floor measured.
pub struct XfrmFloor {
    /// States and policies added.
    pub objects: usize,
    pub add: Duration,
}

impl XfrmFloor {
    /// Microseconds per object.
    pub fn per_object_us(&self) -> f64 {
        self.add.as_secs_f64() * 1e6 / self.objects.max(1) as f64
    }

    /// Adds what the agent on `local` writes toward `nodes` under key `key` (`hex`, a global
    /// key), times it, and removes it again. As the agent: per family both ends have an address
    /// in, an OUT state when the node has pod CIDRs of the family, an IN state when `local`
    /// has, an OUT policy per pod CIDR.
    pub fn measure(local: &TestNode, nodes: &[TestNode], key: u8, hex: &str) -> Self {
        let addr = |n: &TestNode, v4: bool| {
            n.ips
                .iter()
                .filter_map(|a| a.parse::<IpAddr>().ok())
                .find(|a| a.is_ipv4() == v4)
        };
        let cidrs = |n: &TestNode, v4: bool| -> Vec<String> {
            let of_family = |c: &&String| c.contains(':') != v4;
            n.cidrs.iter().filter(of_family).cloned().collect()
        };
        let (mut states, mut policies, mut objects) = (String::new(), String::new(), 0);
        for (i, n) in nodes.iter().enumerate() {
            let id = NodeId::new(u16::try_from(i + 1).unwrap_or(u16::MAX)).unwrap();
            for v4 in [true, false] {
                let (Some(here), Some(there)) = (addr(local, v4), addr(n, v4)) else {
                    continue;
                };
                let theirs = cidrs(n, v4);
                let ends = [
                    (!theirs.is_empty(), here, there, XfrmDir::Out),
                    (!cidrs(local, v4).is_empty(), there, here, XfrmDir::In),
                ];
                for (_, src, dst, dir) in ends.into_iter().filter(|e| e.0) {
                    let spi = Spi::new(key, SpiLayout::PerSender, src).wire();
                    let m = mark::encode(id, key, dir);
                    states.push_str(&format!(
                        "xfrm state add src {src} dst {dst} proto esp spi {spi:#x} reqid 1 \
                         mode tunnel flag esn replay-window 1024 mark {m:#x} mask {:#x} \
                         aead 'rfc4106(gcm(aes))' 0x{hex} 128\n",
                        mark::MASK
                    ));
                    objects += 1;
                }
                let out = Spi::new(key, SpiLayout::PerSender, here).wire();
                let m = mark::encode(id, key, XfrmDir::Out);
                let any = if v4 { "0.0.0.0/0" } else { "::/0" };
                for cidr in theirs {
                    policies.push_str(&format!(
                        "xfrm policy add src {any} dst {cidr} dir out mark {m:#x} mask {:#x} \
                         tmpl src {here} dst {there} proto esp spi {out:#x} reqid 1 mode tunnel\n",
                        mark::MASK
                    ));
                    objects += 1;
                }
            }
        }
        let routes: String = nodes
            .iter()
            .flat_map(|n| n.cidrs.iter())
            .map(|c| format!("route add {c} dev {dev}\n", dev = ROUTE_DEV))
            .collect();
        ip_batch(&[], &routes);
        let t = Instant::now();
        ip_batch(&[], &states);
        ip_batch(&[], &policies);
        let add = t.elapsed();
        ip(&["xfrm", "policy", "flush"]);
        ip(&["xfrm", "state", "flush"]);
        let deletes = routes.replace("route add", "route del");
        ip_batch(&[], &deletes);
        Self { objects, add }
    }
}

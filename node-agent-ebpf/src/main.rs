//! The tc datapath of node-agent.
//!
//! Two classifiers on the uplink, one per direction, look the peer address of each IPv4/IPv6
//! packet up in the pinned `NODE_IDS` map (the source on ingress, the destination on egress). A
//! hit is counted in `NODE_STATS` under the node's ID; on ingress the ID is also written into the
//! configured bits of `skb->mark` so policy routing and xfrm can match on it. With IPsec on, an
//! ESP packet from a known node gets the xfrm IN mark instead (node ID, the SPI from its ESP
//! header, direction 0xD00), which selects the IN state that decrypts it.
//!
//! A third classifier, `tc_pod`, sits on ingress of the interface pod traffic enters the host
//! through (the CNI's bridge). It looks each packet's destination up in the `POD_CIDRS` LPM trie
//! and marks traffic toward a remote node's pod CIDR with the xfrm OUT mark (node ID, the SPI in
//! use, direction 0xE00), which selects the OUT policy and state that encrypt it.
//!
//! The programs only observe and mark: every path returns `TC_ACT_UNSPEC`, so traffic is never
//! dropped or redirected here and any program after ours still runs. Dropping what must not
//! leave unencrypted is the kernel's job (the agent's xfrm block policy).
#![no_std]
#![no_main]

mod log;

use aya_ebpf::{
    Global,
    bindings::{BPF_F_NO_PREALLOC, TC_ACT_UNSPEC},
    btf_maps::{HashMap, LpmTrie, PerCpuArray, lpm_trie::Key},
    macros::{btf_map, classifier},
    programs::TcContext,
};
use node_agent_common::{
    DEFAULT_MARK_MASK, DEFAULT_NODE_MAP_MAX, NODE_STATS_ENTRIES, NodeKey, NodeStats, NodeValue,
    POD_CIDR_FULL_BITS, esp_spi, xfrm_mark,
};

/// Remote node addresses to node IDs. The agent sets the capacity when it first creates the pin;
/// entries are allocated when written, so the capacity costs nothing until it is used.
#[btf_map]
static NODE_IDS: HashMap<
    NodeKey,
    NodeValue,
    { DEFAULT_NODE_MAP_MAX as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// Per-CPU packet and byte counters, indexed by node ID.
#[btf_map]
static NODE_STATS: PerCpuArray<NodeStats, { NODE_STATS_ENTRIES as usize }> = PerCpuArray::new();

/// Remote pod CIDRs to the node that owns them; the agent sets the capacity at first creation.
#[btf_map]
static POD_CIDRS: LpmTrie<NodeKey, NodeValue, { DEFAULT_NODE_MAP_MAX as usize }> = LpmTrie::new();

/// Non-zero when the agent runs with IPsec: ESP packets from known nodes get the xfrm IN mark.
#[unsafe(no_mangle)]
static IPSEC: Global<u32> = Global::new(0);

/// The `skb->mark` bits that carry the node ID on ingress; the agent may override it at load.
#[unsafe(no_mangle)]
static MARK_MASK: Global<u32> = Global::new(DEFAULT_MARK_MASK);
/// Left shift that places a node ID under `MARK_MASK` (its trailing zeros).
#[unsafe(no_mangle)]
static MARK_SHIFT: Global<u32> = Global::new(DEFAULT_MARK_MASK.trailing_zeros());

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
/// Offsets of the source address within the IPv4 and IPv6 headers; the destination follows it.
const IPV4_SADDR: usize = 12;
const IPV6_SADDR: usize = 8;
/// Offsets of the protocol field (IPv4) and next header (IPv6).
const IPV4_PROTO: usize = 9;
const IPV6_NEXTHDR: usize = 6;
const IPV6_HLEN: usize = 40;
const IPPROTO_ESP: u8 = 50;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Ingress,
    Egress,
}

#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    observe(&ctx, Direction::Ingress);
    TC_ACT_UNSPEC
}

#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    observe(&ctx, Direction::Egress);
    TC_ACT_UNSPEC
}

#[classifier]
pub fn tc_pod(ctx: TcContext) -> i32 {
    mark_for_encryption(&ctx);
    TC_ACT_UNSPEC
}

/// Marks a packet toward a remote node's pod CIDR so that the node's xfrm OUT policy selects it.
/// SPI 0 in the entry means IPsec is off for the node: the packet is left as it is.
#[inline(always)]
fn mark_for_encryption(ctx: &TcContext) {
    let Some(dst) = peer_key(ctx, Direction::Egress) else {
        return;
    };
    let Some(value) = POD_CIDRS.get(&Key::new(POD_CIDR_FULL_BITS, dst)).copied() else {
        return;
    };
    if value.spi == 0 {
        return;
    }
    // SAFETY: as in `observe`.
    let mark = unsafe { (*ctx.skb.skb).mark };
    ctx.set_mark(
        (mark & !xfrm_mark::MASK) | xfrm_mark::encode(value.id, value.spi, xfrm_mark::OUT),
    );
}

#[inline(always)]
fn observe(ctx: &TcContext, dir: Direction) {
    let Some(key) = peer_key(ctx, dir) else {
        return;
    };
    // SAFETY: the value is copied out at once; the agent may update it concurrently, which at
    // worst yields the old or the new ID, both valid.
    let Some(value) = (unsafe { NODE_IDS.get(&key) }).copied() else {
        if key.family == node_agent_common::FAMILY_V4 {
            let ip = [key.ip[0], key.ip[1], key.ip[2], key.ip[3]];
            log::debug_ip("no node for peer ", ip);
        } else {
            log::debug_ip("no node for peer ", key.ip);
        }
        return;
    };
    count(ctx, value.id, dir);
    if dir == Direction::Ingress {
        // SAFETY: `skb` is the context pointer the kernel passed in; `mark` is readable by tc
        // programs.
        let mark = unsafe { (*ctx.skb.skb).mark };
        if IPSEC.load() != 0
            && let Some(spi) = esp_spi(ctx)
        {
            ctx.set_mark(
                (mark & !xfrm_mark::MASK) | xfrm_mark::encode(value.id, spi, xfrm_mark::IN),
            );
            return;
        }
        let mask = MARK_MASK.load();
        let shift = MARK_SHIFT.load();
        ctx.set_mark((mark & !mask) | ((u32::from(value.id) << shift) & mask));
    }
}

#[inline(always)]
fn count(ctx: &TcContext, id: u16, dir: Direction) {
    let Some(stats) = NODE_STATS.get_ptr_mut(u32::from(id)) else {
        return;
    };
    let len = u64::from(ctx.len());
    // SAFETY: the slot belongs to this CPU and the program runs with preemption disabled.
    unsafe {
        match dir {
            Direction::Ingress => {
                (*stats).rx_packets += 1;
                (*stats).rx_bytes += len;
            }
            Direction::Egress => {
                (*stats).tx_packets += 1;
                (*stats).tx_bytes += len;
            }
        }
    }
}

/// The map key of the packet's peer address, or `None` for anything that is not a complete
/// Ethernet + IPv4/IPv6 header. `load` goes through `bpf_skb_load_bytes`, which checks bounds.
#[inline(always)]
fn peer_key(ctx: &TcContext, dir: Direction) -> Option<NodeKey> {
    let proto = u16::from_be(ctx.load::<u16>(ETH_HLEN - 2).ok()?);
    match proto {
        ETH_P_IP => {
            let off = ETH_HLEN + IPV4_SADDR + if dir == Direction::Egress { 4 } else { 0 };
            Some(NodeKey::v4(ctx.load::<[u8; 4]>(off).ok()?))
        }
        ETH_P_IPV6 => {
            let off = ETH_HLEN + IPV6_SADDR + if dir == Direction::Egress { 16 } else { 0 };
            Some(NodeKey::v6(ctx.load::<[u8; 16]>(off).ok()?))
        }
        _ => None,
    }
}

/// The key number of an ESP packet's SPI (IPv4 with any header length, IPv6 with ESP as the
/// first next header) when the SPI is one of ours in either layout (`esp_spi`), else `None`.
#[inline(always)]
fn esp_spi(ctx: &TcContext) -> Option<u8> {
    let proto = u16::from_be(ctx.load::<u16>(ETH_HLEN - 2).ok()?);
    let spi_at = match proto {
        ETH_P_IP => {
            if ctx.load::<u8>(ETH_HLEN + IPV4_PROTO).ok()? != IPPROTO_ESP {
                return None;
            }
            let ihl = usize::from(ctx.load::<u8>(ETH_HLEN).ok()? & 0x0F) * 4;
            ETH_HLEN + ihl
        }
        ETH_P_IPV6 => {
            if ctx.load::<u8>(ETH_HLEN + IPV6_NEXTHDR).ok()? != IPPROTO_ESP {
                return None;
            }
            ETH_HLEN + IPV6_HLEN
        }
        _ => return None,
    };
    esp_spi::key_of(u32::from_be(ctx.load::<u32>(spi_at).ok()?))
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

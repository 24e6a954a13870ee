//! The tc datapath of node-agent.
//!
//! Two classifiers, one per direction, look the peer address of each IPv4/IPv6 packet up in the
//! pinned `NODE_IDS` map (the source on ingress, the destination on egress). A hit is counted in
//! `NODE_STATS` under the node's ID; on ingress the ID is also written into the configured bits of
//! `skb->mark` so policy routing and xfrm can match on it. The program only observes and marks:
//! every path returns `TC_ACT_UNSPEC`, so traffic is never dropped or redirected and any program
//! after ours still runs.
#![no_std]
#![no_main]

mod log;

use aya_ebpf::{
    Global,
    bindings::TC_ACT_UNSPEC,
    btf_maps::{HashMap, PerCpuArray},
    macros::{btf_map, classifier},
    programs::TcContext,
};
use node_agent_common::{
    DEFAULT_MARK_MASK, DEFAULT_NODE_MAP_MAX, NODE_STATS_ENTRIES, NodeKey, NodeStats, NodeValue,
};

/// Remote node addresses to node IDs. The agent sets the capacity when it first creates the pin.
#[btf_map]
static NODE_IDS: HashMap<NodeKey, NodeValue, { DEFAULT_NODE_MAP_MAX as usize }> = HashMap::new();

/// Per-CPU packet and byte counters, indexed by node ID.
#[btf_map]
static NODE_STATS: PerCpuArray<NodeStats, { NODE_STATS_ENTRIES as usize }> = PerCpuArray::new();

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
        let mask = MARK_MASK.load();
        let shift = MARK_SHIFT.load();
        // SAFETY: `skb` is the context pointer the kernel passed in; `mark` is readable by tc
        // programs.
        let mark = unsafe { (*ctx.skb.skb).mark };
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

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

//! `cargo bench -p state --bench id_edge`: the edge of the node-ID space under a node-pool
//! upgrade, with the default cool-down, with and without the reuse floor.
//!
//! Scenario: 65,000 nodes hold IDs 1 to 65,000, so 535 IDs were never used. A node-pool upgrade
//! then replaces `NODE_AGENT_BENCH_REPLACED` nodes (6,000 by default): a new node joins every
//! 100 ms, and the node it replaces is deleted a surge delay later (60 s: cordoned, drained,
//! deleted). Each new node asks for an ID when it joins and every second after until it gets
//! one. Prints how many new nodes waited and for how long, under `--id-reuse-floor` 2m and with
//! no early reuse (the floor equal to the cool-down), and what an allocation at the edge costs.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use state::ids::{AllocatorState, IdAllocator, MAX_ID};
use state::objects::NodeId;

const LIVE: u16 = 65_000;
const COOLDOWN: Duration = Duration::from_secs(15 * 60);
const FLOOR: Duration = Duration::from_secs(2 * 60);
const JOINS_PER_SECOND: u32 = 10;
const SURGE: u32 = 60;

struct Figures {
    waited: usize,
    max_wait: u32,
    mean_wait: f64,
    early: usize,
    allocations: usize,
    alloc_time: Duration,
}

fn replay(replaced: u32, floor: Duration) -> Figures {
    let mut ids = IdAllocator::with_max_id(COOLDOWN, MAX_ID, &AllocatorState::default())
        .with_reuse_floor(floor);
    // The old nodes, in the order the upgrade replaces them.
    let mut old: VecDeque<NodeId> = (1..=LIVE).filter_map(NodeId::new).collect();
    for id in &old {
        ids.reserve(*id);
    }
    let mut waiting: VecDeque<(u32, u32)> = VecDeque::new();
    let mut waits = Vec::new();
    let (mut early, mut allocations, mut alloc_time) = (0, 0, Duration::ZERO);
    let last_join = replaced / JOINS_PER_SECOND;
    let mut t = 0u32;
    while t <= last_join + SURGE || !waiting.is_empty() {
        let now = Duration::from_secs(u64::from(t));
        if t < last_join {
            for k in 0..JOINS_PER_SECOND {
                waiting.push_back((t * JOINS_PER_SECOND + k, t));
            }
        }
        // The nodes that joined a surge delay ago replace theirs: the old ones go now.
        if t >= SURGE && t - SURGE < last_join {
            for _ in 0..JOINS_PER_SECOND {
                if let Some(id) = old.pop_front() {
                    ids.free(id, now);
                }
            }
        }
        while let Some(&(_, joined)) = waiting.front() {
            let started = Instant::now();
            let got = ids.allocate(now);
            alloc_time += started.elapsed();
            allocations += 1;
            match got {
                Ok(a) => {
                    early += usize::from(a.early);
                    waits.push(t - joined);
                    waiting.pop_front();
                }
                Err(_) => break,
            }
        }
        t += 1;
        assert!(t < 100_000, "the replay never ends");
    }
    let waited: Vec<u32> = waits.iter().copied().filter(|w| *w > 0).collect();
    Figures {
        waited: waited.len(),
        max_wait: waits.iter().copied().max().unwrap_or(0),
        mean_wait: if waited.is_empty() {
            0.0
        } else {
            f64::from(waited.iter().sum::<u32>()) / waited.len() as f64
        },
        early,
        allocations,
        alloc_time,
    }
}

fn main() {
    let replaced: u32 = std::env::var("NODE_AGENT_BENCH_REPLACED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6_000);
    println!(
        "id edge: {LIVE} nodes in a space of {MAX_ID} IDs ({} never used), {replaced} replaced at \
         {JOINS_PER_SECOND}/s with a {SURGE} s surge, cool-down {} s",
        MAX_ID - LIVE,
        COOLDOWN.as_secs()
    );
    for (name, floor) in [("floor_2m", FLOOR), ("no_floor", COOLDOWN)] {
        let f = replay(replaced, floor);
        println!("bench: id_edge_waited_nodes_{name} {} nodes", f.waited);
        println!("bench: id_edge_max_wait_{name} {} s", f.max_wait);
        println!("bench: id_edge_mean_wait_{name} {:.1} s", f.mean_wait);
        println!("bench: id_edge_early_reuses_{name} {} ids", f.early);
        println!(
            "bench: id_edge_allocation_{name} {:.2} us",
            f.alloc_time.as_secs_f64() * 1e6 / f.allocations.max(1) as f64
        );
    }
}

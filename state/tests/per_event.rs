//! An event's work does not grow with the cluster: a node added, removed or readdressed costs
//! the same at 65,000 nodes as at 5,000, counted, not timed (`cargo xtask bench` prints the
//! times). What is counted is what the daemon does per event on the planner's side: the
//! event-sized plan, the claim index and the record brought up to date. The counts are the plan's
//! part and operations, the records and index records rewritten, and the memory allocated,
//! which a copy of anything of the cluster's size would show.

#[path = "common/cluster.rs"]
mod cluster;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeSet;

use state::inventory::Inventory;
use state::node::Node;
use state::plan::{BrakeMemory, ClaimIndex, PlanInput, plan_scoped};

/// Counts this thread's allocations, so that the test harness's other threads do not count.
struct Counting;

thread_local! {
    static ALLOCATED: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
}

// SAFETY: every call is passed on to the system allocator unchanged; the count is a
// const-initialised thread-local, which allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| {
            let (n, bytes) = a.get();
            a.set((n + 1, bytes + layout.size()));
        });
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| {
            let (n, bytes) = a.get();
            a.set((n + 1, bytes + new_size));
        });
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// What one event cost.
#[derive(Debug, PartialEq, Eq)]
struct Work {
    /// Operations the plan makes.
    ops: usize,
    /// Names the plan covers.
    scope: usize,
    /// Records of the agent's record taken out and put in.
    records_written: usize,
    /// Allocations, and their bytes, over the plan and both updates.
    allocations: usize,
    bytes: usize,
}

/// Each kind of event on a converged cluster of `n` nodes, and its work. The nodes an event
/// touches are named alike at every size, so that names cost the same bytes.
fn events_at(n: usize) -> Vec<(&'static str, Work)> {
    let config = cluster::config();
    let nodes: Vec<Node> = (0..n).map(|i| cluster::node(i, i)).collect();
    let (record, inventory) = cluster::converge(
        None,
        Inventory::new(),
        &cluster::view(nodes),
        &config,
        cluster::NOW,
    );
    let index = ClaimIndex::of(&record);
    let brake = BrakeMemory::default();
    // A name and slot beyond both sizes, and a node below both.
    let events = [
        (
            "add",
            cluster::node(70_000, 70_000).name,
            Some(cluster::node(70_000, 70_000)),
        ),
        ("remove", cluster::node(2_600, 2_600).name, None),
        (
            "readdress",
            cluster::node(2_601, 2_601).name,
            Some(cluster::node(2_601, 70_001)),
        ),
    ];
    events
        .into_iter()
        .map(|(kind, name, now)| {
            let live = cluster::view(now.into_iter().collect());
            let input = PlanInput {
                record: Some(&record),
                live: &live,
                inventory: &inventory,
                allocator: &record.ids,
                brake: &brake,
                confirmed_hold: None,
                now: cluster::NOW,
                config: &config,
            };
            let touched: BTreeSet<String> = [name].into();
            // Copies made before counting: the daemon updates its own in place.
            let (mut after, mut index) = (record.clone(), index.clone());
            ALLOCATED.set((0, 0));
            let plan = plan_scoped(&input, &index, &touched).expect("planned event-sized");
            let names = plan.scope.clone().expect("an event-sized plan has a scope");
            let part = plan.checkpoint_after(&[]);
            index.splice(&after, &names, &part.nodes);
            let spliced = after.splice(&names, part);
            let (allocations, bytes) = ALLOCATED.get();
            assert!(spliced.changed, "{kind}: the event changes the record");
            assert!(
                index == ClaimIndex::of(&after),
                "{kind}: the index follows the record"
            );
            let work = Work {
                ops: plan.ops().len(),
                scope: names.len(),
                records_written: spliced.records_written,
                allocations,
                bytes,
            };
            (kind, work)
        })
        .collect()
}

#[test]
fn an_event_costs_the_same_work_at_65000_nodes_as_at_5000() {
    let small = events_at(5_000);
    let large = events_at(65_000);
    for ((kind, s), (_, l)) in small.iter().zip(&large) {
        println!(
            "per event: {kind}: {} ops, {} names, {} records written, {} allocations ({} bytes) at 5,000 nodes; {} ops, {} names, {} records written, {} allocations ({} bytes) at 65,000",
            s.ops,
            s.scope,
            s.records_written,
            s.allocations,
            s.bytes,
            l.ops,
            l.scope,
            l.records_written,
            l.allocations,
            l.bytes
        );
        assert!(s.ops > 0, "{kind}: the event changes the kernel");
        let counted = |w: &Work| (w.ops, w.scope, w.records_written);
        assert_eq!(
            counted(s),
            counted(l),
            "{kind}: the work grew with the cluster"
        );
        // Where a record falls decides whether a B-tree node splits or merges on the way: a few
        // allocations of a few hundred bytes, either way, at any size.
        assert!(
            l.allocations <= s.allocations + 4 && l.bytes <= s.bytes + 2048,
            "{kind}: the memory allocated grew with the cluster: {s:?} at 5,000 nodes, {l:?} at 65,000"
        );
    }
}

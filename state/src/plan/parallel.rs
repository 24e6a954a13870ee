//! Two pieces of a plan's work at once, where the machine has a second core.
//!
//! A full plan at 65,000 nodes is a few hundred milliseconds on one core, most of it walks over
//! memory that the two pieces here share only for reading. The agent is otherwise idle while it
//! plans, so a second core, where there is one, halves those walks. Where there is not (one CPU,
//! or work too small to be worth a thread), both run here, one after the other.

use std::sync::{Mutex, OnceLock};

/// Nodes from which a piece of work over every node is worth a thread (starting one costs tens
/// of microseconds; copying this many nodes costs more). Debug builds (every test) take the
/// second thread from a handful, so that the planner's tests run through it.
pub(super) const WORTH_A_THREAD: usize = if cfg!(debug_assertions) { 2 } else { 2048 };

/// Runs `a` and `b`, on two threads when `worth_it` and the machine has two cores or more.
/// Both finish before it returns; a panic in either is a panic here. Where no thread can be
/// started (a pod at its limit of processes), both run here: the plan is the same, only slower.
pub(super) fn both<A, B, RA, RB>(worth_it: bool, a: A, b: B) -> (RA, RB)
where
    A: FnOnce() -> RA + Send,
    B: FnOnce() -> RB,
    RA: Send,
{
    if !worth_it || cores() < 2 {
        return (a(), b());
    }
    // Where the other thread takes `a` from, or this one if the thread never starts.
    let slot = Mutex::new(Some(a));
    let take = || slot.lock().map_or(None, |mut a| a.take());
    std::thread::scope(|s| {
        let other = std::thread::Builder::new().spawn_scoped(s, || take().map(|a| a()));
        let b = b();
        let a = match other.map(|h| h.join()) {
            Ok(Ok(Some(a))) => a,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Ok(Ok(None)) | Err(_) => take().expect("`a` runs exactly once")(),
        };
        (a, b)
    })
}

/// The cores this process may use, asked once: the answer reads the affinity mask and cgroup
/// files, too slow to ask at every plan.
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_pieces_run_and_keep_their_answers_apart() {
        for worth_it in [false, true] {
            let data: Vec<u64> = (0..10_000).collect();
            let (a, b) = both(
                worth_it,
                || data.iter().filter(|x| *x % 2 == 0).sum::<u64>(),
                || data.iter().filter(|x| *x % 2 == 1).sum::<u64>(),
            );
            assert_eq!((a, b), (24_995_000, 25_000_000));
        }
    }

    #[test]
    #[should_panic(expected = "the other thread")]
    fn a_panic_on_the_other_thread_is_a_panic_here() {
        both(true, || panic!("the other thread"), || ());
    }
}

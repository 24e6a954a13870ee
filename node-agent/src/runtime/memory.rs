//! Handing freed memory back to the system between the phases of a run.
//!
//! A large list is parsed on a blocking thread, whose allocator arena keeps what the parse freed;
//! a pass's plan and results are freed in the middle of the heap. glibc keeps both as free
//! pages of the process, so the peak RSS of a 65,000-node run was the sum of its phases rather
//! than the largest of them. `malloc_trim` returns the free pages of every arena.

/// Tables above this size get pages of their own, returned whole when freed.
const OWN_PAGES_ABOVE: i32 = 1 << 20;

/// Set once at start. glibc raises its threshold for giving an allocation pages of its own each
/// time such an allocation is freed, up to 32 MiB; after the first large table goes, the next
/// ones (the planner's, the view's, a phase's operations: tens of MiB each at 65,000 nodes) are
/// carved from the heap, where what they leave when freed is hard to give back. A fixed
/// threshold keeps every large table on pages of its own.
pub fn init() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only tunes the allocator; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, OWN_PAGES_ABOVE);
    }
}

/// Returns the allocator's free pages to the system (glibc; nothing elsewhere).
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases memory the allocator holds free.
    unsafe {
        libc::malloc_trim(0);
    }
}

//! Handing freed memory back to the system between the phases of a run.
//!
//! A large list is parsed on a blocking thread, whose allocator arena keeps what the parse freed;
//! a pass's plan and results are freed in the middle of the heap. glibc keeps both as free
//! pages of the process, so the peak RSS of a 65,000-node run was the sum of its phases rather
//! than the largest of them. `malloc_trim` returns the free pages of every arena.

/// Returns the allocator's free pages to the system (glibc; nothing elsewhere).
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases memory the allocator holds free.
    unsafe {
        libc::malloc_trim(0);
    }
}

//! The eBPF object, embedded at build time so the release binary is self-contained.

/// The object's bytes, or `None` when the agent was built before `cargo xtask build-ebpf`.
pub fn bytes() -> Option<&'static [u8]> {
    #[cfg(ebpf_object)]
    {
        Some(aya::include_bytes_aligned!(env!("NODE_AGENT_EBPF_OBJECT")))
    }
    #[cfg(not(ebpf_object))]
    {
        None
    }
}

//! The agent's records pinned in bpffs beside the datapath's maps: kernel state the datapath never
//! reads, kept there because it lives exactly as long as the kernel state it describes (a reboot
//! ends both), while the checkpoint can be lost. Each is an array map made and checked with
//! [`super::pins`].

pub mod freed_ids;
pub mod recent_removals;

pub use self::freed_ids::FreedIds;
pub use self::recent_removals::RecentRemovalsRecord;

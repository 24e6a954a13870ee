//! The agent's clock, read from the kernel: the wall clock once, at start (unless the record
//! continues on this boot), then only the boot clock (`CLOCK_BOOTTIME`), which no step moves.
//! Why, and how a restart continues it: [`state::checkpoint::clock`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use state::checkpoint::{BootTime, Checkpoint, clock};

/// Where the kernel keeps the ID of the running boot.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// The agent's time: `base` when the boot clock read `base_boot`, advancing with it.
#[derive(Clone, Copy, Debug)]
pub struct AgentClock {
    base: Duration,
    base_boot: Duration,
    boot_id: Option<[u8; 16]>,
}

impl AgentClock {
    /// The clock of an agent starting from `record`: continued from it on the same boot, the
    /// wall clock otherwise.
    pub fn resume(record: Option<&Checkpoint>) -> Self {
        let base_boot = since_boot();
        let boot_id = boot_id();
        let now = boot_id.map(|boot_id| BootTime {
            boot_id,
            since_boot: base_boot,
        });
        Self {
            base: clock::resume(record.map(|c| (c.written_at, c.boot)), now, wall_clock()),
            base_boot,
            boot_id,
        }
    }

    /// The agent's time now. A boot clock that cannot be read stands still, which only ever
    /// holds longer.
    pub fn now(&self) -> Duration {
        self.stamp().0
    }

    /// The time now, and where it sits on the boot clock (none without a boot ID): what a
    /// record written now keeps.
    pub fn stamp(&self) -> (Duration, Option<BootTime>) {
        let since = since_boot();
        let at = self
            .base
            .saturating_add(since.saturating_sub(self.base_boot));
        let boot = self.boot_id.map(|boot_id| BootTime {
            boot_id,
            since_boot: since,
        });
        (at, boot)
    }
}

/// Since the Unix epoch, by the wall clock: for what is not the record's time (names, seeds).
pub fn wall_clock() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// `CLOCK_BOOTTIME`, or zero if it cannot be read (it always can on Linux since 2.6.39).
fn since_boot() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    match (rc, u64::try_from(ts.tv_sec), u32::try_from(ts.tv_nsec)) {
        (0, Ok(secs), Ok(nanos)) if nanos < 1_000_000_000 => Duration::new(secs, nanos),
        _ => Duration::ZERO,
    }
}

/// The running boot's ID, if the kernel says (a missing or odd file is no boot ID: the next
/// start then takes the wall clock).
fn boot_id() -> Option<[u8; 16]> {
    let text = std::fs::read_to_string(BOOT_ID).ok()?;
    BootTime::id_from_text(text.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_kernel_has_a_boot_id() {
        assert!(boot_id().is_some(), "{BOOT_ID} on this kernel");
    }

    #[test]
    fn a_record_of_this_boot_continues_by_the_boot_clock() {
        let (at, boot) = AgentClock::resume(None).stamp();
        let hour_ahead = Checkpoint {
            written_at: at + Duration::from_secs(3_600),
            boot,
            ..Checkpoint::default()
        };
        // As if the wall clock had stepped back an hour since the record was written.
        let t = AgentClock::resume(Some(&hour_ahead)).now();
        assert!(t >= hour_ahead.written_at, "{t:?}");
        assert!(t < hour_ahead.written_at + Duration::from_secs(60), "{t:?}");
        let elsewhere = Checkpoint {
            boot: boot.map(|b| BootTime {
                boot_id: [0; 16],
                ..b
            }),
            ..hour_ahead
        };
        let t = AgentClock::resume(Some(&elsewhere)).now();
        assert!(t < elsewhere.written_at, "another boot: the wall clock");
    }
}

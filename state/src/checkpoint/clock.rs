//! The agent's clock: the time every duration in the record is counted in (the brake's window
//! and holds, ID cool-downs, key first-seen times), and how a restarted agent continues it.
//!
//! The wall clock is not fit for that alone: an NTP step, a VM restored from a snapshot or an
//! operator's `date -s` can move it an hour forward, and every hold would ripen and the window
//! of recent removals empty at once (the brake walked around, invariant 9). So the record keeps
//! where its `written_at` sat on the kernel's boot clock (`CLOCK_BOOTTIME`: never stepped,
//! counting suspend), and an agent started on the same boot continues from there by that clock
//! alone. Across a reboot the kernel state the brake protects is gone with it (routes, xfrm and
//! pins live as long as the boot), so the wall clock is taken again: nothing a step there could
//! release still exists to be deleted.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A point on the kernel's boot clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootTime {
    /// The kernel's boot ID (`/proc/sys/kernel/random/boot_id`): which boot the clock is of.
    pub boot_id: [u8; 16],
    /// `CLOCK_BOOTTIME`: since that boot, suspend included.
    pub since_boot: Duration,
}

impl BootTime {
    /// A boot ID's bytes from the kernel's text of it (a canonical lowercase UUID).
    pub fn id_from_text(text: &str) -> Option<[u8; 16]> {
        super::payload::parse_uuid(text)
    }
}

/// The agent's time now, continued from a record written at `written_at` (agent time) and
/// `written_boot` (the boot clock then, if it was read): on the same boot, `written_at` plus
/// the boot clock's advance since (none if the boot clock reads earlier than then, as in a
/// restored VM snapshot: time stands still rather than jump to the wall clock); otherwise
/// (another boot, a record without a boot time, a boot clock that cannot be read) the wall
/// clock. Without a record, the wall clock.
pub fn resume(
    record: Option<(Duration, Option<BootTime>)>,
    boot_now: Option<BootTime>,
    wall_now: Duration,
) -> Duration {
    match (record, boot_now) {
        (Some((written_at, Some(then))), Some(now)) if then.boot_id == now.boot_id => {
            written_at.saturating_add(now.since_boot.saturating_sub(then.since_boot))
        }
        _ => wall_now,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    fn boot(id: u8, since: u64) -> BootTime {
        BootTime {
            boot_id: [id; 16],
            since_boot: S(since),
        }
    }

    #[test]
    fn on_the_same_boot_only_the_boot_clock_counts() {
        let record = Some((S(1_000_000), Some(boot(1, 500))));
        // The wall clock stepped an hour forward, then a day back: neither moves the agent's.
        for wall in [S(1_000_000 + 3_600 + 30), S(1_000_000 - 86_400)] {
            assert_eq!(resume(record, Some(boot(1, 530)), wall), S(1_000_030));
        }
    }

    #[test]
    fn another_boot_or_no_boot_time_takes_the_wall_clock() {
        let wall = S(2_000_000);
        for (record, now) in [
            (Some((S(1_000_000), Some(boot(1, 500)))), Some(boot(2, 30))),
            (Some((S(1_000_000), None)), Some(boot(1, 530))),
            (Some((S(1_000_000), Some(boot(1, 500)))), None),
            (None, Some(boot(1, 530))),
        ] {
            assert_eq!(resume(record, now, wall), wall, "{record:?} {now:?}");
        }
    }

    /// A boot clock behind the record's on the same boot (a VM snapshot restored) does not
    /// fall back to the wall clock, which may be far ahead of the agent's: time stands still.
    #[test]
    fn a_boot_clock_behind_the_record_stands_still() {
        let record = Some((S(1_000_000), Some(boot(1, 500))));
        assert_eq!(
            resume(record, Some(boot(1, 499)), S(9_000_000)),
            S(1_000_000)
        );
    }

    #[test]
    fn a_record_at_the_end_of_time_saturates() {
        let record = Some((Duration::MAX, Some(boot(1, 0))));
        assert_eq!(resume(record, Some(boot(1, 10)), S(5)), Duration::MAX);
    }
}

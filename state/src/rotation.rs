//! IPsec key rotation without a coordinator: which keys have states and which one traffic is
//! sent with, from the order of the key file's lines and when this agent first saw each key.
//!
//! Every agent reads the same key file (a Secret reaches every kubelet within about a minute),
//! but at different moments, and no agent may send with a key before every peer can receive
//! with it. So each agent:
//! 1. installs states (IN and OUT) for a new key as soon as it sees it, and keeps sending with
//!    the key it used;
//! 2. switches to the new key once it has seen it for `propagation` (longer than any two
//!    agents' reads of the file apart), when every peer has its IN states;
//! 3. removes the old key's states `retirement` after its switch, when every peer has switched
//!    too (peers switch at most `propagation` apart, so `retirement` must exceed that).
//!
//! The order of the lines is the order of the keys (SPIs wrap from 15 to 1); the last line is
//! the newest. When the agent first sees a key is kept in the checkpoint, so a restart in the
//! middle of a rotation resumes it on the same schedule. An agent with no record of any key
//! (first start, IPsec just turned on) has nothing to coordinate and sends with the newest key
//! at once; so does one whose every key is new, because the key it sent with is gone from the
//! file (the operator replaced the file rather than appending), and it says so.

use std::sync::Arc;
use std::time::Duration;

use crate::checkpoint::KeySeen;
use crate::objects::{KeyTag, SpiLayout};
use crate::plan::{IpsecConfig, KeyInUse, KeyTags};

/// A key of the key file, as far as planning is concerned: its SPI, what its states hold and
/// their SPI layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileKey {
    pub spi: u8,
    pub tag: KeyTag,
    pub layout: SpiLayout,
}

/// The rotation's two delays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delays {
    /// How long a new key is received before it is sent with (`--ipsec-key-propagation-delay`).
    pub propagation: Duration,
    /// How long an old key is still received after the switch (`--ipsec-key-rotation-delay`).
    pub retirement: Duration,
}

/// Where a rotation stands.
#[derive(Clone, Debug, PartialEq)]
pub struct Rotation {
    /// The keys in use and the one sent with, and when the agent first saw each key of the
    /// file (for the checkpoint): for the planner.
    pub ipsec: IpsecConfig,
    /// When the rotation moves on by itself (a switch, a retirement), if it will.
    pub next_change: Option<Duration>,
    /// The key sent with was taken out of the file before the rotation completed: traffic
    /// switched at once.
    pub abrupt: bool,
}

/// Where a rotation stands at `now` (since the Unix epoch), given the key file's keys in file
/// order (at least one) and the agent's record of when it first saw keys; `tags` says what the
/// states of each key hold.
pub fn rotation(
    file: &[FileKey],
    seen: &[KeySeen],
    now: Duration,
    delays: Delays,
    tags: Arc<dyn KeyTags>,
) -> Rotation {
    assert!(!file.is_empty(), "a key file holds at least one key");
    let fresh = seen.is_empty();
    let first_seen: Vec<Duration> = file
        .iter()
        .map(|k| match seen.iter().find(|s| s.spi == k.spi) {
            Some(s) => s.first_seen,
            None if fresh => Duration::ZERO,
            None => now,
        })
        .collect();
    let ready = |i: usize| now >= first_seen[i].saturating_add(delays.propagation);
    let send = (0..file.len()).rev().find(|i| ready(*i));
    let abrupt = send.is_none();
    let send = send.unwrap_or(file.len() - 1);
    let switched_at = first_seen[send].saturating_add(delays.propagation);
    let retire_at = switched_at.saturating_add(delays.retirement);
    let keys = file
        .iter()
        .enumerate()
        .filter(|(i, _)| *i >= send || now < retire_at)
        .map(|(_, k)| KeyInUse {
            spi: k.spi,
            tag: k.tag,
            layout: k.layout,
        })
        .collect();
    let switch_next =
        (send + 1..file.len()).map(|i| first_seen[i].saturating_add(delays.propagation));
    let retire_next = (send > 0 && now < retire_at).then_some(retire_at);
    Rotation {
        ipsec: IpsecConfig {
            send_spi: file[send].spi,
            keys,
            seen: file
                .iter()
                .zip(&first_seen)
                .map(|(k, t)| KeySeen {
                    spi: k.spi,
                    first_seen: *t,
                })
                .collect(),
            tags,
        },
        next_change: switch_next.chain(retire_next).min(),
        abrupt: abrupt && !fresh,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::GlobalTags;

    const S: Duration = Duration::from_secs(1);
    const DELAYS: Delays = Delays {
        propagation: Duration::from_secs(90),
        retirement: Duration::from_secs(300),
    };

    /// Key 3 seen from the start, key 4 appended at 1000 s.
    const SEEN_3_THEN_4: [KeySeen; 2] = [
        KeySeen {
            spi: 3,
            first_seen: Duration::ZERO,
        },
        KeySeen {
            spi: 4,
            first_seen: Duration::from_secs(1000),
        },
    ];

    fn key(spi: u8) -> FileKey {
        FileKey {
            spi,
            tag: KeyTag(u64::from(spi) * 0x101),
            layout: SpiLayout::Key,
        }
    }

    fn spis(r: &Rotation) -> Vec<u8> {
        r.ipsec.keys.iter().map(|k| k.spi).collect()
    }

    #[test]
    fn a_first_start_sends_with_the_newest_key_at_once_and_keeps_no_other() {
        let r = rotation(
            &[key(2), key(3)],
            &[],
            1000 * S,
            DELAYS,
            Arc::new(GlobalTags),
        );
        assert_eq!(r.ipsec.send_spi, 3);
        assert_eq!(
            spis(&r),
            [3],
            "nothing to coordinate with: the older line is retired"
        );
        assert_eq!(r.next_change, None);
        assert!(!r.abrupt);
    }

    /// A checkpoint may say anything: a key first seen at the end of time is a key not yet
    /// ready to send with, not an overflow.
    #[test]
    fn a_first_seen_time_at_the_end_of_time_is_no_overflow() {
        let start = rotation(&[key(3)], &[], 1000 * S, DELAYS, Arc::new(GlobalTags));
        let mut seen = start.ipsec.seen.clone();
        for s in &mut seen {
            s.first_seen = Duration::MAX;
        }
        let r = rotation(
            &[key(3), key(4)],
            &seen,
            2000 * S,
            DELAYS,
            Arc::new(GlobalTags),
        );
        assert!(r.abrupt, "no key is ready: the newest is sent with at once");
        assert_eq!(r.ipsec.send_spi, 4);
        assert_eq!(
            r.next_change,
            Some(2390 * S),
            "4 seen now, 3 retired after the delays"
        );
    }

    #[test]
    fn an_appended_key_is_received_at_once_sent_with_after_propagation_and_the_old_one_retires() {
        let t0 = 1000 * S;
        let start = rotation(&[key(3)], &[], t0, DELAYS, Arc::new(GlobalTags));
        let t1 = t0 + 50 * S;
        let file = [key(3), key(4)];
        // Seen: both directions of both keys, still sending with 3.
        let r = rotation(&file, &start.ipsec.seen, t1, DELAYS, Arc::new(GlobalTags));
        assert_eq!((r.ipsec.send_spi, spis(&r)), (3, vec![3, 4]));
        assert_eq!(r.next_change, Some(t1 + 90 * S), "the switch");
        // The switch, exactly on time; the old key is still received.
        let r = rotation(
            &file,
            &r.ipsec.seen,
            t1 + 90 * S,
            DELAYS,
            Arc::new(GlobalTags),
        );
        assert_eq!((r.ipsec.send_spi, spis(&r)), (4, vec![3, 4]));
        assert_eq!(r.next_change, Some(t1 + 390 * S), "the retirement");
        let r = rotation(
            &file,
            &r.ipsec.seen,
            t1 + 389 * S,
            DELAYS,
            Arc::new(GlobalTags),
        );
        assert_eq!(spis(&r), [3, 4]);
        // Retired, although its line is still in the file.
        let r = rotation(
            &file,
            &r.ipsec.seen,
            t1 + 390 * S,
            DELAYS,
            Arc::new(GlobalTags),
        );
        assert_eq!((r.ipsec.send_spi, spis(&r)), (4, vec![4]));
        assert_eq!(r.next_change, None);
        // The old line removed afterwards: nothing changes.
        let r = rotation(
            &[key(4)],
            &r.ipsec.seen,
            t1 + 500 * S,
            DELAYS,
            Arc::new(GlobalTags),
        );
        assert_eq!((r.ipsec.send_spi, spis(&r)), (4, vec![4]));
        assert_eq!(r.ipsec.seen.len(), 1);
    }

    #[test]
    fn a_restart_mid_rotation_resumes_on_the_recorded_schedule() {
        let seen = SEEN_3_THEN_4;
        let file = [key(3), key(4)];
        let r = rotation(&file, &seen, 1060 * S, DELAYS, Arc::new(GlobalTags));
        assert_eq!((r.ipsec.send_spi, spis(&r)), (3, vec![3, 4]));
        assert_eq!(r.next_change, Some(1090 * S), "the original switch time");
        assert_eq!(r.ipsec.seen, seen);
    }

    /// The way to the per-sender layout is a rotation to a key written with it: its states
    /// exist beside the old key's before anything is sent with it, and the layout goes with
    /// the key through the switch and the retirement.
    #[test]
    fn a_rotation_to_a_per_sender_key_moves_the_layout_with_the_key() {
        let seen = SEEN_3_THEN_4;
        let file = [
            key(3),
            FileKey {
                layout: SpiLayout::PerSender,
                ..key(4)
            },
        ];
        let layouts = |r: &Rotation| {
            let sent = r.ipsec.send_layout();
            let all: Vec<_> = r.ipsec.keys.iter().map(|k| (k.spi, k.layout)).collect();
            (sent, all)
        };
        let (key_l, per_sender) = (SpiLayout::Key, SpiLayout::PerSender);
        let at = |t| rotation(&file, &seen, t, DELAYS, Arc::new(GlobalTags));
        assert_eq!(
            layouts(&at(1000 * S)),
            (key_l, vec![(3, key_l), (4, per_sender)]),
            "received in both layouts, sent in the old"
        );
        assert_eq!(
            layouts(&at(1000 * S + DELAYS.propagation)),
            (per_sender, vec![(3, key_l), (4, per_sender)]),
            "sent in the new once every peer receives it"
        );
        assert_eq!(
            layouts(&at(1000 * S + DELAYS.propagation + DELAYS.retirement)),
            (per_sender, vec![(4, per_sender)]),
            "the old layout retired with its key"
        );
    }

    #[test]
    fn spis_wrap_in_file_order() {
        let seen = [KeySeen {
            spi: 15,
            first_seen: Duration::ZERO,
        }];
        let file = [key(15), key(1)];
        let r = rotation(&file, &seen, 1000 * S, DELAYS, Arc::new(GlobalTags));
        assert_eq!(r.ipsec.send_spi, 15, "1 is newer than 15 here");
        let r = rotation(&file, &r.ipsec.seen, 1090 * S, DELAYS, Arc::new(GlobalTags));
        assert_eq!(r.ipsec.send_spi, 1);
    }

    #[test]
    fn a_replaced_file_switches_at_once_and_says_so() {
        let seen = [KeySeen {
            spi: 3,
            first_seen: Duration::ZERO,
        }];
        let r = rotation(&[key(4)], &seen, 1000 * S, DELAYS, Arc::new(GlobalTags));
        assert_eq!((r.ipsec.send_spi, spis(&r)), (4, vec![4]));
        assert!(r.abrupt);
        assert_eq!(
            r.ipsec.seen,
            [KeySeen {
                spi: 4,
                first_seen: 1000 * S
            }]
        );
    }

    #[test]
    fn two_rotations_in_a_row_keep_every_key_still_in_flight() {
        let seen = SEEN_3_THEN_4;
        let file = [key(3), key(4), key(5)];
        // 5 appears while 4 is being rotated in.
        let r = rotation(&file, &seen, 1050 * S, DELAYS, Arc::new(GlobalTags));
        assert_eq!((r.ipsec.send_spi, spis(&r)), (3, vec![3, 4, 5]));
        let r = rotation(&file, &r.ipsec.seen, 1090 * S, DELAYS, Arc::new(GlobalTags));
        assert_eq!((r.ipsec.send_spi, spis(&r)), (4, vec![3, 4, 5]));
        assert_eq!(
            r.next_change,
            Some(1140 * S),
            "5 becomes ready before 3 retires"
        );
        let r = rotation(&file, &r.ipsec.seen, 1140 * S, DELAYS, Arc::new(GlobalTags));
        assert_eq!(r.ipsec.send_spi, 5);
        assert_eq!(
            spis(&r),
            [3, 4, 5],
            "both older keys are received for 300 s more"
        );
        let r = rotation(&file, &r.ipsec.seen, 1440 * S, DELAYS, Arc::new(GlobalTags));
        assert_eq!(spis(&r), [5]);
    }
}

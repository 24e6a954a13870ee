//! `ip xfrm` lines for the states and policies the agent writes: the `ip -batch` baselines the
//! benchmarks hold the agent to. Each line asks the kernel for what the agent's own message asks
//! (`node-agent/src/backends/xfrm/message.rs`): the same endpoints, SPI, mark, reqid, tunnel
//! mode, extended sequence numbers and replay window, with the benchmarks' AEAD algorithm.

use std::collections::{HashMap, HashSet};

use node_agent::backends::xfrm::message::{REPLAY_WINDOW, REQID, policy_mark, state_mark};
use state::objects::{KernelObject, ObjectId, XfrmDir, XfrmPolicy, XfrmState};

/// The `ip -batch` line adding `o`, a state (holding key `key_hex`, for `rfc4106(gcm(aes))`
/// with a 128-bit ICV) or a node's policy; `None` for any other object.
pub fn add(o: &KernelObject, key_hex: &str) -> Option<String> {
    write("add", o, key_hex)
}

/// `add` or `update`: the two take the same arguments.
fn write(verb: &str, o: &KernelObject, key_hex: &str) -> Option<String> {
    Some(match o {
        KernelObject::XfrmState(s) => format!(
            "xfrm state {verb} {} reqid {REQID} mode tunnel flag esn replay-window {REPLAY_WINDOW} \
             {} aead 'rfc4106(gcm(aes))' 0x{key_hex} 128\n",
            state_id(s),
            mark(o)
        ),
        KernelObject::XfrmPolicy(p) => format!(
            "xfrm policy {verb} {} {} tmpl src {} dst {} proto esp spi {:#x} reqid {REQID} mode \
             tunnel\n",
            policy_id(p),
            mark(o),
            p.tmpl_src,
            p.tmpl_dst,
            p.spi.wire()
        ),
        _ => return None,
    })
}

/// The `ip -batch` line deleting `o`, a state or a node's policy; `None` for any other object.
pub fn delete(o: &KernelObject) -> Option<String> {
    Some(match o {
        KernelObject::XfrmState(s) => {
            format!("xfrm state delete {} {}\n", state_id(s), mark(o))
        }
        KernelObject::XfrmPolicy(p) => {
            format!("xfrm policy delete {} {}\n", policy_id(p), mark(o))
        }
        _ => return None,
    })
}

/// Every line of `objects` that [`add`] writes, in one batch.
pub fn adds(objects: &[KernelObject], key_hex: &str) -> String {
    objects.iter().filter_map(|o| add(o, key_hex)).collect()
}

/// Every line of `objects` that [`delete`] writes, in one batch.
pub fn deletes(objects: &[KernelObject]) -> String {
    objects.iter().filter_map(delete).collect()
}

/// The lines that take the kernel from `from` to `to` as the agent's backend does: what only `to`
/// has is added (states first, as `to` is ordered), a policy that keeps its identity is updated
/// in place, a state that keeps its identity is deleted and added again (the kernel's update
/// cannot change a state's endpoints or key), and what only `from` has is deleted last.
pub fn changes(from: &[KernelObject], to: &[KernelObject], key_hex: &str) -> String {
    let before: HashMap<ObjectId, &KernelObject> = from.iter().map(|o| (o.id(), o)).collect();
    let kept: HashSet<ObjectId> = to.iter().map(KernelObject::id).collect();
    let mut lines = String::new();
    for o in to {
        let line = match (before.get(&o.id()), o) {
            (None, _) => add(o, key_hex),
            (Some(old), _) if *old == o => None,
            (Some(_), KernelObject::XfrmPolicy(_)) => write("update", o, key_hex),
            (Some(old), _) => delete(old).zip(add(o, key_hex)).map(|(d, a)| d + &a),
        };
        lines.extend(line);
    }
    let gone = from.iter().filter(|o| !kept.contains(&o.id()));
    lines.extend(gone.filter_map(delete));
    lines
}

/// What names a state to the kernel, with its mark.
fn state_id(s: &XfrmState) -> String {
    format!(
        "src {} dst {} proto esp spi {:#x}",
        s.src,
        s.dst,
        s.spi.wire()
    )
}

/// What names a policy to the kernel, with its mark.
fn policy_id(p: &XfrmPolicy) -> String {
    let dir = match p.dir {
        XfrmDir::Out => "out",
        XfrmDir::In => "in",
    };
    format!("src {} dst {} dir {dir}", p.src, p.dst)
}

/// A state's mark, or a policy's: the agent's own.
fn mark(o: &KernelObject) -> String {
    let m = match o {
        KernelObject::XfrmState(s) => state_mark(s),
        KernelObject::XfrmPolicy(p) => policy_mark(p),
        _ => unreachable!("only states and policies are written here"),
    };
    format!("mark {:#x} mask {:#x}", m.value, m.mask)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{xfrm_policy, xfrm_state};
    use state::objects::KeyTag;

    fn state(src: &str, dst: &str, dir: XfrmDir) -> KernelObject {
        KernelObject::XfrmState(xfrm_state(7, src, dst, dir, KeyTag::default()))
    }

    fn policy(dst: &str, tmpl_dst: &str) -> KernelObject {
        KernelObject::XfrmPolicy(xfrm_policy(7, dst, tmpl_dst))
    }

    /// Each way an object can change gets the lines the agent's backend would send: a new
    /// OUT state added, the old one deleted last; an IN state that keeps its identity deleted
    /// and added again; a policy that keeps its own updated; one that does not, added and its
    /// predecessor deleted; an object that did not change, nothing.
    #[test]
    fn changes_write_each_kind_of_change_as_the_agent_does() {
        let from = [
            state("10.0.0.1", "10.0.0.7", XfrmDir::Out),
            state("10.0.0.7", "10.0.0.1", XfrmDir::In),
            policy("10.7.0.0/24", "10.0.0.7"),
            policy("10.17.0.0/24", "10.0.0.7"),
            policy("10.27.0.0/24", "10.0.0.7"),
        ];
        let to = [
            state("10.0.0.1", "10.0.0.8", XfrmDir::Out),
            state("10.0.0.8", "10.0.0.1", XfrmDir::In),
            policy("10.7.0.0/24", "10.0.0.8"),
            policy("10.8.0.0/24", "10.0.0.8"),
            policy("10.27.0.0/24", "10.0.0.7"),
        ];
        let lines = changes(&from, &to, "00");
        let verbs: Vec<String> = lines
            .lines()
            .map(|l| l.split(' ').take(3).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(
            verbs,
            [
                "xfrm state add",
                "xfrm state delete",
                "xfrm state add",
                "xfrm policy update",
                "xfrm policy add",
                "xfrm state delete",
                "xfrm policy delete",
            ]
        );
        assert!(
            lines
                .lines()
                .nth(3)
                .unwrap()
                .contains("tmpl src 10.0.0.1 dst 10.0.0.8")
        );
        assert!(
            lines
                .lines()
                .nth(5)
                .unwrap()
                .contains("dst 10.0.0.7 proto esp")
        );
        assert!(lines.lines().nth(6).unwrap().contains("dst 10.17.0.0/24"));
    }
}

//! `ip xfrm` lines for the states and policies the agent writes: the `ip -batch` baselines the
//! benchmarks hold the agent to. Each line asks the kernel for what the agent's own message asks
//! (`node-agent/src/backends/xfrm/message.rs`): the same endpoints, SPI, mark, reqid, tunnel
//! mode, extended sequence numbers and replay window, with the benchmarks' AEAD algorithm.

use node_agent::backends::xfrm::message::{REPLAY_WINDOW, REQID, policy_mark, state_mark};
use state::objects::{KernelObject, XfrmDir, XfrmPolicy, XfrmState};

/// The `ip -batch` line adding `o`, a state (holding key `key_hex`, for `rfc4106(gcm(aes))`
/// with a 128-bit ICV) or a node's policy; `None` for any other object.
pub fn add(o: &KernelObject, key_hex: &str) -> Option<String> {
    Some(match o {
        KernelObject::XfrmState(s) => format!(
            "xfrm state add {} reqid {REQID} mode tunnel flag esn replay-window {REPLAY_WINDOW} \
             {} aead 'rfc4106(gcm(aes))' 0x{key_hex} 128\n",
            state_id(s),
            mark(o)
        ),
        KernelObject::XfrmPolicy(p) => format!(
            "xfrm policy add {} {} tmpl src {} dst {} proto esp spi {:#x} reqid {REQID} mode \
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

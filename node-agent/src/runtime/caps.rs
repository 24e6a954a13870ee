//! The capabilities the agent needs, checked at start-up, so that a container missing one stops
//! with one line naming it and what it is for, instead of a bare `EPERM` from somewhere deep.
//!
//! The minimum, measured with `setpriv` on the development machines' kernel and in both guest
//! kernels of the VM tier (`tests/tests/it/caps.rs` runs the agent under exactly the manifest's
//! set): `CAP_BPF`, `CAP_PERFMON` and `CAP_NET_ADMIN`. Before Linux 5.8 there is no `CAP_BPF`
//! nor `CAP_PERFMON`, and `CAP_SYS_ADMIN` stands for both (the privileged overlay,
//! `deploy/privileged/`). The agent runs as root: the host's bpffs is mode 0700 and the pins an
//! earlier release left are root's, mode 0600.

use std::fmt;

/// A capability the agent checks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cap {
    NetAdmin,
    SysAdmin,
    Perfmon,
    Bpf,
}

impl Cap {
    /// The bit in the kernel's capability sets.
    const fn bit(self) -> u32 {
        match self {
            Self::NetAdmin => 12,
            Self::SysAdmin => 21,
            Self::Perfmon => 38,
            Self::Bpf => 39,
        }
    }

    const fn name(self) -> &'static str {
        match self {
            Self::NetAdmin => "CAP_NET_ADMIN",
            Self::SysAdmin => "CAP_SYS_ADMIN",
            Self::Perfmon => "CAP_PERFMON",
            Self::Bpf => "CAP_BPF",
        }
    }

    /// What the agent does with it.
    const fn purpose(self) -> &'static str {
        match self {
            Self::NetAdmin => {
                "attaching the tc programs and every route and xfrm change (netlink) need it"
            }
            Self::SysAdmin => "stands for CAP_BPF and CAP_PERFMON on kernels before 5.8",
            Self::Perfmon => {
                "the kernel's verifier refuses the tc programs without it (beside CAP_BPF)"
            }
            Self::Bpf => "creating the pinned maps and loading the tc programs need it",
        }
    }
}

/// A capability the agent needs and does not have.
#[derive(Debug, thiserror::Error)]
pub struct MissingCap {
    pub cap: Cap,
}

impl fmt::Display for MissingCap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "missing capability {}: {}; add it to the container's securityContext \
             (deploy/daemonset.yaml), or use deploy/privileged/ on kernels before 5.8",
            self.cap.name(),
            self.cap.purpose()
        )
    }
}

/// The effective set, from `/proc/self/status` (`CapEff`); `None` where it cannot be read (the
/// check then steps aside and the kernel's own errors speak).
fn effective() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

/// What is missing from `effective` for a run that loads the datapath.
pub fn missing(effective: u64) -> Option<Cap> {
    let has = |c: Cap| effective & (1 << c.bit()) != 0;
    if !has(Cap::NetAdmin) {
        return Some(Cap::NetAdmin);
    }
    if has(Cap::SysAdmin) {
        return None;
    }
    [Cap::Bpf, Cap::Perfmon].into_iter().find(|c| !has(*c))
}

/// Checks the calling process's capabilities for a run that loads the datapath.
pub fn check() -> Result<(), MissingCap> {
    match effective().and_then(missing) {
        Some(cap) => Err(MissingCap { cap }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: u64 = (1 << 12) | (1 << 38) | (1 << 39);

    #[test]
    fn each_missing_capability_is_named_with_what_it_is_for() {
        assert_eq!(missing(ALL), None);
        assert_eq!(missing(ALL & !(1 << 39)), Some(Cap::Bpf));
        assert_eq!(missing(ALL & !(1 << 38)), Some(Cap::Perfmon));
        assert_eq!(missing(ALL & !(1 << 12)), Some(Cap::NetAdmin));
        assert_eq!(
            missing((1 << 12) | (1 << 21)),
            None,
            "CAP_SYS_ADMIN stands for both"
        );
        let line = MissingCap { cap: Cap::Perfmon }.to_string();
        assert!(
            line.starts_with("missing capability CAP_PERFMON: the kernel's verifier"),
            "{line}"
        );
        assert!(!line.contains('\n'));
    }
}

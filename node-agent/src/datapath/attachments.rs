//! One reconciler for every attachment of ours: each uplink's (`--datapath-iface`) ingress and
//! egress classifiers and each pod interface's (`--pod-iface`) pod classifier, alike.
//!
//! The desired set comes from the configuration: (interface name, program, direction). The
//! actual set is, for each, the index of the device the program was attached at, or nothing.
//! [`Attachments::check`] compares them with the kernel:
//!
//! - an attachment whose device is gone, or whose name now points at another device (deleted and
//!   made again: a CNI reset, an uplink bond rebuilt), or whose classifier is no longer there, is
//!   lost: its classifier went with the old device. Its link pin (TCX kernels) is unpinned, so no
//!   pin of ours names a device that is gone;
//! - a missing attachment whose device exists is attached (the clsact qdisc is created where
//!   needed on netlink-filter kernels; a foreign filter at our place is never replaced);
//! - what is still missing is returned, for readiness to name.
//!
//! The daemon runs a check when a link notification arrives (`RTNLGRP_LINK`, see
//! [`super::link_watch`]) and periodically behind it, since notifications can be lost.

use std::io;
use std::path::{Path, PathBuf};

use aya::Ebpf;
use aya::programs::{SchedClassifier, TcAttachType};

use super::attach::{self, Attachment, direction_name};
use super::{DatapathConfig, DatapathError};

/// What an interface is to the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A `--datapath-iface`: ingress and egress classifiers.
    Uplink,
    /// A `--pod-iface`: the pod classifier on ingress.
    Pod,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Uplink => "uplink",
            Role::Pod => "pod interface",
        }
    }
}

/// One attachment the configuration asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired {
    pub iface: String,
    pub prog: &'static str,
    pub dir: TcAttachType,
    pub role: Role,
}

/// A desired attachment that is not there, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Missing {
    pub iface: String,
    pub dir: TcAttachType,
    pub role: Role,
    /// `None`: no such interface; otherwise why attaching failed.
    pub error: Option<String>,
}

/// What was attached, where.
#[derive(Clone, Copy, Debug)]
struct Actual {
    /// The device's index when it was attached.
    index: u32,
    outcome: Attachment,
}

#[derive(Debug)]
struct Entry {
    want: Desired,
    have: Option<Actual>,
    /// The last attach error, logged once rather than at every check.
    error: Option<String>,
}

/// The desired attachments and the actual ones.
#[derive(Debug)]
pub struct Attachments {
    entries: Vec<Entry>,
    link_dir: PathBuf,
}

impl Attachments {
    /// The attachments `config` asks for, none made yet.
    pub fn new(config: &DatapathConfig, link_dir: &Path) -> Self {
        let mut entries = Vec::new();
        let mut want = |iface: &String, prog, dir, role| {
            entries.push(Entry {
                want: Desired {
                    iface: iface.clone(),
                    prog,
                    dir,
                    role,
                },
                have: None,
                error: None,
            });
        };
        for iface in &config.ifaces {
            want(
                iface,
                node_agent_common::INGRESS_PROG,
                TcAttachType::Ingress,
                Role::Uplink,
            );
            want(
                iface,
                node_agent_common::EGRESS_PROG,
                TcAttachType::Egress,
                Role::Uplink,
            );
        }
        for iface in &config.pod_ifaces {
            want(
                iface,
                node_agent_common::POD_PROG,
                TcAttachType::Ingress,
                Role::Pod,
            );
        }
        Self {
            entries,
            link_dir: link_dir.to_owned(),
        }
    }

    /// Whether the configuration asks for any attachment.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The link pins the desired attachments use (TCX kernels).
    pub fn pins(&self) -> Vec<PathBuf> {
        self.entries.iter().map(|e| self.pin(&e.want)).collect()
    }

    fn pin(&self, want: &Desired) -> PathBuf {
        attach::link_pin(&self.link_dir, want.prog, &want.iface, want.dir)
    }

    /// Each attachment made, and whether it took over an earlier one.
    pub fn made(&self) -> Vec<(String, TcAttachType, Attachment)> {
        self.entries
            .iter()
            .filter_map(|e| Some((e.want.iface.clone(), e.want.dir, e.have?.outcome)))
            .collect()
    }

    /// Attaches `ebpf`'s programs everywhere the configuration asks, taking over the
    /// attachments that exist (an earlier agent's, or this one's before the maps grew). A
    /// device that does not exist is left missing (attached by a later check); an attach that
    /// fails on a device that exists is the error.
    pub fn attach_all(&mut self, ebpf: &mut Ebpf) -> Result<Vec<Missing>, DatapathError> {
        for e in &mut self.entries {
            e.have = None;
            e.error = None;
        }
        let mut missing = Vec::new();
        for i in 0..self.entries.len() {
            let want = self.entries[i].want.clone();
            let Ok(index) = attach::if_index(&want.iface) else {
                tracing::warn!(
                    iface = want.iface,
                    role = want.role.name(),
                    direction = direction_name(want.dir),
                    "interface does not exist; its classifier is attached as soon as it does"
                );
                self.unpin_stale(&want);
                missing.push(want.missing(None));
                continue;
            };
            let outcome = attach_one(ebpf, &want, &self.link_dir)?;
            tracing::info!(
                iface = want.iface,
                program = want.prog,
                direction = direction_name(want.dir),
                ?outcome,
                "classifier attached"
            );
            self.entries[i].have = Some(Actual { index, outcome });
        }
        Ok(missing)
    }

    /// Compares the desired attachments with the kernel: a lost one (device gone or made
    /// again, classifier removed) is forgotten and its stale pin removed; a missing one whose
    /// device exists is attached. Returns those still missing.
    pub fn check(&mut self, ebpf: &mut Ebpf) -> Vec<Missing> {
        let tcx = attach::has_tcx();
        let mut missing = Vec::new();
        for i in 0..self.entries.len() {
            let want = self.entries[i].want.clone();
            let index = attach::if_index(&want.iface).ok();
            if let Some(have) = self.entries[i].have {
                let same_device = index == Some(have.index);
                if same_device && present(ebpf, &want, have.index, tcx) {
                    continue;
                }
                tracing::warn!(
                    iface = want.iface,
                    role = want.role.name(),
                    direction = direction_name(want.dir),
                    "{}; attached again as soon as the interface exists",
                    match (index, same_device) {
                        (None, _) => "interface deleted: its classifier went with the device",
                        (Some(_), false) =>
                            "interface made again under its name: its classifier went with the \
                             old device",
                        (Some(_), true) => "our classifier is no longer on the interface",
                    }
                );
                self.entries[i].have = None;
                if !same_device {
                    self.unpin_stale(&want);
                }
            }
            let Some(index) = index else {
                self.unpin_stale(&want);
                missing.push(want.missing(None));
                continue;
            };
            match attach_one(ebpf, &want, &self.link_dir) {
                Ok(outcome) => {
                    tracing::info!(
                        iface = want.iface,
                        role = want.role.name(),
                        program = want.prog,
                        direction = direction_name(want.dir),
                        ?outcome,
                        "interface appeared; classifier attached"
                    );
                    let e = &mut self.entries[i];
                    e.have = Some(Actual { index, outcome });
                    e.error = None;
                }
                Err(err) => {
                    let err = err.to_string();
                    let e = &mut self.entries[i];
                    if e.error.as_ref() != Some(&err) {
                        tracing::warn!(iface = want.iface, "{err}; tried again at every check");
                        e.error = Some(err.clone());
                    }
                    // Gone between the look and the attach: just missing.
                    let error = attach::if_index(&want.iface).is_ok().then_some(err);
                    missing.push(want.missing(error));
                }
            }
        }
        missing
    }

    /// Removes the link pin of `want` (TCX kernels) when its device is gone or another: the link
    /// it holds was detached with the old device, and no pin of ours may name a device that
    /// is gone. The pin is ours; nothing else is touched.
    fn unpin_stale(&self, want: &Desired) {
        let pin = self.pin(want);
        match std::fs::remove_file(&pin) {
            Ok(()) => {
                tracing::info!(pin = %pin.display(), "stale link pin of a device that went: unpinned")
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(pin = %pin.display(), "unpinning a stale link: {e}"),
        }
    }
}

impl Desired {
    fn missing(&self, error: Option<String>) -> Missing {
        Missing {
            iface: self.iface.clone(),
            dir: self.dir,
            role: self.role,
            error,
        }
    }
}

fn program<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, DatapathError> {
    ebpf.program_mut(name)
        .and_then(|p| p.try_into().ok())
        .ok_or(DatapathError::Program {
            name,
            source: Box::new(aya::programs::ProgramError::NotLoaded),
        })
}

fn attach_one(
    ebpf: &mut Ebpf,
    want: &Desired,
    link_dir: &Path,
) -> Result<Attachment, DatapathError> {
    let prog = program(ebpf, want.prog)?;
    attach::attach(prog, want.prog, &want.iface, want.dir, link_dir)
}

/// Whether our program is still attached at `index` in `want`'s direction, as far as the
/// kernel can be asked; `true` when it cannot (nothing is re-attached on a guess).
fn present(ebpf: &Ebpf, want: &Desired, index: u32, tcx: bool) -> bool {
    if tcx {
        let Some(ours) = ebpf
            .program(want.prog)
            .and_then(|p| p.info().ok())
            .map(|i| i.id())
        else {
            return true;
        };
        match SchedClassifier::query_tcx(&want.iface, want.dir) {
            Ok((_, progs)) => progs.iter().any(|p| p.id() == ours),
            Err(_) => true,
        }
    } else {
        attach::ours_at(index, want.dir).unwrap_or(true)
    }
}

/// The readiness lines for `missing`: one per interface.
pub fn describe(missing: &[Missing]) -> Vec<String> {
    let mut lines: Vec<(String, String)> = Vec::new();
    for m in missing {
        let key = format!("{} {}", m.role.name(), m.iface);
        let what = match &m.error {
            None => "no such interface (attached as soon as it exists)".to_string(),
            Some(e) => format!("{} not attached: {e}", direction_name(m.dir)),
        };
        match lines.iter_mut().find(|(k, _)| *k == key) {
            Some((_, w)) if *w != what => {
                w.push_str("; ");
                w.push_str(&what);
            }
            Some(_) => {}
            None => lines.push((key, what)),
        }
    }
    lines
        .into_iter()
        .map(|(k, w)| format!("{k} has no classifier: {w}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_names_each_interface_once() {
        let m = |iface: &str, dir, role, error: Option<&str>| Missing {
            iface: iface.into(),
            dir,
            role,
            error: error.map(str::to_owned),
        };
        let lines = describe(&[
            m("eth0", TcAttachType::Ingress, Role::Uplink, None),
            m("eth0", TcAttachType::Egress, Role::Uplink, None),
            m("cni0", TcAttachType::Ingress, Role::Pod, Some("refused")),
        ]);
        assert_eq!(
            lines,
            [
                "uplink eth0 has no classifier: no such interface (attached as soon as it exists)",
                "pod interface cni0 has no classifier: ingress not attached: refused",
            ]
        );
    }

    #[test]
    fn the_desired_set_is_each_uplinks_two_directions_and_each_pod_interfaces_ingress() {
        let mut c = DatapathConfig::new("/sys/fs/bpf");
        c.ifaces = vec!["eth0".into(), "eth1".into()];
        c.pod_ifaces = vec!["cni0".into()];
        let a = Attachments::new(&c, Path::new("/sys/fs/bpf/node-agent/links"));
        let names: Vec<_> = a
            .pins()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "eth0-ingress",
                "eth0-egress",
                "eth1-ingress",
                "eth1-egress",
                "cni0-pod"
            ]
        );
    }
}

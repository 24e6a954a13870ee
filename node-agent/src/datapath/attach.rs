//! Attaching the classifiers so that an agent restart never detaches them.
//!
//! On kernels with TCX (6.6+) each attachment is a BPF link pinned under
//! `<bpffs>/node-agent/links/`. A new agent finds the pin and swaps its freshly loaded program
//! into the existing link with `bpf_link_update`, which is atomic: there is no instant at which the
//! interface runs without our program, and never two copies of it. On older kernels the
//! classifier is a netlink tc filter at a fixed priority and handle; such filters outlive the
//! process by themselves, and a new agent replaces the filter in place.

use std::io;
use std::path::{Path, PathBuf};

use aya::pin::PinError;
use aya::programs::links::{FdLink, LinkError, PinnedLink};
use aya::programs::tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle};
use aya::programs::{LinkOrder, ProgramError, SchedClassifier, TcAttachType};
use aya::sys::SyscallError;
use aya::util::KernelVersion;

use super::{DatapathError, tc_filter};

/// Priority of our netlink tc filter (pre-TCX kernels). Fixed, so a restarted agent finds and
/// replaces its predecessor's filter instead of stacking a second one.
const NETLINK_PRIORITY: u16 = 0x4e41;
/// Handle of our netlink tc filter.
const NETLINK_HANDLE: u32 = 1;

/// Why an attachment failed; each variant is the layer that refused.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error(transparent)]
    Program(#[from] ProgramError),
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error("pinning the link: {0}")]
    Pin(#[from] PinError),
    #[error(transparent)]
    Tc(#[from] tc::TcError),
    #[error("removing the stale link pin {path}: {source}")]
    Unpin { path: PathBuf, source: io::Error },
    #[error("no such interface")]
    Missing,
    /// Someone else's filter sits where ours goes (a kernel without tcx links): left alone.
    #[error(
        "{what} is at the classifier's place (priority {NETLINK_PRIORITY:#x}, handle \
         {NETLINK_HANDLE}) and is not ours; left alone"
    )]
    Occupied { what: String },
    #[error("reading the filters at the classifier's place: {0}")]
    Read(#[source] io::Error),
}

/// The index of interface `iface`.
pub(super) fn if_index(iface: &str) -> Result<u32, AttachError> {
    let name = std::ffi::CString::new(iface).map_err(|_| AttachError::Missing)?;
    // SAFETY: if_nametoindex(3) reads a NUL-terminated string that outlives the call.
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(AttachError::Missing),
        index => Ok(index),
    }
}

/// How the program ended up attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attachment {
    /// A new attachment was created.
    Created,
    /// A previous agent's attachment now runs this agent's program.
    TakenOver,
}

pub(super) fn direction_name(dir: TcAttachType) -> &'static str {
    match dir {
        TcAttachType::Ingress => "ingress",
        TcAttachType::Egress => "egress",
        TcAttachType::Custom(_) => "custom",
    }
}

/// Attaches `prog` (named `name`) to `iface` in direction `dir`, taking over a previous agent's
/// attachment.
pub(super) fn attach(
    prog: &mut SchedClassifier,
    name: &str,
    iface: &str,
    dir: TcAttachType,
    link_dir: &Path,
) -> Result<Attachment, DatapathError> {
    let err = |source: AttachError| DatapathError::Attach {
        iface: iface.to_owned(),
        direction: direction_name(dir),
        source,
    };
    if has_tcx() {
        attach_tcx(prog, &link_pin(link_dir, name, iface, dir), iface, dir).map_err(err)
    } else {
        attach_netlink(prog, iface, dir).map_err(err)
    }
}

/// TCX links arrived in 6.6; before that tc programs attach through netlink.
pub(super) fn has_tcx() -> bool {
    KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0))
}

/// Unpins (and so detaches) every TCX link of ours under `link_dir` that is not `configured`:
/// an interface taken out of the flags kept our classifier, and after the maps grew, an old
/// program reading an old map no one updates any more. Netlink filters (kernels before TCX) are
/// not found this way, and stay.
///
/// Every pin under `link_dir` is ours: `<bpffs>/node-agent/links` is made 0700 by the agent and
/// refused when it is a symlink or someone else's (`state::input::private_dir`), and only the
/// agent pins there. The pin directory's lock (`Checkpointer::lock_pins`, taken before anything
/// is loaded) keeps out a second agent with another `--state-dir` on the same bpffs, which would
/// otherwise take this one's links for its own leftovers: the pins are only ever this agent's
/// and its predecessors'.
pub(super) fn unpin_unconfigured(link_dir: &Path, configured: &[PathBuf]) {
    let Ok(pins) = std::fs::read_dir(link_dir) else {
        return;
    };
    for pin in pins.flatten().map(|e| e.path()) {
        if configured.contains(&pin) {
            continue;
        }
        match std::fs::remove_file(&pin) {
            Ok(()) => tracing::info!(
                pin = %pin.display(),
                "classifier link of an interface no longer configured: unpinned, detached"
            ),
            Err(e) => {
                tracing::warn!(pin = %pin.display(), "unpinning a link no longer configured: {e}")
            }
        }
    }
}

/// `<iface>-ingress` and `<iface>-egress` for the uplink classifiers (the names releases before
/// the pod classifier used, kept so that an upgrade takes their links over), `<iface>-pod` for
/// the pod classifier.
pub(super) fn link_pin(link_dir: &Path, prog: &str, iface: &str, dir: TcAttachType) -> PathBuf {
    if prog == node_agent_common::POD_PROG {
        link_dir.join(format!("{iface}-pod"))
    } else {
        link_dir.join(format!("{iface}-{}", direction_name(dir)))
    }
}

fn attach_tcx(
    prog: &mut SchedClassifier,
    pin: &Path,
    iface: &str,
    dir: TcAttachType,
) -> Result<Attachment, AttachError> {
    let pin = pin.to_path_buf();
    match PinnedLink::from_pin(&pin) {
        Ok(old) => {
            let link = SchedClassifierLink::try_from(FdLink::from(old))?;
            match prog.attach_to_link(link) {
                Ok(id) => {
                    // The pin keeps the link alive; our fd to it may close.
                    drop(prog.take_link(id)?);
                    return Ok(Attachment::TakenOver);
                }
                Err(e) => {
                    // The link outlived its interface (deleted and re-created): it cannot be
                    // updated. Its pin is all that is left of it.
                    tracing::warn!(pin = %pin.display(), error = %e, "stale tc link pin, replacing it");
                    std::fs::remove_file(&pin).map_err(|source| AttachError::Unpin {
                        path: pin.clone(),
                        source,
                    })?;
                }
            }
        }
        Err(LinkError::SyscallError(SyscallError { io_error, .. }))
            if io_error.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    let id =
        prog.attach_with_options(iface, dir, TcAttachOptions::TcxOrder(LinkOrder::default()))?;
    let link = FdLink::try_from(prog.take_link(id)?)?;
    link.pin(&pin)?;
    Ok(Attachment::Created)
}

/// Whether our filter (a bpf filter running one of our programs) is at our place on interface
/// `index`'s clsact hook `dir` (netlink-filter kernels).
pub(super) fn ours_at(index: u32, dir: TcAttachType) -> io::Result<bool> {
    let parent = tc_filter::clsact_parent(matches!(dir, TcAttachType::Ingress));
    Ok(
        tc_filter::at(index, parent, NETLINK_PRIORITY, NETLINK_HANDLE)?
            .is_some_and(|f| f.is_ours()),
    )
}

fn attach_netlink(
    prog: &mut SchedClassifier,
    iface: &str,
    dir: TcAttachType,
) -> Result<Attachment, AttachError> {
    match tc::qdisc_add_clsact(iface) {
        Ok(()) => {}
        Err(tc::TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
        Err(e) => return Err(e.into()),
    }
    let handle = TcHandle::from(NETLINK_HANDLE);
    // A replace at our place replaces whatever filter is there: only ours is taken over.
    let index = if_index(iface)?;
    let parent = tc_filter::clsact_parent(matches!(dir, TcAttachType::Ingress));
    let there = tc_filter::at(index, parent, NETLINK_PRIORITY, NETLINK_HANDLE)
        .map_err(AttachError::Read)?;
    if let Some(theirs) = there.as_ref().filter(|f| !f.is_ours()) {
        return Err(AttachError::Occupied {
            what: theirs.to_string(),
        });
    }
    let existing = SchedClassifierLink::attached(iface, dir, NETLINK_PRIORITY, handle, None)
        .map_err(tc::TcError::IoError)?;
    let taken = there
        .is_some()
        .then(|| prog.attach_to_link(existing))
        .and_then(Result::ok);
    let (id, outcome) = match taken {
        Some(id) => (id, Attachment::TakenOver),
        None => {
            let options = TcAttachOptions::Netlink(NlOptions {
                priority: NETLINK_PRIORITY,
                handle,
                ..NlOptions::default()
            });
            (
                prog.attach_with_options(iface, dir, options)?,
                Attachment::Created,
            )
        }
    };
    // Dropping the link would delete the filter; it must outlive this process.
    std::mem::forget(prog.take_link(id)?);
    Ok(outcome)
}

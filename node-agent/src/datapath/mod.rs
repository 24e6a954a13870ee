//! Loading the tc datapath: the pinned maps, the classifiers, and their log stream.
//!
//! The maps live under `<bpffs>/node-agent/` and outlive the agent: they hold the node IDs the
//! datapath is using right now, and the next agent restores IDs from them. A restart therefore
//! reuses them (after checking their layout) and takes over the attached programs without
//! detaching them first (see [`attach`]).
//!
//! What is pinned is read and written in one place: [`maps`] the datapath's maps of node values,
//! [`records`] the agent's own records beside them, [`pins`] the layout checks of both, and
//! [`txn`] the crash-safe transaction that replaces pins when the maps grow ([`grow`]).

pub mod attach;
pub mod attachments;
pub mod grow;
pub mod link_watch;
pub mod log_forward;
pub mod maps;
pub mod object;
pub mod pins;
pub mod records;
pub mod tc_filter;
pub mod txn;

use std::path::{Path, PathBuf};

use aya::maps::MapType;
use aya::programs::{SchedClassifier, TcAttachType};
use aya::{Ebpf, EbpfLoader};
use node_agent_common as abi;

use self::attach::Attachment;
use self::attachments::{Attachments, Missing};
use self::log_forward::LogForwarder;
use self::pins::MapLayout;

/// `statfs` magic of a bpffs mount.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error(
        "this node-agent was built without its eBPF object; run `cargo xtask build-ebpf` and \
         rebuild the agent"
    )]
    ObjectMissing,
    #[error("{path} is not a bpffs mount (mount one with `mount -t bpf bpf {path}`)")]
    NotBpffs { path: PathBuf },
    #[error(transparent)]
    Dir(#[from] state::input::DirError),
    #[error("checking {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Txn(Box<txn::TxnError>),
    #[error("reading the pinned map {pin}: {source}")]
    PinInfo {
        pin: PathBuf,
        source: aya::maps::MapError,
    },
    #[error(
        "the pinned map {pin} is incompatible with this agent: it is ({found}), this agent needs \
         ({expected}); nothing was changed. Drain the node and remove the pin"
    )]
    PinMismatch {
        pin: PathBuf,
        found: MapLayout,
        expected: MapLayout,
    },
    #[error("growing the node-ID and pod-CIDR maps to {capacity} entries: {what}")]
    Grow { capacity: u32, what: String },
    #[error("node-ID map capacity must be 1..={max} entries, got {0}", max = abi::MAX_NODE_MAP_MAX)]
    BadCapacity(u32),
    #[error("mark mask {0:#010x} must be one contiguous run of at least 16 bits")]
    BadMarkMask(u32),
    #[error(
        "with IPsec the mark mask must be 0xffff0000 (got {0:#010x}): the xfrm marks of ESP \
         packets put the node ID in bits 16-31"
    )]
    IpsecMarkMask(u32),
    #[error(
        "IPsec needs --pod-iface (the interface pod traffic enters the host through, e.g. the \
         CNI's bridge cni0): without it no packet is marked for encryption and pod traffic \
         would leave in the clear"
    )]
    IpsecWithoutPodIface,
    #[error("{0} is both a --datapath-iface and a --pod-iface; each interface has one role")]
    IfaceTwice(String),
    #[error("loading the eBPF object: {0}")]
    Load(#[source] Box<aya::EbpfError>),
    #[error("loading program {name}: {source}")]
    Program {
        name: &'static str,
        source: Box<aya::programs::ProgramError>,
    },
    #[error("attaching to {iface} ({direction}): {source}")]
    Attach {
        iface: String,
        direction: &'static str,
        source: attach::AttachError,
    },
}

impl From<txn::TxnError> for DatapathError {
    fn from(e: txn::TxnError) -> Self {
        Self::Txn(Box::new(e))
    }
}

/// What to load and where to attach it.
#[derive(Clone, Debug)]
pub struct DatapathConfig {
    /// Root of a bpffs mount; our pins go under `node-agent/` in it.
    pub bpffs: PathBuf,
    /// Capacity of the node-ID and pod-CIDR maps where they are created. An existing pin is
    /// loaded at its own capacity; the datapath's is the smaller of the two maps'
    /// ([`Datapath::capacity`]).
    pub node_map_max: u32,
    /// `skb->mark` bits that carry the node ID on ingress.
    pub mark_mask: u32,
    /// Interfaces to attach the classifiers to, on ingress and egress.
    pub ifaces: Vec<String>,
    /// Interfaces pod traffic enters the host through (the CNI's bridge): the pod classifier
    /// attaches to their ingress and marks traffic toward remote pod CIDRs for xfrm.
    pub pod_ifaces: Vec<String>,
    /// IPsec is on: ESP packets get the xfrm IN mark, and a pod interface is required.
    pub ipsec: bool,
}

impl DatapathConfig {
    pub fn new(bpffs: impl Into<PathBuf>) -> Self {
        Self {
            bpffs: bpffs.into(),
            node_map_max: abi::DEFAULT_NODE_MAP_MAX,
            mark_mask: abi::DEFAULT_MARK_MASK,
            ifaces: Vec::new(),
            pod_ifaces: Vec::new(),
            ipsec: false,
        }
    }

    /// The directory holding our pins.
    pub fn pin_dir(&self) -> PathBuf {
        pin_dir(&self.bpffs)
    }
}

/// The node-ID and pod-CIDR maps' capacity to run with: the larger of the one asked for and
/// the existing pins' (a map that grew online is never shrunk by a smaller `--node-map-max`);
/// the pins', so that an agent started without the flag keeps maps an earlier release created
/// at another default; else [`abi::DEFAULT_NODE_MAP_MAX`] for new maps.
pub fn resolve_capacity(requested: Option<u32>, bpffs: &Path) -> Result<u32, DatapathError> {
    let pinned = pinned_capacity(bpffs)?;
    Ok(match (requested, pinned) {
        (Some(r), Some(p)) if p > r => {
            tracing::info!(
                requested = r,
                pinned = p,
                "the pinned maps are larger than --node-map-max asks (they grew online); keeping them"
            );
            p
        }
        (Some(r), _) => r,
        (None, Some(p)) => p,
        (None, None) => abi::DEFAULT_NODE_MAP_MAX,
    })
}

/// The capacity the start leaves the pinned node-ID and pod-CIDR maps at, if either is
/// pinned: the larger of the two pins' (pins of unequal capacities are both grown to the larger
/// one) and of a growth the start finishes.
pub fn pinned_capacity(bpffs: &Path) -> Result<Option<u32>, DatapathError> {
    let mut capacity = txn::forward_capacity(bpffs)?;
    for pin in [node_ids_pin(bpffs), pod_cidrs_pin(bpffs)] {
        let layout = MapLayout::of_pin(&pin).map_err(|source| DatapathError::PinInfo {
            pin: pin.clone(),
            source,
        })?;
        capacity = capacity.max(layout.map(|l| l.max_entries));
    }
    Ok(capacity)
}

/// Where the loader finds, or creates and pins, each map.
pub(crate) struct Pins {
    pub node_ids: PathBuf,
    pub pod_cidrs: PathBuf,
    pub node_stats: PathBuf,
}

impl Pins {
    /// The maps' own pins.
    pub fn of(bpffs: &Path) -> Self {
        Self {
            node_ids: node_ids_pin(bpffs),
            pod_cidrs: pod_cidrs_pin(bpffs),
            node_stats: node_stats_pin(bpffs),
        }
    }
}

/// `<bpffs>/node-agent`.
pub fn pin_dir(bpffs: &Path) -> PathBuf {
    bpffs.join(abi::PIN_DIR)
}

/// Path of the pinned node-ID map under a bpffs root.
pub fn node_ids_pin(bpffs: &Path) -> PathBuf {
    pin_dir(bpffs).join(abi::NODE_IDS_PIN)
}

/// Path of the pinned pod-CIDR map under a bpffs root.
pub fn pod_cidrs_pin(bpffs: &Path) -> PathBuf {
    pin_dir(bpffs).join(abi::POD_CIDRS_PIN)
}

/// Path of the pinned counters map under a bpffs root.
pub fn node_stats_pin(bpffs: &Path) -> PathBuf {
    pin_dir(bpffs).join(abi::NODE_STATS_PIN)
}

/// The loaded datapath. Dropping it leaves the maps pinned and the programs attached: that is
/// what lets the next agent take over without a gap.
pub struct Datapath {
    ebpf: Ebpf,
    config: DatapathConfig,
    _logs: Option<LogForwarder>,
    /// Every attachment the configuration asks for, uplinks and pod interfaces alike, and
    /// where each is made (see [`attachments`]).
    attach: Attachments,
    /// What the last attach or check found missing.
    missing: Vec<Missing>,
    link_dir: PathBuf,
}

impl Datapath {
    /// Loads the embedded object, reusing compatible pins, and attaches to every configured
    /// interface.
    pub fn load(config: &DatapathConfig) -> Result<Self, DatapathError> {
        let bytes = object::bytes().ok_or(DatapathError::ObjectMissing)?;
        Self::load_object(bytes, config)
    }

    fn load_object(bytes: &[u8], config: &DatapathConfig) -> Result<Self, DatapathError> {
        // A pin transaction a crash (or a failed step) cut short is finished or undone first.
        txn::recover(&config.bpffs)?;
        let mut dp = Self::open(bytes, config, false)?;
        dp.attach_all()?;
        Ok(dp)
    }

    /// Checks `config` and the pins, and loads the object against the pinned maps, each at its
    /// own capacity (creating those that do not exist, at the configured one), and its programs
    /// into the kernel, attaching nothing yet. With `fresh`, the node-ID and pod-CIDR maps are
    /// new ones, not pinned (a growth pins them).
    fn open(bytes: &[u8], config: &DatapathConfig, fresh: bool) -> Result<Self, DatapathError> {
        if config.node_map_max == 0 || config.node_map_max > abi::MAX_NODE_MAP_MAX {
            return Err(DatapathError::BadCapacity(config.node_map_max));
        }
        let mask = config.mark_mask;
        let shift = mask.trailing_zeros();
        if mask.count_ones() < 16 || (mask >> shift).count_ones() != (mask >> shift).trailing_ones()
        {
            return Err(DatapathError::BadMarkMask(mask));
        }
        if config.ipsec && mask != abi::DEFAULT_MARK_MASK {
            return Err(DatapathError::IpsecMarkMask(mask));
        }
        if config.ipsec && config.pod_ifaces.is_empty() {
            return Err(DatapathError::IpsecWithoutPodIface);
        }
        if let Some(i) = config.pod_ifaces.iter().find(|i| config.ifaces.contains(i)) {
            return Err(DatapathError::IfaceTwice(i.clone()));
        }
        check_bpffs(&config.bpffs)?;
        // The agent's own directories: never through a symlink, never someone else's (the link
        // directory's entries are unpinned when not configured, see `attach::unpin_unconfigured`).
        let dir = config.pin_dir();
        let link_dir = dir.join("links");
        state::input::private_dir(&dir, "pin directory")?;
        state::input::private_dir(&link_dir, "link pin directory")?;
        let pins = Pins::of(&config.bpffs);
        let (mut ids_max, mut cidrs_max) = (config.node_map_max, config.node_map_max);
        if !fresh {
            ids_max = check_pin(&pins.node_ids, node_ids_layout)?.unwrap_or(ids_max);
            cidrs_max = check_pin(&pins.pod_cidrs, pod_cidrs_layout)?.unwrap_or(cidrs_max);
        }
        check_pin(&pins.node_stats, |_| node_stats_layout())?;
        let ipsec = u32::from(config.ipsec);

        // No kernel BTF: the programs use no CO-RE relocations, and parsing vmlinux's BTF would
        // cost the agent tens of MiB of memory for nothing. The object's own BTF still goes to
        // the kernel with its maps, which is what bpftool needs to print field names.
        let mut loader = EbpfLoader::new();
        loader
            .btf(None)
            .map_pin_path(abi::NODE_STATS_MAP, pins.node_stats.as_path());
        if !fresh {
            loader
                .map_pin_path(abi::NODE_IDS_MAP, pins.node_ids.as_path())
                .map_pin_path(abi::POD_CIDRS_MAP, pins.pod_cidrs.as_path());
        }
        let mut ebpf = loader
            .map_max_entries(abi::NODE_IDS_MAP, ids_max)
            .map_max_entries(abi::POD_CIDRS_MAP, cidrs_max)
            .override_global(abi::MARK_MASK_GLOBAL, &mask, true)
            .override_global(abi::MARK_SHIFT_GLOBAL, &shift, true)
            .override_global(abi::IPSEC_GLOBAL, &ipsec, true)
            .load(bytes)
            .map_err(|e| DatapathError::Load(Box::new(e)))?;

        // The log ring buffer must stay open while programs load and run.
        let logs = match LogForwarder::start(&mut ebpf) {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::warn!(error = %e, "eBPF log forwarding unavailable");
                None
            }
        };
        for name in [abi::INGRESS_PROG, abi::EGRESS_PROG, abi::POD_PROG] {
            let prog_err = |e: aya::programs::ProgramError| DatapathError::Program {
                name,
                source: Box::new(e),
            };
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or_else(|| prog_err(aya::programs::ProgramError::NotLoaded))?
                .try_into()
                .map_err(prog_err)?;
            prog.load().map_err(prog_err)?;
        }
        Ok(Self {
            ebpf,
            config: DatapathConfig {
                node_map_max: ids_max.min(cidrs_max),
                ..config.clone()
            },
            _logs: logs,
            attach: Attachments::new(config, &link_dir),
            missing: Vec::new(),
            link_dir,
        })
    }

    /// Attaches the loaded programs to every configured interface that exists, taking over the
    /// attachments that exist (an earlier agent's, or this one's before the maps grew); one
    /// that does not exist yet is missing until a check finds it. Link pins of ours that no
    /// configured attachment uses are unpinned.
    fn attach_all(&mut self) -> Result<(), DatapathError> {
        self.missing = self.attach.attach_all(&mut self.ebpf)?;
        attach::unpin_unconfigured(&self.link_dir, &self.attach.pins());
        Ok(())
    }

    /// The interfaces (uplinks and pod interfaces) with a desired attachment missing, as the
    /// last attach or check found them.
    pub fn pending(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for m in &self.missing {
            if !names.contains(&m.iface) {
                names.push(m.iface.clone());
            }
        }
        names
    }

    /// Every desired attachment missing, as the last attach or check found them.
    pub fn missing(&self) -> &[Missing] {
        &self.missing
    }

    /// Compares the desired attachments with the kernel and repairs them: one whose device
    /// went, was made again under its name, or lost our classifier is attached again as soon
    /// as its device exists. Returns those still missing.
    pub fn check_attachments(&mut self) -> &[Missing] {
        self.missing = self.attach.check(&mut self.ebpf);
        &self.missing
    }

    /// Whether the configuration asks for any attachment (there is something to check).
    pub fn attaches(&self) -> bool {
        !self.attach.is_empty()
    }

    /// Each interface and direction we attached to, and whether we took it over.
    pub fn attachments(&self) -> Vec<(String, TcAttachType, Attachment)> {
        self.attach.made()
    }

    /// What the datapath was loaded with (its capacity as grown).
    pub fn config(&self) -> &DatapathConfig {
        &self.config
    }

    /// The loaded object, for tests and tools that inspect it.
    pub fn ebpf(&self) -> &Ebpf {
        &self.ebpf
    }
}

pub(crate) fn check_bpffs(path: &Path) -> Result<(), DatapathError> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
        DatapathError::NotBpffs {
            path: path.to_owned(),
        }
    })?;
    // SAFETY: `c` is a valid NUL-terminated path and `st` a properly sized out-parameter.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(DatapathError::Io {
            path: path.to_owned(),
            source: std::io::Error::last_os_error(),
        });
    }
    if st.f_type as i64 != BPF_FS_MAGIC {
        return Err(DatapathError::NotBpffs {
            path: path.to_owned(),
        });
    }
    Ok(())
}

/// Checks the map pinned at `pin`, if any, against `expected` at its own capacity, and returns
/// that capacity.
fn check_pin(
    pin: &Path,
    expected: impl Fn(u32) -> MapLayout,
) -> Result<Option<u32>, DatapathError> {
    let found = MapLayout::of_pin(pin).map_err(|source| DatapathError::PinInfo {
        pin: pin.to_owned(),
        source,
    })?;
    match found {
        Some(found) if found != expected(found.max_entries) => Err(DatapathError::PinMismatch {
            pin: pin.to_owned(),
            found,
            expected: expected(found.max_entries),
        }),
        found => Ok(found.map(|f| f.max_entries)),
    }
}

/// The layout `node_ids` must have for this build.
pub fn node_ids_layout(max_entries: u32) -> MapLayout {
    MapLayout {
        map_type: MapType::Hash,
        key_size: size_of::<abi::NodeKey>() as u32,
        value_size: size_of::<abi::NodeValue>() as u32,
        max_entries,
    }
}

/// The layout `pod_cidrs` must have for this build.
pub fn pod_cidrs_layout(max_entries: u32) -> MapLayout {
    MapLayout {
        map_type: MapType::LpmTrie,
        key_size: (size_of::<u32>() + size_of::<abi::NodeKey>()) as u32,
        value_size: size_of::<abi::NodeValue>() as u32,
        max_entries,
    }
}

/// The layout `node_stats` must have for this build.
pub fn node_stats_layout() -> MapLayout {
    MapLayout {
        map_type: MapType::PerCpuArray,
        key_size: size_of::<u32>() as u32,
        value_size: size_of::<abi::NodeStats>() as u32,
        max_entries: abi::NODE_STATS_ENTRIES,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_object_error_names_the_build_command() {
        assert!(
            DatapathError::ObjectMissing
                .to_string()
                .contains("cargo xtask build-ebpf")
        );
    }

    #[test]
    fn mark_masks_must_be_one_run_of_at_least_16_bits() {
        let with = |mask| {
            let mut c = DatapathConfig::new("/nonexistent");
            c.mark_mask = mask;
            Datapath::load_object(&[], &c).err().map(|e| e.to_string())
        };
        for bad in [0x0000_FF00, 0xFF00_FF00, 0x00FF_0000, 0] {
            assert!(
                with(bad).unwrap().contains("mark mask"),
                "{bad:#x} accepted"
            );
        }
        // A good mask gets past the check and fails later, on the missing bpffs.
        assert!(with(0xFFFF_0000).unwrap().contains("/nonexistent"));
        assert!(with(0x0FFF_F000).unwrap().contains("/nonexistent"));
    }
}

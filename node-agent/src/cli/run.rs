//! `node-agent run` and `node-agent plan`: the agent's main job, and its dry run.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::sync::mpsc;

use super::flags::{
    Bounded, CHECKPOINT_INTERVAL, DEBOUNCE, ID_COOLDOWN, ID_REUSE_FLOOR,
    IPSEC_KEY_PROPAGATION_DELAY, IPSEC_KEY_ROTATION_DELAY, MAX_NODE_ID, MAX_PRUNE_RATIO,
    NODE_MAP_MAX, NODES_FILE_POLL, NODES_FILE_SETTLE, PRUNE_CONFIRM_DELAY, RELIST_INTERVAL,
    RESYNC_INTERVAL, SYNC_TIMEOUT, TEST_ID_COOLDOWN, parse_iface, parse_mark_mask,
    parse_metrics_addr, parse_route_protocol, parse_route_table,
};
use super::{BpffsArg, Output};
use crate::agent::{self, AgentConfig, ExitStatus};
use crate::source::file::FileSource;
use crate::source::kube::KubeSource;
use crate::source::{SourceEvent, SourceRequest};
use crate::telemetry::{self, Telemetry};
use std::sync::Arc;

/// Where the nodes come from: the Kubernetes API (the default: in-cluster service account, or
/// `--kubeconfig`), or a NodeList file (`--nodes-file`).
#[derive(Debug, clap::Args)]
pub struct SourceArgs {
    /// Source: a Kubernetes NodeList file (YAML or JSON, e.g. `kubectl get nodes -o yaml`),
    /// watched for changes. Each successful parse is a full relist; the first marks the source
    /// as synced. Without it the agent watches Nodes through the Kubernetes API.
    #[arg(long, env = "NODE_AGENT_NODES_FILE", conflicts_with = "kubeconfig")]
    pub nodes_file: Option<PathBuf>,
    /// Source: the Kubernetes API through this kubeconfig instead of the pod's in-cluster
    /// service account. The first complete list marks the source as synced; API errors (403
    /// included) never make nodes look deleted.
    #[arg(long, env = "NODE_AGENT_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// How often the nodes file is checked for changes.
    #[arg(long, env = "NODE_AGENT_NODES_FILE_POLL", default_value = "1s", value_parser = |s: &str| NODES_FILE_POLL.parse(s))]
    pub nodes_file_poll: Duration,
    /// How long the nodes file must stay unchanged before a read that removes or changes nodes
    /// is taken; a read that only adds nodes is taken at once. A file written in place
    /// (`kubectl get nodes -o yaml > file`) can be read while its writer pauses, a valid but
    /// shorter list: a pause shorter than this never prunes a live node. Writers should replace
    /// the file by rename. With --once, the wait counts against --sync-timeout. At least 100ms.
    #[arg(long, env = "NODE_AGENT_NODES_FILE_SETTLE", default_value = "5s", value_parser = |s: &str| NODES_FILE_SETTLE.parse(s))]
    pub nodes_file_settle: Duration,
    /// How often the nodes file is re-read even when unchanged (a fresh full list).
    #[arg(long, env = "NODE_AGENT_RELIST_INTERVAL", default_value = "30s", value_parser = |s: &str| RELIST_INTERVAL.parse(s))]
    pub relist_interval: Duration,
}

/// Everything about the node and the kernel state the agent owns.
#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// This node's name; required (also read from NODE_NAME, as a DaemonSet sets it).
    #[arg(long, env = "NODE_AGENT_NODE_NAME")]
    pub node_name: Option<String>,
    /// Directory for the lock and the checkpoint (`nodes.ckpt`); created 0700.
    #[arg(long, env = "NODE_AGENT_STATE_DIR", default_value = "/run/node-agent")]
    pub state_dir: PathBuf,
    #[command(flatten)]
    pub bpffs: BpffsArg,
    /// Interface to attach the tc classifiers to (ingress and egress); repeatable.
    #[arg(
        long = "datapath-iface",
        env = "NODE_AGENT_DATAPATH_IFACE",
        value_delimiter = ',',
        value_parser = parse_iface
    )]
    pub datapath_ifaces: Vec<String>,
    /// Interface pod traffic enters the host through (the CNI's bridge, e.g. `cni0`);
    /// repeatable. With IPsec, a classifier on its ingress marks traffic toward remote pod
    /// CIDRs for encryption; IPsec refuses to start without one.
    #[arg(
        long = "pod-iface",
        env = "NODE_AGENT_POD_IFACE",
        value_delimiter = ',',
        value_parser = parse_iface
    )]
    pub pod_ifaces: Vec<String>,
    /// Capacity of the node-ID and pod-CIDR maps, in entries (one per mapped address or pod
    /// CIDR). Over existing pins the larger wins: a larger value grows the maps online at start,
    /// a smaller one never shrinks them. Default: the existing maps' capacity, or 131072 (a
    /// dual-stack cluster of 65,536 nodes) for new ones. 1 to 4194304.
    #[arg(long, env = "NODE_AGENT_NODE_MAP_MAX", value_parser = |s: &str| NODE_MAP_MAX.int::<u32>(s))]
    pub node_map_max: Option<u32>,
    /// Grow the node-ID and pod-CIDR maps online, doubling them, when they would be more than
    /// three quarters full; `false` keeps their capacity fixed (a node that does not fit is
    /// then held with a "map full" error).
    #[arg(long, env = "NODE_AGENT_NODE_MAP_GROW", default_value_t = true, action = clap::ArgAction::Set)]
    pub node_map_grow: bool,
    /// skb->mark bits that carry the node ID on ingress (one run of at least 16 bits).
    #[arg(long, env = "NODE_AGENT_MARK_MASK", default_value = "0xffff0000", value_parser = parse_mark_mask)]
    pub mark_mask: u32,
    /// Route protocol number marking our routes and nexthops (name it in
    /// /etc/iproute2/rt_protos.d). The numbers the kernel, well-known routing daemons and
    /// Calico (80) use are refused: the agent takes every route of its protocol in its table
    /// for its own.
    #[arg(long, env = "NODE_AGENT_ROUTE_PROTOCOL", default_value_t = crate::backends::routes::DEFAULT_ROUTE_PROTOCOL, value_parser = parse_route_protocol)]
    pub route_protocol: u8,
    /// Route through one nexthop object per node and family (`ip nexthop`), where the kernel
    /// has them (5.3 and later); `false` writes each route with its own gateway, as a kernel
    /// without nexthops needs.
    #[arg(long, env = "NODE_AGENT_ROUTE_NEXTHOPS", default_value_t = true, action = clap::ArgAction::Set)]
    pub route_nexthops: bool,
    /// Routing table for pod CIDR routes (254 is main). The tables the kernel reserves (0
    /// unspec, 253 default, 255 local) are refused.
    #[arg(long, env = "NODE_AGENT_ROUTE_TABLE", default_value_t = crate::backends::routes::MAIN_TABLE, value_parser = parse_route_table)]
    pub route_table: u32,
    /// Largest share of known remote nodes one prune may delete before the brake holds it
    /// (0 to 1).
    #[arg(long, env = "NODE_AGENT_MAX_PRUNE_RATIO", default_value_t = 0.5, value_parser = |s: &str| MAX_PRUNE_RATIO.parse(s))]
    pub max_prune_ratio: f64,
    /// Delete stale nodes even when the brake would hold them. The daemon uses it for its
    /// first plan only: later holds wait for a confirmation (`node-agent prune confirm`).
    #[arg(long, env = "NODE_AGENT_FORCE_PRUNE")]
    pub force_prune: bool,
    /// As a daemon, a held prune goes ahead once a fresh full list at least this much later
    /// still asks for it.
    #[arg(long, env = "NODE_AGENT_PRUNE_CONFIRM_DELAY", default_value = "60s", value_parser = |s: &str| PRUNE_CONFIRM_DELAY.parse(s))]
    pub prune_confirm_delay: Duration,
    /// Full kernel dump and repair interval.
    #[arg(long, env = "NODE_AGENT_RESYNC_INTERVAL", default_value = "5m", value_parser = |s: &str| RESYNC_INTERVAL.parse(s))]
    pub resync_interval: Duration,
    /// Also map ExternalIPs to node IDs (InternalIPs always are).
    #[arg(long, env = "NODE_AGENT_INCLUDE_EXTERNAL_IPS")]
    pub include_external_ips: bool,
    /// How long a freed node ID rests before it is handed out again. At least 2m: a segment
    /// the old node's peer retransmits may carry its ID for 120 s (TCP_RTO_MAX).
    #[arg(long, env = "NODE_AGENT_ID_COOLDOWN", default_value = "15m", value_parser = |s: &str| ID_COOLDOWN.parse(s))]
    pub id_cooldown: Duration,
    /// When every node ID is in use or cooling down, the freed ID that has cooled longest is
    /// handed out early once it has cooled this long (1s to `--id-cooldown`), with a warning.
    #[arg(long, env = "NODE_AGENT_ID_REUSE_FLOOR", default_value = "2m", value_parser = |s: &str| ID_REUSE_FLOOR.parse(s))]
    pub id_reuse_floor: Duration,
    /// Tests only: the ID cool-down, below `--id-cooldown`'s least (`0s`: a freed node ID is
    /// handed out again at once), for benchmarks that churn more nodes than the ID space has
    /// free IDs and for histories that run cool-downs out; the floor is at most this.
    // No environment variable: a stray one in a DaemonSet would lower a production cool-down
    // unseen; a test says it on the command line, and the agent warns.
    #[arg(long, hide = true, value_parser = |s: &str| TEST_ID_COOLDOWN.parse(s))]
    pub test_id_cooldown: Option<Duration>,
    /// Tests only: hand out node IDs up to this one (65535 in real use), to reach the edge of the
    /// ID space with a few nodes. 2 to 65535.
    #[arg(long, default_value_t = state::ids::MAX_ID, hide = true, value_parser = |s: &str| MAX_NODE_ID.int::<u16>(s))]
    pub max_node_id: u16,
    /// IPsec key file, one key per line: `<spi 1-15> rfc4106(gcm(aes)) 0x<key+salt hex> <icv
    /// bits> [per-sender-spi]`; the last line is the newest key, and appending a line rotates to
    /// it. Enables
    /// encryption of pod traffic toward every remote node (needs --pod-iface); start-up fails
    /// if the kernel has no ESP.
    #[arg(long, env = "NODE_AGENT_IPSEC_KEY_FILE")]
    pub ipsec_key_file: Option<PathBuf>,
    /// A new key is received at once but sent with only after this long, so that every node
    /// has read the new key file first (a Secret reaches every kubelet within about a minute).
    /// At least 1s.
    #[arg(long, env = "NODE_AGENT_IPSEC_KEY_PROPAGATION_DELAY", default_value = "90s", value_parser = |s: &str| IPSEC_KEY_PROPAGATION_DELAY.parse(s))]
    pub ipsec_key_propagation_delay: Duration,
    /// The previous key is still received this long after the switch to a new one, then its
    /// states are removed. Must be longer than the propagation delay plus the longest an agent
    /// may be down during a rotation: a node whose agent is down still sends with the old key.
    #[arg(long, env = "NODE_AGENT_IPSEC_KEY_ROTATION_DELAY", default_value = "5m", value_parser = |s: &str| IPSEC_KEY_ROTATION_DELAY.parse(s))]
    pub ipsec_key_rotation_delay: Duration,
    /// Shortest interval between two checkpoint writes (changes in between are coalesced; a
    /// final write always happens on SIGTERM).
    #[arg(long, env = "NODE_AGENT_CHECKPOINT_INTERVAL", default_value = "1s", value_parser = |s: &str| CHECKPOINT_INTERVAL.parse(s))]
    pub checkpoint_interval: Duration,
    /// How long the daemon waits after a node change before it reconciles, so that a burst of
    /// changes (a rolling upgrade, a relist) is planned and applied once. 0 reconciles at once.
    #[arg(long, env = "NODE_AGENT_DEBOUNCE", default_value = "100ms", value_parser = |s: &str| DEBOUNCE.parse(s))]
    pub debounce: Duration,
    /// With --once, --dry-run and `plan`: how long the run may wait before its first plan, on
    /// whatever blocks: the state directory's lock and checkpoint, the kernel's objects, the
    /// node source's first full list (a nodes file's settle period included). At the deadline
    /// the run ends with status 1, naming what it waited for, having changed nothing. At least
    /// 1s.
    #[arg(long, env = "NODE_AGENT_SYNC_TIMEOUT", default_value = "120s", value_parser = |s: &str| SYNC_TIMEOUT.parse(s))]
    pub sync_timeout: Duration,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    #[command(flatten)]
    pub agent: AgentArgs,
    /// Sync, reconcile to convergence, write the checkpoint, and exit (0 converged, 3 brake
    /// held, 1 operations failed).
    #[arg(long, env = "NODE_AGENT_ONCE")]
    pub once: bool,
    /// Plan and print the plan without touching the kernel or the checkpoint.
    #[arg(long, env = "NODE_AGENT_DRY_RUN")]
    pub dry_run: bool,
    /// With --once: `json` prints one summary object on stdout.
    #[arg(long, env = "NODE_AGENT_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
    /// Address for /metrics (Prometheus), /healthz and /readyz; port 1 to 65535.
    #[arg(
        long,
        env = "NODE_AGENT_METRICS_ADDR",
        default_value = "127.0.0.1:9965",
        value_parser = parse_metrics_addr
    )]
    pub metrics_addr: std::net::SocketAddr,
}

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    #[command(flatten)]
    pub agent: AgentArgs,
    /// `text` for a table, `json` for tools.
    #[arg(long, env = "NODE_AGENT_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

impl AgentArgs {
    /// The relations between flags that no single flag's range shows; checked before
    /// anything is read from the host.
    pub(super) fn check_relations(&self) -> anyhow::Result<()> {
        if self.test_id_cooldown.is_none() && self.id_reuse_floor > self.id_cooldown {
            bail!(
                "--id-reuse-floor ({}) must be at most --id-cooldown ({}): the floor is how long a \
                 freed ID cools at least before an early reuse, within its cool-down",
                self.id_reuse_floor.show(),
                self.id_cooldown.show()
            );
        }
        if self.ipsec_key_rotation_delay <= self.ipsec_key_propagation_delay {
            bail!(
                "--ipsec-key-rotation-delay ({}) must be longer than \
                 --ipsec-key-propagation-delay ({}): a node must keep receiving the old key \
                 until every other node has switched",
                self.ipsec_key_rotation_delay.show(),
                self.ipsec_key_propagation_delay.show()
            );
        }
        Ok(())
    }

    pub fn config(&self) -> anyhow::Result<AgentConfig> {
        let node_name = self
            .node_name
            .clone()
            .or_else(|| std::env::var("NODE_NAME").ok())
            .filter(|n| !n.is_empty());
        let Some(node_name) = node_name else {
            bail!("the local node's name is required: pass --node-name or set NODE_NAME");
        };
        self.check_relations()?;
        let mut c = AgentConfig::new(node_name, &self.state_dir, &self.bpffs.bpffs);
        c.datapath.ifaces = self.datapath_ifaces.clone();
        c.datapath.pod_ifaces = self.pod_ifaces.clone();
        c.datapath.ipsec = self.ipsec_key_file.is_some();
        c.key_delays = state::rotation::Delays {
            propagation: self.ipsec_key_propagation_delay,
            retirement: self.ipsec_key_rotation_delay,
        };
        c.datapath.node_map_max =
            crate::datapath::resolve_capacity(self.node_map_max, &self.bpffs.bpffs)?;
        c.datapath.mark_mask = self.mark_mask;
        c.node_map_grow = self.node_map_grow;
        c.route_protocol = self.route_protocol;
        c.route_nexthops = self.route_nexthops;
        c.route_table = self.route_table;
        c.max_prune_ratio = self.max_prune_ratio;
        c.force_prune = self.force_prune;
        c.prune_confirm_delay = self.prune_confirm_delay;
        c.resync_interval = self.resync_interval;
        c.include_external_ips = self.include_external_ips;
        if let Some(t) = self.test_id_cooldown {
            tracing::warn!(
                "--test-id-cooldown {}: a test's setting, below what --id-cooldown allows",
                t.show()
            );
        }
        c.id_cooldown = self.test_id_cooldown.unwrap_or(self.id_cooldown);
        c.id_reuse_floor = self.id_reuse_floor.min(c.id_cooldown);
        c.max_node_id = self.max_node_id;
        c.sync_timeout = self.sync_timeout;
        c.checkpoint_interval = self.checkpoint_interval;
        c.debounce = self.debounce;
        c.ipsec_key_file = self.ipsec_key_file.clone();
        Ok(c)
    }
}

/// A running source: its events, and where to ask it for a fresh list.
struct Source {
    events: mpsc::Receiver<SourceEvent>,
    requests: mpsc::Sender<SourceRequest>,
    /// A NodeList file: one that does not parse will not fix itself.
    file: bool,
}

/// Starts the configured source; a Kubernetes client that cannot be built fails here, at
/// start-up, rather than reading as "no nodes".
async fn spawn_source(args: &SourceArgs) -> anyhow::Result<Source> {
    let (tx, events) = mpsc::channel(1024);
    let (requests, rx) = mpsc::channel(1);
    match &args.nodes_file {
        Some(path) => {
            let source = FileSource {
                path: path.clone(),
                poll: args.nodes_file_poll,
                relist: args.relist_interval,
                settle: args.nodes_file_settle,
            };
            tokio::spawn(source.run(tx, rx));
        }
        None => {
            let source = KubeSource {
                kubeconfig: args.kubeconfig.clone(),
            };
            let client = source.client().await?;
            tokio::spawn(source.run(client, tx, rx));
        }
    }
    // The source starts its first list now, before the agent reads its checkpoint and loads
    // the datapath (tens of milliseconds that need neither): a file is parsed on a blocking
    // thread meanwhile, and a Kubernetes list is already asked for. On this single-threaded
    // runtime the spawned task would otherwise first run at the agent's first await.
    tokio::task::yield_now().await;
    Ok(Source {
        events,
        requests,
        file: args.nodes_file.is_some(),
    })
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// A one-shot run's `--sync-timeout`, started before its source: a Kubernetes client reads its
/// kubeconfig and the files it names (a token, certificates) as it is built, and any of them
/// can block (a FIFO) or be slow (a network mount).
fn source_deadline(config: &agent::AgentConfig) -> agent::deadline::Deadline {
    agent::deadline::Deadline::start(
        config.sync_timeout,
        "the node source (a Kubernetes client reads its kubeconfig and the files it names)",
    )
}

/// Returns the process exit status.
pub fn run(args: &RunArgs, out: &mut impl Write) -> anyhow::Result<u8> {
    let config = args.agent.config()?;
    if !args.dry_run {
        crate::runtime::caps::check()?;
    }
    runtime()?.block_on(async {
        let deadline = (args.once || args.dry_run).then(|| source_deadline(&config));
        let source = spawn_source(&args.source).await?;
        if let Some(deadline) = deadline {
            let once =
                agent::run_once(config, args.dry_run, source.file, source.events, deadline).await?;
            let (status, report, plan) = (once.status, once.report, once.plan);
            match (args.output, plan) {
                (Output::Json, Some(plan)) => writeln!(out, "{}", serde_json::to_string_pretty(&plan)?)?,
                (Output::Json, None) => writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?,
                (Output::Text, Some(plan)) => write!(out, "{}", agent::report::plan_table(&plan))?,
                (Output::Text, None) => {
                    writeln!(
                        out,
                        "synced, {} live nodes, {} restored, {} pruned, {} kernel writes, {} node errors",
                        report.live_nodes,
                        report.restored_nodes,
                        report.pruned_nodes,
                        report.kernel_writes,
                        report.errors.len()
                    )?;
                    for e in &report.errors {
                        writeln!(out, "node {}: {}", e.node, e.error)?;
                    }
                    for f in &report.failed_ops {
                        writeln!(out, "failed: {} (node {}): {}", f.op, f.node.as_deref().unwrap_or("-"), f.error)?;
                    }
                }
            }
            if let Some(b) = &report.brake {
                eprintln!(
                    "node-agent: brake held: {} stale nodes would have been deleted (hold {}): {}",
                    b.stale_nodes, b.id, b.message
                );
            }
            Ok(status.code())
        } else {
            let telemetry = Arc::new(Telemetry::new(config.resync_interval.max(Duration::from_secs(60)) * 2));
            let addr = telemetry::http::serve(args.metrics_addr, telemetry.clone())
                .await
                .with_context(|| format!("serving metrics on {}", args.metrics_addr))?;
            tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
            agent::run(config, telemetry, source.events, source.requests).await?;
            Ok(ExitStatus::Converged.code())
        }
    })
}

/// `node-agent plan`: what a reconcile would do now. Nothing is changed.
pub fn plan(args: &PlanArgs, out: &mut impl Write) -> anyhow::Result<u8> {
    let config = args.agent.config()?;
    runtime()?.block_on(async {
        let deadline = source_deadline(&config);
        let source = spawn_source(&args.source).await?;
        let once = agent::run_once(config, true, source.file, source.events, deadline).await?;
        let (status, plan) = (once.status, once.plan);
        let plan = plan.expect("a dry run returns its plan");
        match args.output {
            Output::Json => writeln!(out, "{}", serde_json::to_string_pretty(&plan)?)?,
            Output::Text => write!(out, "{}", agent::report::plan_table(&plan))?,
        }
        Ok(status.code())
    })
}

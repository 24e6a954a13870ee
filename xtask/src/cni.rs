//! Pods as a container runtime makes them: the reference CNI plugins (Debian's
//! `containernetworking-plugins`) run in the node's network namespace with `CNI_COMMAND=ADD` or
//! `DEL`, `loopback` for `lo` and `bridge` for `eth0`, with `host-local` leasing addresses from
//! the node's pod CIDRs. The demo and the test tiers make every pod here.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// Where Debian installs the plugins, and where the VM tier's guest finds them.
pub const PLUGIN_DIR: &str = "/usr/lib/cni";

/// The plugins a pod needs.
pub const PLUGINS: &[&str] = &["loopback", "bridge", "host-local"];

/// One node's pod network: a bridge holding the gateway (the first address) of each pod CIDR,
/// pods' addresses leased by `host-local` under `leases`.
#[derive(Clone, Debug)]
pub struct PodNetwork {
    /// The network's name; `host-local` keeps its leases in `leases/<name>`.
    pub name: String,
    /// The node's network namespace, where the plugins run.
    pub node_ns: String,
    pub bridge: String,
    /// The node's pod CIDRs, at most one per family.
    pub cidrs: Vec<String>,
    /// For the bridge and the pods' interfaces (room for ESP, say); the plugin's default if none.
    pub mtu: Option<u32>,
    pub leases: PathBuf,
}

impl PodNetwork {
    /// The `bridge` plugin's configuration.
    pub fn bridge_conf(&self) -> String {
        let ranges: Vec<_> = self
            .cidrs
            .iter()
            .map(|c| serde_json::json!([{ "subnet": c }]))
            .collect();
        let routes: Vec<_> = self
            .cidrs
            .iter()
            .map(|c| serde_json::json!({ "dst": if c.contains(':') { "::/0" } else { "0.0.0.0/0" } }))
            .collect();
        let mut conf = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": self.name,
            "type": "bridge",
            "bridge": self.bridge,
            "isGateway": true,
            "ipam": {
                "type": "host-local",
                "ranges": ranges,
                "routes": routes,
                "dataDir": self.leases,
            },
        });
        if let Some(mtu) = self.mtu {
            conf["mtu"] = mtu.into();
        }
        serde_json::to_string_pretty(&conf).expect("JSON")
    }

    fn loopback_conf(&self) -> String {
        serde_json::json!({ "cniVersion": "1.0.0", "name": format!("{}-lo", self.name), "type": "loopback" })
            .to_string()
    }

    /// `ADD` for the pod whose namespace is `pod_ns` (made by the caller, as a runtime makes
    /// the sandbox): `lo` up, `eth0` on the bridge. Returns the pod's addresses, without their
    /// prefix lengths, in the order of the result.
    pub fn add(&self, pod_ns: &str) -> anyhow::Result<Vec<String>> {
        self.invoke(pod_ns, "ADD", "loopback", "lo")?;
        let result = self.invoke(pod_ns, "ADD", "bridge", "eth0")?;
        let json: serde_json::Value =
            serde_json::from_str(&result).context("the bridge plugin's result")?;
        let ips: Vec<String> = json["ips"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|ip| ip["address"].as_str())
            .map(|a| a.split('/').next().unwrap_or(a).to_owned())
            .collect();
        if ips.is_empty() {
            bail!("no address in the bridge plugin's result: {result}");
        }
        Ok(ips)
    }

    /// `DEL` for the pod, both plugins tried; the first failure is returned.
    pub fn del(&self, pod_ns: &str) -> anyhow::Result<()> {
        let bridge = self.invoke(pod_ns, "DEL", "bridge", "eth0");
        let lo = self.invoke(pod_ns, "DEL", "loopback", "lo");
        bridge.and(lo).map(drop)
    }

    /// The leases `host-local` holds: none once every pod had its `DEL`.
    pub fn leases_held(&self) -> Vec<String> {
        let dir = self.leases.join(&self.name);
        let mut held: Vec<String> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n != "lock" && !n.starts_with("last_reserved_ip"))
            .collect();
        held.sort();
        held
    }

    /// Runs `plugin` for the pod, as a kubelet's runtime would, and returns its result.
    fn invoke(
        &self,
        pod_ns: &str,
        command: &str,
        plugin: &str,
        ifname: &str,
    ) -> anyhow::Result<String> {
        let conf = match plugin {
            "bridge" => self.bridge_conf(),
            _ => self.loopback_conf(),
        };
        let exe = Path::new(PLUGIN_DIR).join(plugin);
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.node_ns])
            .arg(&exe)
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", pod_ns)
            .env("CNI_NETNS", format!("/run/netns/{pod_ns}"))
            .env("CNI_IFNAME", ifname)
            .env("CNI_PATH", PLUGIN_DIR)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} (Debian package containernetworking-plugins)",
                    exe.display()
                )
            })?;
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(conf.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "CNI {command} {plugin} for {pod_ns}: {}\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

//! Kernel tier (and VM, for IPsec): the agent under exactly the capabilities the manifest gives
//! it, read from `deploy/daemonset.yaml` itself, so the manifest and the proof cannot drift
//! apart. The sandbox is made like a host: the bpffs root mode 0700, and the pins and links left
//! by an earlier run as full root.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use node_agent_tests::agent::{AgentEnv, Daemon, assert_exact, cluster};
use node_agent_tests::{ip, report, require_sandbox, sandbox};

/// The agent container's user and added capabilities, from the manifest.
fn manifest() -> (u32, Vec<String>) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/daemonset.yaml");
    let ds: serde_json::Value = serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap())
        .expect("deploy/daemonset.yaml");
    let c = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "node-agent")
        .expect("the node-agent container");
    let sc = &c["securityContext"];
    let uid = sc["runAsUser"].as_u64().unwrap_or(0) as u32;
    let caps = sc["capabilities"]["add"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    (uid, caps)
}

/// The number of a capability named as in a manifest (`NET_ADMIN`).
fn cap_number(name: &str) -> u32 {
    match name {
        "NET_ADMIN" => 12,
        "SYS_ADMIN" => 21,
        "PERFMON" => 38,
        "BPF" => 39,
        other => panic!("the test does not know the capability {other}"),
    }
}

/// Makes `cmd` run with only `caps`: the bounding set is cut to them before exec, so root's
/// exec gets exactly them (root's inheritable set is empty).
fn restrict(cmd: &mut Command, uid: u32, caps: &[u32]) {
    assert_eq!(uid, 0, "the test runs the agent as the manifest's uid, 0");
    let keep = caps.to_vec();
    // SAFETY: prctl between fork and exec touches only the child.
    unsafe {
        cmd.pre_exec(move || {
            for c in 0..64 {
                if !keep.contains(&c)
                    && libc::prctl(libc::PR_CAPBSET_DROP, c as libc::c_ulong, 0, 0, 0) != 0
                {
                    let e = std::io::Error::last_os_error();
                    if e.raw_os_error() != Some(libc::EINVAL) {
                        return Err(e);
                    }
                }
            }
            Ok(())
        });
    }
}

/// Whether this kernel can create ESP states (only the VM's can).
fn has_esp() -> bool {
    node_agent_tests::runtime().block_on(async {
        let x = node_agent::backends::xfrm::XfrmBackend::new(Default::default()).unwrap();
        x.probe_esp().await.is_ok()
    })
}

#[test]
fn the_agent_runs_under_exactly_the_manifests_capabilities() {
    require_sandbox!();
    let (uid, names) = manifest();
    let caps: Vec<u32> = names.iter().map(|n| cap_number(n)).collect();
    report(&format!(
        "caps: the manifest gives the agent uid {uid} and {names:?}"
    ));
    sandbox(|sb| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&sb.bpffs, std::fs::Permissions::from_mode(0o700)).unwrap();
        let env = AgentEnv::new(&sb.bpffs);
        let mut nodes = cluster(3);
        env.write_nodes(&nodes);
        // An earlier run as full root leaves the pins and links.
        let (code, _, err) = env.once(&[]);
        assert_eq!(code, 0, "{err}");
        let esp = has_esp();
        let mut extra = Vec::new();
        if esp {
            ip(&["link", "add", "cni0", "type", "bridge"]);
            let key = env.state_dir.with_file_name("ipsec.keys");
            std::fs::write(
                &key,
                "3+ rfc4106(gcm(aes)) 0x0102030405060708090a0b0c0d0e0f1011121314 128\n",
            )
            .unwrap();
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
            extra.extend([
                "--ipsec-key-file".to_string(),
                key.display().to_string(),
                "--pod-iface".into(),
                "cni0".into(),
            ]);
        } else {
            report(
                "SKIPPED the_agent_runs_under_exactly_the_manifests_capabilities (xfrm half): this kernel has no ESP; the VM tier runs it",
            );
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let mut cmd = env.command(&extra);
        restrict(&mut cmd, uid, &caps);
        let log = std::fs::File::create(env.log()).unwrap();
        let _daemon = Daemon(cmd.stdout(Stdio::null()).stderr(log).spawn().unwrap());
        // A node joins while the restricted daemon runs.
        nodes.push(node_agent_tests::agent::TestNode::dual("node-0004", 4));
        env.write_nodes(&nodes);
        env.wait(
            "the restricted agent to program the new node",
            Duration::from_secs(30),
            || env.routes() == node_agent_tests::agent::expected_routes(&nodes),
        );
        assert_exact(&env, &nodes);
        let log = std::fs::read_to_string(env.log()).unwrap();
        assert!(
            log.matches("outcome=TakenOver").count() >= 2,
            "the links the root run left are taken over:\n{log}"
        );
        if esp {
            // Four dual-stack nodes with pod CIDRs of both families: an OUT state per family
            // each, and an IN state for IPv4, the only family of the local node's pod CIDRs.
            env.wait("the xfrm states", Duration::from_secs(20), || {
                let out = ip(&["xfrm", "state"]);
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                text.lines().filter(|l| l.starts_with("src ")).count() == 4 * (2 + 1)
            });
        }
    });
}

#[test]
fn without_any_one_of_them_the_agent_stops_with_one_line_naming_it() {
    require_sandbox!();
    let (uid, names) = manifest();
    sandbox(|sb| {
        let env = AgentEnv::new(&sb.bpffs);
        env.write_nodes(&cluster(2));
        for missing in &names {
            let caps: Vec<u32> = names
                .iter()
                .filter(|n| *n != missing)
                .map(|n| cap_number(n))
                .collect();
            let mut cmd = env.command(&["--once"]);
            restrict(&mut cmd, uid, &caps);
            let out = cmd.output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err.lines().last().unwrap_or_default();
            assert_eq!(out.status.code(), Some(1), "{err}");
            assert!(
                last.starts_with(&format!("node-agent: missing capability CAP_{missing}: ")),
                "without {missing}: {last}"
            );
            assert!(
                !node_agent::datapath::node_ids_pin(&env.bpffs).exists(),
                "nothing was created"
            );
        }
    });
}

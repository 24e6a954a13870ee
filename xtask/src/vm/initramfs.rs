//! The kernel-independent half of the initramfs: busybox, the real iproute2 and bpftool with
//! their libraries, and `/init`. The kernel's half (its modules) is cached per kernel; the
//! kernel unpacks the two archives concatenated.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use super::build::Payload;
use super::cpio::Archive;
use crate::cmd::output;

/// Host binaries the tests call by name; copied with the libraries `ldd` lists.
const TOOLS: &[&str] = &["/usr/sbin/ip", "/usr/sbin/tc", "/usr/sbin/bpftool"];

/// Busybox applets that must not shadow the real tools: its `ip` and `tc` lack xfrm and BPF.
const NOT_APPLETS: &[&str] = &["busybox", "ip", "tc"];

/// Rust binaries load it at run time for unwinding, so `ldd` does not name it.
/// Debian's CA bundle (package ca-certificates), where rustls' platform verifier looks.
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
const LIBGCC: &str = "/lib/x86_64-linux-gnu/libgcc_s.so.1";

/// The guest's marker lines, parsed by the host (see `qemu.rs`).
pub const BEGIN: &str = "VMTEST: tests begin";
pub const DONE: &str = "VMTEST: done rc=";
pub const SMOKE_OK: &str = "VMTEST: smoke ok";
pub const FAILED: &str = "VMTEST: FAILED: ";

/// The ESP smoke test: an ESP state with the AEAD the agent uses, added and deleted.
const SMOKE: &str = "/usr/sbin/ip xfrm state add src 10.0.0.1 dst 10.0.0.2 proto esp spi 0x100 \
    mode tunnel reqid 1 aead 'rfc4106(gcm(aes))' 0x0102030405060708090a0b0c0d0e0f1011121314 128 \
    && /usr/sbin/ip xfrm state delete src 10.0.0.1 dst 10.0.0.2 proto esp spi 0x100";

/// Builds `target/vm/tools.cpio` and returns its path.
pub fn tools(vm_dir: &Path, payload: &Payload, test_args: &[String]) -> anyhow::Result<PathBuf> {
    let mut a = Archive::new();
    for d in ["proc", "sys", "dev", "tmp", "run", "root", "etc"] {
        a.dir(d);
    }
    busybox(&mut a)?;
    let mut libs = BTreeSet::new();
    for tool in TOOLS {
        a.host_file(Path::new(tool), tool)?;
        libs.extend(ldd(Path::new(tool))?);
    }
    for bin in &payload.binaries {
        libs.extend(ldd(bin)?);
    }
    // Static Go binaries: nothing for `ldd` to find.
    for plugin in xtask::cni::PLUGINS {
        let path = Path::new(xtask::cni::PLUGIN_DIR).join(plugin);
        a.host_file(&path, path.to_str().expect("a UTF-8 path"))?;
    }
    libs.insert(LIBGCC.to_owned());
    for lib in &libs {
        a.host_file(Path::new(lib), lib)?;
    }
    // `Command::new("ip")` in the tests must find the real one whatever PATH order says.
    a.symlink("bin/ip", "/usr/sbin/ip");
    a.symlink("bin/tc", "/usr/sbin/tc");
    for conf in ["/etc/iproute2", "/usr/share/iproute2"] {
        if Path::new(conf).is_dir() {
            a.host_tree(Path::new(conf), conf.trim_start_matches('/'))?;
        }
    }
    // The Kubernetes client builds its TLS configuration from the system's CA store even for a
    // plain-http API server (the tests' stand-in), and refuses to start without one.
    let ca = Path::new(CA_BUNDLE);
    if ca.is_file() {
        a.host_file(ca, CA_BUNDLE)?;
    }
    a.file("etc/passwd", 0o644, b"root:x:0:0:root:/root:/bin/sh\n");
    a.file("etc/group", 0o644, b"root:x:0:\n");
    a.file("init", 0o755, init_script(payload, test_args).as_bytes());
    let path = vm_dir.join("tools.cpio");
    std::fs::create_dir_all(vm_dir)?;
    std::fs::write(&path, a.finish()).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

fn busybox(a: &mut Archive) -> anyhow::Result<()> {
    let bb = Path::new("/bin/busybox");
    a.host_file(bb, "bin/busybox")?;
    let list = output(Command::new("busybox").arg("--list-full"))
        .context("busybox --list-full (is busybox-static installed?)")?;
    for applet in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let name = applet.rsplit('/').next().unwrap_or(applet);
        if NOT_APPLETS.contains(&name) {
            continue;
        }
        a.symlink(applet, "/bin/busybox");
    }
    Ok(())
}

/// The shared libraries `ldd` resolves for `bin`, the dynamic loader included.
fn ldd(bin: &Path) -> anyhow::Result<Vec<String>> {
    let out =
        output(Command::new("ldd").arg(bin)).with_context(|| format!("ldd {}", bin.display()))?;
    let mut libs = Vec::new();
    for line in out.lines() {
        let line = line.trim();
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        match path {
            Some(p) if p.starts_with('/') => libs.push(p.to_owned()),
            Some("not") => bail!("ldd {}: {line}", bin.display()),
            _ => {}
        }
    }
    Ok(libs)
}

/// Single-quotes `s` for the guest's shell.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `/init`: mounts, modules, the payload, the ESP smoke test, then each test binary in its own
/// network namespace, and the final status line. Anything that goes wrong sets a non-zero rc
/// and says what on the console.
fn init_script(payload: &Payload, test_args: &[String]) -> String {
    // The benchmarks' settings (`NODE_AGENT_BENCH*`) reach the tests in the guest as they are.
    let env: String = std::env::vars()
        .filter(|(k, _)| k.starts_with("NODE_AGENT_BENCH"))
        .map(|(k, v)| format!("export {k}={}\n", quote(&v)))
        .collect();
    let args: Vec<String> = test_args.iter().map(|s| quote(s)).collect();
    let args = args.join(" ");
    let tests: Vec<String> = payload.tests.iter().map(|t| quote(t)).collect();
    let tests = tests.join(" ");
    format!(
        r#"#!/bin/sh
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root
mount -t proc proc /proc
echo "VMTEST: /init at $(cut -d' ' -f1 /proc/uptime) s"
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mount -t bpf bpf /sys/fs/bpf
rc=0
fail() {{ echo "{FAILED}$*"; rc=1; }}
for m in $(cat /etc/vmtest-modules); do
    modprobe "$m" || fail "modprobe $m"
done
mkdir -p {share}
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,cache=loose,ro host0 {share} \
    || fail "mounting the workspace (9p host0) on {share}"
echo "VMTEST: kernel $(uname -r), modules and payload ready at $(cut -d' ' -f1 /proc/uptime) s"
if out=$(unshare -n sh -c {smoke} 2>&1); then
    echo "{SMOKE_OK}"
else
    fail "ESP smoke test (ip xfrm state add ... proto esp ... rfc4106(gcm(aes))): $out"
fi
export NODE_AGENT_VM=1
{env}echo "{BEGIN} at $(cut -d' ' -f1 /proc/uptime) s"
for t in {tests}; do
    if [ ! -x "$t" ]; then
        fail "$t is missing in the guest"
        continue
    fi
    echo "VMTEST: run $t"
    unshare -n -- "$t" {args}
    r=$?
    echo "VMTEST: $t exited rc=$r"
    [ "$r" -eq 0 ] || rc=$r
done
echo "{DONE}$rc"
poweroff -f
echo o > /proc/sysrq-trigger
"#,
        smoke = quote(SMOKE),
        share = quote(&payload.share.to_string_lossy()),
    )
}

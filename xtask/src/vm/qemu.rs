//! One QEMU boot: the kernel, the two initramfs halves, the payload over 9p, and the serial
//! console streamed to stdout and parsed for the guest's verdict.
//!
//! TCG with `-cpu max,-cx16` on one host thread: KVM here is an emulated nested one (no vmx/svm
//! flag), QEMU 7.2's `cmpxchg16b` emulation crashed a quarter of the 6.12 boots, and with one
//! host thread per vCPU the kernel's live code patching races the other vCPU (see [`accel`]).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::build::Payload;
use super::initramfs::{BEGIN, DONE, FAILED, SMOKE_OK};
use super::kernel::Kernel;
use crate::cmd::step;

/// `quiet` and skipping the crypto self-tests save about 0.5 s; `panic=-1` with `-no-reboot`
/// turns a guest panic into QEMU exiting.
const CMDLINE: &str = "console=ttyS0 quiet panic=-1 mitigations=off cryptomgr.notests=1";

pub struct Boot<'a> {
    pub kernel: &'a Kernel,
    pub tools: &'a std::path::Path,
    pub payload: &'a Payload,
    pub timeout: Duration,
    pub bzimage: bool,
    pub memory_mib: u32,
    /// Prefix every console line with the kernel's series (guests running side by side).
    pub label: bool,
}

/// The guest ran its tests and some failed: the process exits with the guest's status.
#[derive(Debug)]
pub struct TestsFailed(pub i32);

impl std::fmt::Display for TestsFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tests failed in the guest (rc={})", self.0)
    }
}

impl std::error::Error for TestsFailed {}

/// The guest kernel died while booting, before the test payload started: nothing of ours ran,
/// so the boot may be tried again. Under multi-threaded TCG, 6.12 was seen to oops in its own
/// code patching at boot (an `int3` left in `sched_clock_cpu` on the second vCPU); [`accel`]
/// now runs both vCPUs on one thread, so this is a last resort.
#[derive(Debug)]
pub struct BootCrashed(pub String);

impl std::fmt::Display for BootCrashed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BootCrashed {}

/// KVM only where it is real: `/dev/kvm` writable *and* a vmx/svm CPU flag. Here `/dev/kvm`
/// exists but the machine is itself a guest with an emulated nested KVM, which aborts or runs
/// slower than TCG.
///
/// TCG runs the vCPUs in turn on one host thread (`thread=single`). With a thread per vCPU
/// (QEMU's default), the kernel's live code patching (static keys flipped by tc qdiscs coming
/// and going, `text_poke_bp`'s `int3` protocol) races the other vCPU's translated code: a 6.12
/// guest died with `Oops: int3` at the `ingress_needed_key` branch in
/// `__netif_receive_skb_core`, three minutes into the tests, and once at boot in
/// `sched_clock_cpu`. Nothing in the guest can avoid every static key, so the emulator must
/// be coherent; two vCPUs are kept so libtest still overlaps tests that wait.
fn accel() -> [&'static str; 4] {
    let writable = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let virt = flags
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    if writable && virt {
        ["-accel", "kvm", "-cpu", "host"]
    } else {
        ["-accel", "tcg,thread=single", "-cpu", "max,-cx16"]
    }
}

pub struct Timing {
    /// QEMU start to the first test (boot, modules, payload mount, smoke test).
    pub boot: Duration,
    /// First test to the final status line.
    pub tests: Duration,
}

pub fn run(b: &Boot) -> anyhow::Result<Timing> {
    let k = b.kernel;
    let initrd = k.dir.join("initrd.cpio");
    let mut img =
        std::fs::read(&k.modules).with_context(|| format!("reading {}", k.modules.display()))?;
    img.extend(std::fs::read(b.tools).with_context(|| format!("reading {}", b.tools.display()))?);
    std::fs::write(&initrd, img).with_context(|| format!("writing {}", initrd.display()))?;

    let image = match (&k.vmlinux, b.bzimage) {
        (Some(v), false) => v,
        _ => &k.bzimage,
    };
    let accel = accel();
    let mut qemu = command(b, image, &initrd, accel);
    step(&format!(
        "vm-test: booting {} ({}) from {} ({} {})",
        k.series,
        k.release,
        image.display(),
        accel[1],
        accel[3]
    ));
    let started = Instant::now();
    let mut child = qemu.spawn().context("starting qemu-system-x86_64")?;
    let prefix = if b.label {
        format!("[{}] ", k.series)
    } else {
        String::new()
    };
    let console = watch(&mut child, started + b.timeout, &prefix)?;
    let Console {
        tail,
        begin,
        done,
        smoke_ok,
        failed,
        esp_skips,
        timed_out,
        status,
    } = console;
    let Some((rc, end)) = done else {
        let what = if timed_out {
            format!("timed out after {} s (--timeout)", b.timeout.as_secs())
        } else {
            format!(
                "crashed: QEMU exited ({status}) after {:.1} s",
                started.elapsed().as_secs_f64()
            )
        };
        let tail = if tail.is_empty() {
            "(no console output)".to_owned()
        } else {
            Vec::from(tail).join("\n")
        };
        let message =
            format!("the guest {what} without printing `{DONE}N`; last console lines:\n{tail}");
        if !timed_out && begin.is_none() {
            return Err(BootCrashed(message).into());
        }
        bail!("{message}");
    };
    let begin = begin.unwrap_or(end);
    let timing = Timing {
        boot: begin - started,
        tests: end - begin,
    };
    step(&format!(
        "vm-test: {} boot {:.1} s, tests {:.1} s",
        k.series,
        timing.boot.as_secs_f64(),
        timing.tests.as_secs_f64()
    ));
    if !failed.is_empty() {
        bail!("in the guest: {}", failed.join("; "));
    }
    if !smoke_ok {
        bail!("the ESP smoke test did not report success");
    }
    if !esp_skips.is_empty() {
        bail!(
            "ESP tests skipped inside the VM, where ESP exists: {}",
            esp_skips.join("; ")
        );
    }
    if rc != 0 {
        return Err(TestsFailed(rc).into());
    }
    Ok(timing)
}

/// The QEMU command line: the kernel and the initramfs, the payload shared read-only, the
/// console on stdio.
fn command(
    b: &Boot,
    image: &std::path::Path,
    initrd: &std::path::Path,
    accel: [&str; 4],
) -> Command {
    // Two vCPUs: libtest then runs two tests at once, and one that waits (a timeout, a
    // debounce) leaves the other the host thread.
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args([
        "-nodefaults",
        "-no-user-config",
        "-no-reboot",
        "-display",
        "none",
    ])
    .args(accel)
    .args(["-smp", "2"])
    .arg("-m")
    .arg(format!("{}M", b.memory_mib))
    .args(["-serial", "stdio"])
    .arg("-kernel")
    .arg(image)
    .arg("-initrd")
    .arg(initrd)
    .args(["-append", CMDLINE])
    .arg("-virtfs")
    .arg(format!(
        "local,path={},mount_tag=host0,security_model=none,readonly=on",
        b.payload.share.display()
    ))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    qemu
}

/// What the guest's console said, and how QEMU ended.
struct Console {
    /// The last 30 lines, for an error.
    tail: VecDeque<String>,
    /// When the first test began.
    begin: Option<Instant>,
    /// The guest's test status and when it came.
    done: Option<(i32, Instant)>,
    smoke_ok: bool,
    failed: Vec<String>,
    esp_skips: Vec<String>,
    timed_out: bool,
    status: std::process::ExitStatus,
}

/// Echoes the console (each line after `prefix`) and reads what it says until QEMU ends or `deadline` passes (then QEMU is
/// killed); waits a short grace for QEMU to exit after its last line.
fn watch(
    child: &mut std::process::Child,
    deadline: Instant,
    prefix: &str,
) -> anyhow::Result<Console> {
    let (tx, rx) = mpsc::channel::<String>();
    let stdout = child.stdout.take().expect("piped");
    let stderr = child.stderr.take().expect("piped");
    let tx2 = tx.clone();
    std::thread::spawn(move || forward(stdout, tx));
    std::thread::spawn(move || forward(stderr, tx2));

    let mut tail = VecDeque::new();
    let mut begin = None;
    let mut done: Option<(i32, Instant)> = None;
    let mut smoke_ok = false;
    let mut failed = Vec::new();
    let mut esp_skips = Vec::new();
    let mut timed_out = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = match rx.recv_timeout(left) {
            Ok(l) => l,
            // Both pipes closed: QEMU is gone.
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                timed_out = true;
                let _ = child.kill();
                break;
            }
        };
        // Locked per line: another guest's console may be echoed beside this one.
        {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{prefix}{line}");
            let _ = out.flush();
        }
        if tail.len() == 30 {
            tail.pop_front();
        }
        tail.push_back(line.clone());
        let l = line.trim_start();
        if l.starts_with(BEGIN) {
            begin = Some(Instant::now());
        } else if let Some(rc) = l.strip_prefix(DONE) {
            done = Some((rc.trim().parse().unwrap_or(-1), Instant::now()));
        } else if l.starts_with(SMOKE_OK) {
            smoke_ok = true;
        } else if let Some(why) = l.strip_prefix(FAILED) {
            failed.push(why.to_owned());
        } else if l.starts_with("SKIPPED") && mentions_esp(l) {
            esp_skips.push(l.to_owned());
        }
    }
    // After the status line the guest powers off; don't wait long on one that hangs there.
    let grace = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > grace {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok(Console {
        tail,
        begin,
        done,
        smoke_ok,
        failed,
        esp_skips,
        timed_out,
        status,
    })
}

fn forward(pipe: impl std::io::Read, tx: mpsc::Sender<String>) {
    let mut r = BufReader::new(pipe);
    let mut buf = Vec::new();
    while matches!(r.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
        let line = String::from_utf8_lossy(&buf);
        let line = line.trim_end_matches(['\n', '\r']).to_owned();
        if tx.send(line).is_err() {
            return;
        }
        buf.clear();
    }
}

/// A skip line about ESP: `ESP` anywhere, or the word `esp` (not `response`).
fn mentions_esp(line: &str) -> bool {
    line.contains("ESP")
        || line
            .split(|c: char| !c.is_ascii_alphanumeric())
            .any(|w| w.eq_ignore_ascii_case("esp") || w == "esp4" || w == "esp6")
}

#[cfg(test)]
mod tests {
    use super::mentions_esp;

    #[test]
    fn esp_skips_are_recognised() {
        assert!(mentions_esp("SKIPPED xfrm_states: kernel has no ESP"));
        assert!(mentions_esp("SKIPPED t: proto esp unsupported"));
        assert!(mentions_esp("SKIPPED t: esp4 missing"));
        assert!(!mentions_esp("SKIPPED t: no response from peer"));
    }
}

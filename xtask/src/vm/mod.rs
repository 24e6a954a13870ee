//! `cargo xtask vm-test`: the VM test tier. Boots stock Debian kernels under QEMU and runs the
//! kernel-tier test binaries inside, as root, where ESP and module loading exist (the host's
//! kernel has neither). docs/vm-tests.md records why each choice below is the one that works.
//!
//! One boot per kernel runs every test binary: a boot costs about 3 s under TCG, so booting per
//! binary would dominate the run.

mod build;
mod cpio;
mod host;
mod initramfs;
mod kernel;
mod qemu;

use std::time::{Duration, Instant};

use anyhow::bail;

use crate::build_ebpf;
use crate::cmd::{self, root, step};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Which Debian kernel to boot.
    #[arg(long, value_enum, default_value = "6.1")]
    pub kernel: KernelChoice,
    /// Give up on a guest that has not printed its final status line after this many seconds.
    #[arg(long, default_value_t = 900)]
    pub timeout: u64,
    /// Boot the compressed bzImage even when the extracted vmlinux could boot through PVH.
    #[arg(long)]
    pub bzimage: bool,
    /// Build the agent and the tests with `--release`: for the benchmarks that need ESP
    /// (`cargo xtask bench` runs the IPsec figures this way).
    #[arg(long)]
    pub release: bool,
    /// The guest's memory in MiB.
    #[arg(long, default_value_t = 2048)]
    pub memory_mib: u32,
    /// Arguments for the test binary (a test name filter, `--nocapture`, ...). Without a
    /// filter the guest runs the kernel-tier modules.
    #[arg(last = true)]
    pub rest: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KernelChoice {
    #[value(name = "6.1")]
    V6_1,
    #[value(name = "6.12")]
    V6_12,
    #[value(name = "all")]
    All,
}

impl KernelChoice {
    fn kernels(self) -> Vec<kernel::Series> {
        match self {
            Self::V6_1 => vec![kernel::Series::V6_1],
            Self::V6_12 => vec![kernel::Series::V6_12],
            Self::All => vec![kernel::Series::V6_1, kernel::Series::V6_12],
        }
    }
}

/// A guest that died while booting ran nothing of ours: it is booted once more, and that is said.
fn boot_once_more_if_it_crashed(boot: &qemu::Boot) -> anyhow::Result<qemu::Timing> {
    let result = qemu::run(boot);
    if let Err(e) = &result
        && let Some(crash) = e.downcast_ref::<qemu::BootCrashed>()
    {
        let first = crash.0.lines().next().unwrap_or_default().to_owned();
        step(&format!(
            "vm-test: {} died while booting, before any test ran ({first}); booting it again",
            boot.kernel.series
        ));
        return qemu::run(boot);
    }
    result
}

/// Runs the tier; `Ok(code)` is the process's exit status: 0, or the first failing guest's
/// test status when the only failures are test failures. Anything else (a crash, a timeout, a
/// failed smoke test, an ESP skip) is an error.
pub fn run(args: &Args) -> anyhow::Result<i32> {
    let started = Instant::now();
    if !cmd::is_root() {
        bail!("vm-test installs Debian packages and builds a root filesystem; run it as root");
    }
    host::ensure_packages()?;
    let vm_dir = root().join("target/vm");

    let mut kernels = Vec::new();
    for series in args.kernel.kernels() {
        let t = Instant::now();
        let k = kernel::prepare(series, &vm_dir)?;
        step(&format!(
            "vm-test: kernel {} ({}) ready in {:.1} s",
            series,
            k.release,
            t.elapsed().as_secs_f64()
        ));
        kernels.push(k);
    }

    build_ebpf::run(&build_ebpf::Args { release: true })?;
    let payload = build::tests(args.release)?;

    let t = Instant::now();
    let tools = initramfs::tools(&vm_dir, &payload, &test_args(&args.rest))?;
    step(&format!(
        "vm-test: initramfs tools and /init in {:.1} s",
        t.elapsed().as_secs_f64()
    ));

    // One guest runs its vCPUs on one host thread (see `qemu::accel`), so the kernels boot side
    // by side: each has a host core of its own, as it would alone, and the tier takes as long as
    // its slowest guest. Their console lines are told apart by a prefix.
    let label = kernels.len() > 1;
    let results: Vec<anyhow::Result<qemu::Timing>> = std::thread::scope(|s| {
        let guests: Vec<_> = kernels
            .iter()
            .map(|k| {
                let boot = qemu::Boot {
                    kernel: k,
                    tools: &tools,
                    payload: &payload,
                    timeout: Duration::from_secs(args.timeout),
                    bzimage: args.bzimage,
                    memory_mib: args.memory_mib,
                    label,
                };
                s.spawn(move || boot_once_more_if_it_crashed(&boot))
            })
            .collect();
        guests
            .into_iter()
            .map(|g| {
                g.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("the guest's thread panicked")))
            })
            .collect()
    });

    let mut failures = Vec::new();
    let mut summary = Vec::new();
    let mut test_rc = 0;
    for (k, result) in kernels.iter().zip(results) {
        let line = match &result {
            Ok(_) => format!("{} ok", k.series),
            Err(e) => format!("{} FAILED: {e:#}", k.series),
        };
        match result {
            Ok(_) => {}
            Err(e) => match e.downcast_ref::<qemu::TestsFailed>() {
                Some(t) if test_rc == 0 => test_rc = t.0,
                Some(_) => {}
                None => failures.push(line.clone()),
            },
        }
        summary.push(line);
    }
    for line in &summary {
        step(&format!("vm-test: {line}"));
    }
    step(&format!(
        "vm-test: total {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    if !failures.is_empty() {
        bail!("vm-test failed on {}", failures.join("; "));
    }
    Ok(test_rc)
}

/// The test binary's arguments: the user's, with the kernel-tier modules as the filter unless
/// the user gave one (a flag's value, as in `--test-threads 1`, is not a filter).
fn test_args(rest: &[String]) -> Vec<String> {
    let mut filtered = false;
    let mut takes_value = false;
    for a in rest {
        if takes_value {
            takes_value = false;
        } else if a.starts_with('-') {
            takes_value = !a.contains('=')
                && matches!(
                    a.as_str(),
                    "--test-threads" | "--skip" | "--format" | "--color" | "-Z"
                );
        } else {
            filtered = true;
        }
    }
    let mut args = rest.to_vec();
    if !filtered {
        args.extend(build::KERNEL_TIER.iter().map(|m| (*m).to_owned()));
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_tier_is_the_filter_unless_the_user_gives_one() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let args = test_args(&s(&["--nocapture", "--test-threads", "2"]));
        assert!(args.contains(&"datapath::".to_string()));
        assert_eq!(test_args(&s(&["ipsec"])), s(&["ipsec"]));
    }
}

//! Fetching and preparing a Debian kernel for the guest, cached under `target/vm/<series>/`.
//!
//! The package is downloaded with `apt-get download` and unpacked with `dpkg -x`; nothing is
//! installed on the host. 6.12 comes from bookworm-backports through a private apt
//! configuration, so the host's sources stay as they are. What the guest needs is kept
//! (the `.deb`, the kernel image, the vmlinux extracted from it, the modules archive); the
//! unpacked tree is removed, since it is rebuilt from the `.deb` without the network.
//!
//! The `.deb` is kept until `target/vm/<series>/` is removed: delete that directory to pick up
//! a newer kernel from the archive.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use super::cpio::Archive;
use crate::cmd::{self, step};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Series {
    V6_1,
    V6_12,
}

impl fmt::Display for Series {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V6_1 => "6.1",
            Self::V6_12 => "6.12",
        })
    }
}

impl Series {
    /// The prefix the package picked must carry, to catch a metapackage that moved on.
    fn package_prefix(self) -> &'static str {
        match self {
            Self::V6_1 => "linux-image-6.1.",
            Self::V6_12 => "linux-image-6.12.",
        }
    }
}

/// A kernel ready to boot.
pub struct Kernel {
    pub series: Series,
    /// `uname -r` of the guest, e.g. `6.1.0-56-amd64`.
    pub release: String,
    /// The compressed image as shipped.
    pub bzimage: PathBuf,
    /// The ELF inside it, when it has a PVH entry point QEMU can boot directly.
    pub vmlinux: Option<PathBuf>,
    /// An uncompressed cpio with the modules, their `modules.dep`, and `/etc/vmtest-modules`.
    pub modules: PathBuf,
    pub dir: PathBuf,
}

/// Modules the guest loads at boot, in this order (virtio and 9p first: the payload needs them).
/// Names the kernel has built in are dropped from the list; missing ones stop the preparation.
const LOAD: &[&str] = &[
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "veth",
    "dummy",
    "bridge",
    "sch_ingress",
    "cls_bpf",
    "xfrm_user",
    "xfrm_algo",
    "esp4",
    "esp6",
    "xfrm4_tunnel",
    "xfrm6_tunnel",
    "tunnel4",
    "tunnel6",
];

/// Module trees copied whole: the kernel loads crypto templates on demand through
/// `/sbin/modprobe`, and which ones an ESP state needs differs between kernels (6.1's `seqiv`
/// pulls in `drbg` and `jitterentropy_rng`).
const TREES: &[&str] = &[
    "kernel/crypto",
    "kernel/arch/x86/crypto",
    "kernel/lib/crypto",
];

/// Bumped whenever what goes into the modules archive changes, so caches rebuild.
fn modules_stamp() -> String {
    format!("v2 {} | {}", LOAD.join(" "), TREES.join(" "))
}

pub fn prepare(series: Series, vm_dir: &Path) -> anyhow::Result<Kernel> {
    let dir = vm_dir.join(series.to_string());
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let deb = fetch(series, &dir)?;

    let stamp_path = dir.join("prepared");
    let stamp = format!("{}\n{}\n", deb.display(), modules_stamp());
    let kernel = |release: String| Kernel {
        series,
        bzimage: dir.join("vmlinuz"),
        vmlinux: Some(dir.join("vmlinux")).filter(|p| p.is_file()),
        modules: dir.join("modules.cpio"),
        dir: dir.clone(),
        release,
    };
    if let Ok(text) = std::fs::read_to_string(&stamp_path)
        && let Some(release) = text.strip_prefix(&stamp)
        && dir.join("vmlinuz").is_file()
        && dir.join("modules.cpio").is_file()
    {
        step(&format!(
            "vm-test: kernel {series}: cached in {}",
            dir.display()
        ));
        return Ok(kernel(release.trim().to_owned()));
    }

    let tree = dir.join("root");
    if tree.exists() {
        std::fs::remove_dir_all(&tree).with_context(|| format!("removing {}", tree.display()))?;
    }
    step(&format!(
        "vm-test: kernel {series}: unpacking {}",
        deb.display()
    ));
    cmd::run(Command::new("dpkg").arg("-x").arg(&deb).arg(&tree))
        .with_context(|| format!("unpacking {}", deb.display()))?;
    let modules_root = ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|p| tree.join(p))
        .find(|p| p.is_dir())
        .with_context(|| format!("{} has no lib/modules", deb.display()))?;
    let release = only_entry(&modules_root)?;
    let base = modules_root
        .parent()
        .and_then(Path::parent)
        .context("modules root has a base")?
        .to_owned();
    // Debian ships no modules.dep; busybox's depmod reads compressed modules too.
    cmd::run(
        Command::new("busybox")
            .arg("depmod")
            .arg("-b")
            .arg(&base)
            .arg(&release),
    )
    .with_context(|| format!("depmod for {release}"))?;

    let image = tree.join(format!("boot/vmlinuz-{release}"));
    std::fs::copy(&image, dir.join("vmlinuz"))
        .with_context(|| format!("copying {}", image.display()))?;
    let _ = std::fs::remove_file(dir.join("vmlinux"));
    match extract_vmlinux(&image)? {
        Some(elf) => {
            std::fs::write(dir.join("vmlinux"), elf).context("writing vmlinux")?;
            step(&format!(
                "vm-test: kernel {series}: extracted vmlinux (PVH entry)"
            ));
        }
        None => step(&format!(
            "vm-test: kernel {series}: no PVH vmlinux in the image; booting the bzImage"
        )),
    }

    let modules = modules_archive(&modules_root.join(&release), &release, &dir)?;
    std::fs::write(dir.join("modules.cpio"), modules).context("writing modules.cpio")?;
    std::fs::remove_dir_all(&tree).with_context(|| format!("removing {}", tree.display()))?;
    std::fs::write(&stamp_path, format!("{stamp}{release}\n"))
        .with_context(|| format!("writing {}", stamp_path.display()))?;
    Ok(kernel(release))
}

fn only_entry(dir: &Path) -> anyhow::Result<String> {
    let names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    match names.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!(
            "expected one kernel release in {}, found {names:?}",
            dir.display()
        ),
    }
}

/// The private apt configuration for a series, or none to use the host's (6.1 is in the
/// host's bookworm-security).
fn apt_options(series: Series, dir: &Path) -> anyhow::Result<Vec<String>> {
    // apt's download sandbox user cannot write into target/.
    let sandbox = "-oAPT::Sandbox::User=root".to_owned();
    let line = match series {
        Series::V6_1 => return Ok(vec![sandbox]),
        Series::V6_12 => {
            "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] \
             http://deb.debian.org/debian bookworm-backports main\n"
        }
    };
    let apt = dir.join("apt");
    for d in ["sources.list.d", "lists/partial", "cache/archives/partial"] {
        std::fs::create_dir_all(apt.join(d))
            .with_context(|| format!("creating {}", apt.join(d).display()))?;
    }
    std::fs::write(apt.join("sources.list"), line).context("writing the private sources.list")?;
    let p = |s: &str| apt.join(s).display().to_string();
    Ok(vec![
        format!("-oDir::Etc::SourceList={}", p("sources.list")),
        format!("-oDir::Etc::SourceParts={}", p("sources.list.d")),
        format!("-oDir::State::Lists={}", p("lists")),
        format!("-oDir::Cache={}", p("cache")),
        sandbox,
    ])
}

/// Downloads the series' kernel package once; returns the `.deb`.
fn fetch(series: Series, dir: &Path) -> anyhow::Result<PathBuf> {
    let deb_dir = dir.join("deb");
    if let Ok(mut debs) = std::fs::read_dir(&deb_dir).map(|r| {
        r.filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "deb"))
            .collect::<Vec<_>>()
    }) && debs.len() == 1
    {
        return Ok(debs.remove(0));
    }
    let opts = apt_options(series, dir)?;
    let private = series != Series::V6_1;
    if private {
        step(&format!(
            "vm-test: kernel {series}: apt-get update (private config)"
        ));
        cmd::fetch(Command::new("apt-get").args(&opts).args(["update", "-qq"]))
            .context("apt-get update with the private bookworm-backports config")?;
    }
    let depends = || {
        cmd::output(
            Command::new("apt-cache")
                .args(&opts)
                .args(["depends", "linux-image-amd64"]),
        )
    };
    let mut out = depends();
    if out.is_none() && !private {
        step("vm-test: the host's apt lists lack linux-image-amd64; apt-get update");
        cmd::fetch(Command::new("apt-get").args(["update", "-qq"])).context("apt-get update")?;
        out = depends();
    }
    let out = out.context("apt-cache depends linux-image-amd64 failed")?;
    let package = out
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .map(|p| p.trim_matches(['<', '>']).to_owned())
        .find(|p| p.starts_with(series.package_prefix()))
        .with_context(|| {
            format!(
                "linux-image-amd64 does not depend on a {}* package:\n{out}",
                series.package_prefix()
            )
        })?;
    step(&format!("vm-test: kernel {series}: downloading {package}"));
    if deb_dir.exists() {
        std::fs::remove_dir_all(&deb_dir)?;
    }
    std::fs::create_dir_all(&deb_dir)?;
    cmd::fetch(
        Command::new("apt-get")
            .current_dir(&deb_dir)
            .args(&opts)
            .args(["download", &package]),
    )
    .with_context(|| format!("downloading {package}"))?;
    let deb = std::fs::read_dir(&deb_dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .with_context(|| format!("apt-get download left no .deb in {}", deb_dir.display()))?;
    Ok(deb)
}

/// `esp4.ko.xz` → `esp4`; dashes and underscores are the same to modprobe.
fn module_name(path: &str) -> String {
    let base = path.rsplit('/').next().unwrap_or(path);
    let base = base.split(".ko").next().unwrap_or(base);
    base.replace('-', "_")
}

/// The modules the guest gets: [`LOAD`] and [`TREES`] with their `modules.dep` closure,
/// decompressed (busybox's insmod takes plain `.ko`), with a fresh `modules.dep` and the list
/// of modules `/init` loads. One pass from Debian's `modules.dep` to the archive, in the order
/// the archive needs it (resolve, copy and decompress, write the new index); its steps share
/// the resolved tables, which is why it is one function of a little over 100 lines.
fn modules_archive(src: &Path, release: &str, dir: &Path) -> anyhow::Result<Vec<u8>> {
    let dep_text = std::fs::read_to_string(src.join("modules.dep"))
        .with_context(|| format!("reading {}/modules.dep", src.display()))?;
    let mut deps: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut by_name: BTreeMap<String, String> = BTreeMap::new();
    for line in dep_text.lines() {
        let Some((m, rest)) = line.split_once(':') else {
            continue;
        };
        // busybox writes paths relative to the release directory; kmod too. Be lenient.
        let m = m
            .trim()
            .trim_start_matches(&format!("/lib/modules/{release}/"))
            .to_owned();
        let d = rest
            .split_whitespace()
            .map(|s| {
                s.trim_start_matches(&format!("/lib/modules/{release}/"))
                    .to_owned()
            })
            .collect();
        by_name.insert(module_name(&m), m.clone());
        deps.insert(m, d);
    }
    let builtin: BTreeSet<String> = std::fs::read_to_string(src.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .map(module_name)
        .collect();

    let mut load = Vec::new();
    let mut todo: Vec<String> = Vec::new();
    for name in LOAD {
        let name = name.replace('-', "_");
        if let Some(path) = by_name.get(&name) {
            load.push(name);
            todo.push(path.clone());
        } else if !builtin.contains(&name) {
            bail!("module {name} is neither a module nor built into {release}");
        }
    }
    for tree in TREES {
        todo.extend(
            deps.keys()
                .filter(|m| m.starts_with(&format!("{tree}/")))
                .cloned(),
        );
    }
    let mut want = BTreeSet::new();
    while let Some(m) = todo.pop() {
        if want.insert(m.clone())
            && let Some(d) = deps.get(&m)
        {
            todo.extend(d.iter().cloned());
        }
    }

    // Stage the decompressed modules so busybox's depmod can index exactly what the guest has.
    let stage = dir.join("stage");
    if stage.exists() {
        std::fs::remove_dir_all(&stage)?;
    }
    let stage_rel = stage.join(format!("lib/modules/{release}"));
    for m in &want {
        let from = src.join(m);
        let plain = m
            .strip_suffix(".xz")
            .or_else(|| m.strip_suffix(".zst"))
            .or_else(|| m.strip_suffix(".gz"))
            .unwrap_or(m);
        let to = stage_rel.join(plain);
        std::fs::create_dir_all(to.parent().unwrap())?;
        let data = decompress_module(&from)?;
        std::fs::write(&to, data).with_context(|| format!("writing {}", to.display()))?;
    }
    for f in [
        "modules.builtin",
        "modules.builtin.modinfo",
        "modules.order",
    ] {
        if src.join(f).is_file() {
            std::fs::copy(src.join(f), stage_rel.join(f))?;
        }
    }
    cmd::run(
        Command::new("busybox")
            .arg("depmod")
            .arg("-b")
            .arg(&stage)
            .arg(release),
    )
    .context("depmod on the guest's module set")?;

    let mut a = Archive::new();
    a.host_tree(&stage.join("lib"), "lib")?;
    a.file(
        "etc/vmtest-modules",
        0o644,
        format!("{}\n", load.join("\n")).as_bytes(),
    );
    std::fs::remove_dir_all(&stage)?;
    step(&format!(
        "vm-test: {release}: {} modules in the initramfs; loading {}",
        want.len(),
        load.join(" ")
    ));
    Ok(a.finish())
}

fn decompress_module(path: &Path) -> anyhow::Result<Vec<u8>> {
    let name = path.to_string_lossy();
    let tool = if name.ends_with(".xz") {
        "xz"
    } else if name.ends_with(".zst") {
        "zstd"
    } else if name.ends_with(".gz") {
        "gzip"
    } else {
        return std::fs::read(path).with_context(|| format!("reading {}", path.display()));
    };
    let out = Command::new(tool)
        .arg("-dc")
        .arg(path)
        .output()
        .with_context(|| format!("running {tool} -dc {}", path.display()))?;
    if !out.status.success() {
        bail!(
            "{tool} -dc {} failed: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out.stdout)
}

/// The uncompressed kernel ELF inside a bzImage, if it has a PVH entry note (QEMU then boots
/// it directly, skipping the decompressor, which costs 1.5–2 s under TCG).
///
/// The compressed payload's place comes from the boot protocol header (`setup_sects`,
/// `payload_offset`); its format from its magic.
fn extract_vmlinux(bzimage: &Path) -> anyhow::Result<Option<Vec<u8>>> {
    let img = std::fs::read(bzimage).with_context(|| format!("reading {}", bzimage.display()))?;
    let u32_at = |o: usize| {
        img.get(o..o + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    };
    if img.get(0x202..0x206) != Some(b"HdrS") {
        bail!("{} is not a bzImage (no HdrS header)", bzimage.display());
    }
    let setup_sects = match img[0x1f1] {
        0 => 4,
        n => n as usize,
    };
    let (Some(off), Some(len)) = (u32_at(0x248), u32_at(0x24c)) else {
        return Ok(None);
    };
    let start = (setup_sects + 1) * 512 + off as usize;
    let Some(payload) = img.get(start..start + len as usize) else {
        bail!("{}: payload outside the image", bzimage.display());
    };
    let args: &[&str] = if payload.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        &["xz", "-dc", "--single-stream"]
    } else if payload.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        &["zstd", "-dc"]
    } else if payload.starts_with(&[0x02, 0x21, 0x4c, 0x18]) {
        &["lz4", "-dc"]
    } else if payload.starts_with(&[0x1f, 0x8b]) {
        &["gzip", "-dc"]
    } else {
        return Ok(None);
    };
    let tmp = bzimage.with_extension("payload");
    std::fs::write(&tmp, payload)?;
    // Trailing bytes after the stream (the appended size) make some tools exit non-zero even
    // though the output is whole; the ELF check below decides.
    let out = Command::new(args[0])
        .args(&args[1..])
        .arg(&tmp)
        .output()
        .with_context(|| format!("running {}", args.join(" ")))?;
    let _ = std::fs::remove_file(&tmp);
    let elf = out.stdout;
    if !elf.starts_with(b"\x7fELF") {
        return Ok(None);
    }
    // XEN_ELFNOTE_PHYS32_ENTRY: namesz 4, descsz 4 or 8 (6.1 writes a pointer), type 18, "Xen".
    let pvh = elf.windows(16).any(|w| {
        w[..4] == [4, 0, 0, 0]
            && (w[4..8] == [4, 0, 0, 0] || w[4..8] == [8, 0, 0, 0])
            && w[8..] == [18, 0, 0, 0, b'X', b'e', b'n', 0]
    });
    Ok(pvh.then_some(elf))
}

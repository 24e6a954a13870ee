//! `cargo xtask image`: the container image, packaging the agent xtask builds.
//!
//! The agent is built once, the way CI builds and tests it (`cargo xtask build-ebpf --release`,
//! `cargo build --release -p node-agent`); the `Dockerfile` only copies that binary onto
//! `debian:bookworm-slim` with the inspection tools. The Dockerfile's header says why.
//!
//! Without a reachable registry (these project machines), the base is a stand-in built here:
//! `debootstrap --variant=minbase bookworm`, trimmed the way Debian's own `-slim` images are
//! (debuerreotype's minimizing-config and slimify), imported into podman. It is cached as a
//! local image and as a tarball under `target/image/`, so only the first run pays for it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

use crate::cmd::{self, output, root, step};
use crate::{apt, build_ebpf, setup};

/// The base the Dockerfile names by default; the stand-in replaces it only when it cannot be
/// pulled. The Dockerfile check (`dockerfile.rs`, run by the deploy tests) reads this constant
/// from this file's text and requires the Dockerfile's `ARG BASE` default to be it.
pub const REGISTRY_BASE: &str = "docker.io/library/debian:bookworm-slim";
/// The stand-in's name in local podman storage.
pub const STAND_IN_BASE: &str = "localhost/node-agent-base:bookworm-slim";
/// The binary the Dockerfile copies; the Dockerfile check (`dockerfile.rs`) checks its `COPY` and
/// .dockerignore.
pub const BINARY: &str = "target/release/node-agent";
const SUITE: &str = "bookworm";

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image's name and tag.
    #[arg(long, default_value = concat!("localhost/node-agent:", env!("CARGO_PKG_VERSION")))]
    pub tag: String,
    /// The base: `auto` uses docker.io/library/debian:bookworm-slim, pulling it if needed, and
    /// falls back to the stand-in when no registry is reachable.
    #[arg(long, value_enum, default_value_t = Base::Auto)]
    pub base: Base,
    /// Pull the registry base again, or rebuild the stand-in, instead of using the cached one.
    #[arg(long)]
    pub refresh_base: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Base {
    Auto,
    /// docker.io/library/debian:bookworm-slim, or fail.
    Registry,
    /// The debootstrap stand-in for it, even when the registry is reachable.
    StandIn,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let start = Instant::now();
    setup::run()?;
    build_ebpf::run(&build_ebpf::Args { release: true })?;
    step("image: cargo build --release -p node-agent");
    cmd::run(Command::new("cargo").current_dir(root()).args([
        "build",
        "--release",
        "-p",
        "node-agent",
    ]))?;
    let binary = root().join(BINARY);
    if !binary.is_file() {
        bail!("{} is missing after the release build", binary.display());
    }
    apt::ensure(
        "image",
        &["podman"],
        "; podman builds the image (Docker works too: docs/install.md)",
    )?;
    let base = base(args)?;
    step(&format!("image: building {} on {base}", args.tag));
    let build = Instant::now();
    cmd::run(
        Command::new("podman")
            .current_dir(root())
            // chroot isolation runs the RUN steps without an OCI runtime, so it works where
            // containers cannot be started (these machines refuse the runtime's setrlimit).
            .args(["build", "--isolation", "chroot", "--build-arg"])
            .arg(format!("BASE={base}"))
            .args(["--tag", &args.tag, "--file", "Dockerfile", "."]),
    )?;
    let build = build.elapsed().as_secs_f64();
    let size = output(Command::new("podman").args([
        "image",
        "inspect",
        "--format",
        "{{.Size}}",
        &args.tag,
    ]))
    .and_then(|s| s.trim().parse::<u64>().ok())
    .context("podman image inspect: no size")?;
    smoke(&args.tag)?;
    step(&format!(
        "image: {} built: {:.1} MB on {base}; podman build {build:.1} s, total {:.1} s",
        args.tag,
        size as f64 / 1e6,
        start.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// The base `cargo xtask image` picks by default, pulled or made now, so that the image build
/// that follows finds it ready.
pub fn prepare_base() -> anyhow::Result<String> {
    base(&Args {
        tag: String::new(),
        base: Base::Auto,
        refresh_base: false,
    })
}

/// Which base to build on, pulled or made as needed.
fn base(args: &Args) -> anyhow::Result<String> {
    if args.base != Base::StandIn {
        match registry_base(args.refresh_base) {
            Ok(()) => {
                step(&format!("image: base {REGISTRY_BASE}"));
                return Ok(REGISTRY_BASE.into());
            }
            Err(e) if args.base == Base::Registry => return Err(e),
            Err(e) => step(&format!(
                "image: {REGISTRY_BASE} unavailable ({e:#}); using the debootstrap stand-in"
            )),
        }
    }
    stand_in(args.refresh_base)?;
    Ok(STAND_IN_BASE.into())
}

fn exists(image: &str) -> bool {
    Command::new("podman")
        .args(["image", "exists", image])
        .status()
        .is_ok_and(|s| s.success())
}

fn registry_base(refresh: bool) -> anyhow::Result<()> {
    if exists(REGISTRY_BASE) && !refresh {
        return Ok(());
    }
    let out = Command::new("podman")
        .args(["pull", "--quiet", REGISTRY_BASE])
        .output()
        .context("starting podman pull")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!(
            "podman pull: {}",
            err.lines().last().unwrap_or("failed").trim()
        );
    }
    Ok(())
}

/// The stand-in base: the local image if there is one, else imported from the cached tarball,
/// else built with debootstrap (about two minutes).
fn stand_in(refresh: bool) -> anyhow::Result<()> {
    let dir = root().join("target/image");
    let tarball = dir.join(format!("{SUITE}-slim.tar"));
    if refresh {
        let _ = std::fs::remove_file(&tarball);
    } else if exists(STAND_IN_BASE) {
        step(&format!("image: stand-in base {STAND_IN_BASE} (cached)"));
        return Ok(());
    }
    if !tarball.is_file() {
        if !cmd::is_root() {
            bail!(
                "building the stand-in base (debootstrap) needs root; run as root, or on a \
                 machine that can pull {REGISTRY_BASE}"
            );
        }
        apt::ensure("image", &["debootstrap"], "")?;
        let (mirror, security) = host_mirrors();
        let rootfs = dir.join("rootfs");
        if rootfs.exists() {
            std::fs::remove_dir_all(&rootfs)
                .with_context(|| format!("removing the leftover {}", rootfs.display()))?;
        }
        std::fs::create_dir_all(&dir)?;
        step(&format!(
            "image: no registry base; building the stand-in: debootstrap --variant=minbase \
             {SUITE} from {mirror} (about two minutes)"
        ));
        let started = Instant::now();
        let log = dir.join("debootstrap.log");
        eprintln!(
            "  $ debootstrap --variant=minbase {SUITE} {} {mirror} > {}",
            rootfs.display(),
            log.display()
        );
        let file = std::fs::File::create(&log)?;
        let status = Command::new("debootstrap")
            .args(["--variant=minbase", SUITE])
            .arg(&rootfs)
            .arg(&mirror)
            .stdout(file.try_clone()?)
            .stderr(file)
            .status()
            .context("starting debootstrap")?;
        if !status.success() {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "debootstrap failed ({status}); the end of {}:\n{}",
                log.display(),
                tail.join("\n")
            );
        }
        slim(&rootfs, &mirror, &security)?;
        let partial = tarball.with_extension("tar.partial");
        cmd::run(
            Command::new("tar")
                .args(["--numeric-owner", "--xattrs", "-C"])
                .arg(&rootfs)
                .arg("-cf")
                .arg(&partial)
                .arg("."),
        )?;
        std::fs::rename(&partial, &tarball)?;
        std::fs::remove_dir_all(&rootfs)?;
        step(&format!(
            "image: stand-in root filesystem in {:.0} s, cached as {}",
            started.elapsed().as_secs_f64(),
            tarball.display()
        ));
    }
    cmd::run(
        Command::new("podman")
            .arg("import")
            .args(["--change", "CMD [\"bash\"]"])
            .args([
                "--message",
                "stand-in for debian:bookworm-slim: debootstrap --variant=minbase, slimmed \
                 (cargo xtask image)",
            ])
            .arg(&tarball)
            .arg(STAND_IN_BASE),
    )?;
    step(&format!("image: stand-in base {STAND_IN_BASE} imported"));
    Ok(())
}

/// The host's Debian mirrors (the archive and the security archive) from its apt sources, so the
/// stand-in is fetched the way this machine fetches its own packages; deb.debian.org otherwise.
fn host_mirrors() -> (String, String) {
    let mut text = std::fs::read_to_string("/etc/apt/sources.list").unwrap_or_default();
    if let Ok(dir) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut files: Vec<PathBuf> = dir.filter_map(|e| e.ok().map(|e| e.path())).collect();
        files.sort();
        for f in files {
            text.push_str("\n\n");
            text.push_str(&std::fs::read_to_string(f).unwrap_or_default());
        }
    }
    mirrors_in(&text)
}

/// `(archive, security)` from apt sources in either format (one-line `deb URI SUITE ...` or
/// deb822 paragraphs). The archive is a URI ending in `/debian` serving a plain suite; the
/// security archive one serving a `-security` suite.
fn mirrors_in(sources: &str) -> (String, String) {
    let mut entries: Vec<(String, Vec<String>)> = Vec::new();
    for line in sources.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("deb ") {
            let mut words = rest.split_whitespace().skip_while(|w| w.starts_with('['));
            if let (Some(uri), Some(suite)) = (words.next(), words.next()) {
                entries.push((uri.to_owned(), vec![suite.to_owned()]));
            }
        }
    }
    for para in sources.split("\n\n") {
        let field = |name: &str| {
            para.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        };
        if field("Types:").is_some_and(|t| t.iter().any(|t| t == "deb"))
            && let (Some(uris), Some(suites)) = (field("URIs:"), field("Suites:"))
        {
            for uri in uris {
                entries.push((uri, suites.clone()));
            }
        }
    }
    let find = |security: bool| {
        entries
            .iter()
            .find(|(uri, suites)| {
                suites
                    .iter()
                    .any(|s| s.ends_with("-security") == security && (security || !s.contains('-')))
                    && (security || uri.trim_end_matches('/').ends_with("/debian"))
            })
            .map(|(uri, _)| uri.trim_end_matches('/').to_owned())
    };
    (
        find(false).unwrap_or_else(|| "http://deb.debian.org/debian".into()),
        find(true).unwrap_or_else(|| "http://deb.debian.org/debian-security".into()),
    )
}

/// Trims a debootstrap root the way Debian's `-slim` images are trimmed (debuerreotype's
/// `minimizing-config` and `slimify`): no documentation, manual pages or translations, now or
/// in packages installed later, no apt caches, services never started by package scripts, and
/// the image's apt sources (archive, updates, security) in deb822 form.
fn slim(rootfs: &Path, mirror: &str, security: &str) -> anyhow::Result<()> {
    let write = |rel: &str, text: &str| -> anyhow::Result<()> {
        let path = rootfs.join(rel);
        std::fs::create_dir_all(path.parent().unwrap())?;
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    write("usr/sbin/policy-rc.d", "#!/bin/sh\nexit 101\n")?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        rootfs.join("usr/sbin/policy-rc.d"),
        std::fs::Permissions::from_mode(0o755),
    )?;
    write(
        "etc/dpkg/dpkg.cfg.d/docker-apt-speedup",
        "force-unsafe-io\n",
    )?;
    write(
        "etc/apt/apt.conf.d/docker-autoremove-suggests",
        "Apt::AutoRemove::SuggestsImportant \"false\";\n",
    )?;
    let clean = "\"rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb \
                 /var/cache/apt/*.bin || true\";";
    write(
        "etc/apt/apt.conf.d/docker-clean",
        &format!(
            "DPkg::Post-Invoke {{ {clean} }};\nAPT::Update::Post-Invoke {{ {clean} }};\n\
             Dir::Cache::pkgcache \"\";\nDir::Cache::srcpkgcache \"\";\n"
        ),
    )?;
    write(
        "etc/apt/apt.conf.d/docker-gzip-indexes",
        "Acquire::GzipIndexes \"true\";\n",
    )?;
    write(
        "etc/apt/apt.conf.d/docker-no-languages",
        "Acquire::Languages \"none\";\n",
    )?;
    let mut dpkg = String::from("# The \"slim\" variant: files containers do not need stay out.\n");
    for d in SLIM_EXCLUDE {
        dpkg.push_str(&format!("path-exclude /{d}/*\n"));
    }
    for i in SLIM_INCLUDE {
        dpkg.push_str(&format!("path-include /{i}\n"));
    }
    write("etc/dpkg/dpkg.cfg.d/docker", &dpkg)?;
    // The manual sections stay as empty directories: some packages' scripts expect them.
    let sections: Vec<PathBuf> = std::fs::read_dir(rootfs.join("usr/share/man"))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    for d in SLIM_EXCLUDE {
        prune(rootfs, &rootfs.join(d))?;
    }
    for s in sections.iter().filter(|s| {
        s.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("man"))
            .is_some_and(|n| n.len() == 1 && n.chars().all(|c| c.is_ascii_digit()))
    }) {
        std::fs::create_dir_all(s)?;
    }
    let _ = std::fs::remove_file(rootfs.join("etc/apt/sources.list"));
    write(
        "etc/apt/sources.list.d/debian.sources",
        &format!(
            "Types: deb\nURIs: {mirror}\nSuites: {SUITE} {SUITE}-updates\nComponents: main\n\
             Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n\
             Types: deb\nURIs: {security}\nSuites: {SUITE}-security\nComponents: main\n\
             Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        ),
    )?;
    for dir in ["var/cache/apt/archives", "var/lib/apt/lists", "var/log"] {
        empty_files(&rootfs.join(dir))?;
    }
    // debuerreotype-fixup: backups and caches that only describe the build.
    for rel in [
        "var/cache/apt/pkgcache.bin",
        "var/cache/apt/srcpkgcache.bin",
        "var/cache/debconf/config.dat-old",
        "var/cache/debconf/templates.dat-old",
        "var/lib/dpkg/diversions-old",
        "var/lib/dpkg/status-old",
        "var/cache/ldconfig/aux-cache",
    ] {
        let _ = std::fs::remove_file(rootfs.join(rel));
    }
    // Every container gets its own machine id.
    write("etc/machine-id", "")?;
    Ok(())
}

/// What the slim variant leaves out (below the root), and what it keeps of it.
const SLIM_EXCLUDE: &[&str] = &[
    "usr/share/doc",
    "usr/share/info",
    "usr/share/linda",
    "usr/share/lintian/overrides",
    "usr/share/locale",
    "usr/share/man",
];
const SLIM_INCLUDE: &[&str] = &[
    "usr/share/doc/*/copyright",
    "usr/share/locale/all_languages",
    "usr/share/locale/currency/*",
    "usr/share/locale/l10n/*",
    "usr/share/locale/languages",
    "usr/share/locale/locale.alias",
];

/// Whether `rel` (relative to the root) is kept by [`SLIM_INCLUDE`].
fn kept(rel: &str) -> bool {
    SLIM_INCLUDE.iter().any(|pat| match pat.split_once('*') {
        None => rel == *pat,
        Some((head, tail)) => {
            rel.len() > head.len() + tail.len()
                && rel.starts_with(head)
                && rel.ends_with(tail)
                && (tail.is_empty() || !rel[head.len()..rel.len() - tail.len()].contains('/'))
        }
    })
}

/// Removes every file below `dir` that [`kept`] does not keep, then the directories left empty
/// and links left dangling.
fn prune(rootfs: &Path, dir: &Path) -> anyhow::Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry?.path();
        let meta = std::fs::symlink_metadata(&path)?;
        let rel = path.strip_prefix(rootfs)?.to_string_lossy().into_owned();
        if meta.is_dir() {
            prune(rootfs, &path)?;
            if std::fs::read_dir(&path)?.next().is_none() {
                std::fs::remove_dir(&path)?;
            }
        } else if !meta.is_symlink() && !kept(&rel) {
            std::fs::remove_file(&path)?;
        }
    }
    // Links into what was removed (documentation directories link to one another).
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_symlink() && !resolve_in(rootfs, &path).exists() {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}

/// Where the link `path` points inside `rootfs` (absolute targets are relative to the root).
fn resolve_in(rootfs: &Path, path: &Path) -> PathBuf {
    match std::fs::read_link(path) {
        Ok(t) if t.is_absolute() => rootfs.join(t.strip_prefix("/").unwrap()),
        Ok(t) => path.parent().unwrap().join(t),
        Err(_) => path.to_owned(),
    }
}

/// Removes the regular files directly in `dir` (apt's caches and lists, logs), keeping its
/// sub-directories (`partial/`).
fn empty_files(dir: &Path) -> anyhow::Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry?.path();
        if path.is_file() && !path.is_symlink() {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}

/// The image's own binary runs on its own base: as root, from the image's filesystem
/// (`podman create` + `podman mount` + `chroot`; `podman run` needs an OCI runtime that may
/// not work here). A binary linked against a newer glibc than the base's fails right here.
fn smoke(tag: &str) -> anyhow::Result<()> {
    if !cmd::is_root() {
        step("image: smoke test skipped (needs root to mount the image)");
        return Ok(());
    }
    let name = format!("node-agent-image-smoke-{}", std::process::id());
    cmd::run(Command::new("podman").args(["create", "--name", &name, tag]))?;
    let result = (|| {
        let mnt = output(Command::new("podman").args(["mount", &name]))
            .context("podman mount")?
            .trim()
            .to_owned();
        let version = output(
            Command::new("chroot")
                .arg(&mnt)
                .args(["/usr/local/bin/node-agent", "--version"]),
        );
        let _ = Command::new("podman").args(["umount", &name]).output();
        match version {
            Some(v) => {
                step(&format!(
                    "image: smoke test: `node-agent --version`: {}",
                    v.trim()
                ));
                Ok(())
            }
            None => bail!(
                "the image's node-agent does not run on its base (built against a newer glibc \
                 than {SUITE}'s? build on Debian {SUITE})"
            ),
        }
    })();
    let _ = Command::new("podman")
        .args(["rm", "--force", &name])
        .output();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirrors_come_from_the_hosts_sources() {
        let deb822 = "Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm \
                      bookworm-updates\nComponents: main\n\nTypes: deb\nURIs: \
                      https://deb.nodesource.com/node_20.x\nSuites: nodistro\n\nTypes: deb\nURIs: \
                      http://mirror.example/debian-security\nSuites: bookworm-security\n";
        assert_eq!(
            mirrors_in(deb822),
            (
                "http://mirror.example/debian".into(),
                "http://mirror.example/debian-security".into()
            )
        );
        let list = "# comment\ndeb [arch=amd64] http://m.example/debian bookworm main\n\
                    deb http://s.example/debian-security bookworm-security main\n";
        assert_eq!(
            mirrors_in(list),
            (
                "http://m.example/debian".into(),
                "http://s.example/debian-security".into()
            )
        );
        assert_eq!(
            mirrors_in("deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main\n"),
            (
                "http://deb.debian.org/debian".into(),
                "http://deb.debian.org/debian-security".into()
            )
        );
    }

    #[test]
    fn slimming_keeps_copyrights_and_locale_aliases_only() {
        for rel in [
            "usr/share/doc/bash/copyright",
            "usr/share/locale/locale.alias",
            "usr/share/locale/currency/EUR",
        ] {
            assert!(kept(rel), "{rel}");
        }
        for rel in [
            "usr/share/doc/bash/README",
            "usr/share/doc/bash/x/copyright",
            "usr/share/man/man1/ls.1.gz",
            "usr/share/locale/de/LC_MESSAGES/apt.mo",
        ] {
            assert!(!kept(rel), "{rel}");
        }
        let root = std::env::temp_dir().join(format!("xtask-slim-{}", std::process::id()));
        let file = |rel: &str| {
            let p = root.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, "x").unwrap();
        };
        file("usr/share/doc/bash/copyright");
        file("usr/share/doc/bash/README.gz");
        file("usr/share/man/man1/bash.1.gz");
        std::os::unix::fs::symlink("bash", root.join("usr/share/doc/sh")).unwrap();
        std::os::unix::fs::symlink("gone", root.join("usr/share/doc/dangling")).unwrap();
        for d in SLIM_EXCLUDE {
            prune(&root, &root.join(d)).unwrap();
        }
        assert!(root.join("usr/share/doc/bash/copyright").is_file());
        assert!(!root.join("usr/share/doc/bash/README.gz").exists());
        assert!(root.join("usr/share/doc/sh").is_symlink());
        assert!(!root.join("usr/share/doc/dangling").is_symlink());
        assert!(!root.join("usr/share/man/man1").exists());
        std::fs::remove_dir_all(&root).unwrap();
    }
}

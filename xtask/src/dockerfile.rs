//! The Dockerfile's check: it packages the agent `cargo xtask image` builds, on the base that
//! command pulls, with only runtime packages that `cargo xtask setup` installs (the tools the
//! tests ran the docs' commands with). The expectations are derived from xtask's own source
//! text, so the deploy tests can change that text and see the check follow.

use std::collections::BTreeSet;

/// The string literal of `const NAME: &str = "...";` in `src`.
fn const_str(src: &str, name: &str) -> String {
    src.lines()
        .find_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix(&format!("const {name}: &str = \""))
        })
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no const {name}"))
        .to_owned()
}

/// The quoted strings of the slice literal that defines `const PACKAGES` (one line or several).
fn packages(setup: &str) -> Vec<String> {
    let start = setup
        .find("const PACKAGES")
        .expect("const PACKAGES in xtask/src/setup.rs");
    let rest = &setup[start..];
    let list = rest.split_once("= &[").expect("a slice literal").1;
    let list = list
        .split_once("];")
        .expect("the end of the slice literal")
        .0;
    list.split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The files the Dockerfile's expectations are derived from (by [`expected_from`]):
/// `xtask/src/setup.rs`, `xtask/src/image.rs` and the README, as text, so that a test can
/// change them and see the check follow.
pub struct Sources {
    pub setup: String,
    pub image: String,
    pub readme: String,
}

/// The files of the Dockerfile's check, relative to the workspace.
pub const SETUP_RS: &str = "xtask/src/setup.rs";
pub const IMAGE_RS: &str = "xtask/src/image.rs";
pub const README: &str = "README.md";

/// What the Dockerfile must say, derived from xtask's source and the workspace.
#[derive(Debug)]
pub struct Expected {
    /// The default of `ARG BASE`: the registry base `cargo xtask image` pulls.
    pub base: String,
    /// What `cargo xtask setup` installs on the build machine: the runtime packages are among
    /// them, so the image's tools are the ones the tests ran the docs' commands with.
    pub setup_packages: Vec<String>,
    /// The agent `cargo xtask image` builds, relative to the workspace: what the Dockerfile
    /// copies and the only file .dockerignore lets into the context.
    pub binary: String,
    /// The route protocol the agent writes, named in the image's rt_protos.d.
    pub route_protocol: String,
}

/// The expectations, or why xtask's source no longer fits the chain they are derived from.
/// `route_protocol` is the number the agent writes its routes with (the agent's constant, which
/// xtask does not link).
pub fn expected_from(src: &Sources, route_protocol: u8) -> Result<Expected, String> {
    let image = &src.image;
    if !image.contains("build_ebpf::run(&build_ebpf::Args { release: true })") {
        return Err("xtask image no longer builds the eBPF object with --release".into());
    }
    // `cargo build ...` in xtask image: the string literals of the `.args([...])` that starts
    // with "build".
    let args: Vec<String> = image
        .split_once("\"build\",")
        .map(|(_, rest)| format!("\"build\",{}", rest.split(']').next().unwrap_or("")))
        .ok_or("no `cargo build` of the agent in xtask image")?
        .split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    let build = format!("cargo {}", args.join(" "));
    if !(src.readme.contains(&build) && src.readme.contains("cargo xtask build-ebpf --release")) {
        return Err(format!(
            "the README builds the agent otherwise than xtask image (`{build}`)"
        ));
    }
    let profile = if args.iter().any(|a| a == "--release") {
        "release"
    } else {
        "debug"
    };
    let package = args
        .iter()
        .skip_while(|a| *a != "-p")
        .nth(1)
        .ok_or("xtask image's cargo build names no package")?;
    let built = format!("target/{profile}/{package}");
    let binary = const_str(image, "BINARY");
    if binary != built {
        return Err(format!(
            "xtask image's BINARY {binary} is not what its `{build}` builds ({built})"
        ));
    }
    Ok(Expected {
        base: const_str(image, "REGISTRY_BASE"),
        setup_packages: packages(&src.setup),
        binary,
        route_protocol: format!(
            "mkdir -p /etc/iproute2/rt_protos.d && echo \"{} node-agent\" > \
             /etc/iproute2/rt_protos.d/node-agent.conf",
            route_protocol
        ),
    })
}

/// One instruction of a Dockerfile: its keyword, its text (continuations joined), and the
/// comment lines right above it.
pub struct Instruction {
    pub keyword: String,
    pub text: String,
    pub comments: Vec<String>,
}

pub fn instructions(dockerfile: &str) -> Vec<Instruction> {
    let mut out = Vec::new();
    let mut comments = Vec::new();
    let mut lines = dockerfile.lines();
    while let Some(line) = lines.next() {
        let line = line.trim();
        if let Some(c) = line.strip_prefix('#') {
            comments.push(c.trim().to_owned());
            continue;
        }
        if line.is_empty() {
            comments.clear();
            continue;
        }
        let mut text = line.to_owned();
        while text.ends_with('\\') {
            text.pop();
            text.push(' ');
            text.push_str(lines.next().unwrap_or("").trim());
        }
        let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let (keyword, rest) = text.split_once(' ').unwrap_or((&text, ""));
        out.push(Instruction {
            keyword: keyword.to_uppercase(),
            text: rest.to_owned(),
            comments: std::mem::take(&mut comments),
        });
    }
    out
}

/// The packages of `apt-get update && apt-get install -y --no-install-recommends A B && rm ...`.
pub fn apt_packages(run: &str) -> Option<Vec<String>> {
    let parts: Vec<&str> = run.split("&&").map(str::trim).collect();
    if parts.len() != 3 || parts[0] != "apt-get update" || parts[2] != "rm -rf /var/lib/apt/lists/*"
    {
        return None;
    }
    let install = parts[1]
        .strip_prefix("DEBIAN_FRONTEND=noninteractive ")
        .unwrap_or(parts[1])
        .strip_prefix("apt-get install -y --no-install-recommends ")?;
    Some(install.split(' ').map(str::to_owned).collect())
}

/// What the runtime must have: bpftool and ip for the docs' inspection commands, the CA store
/// the Kubernetes client loads.
const RUNTIME_TOOLS: &[&str] = &["bpftool", "iproute2", "ca-certificates"];

/// A package that has no business in the runtime image: a compiler, a toolchain, headers.
fn is_build_tool(pkg: &str) -> bool {
    pkg.ends_with("-dev")
        || [
            "llvm",
            "clang",
            "gcc",
            "g++",
            "rustc",
            "cargo",
            "build-essential",
        ]
        .iter()
        .any(|t| pkg.starts_with(t))
}

/// What is wrong with `dockerfile` and `dockerignore` against `want`: a build stage, another
/// base, a RUN that mirrors nothing or something unknown, runtime packages that are not the
/// tested tools or are build tools, a COPY of another file than the agent xtask builds, a build
/// context that lets more in.
pub fn problems(dockerfile: &str, dockerignore: &str, want: &Expected) -> Vec<String> {
    let mut problems = Vec::new();
    let all = instructions(dockerfile);
    let of = |kw: &str| -> Vec<&Instruction> { all.iter().filter(|i| i.keyword == kw).collect() };
    let froms: Vec<&str> = of("FROM").iter().map(|i| i.text.as_str()).collect();
    if froms != ["${BASE}"] {
        problems.push(format!(
            "stages {froms:?}: one stage, FROM ${{BASE}} (the Dockerfile packages the agent \
             xtask built; it does not build)"
        ));
    }
    let args: Vec<&str> = of("ARG").iter().map(|i| i.text.as_str()).collect();
    let base = format!("BASE={}", want.base);
    if args != [base.as_str()] {
        problems.push(format!(
            "ARG {args:?}: expected [{base}], the base xtask image pulls"
        ));
    }
    if all.first().map(|i| i.keyword.as_str()) != Some("ARG") {
        problems.push("ARG BASE must come before FROM".into());
    }
    let mut seen = BTreeSet::new();
    for i in of("RUN") {
        let ids: Vec<&str> = i
            .comments
            .iter()
            .filter_map(|c| c.strip_prefix("mirrors: "))
            .collect();
        let [id] = ids[..] else {
            problems.push(format!(
                "RUN {} has {} `# mirrors:` lines, not one",
                i.text,
                ids.len()
            ));
            continue;
        };
        if !seen.insert(id.to_owned()) {
            problems.push(format!("two RUNs mirror {id}"));
        }
        match id {
            "runtime:packages" => match apt_packages(&i.text) {
                None => problems.push(format!("{id}: not a plain apt-get install: {}", i.text)),
                Some(got) => {
                    for p in &got {
                        if !want.setup_packages.contains(p) {
                            problems.push(format!(
                                "{id}: {p} is not among the packages xtask setup installs \
                                 (and the tests run with): {:?}",
                                want.setup_packages
                            ));
                        }
                        if is_build_tool(p) {
                            problems.push(format!("{id}: {p} is a build tool"));
                        }
                    }
                    for t in RUNTIME_TOOLS {
                        if !got.iter().any(|p| p == t) {
                            problems.push(format!("{id}: the runtime lacks {t}"));
                        }
                    }
                }
            },
            "runtime:route-protocol" => {
                if i.text != want.route_protocol {
                    problems.push(format!(
                        "{id}: the Dockerfile runs `{}`, expected `{}`",
                        i.text, want.route_protocol
                    ));
                }
            }
            other => problems.push(format!("`# mirrors: {other}` names no known step")),
        }
    }
    for id in ["runtime:packages", "runtime:route-protocol"] {
        if !seen.contains(id) {
            problems.push(format!("no RUN mirrors {id}"));
        }
    }
    let copies: Vec<&str> = of("COPY").iter().map(|i| i.text.as_str()).collect();
    let copy = format!("{} /usr/local/bin/node-agent", want.binary);
    if copies != [copy.as_str()] {
        problems.push(format!(
            "COPY {copies:?}: expected [{copy}], the agent xtask image builds"
        ));
    }
    let ignore: Vec<&str> = dockerignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let only = format!("!{}", want.binary);
    if ignore != ["*", only.as_str()] {
        problems.push(format!(
            ".dockerignore {ignore:?}: expected [\"*\", \"{only}\"], the agent and nothing else"
        ));
    }
    problems
}

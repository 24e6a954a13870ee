//! The Dockerfile and .dockerignore, checked against what `cargo xtask image` builds and
//! `cargo xtask setup` installs (`xtask::dockerfile` holds the check; the image itself is built
//! and run by `image.rs`).

use node_agent::backends::routes::DEFAULT_ROUTE_PROTOCOL;
use xtask::dockerfile::{
    Expected, IMAGE_RS, README, SETUP_RS, Sources, apt_packages, expected_from, instructions,
    problems,
};

use super::read;

fn sources() -> Sources {
    Sources {
        setup: read(SETUP_RS),
        image: read(IMAGE_RS),
        readme: read(README),
    }
}

fn expected() -> Expected {
    expected_from(&sources(), DEFAULT_ROUTE_PROTOCOL).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn dockerfile_packages_what_xtask_builds_with_the_tested_tools() {
    let problems = problems(&read("Dockerfile"), &read(".dockerignore"), &expected());
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn dockerfile_ships_the_agent_and_the_inspection_tools() {
    let all = instructions(&read("Dockerfile"));
    let last = |kw: &str| {
        all.iter()
            .rfind(|i| i.keyword == kw)
            .map(|i| i.text.clone())
    };
    assert_eq!(
        last("ENTRYPOINT").as_deref(),
        Some(r#"["/usr/local/bin/node-agent"]"#)
    );
    let tools: Vec<String> = all
        .iter()
        .filter_map(|i| apt_packages(&i.text))
        .flatten()
        .collect();
    assert!(
        tools.contains(&"bpftool".into()) && tools.contains(&"iproute2".into()),
        "{tools:?}"
    );
}

#[test]
fn the_dockerfile_check_fails_when_the_two_drift() {
    let want = expected();
    let good = read("Dockerfile");
    let ignore = read(".dockerignore");
    assert!(problems(&good, &ignore, &want).is_empty());
    let drifted = [
        // Another base, or one hard-wired past the stand-in.
        good.replace("debian:bookworm-slim\n", "debian:trixie-slim\n"),
        good.replace(
            "FROM ${BASE}",
            "FROM docker.io/library/debian:bookworm-slim",
        ),
        // A build stage back in.
        good.replace(
            "ARG BASE=",
            "FROM docker.io/library/rust:1.95-bookworm AS build\nRUN cargo build\nARG BASE=",
        ),
        // Runtime packages: a compiler, one the tests never ran, one missing.
        good.replace("bpftool iproute2", "bpftool llvm-22-dev iproute2"),
        good.replace("bpftool iproute2", "bpftool curl iproute2"),
        good.replace("bpftool iproute2 ", "bpftool "),
        // Another route protocol number.
        good.replace("\"201 node-agent\"", "\"200 node-agent\""),
        // Another binary than the one xtask builds (and the tests ran).
        good.replace(
            "COPY target/release/node-agent",
            "COPY target/debug/node-agent",
        ),
        // A step that mirrors nothing, one that names an unknown step, one more RUN.
        good.replace("# mirrors: runtime:route-protocol\n", ""),
        good.replace(
            "# mirrors: runtime:route-protocol",
            "# mirrors: runtime:route-protocols",
        ),
        good.replace("ENTRYPOINT", "RUN rm -rf /usr/share\nENTRYPOINT"),
    ];
    for (i, d) in drifted.iter().enumerate() {
        assert_ne!(d, &good, "drift case {i} did not change the Dockerfile");
        assert!(
            !problems(d, &ignore, &want).is_empty(),
            "drift case {i} was not caught"
        );
    }
    // A build context that lets the whole workspace in, or another binary.
    for bad in [
        ignore.replace("*\n", ""),
        ignore.replace("release", "debug"),
    ] {
        assert_ne!(bad, ignore);
        assert!(!problems(&good, &bad, &want).is_empty(), "{bad}");
    }
    // And changes on xtask's side: another registry base, a debug build, setup without bpftool.
    let src = sources();
    let moved = [
        Sources {
            image: src
                .image
                .replace("debian:bookworm-slim\"", "debian:trixie-slim\""),
            ..sources()
        },
        Sources {
            image: src.image.replacen("\"--release\",\n", "", 1),
            ..sources()
        },
        Sources {
            setup: src.setup.replace("\"bpftool\",\n", ""),
            ..sources()
        },
    ];
    for (i, s) in moved.into_iter().enumerate() {
        assert!(
            s.image != src.image || s.setup != src.setup,
            "xtask drift case {i} changed nothing"
        );
        // Either the derivation refuses it (a debug build is not what BINARY names) or the
        // Dockerfile no longer fits.
        let caught = match expected_from(&s, DEFAULT_ROUTE_PROTOCOL) {
            Err(_) => true,
            Ok(want) => !problems(&good, &ignore, &want).is_empty(),
        };
        assert!(caught, "xtask drift case {i} was not caught");
    }
}

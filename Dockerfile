# syntax=docker/dockerfile:1
# The node-agent image: `docker build -t node-agent .` at the repository root.
#
# The build stage repeats, step for step, what CI does on a fresh machine (.ci/run ->
# `cargo xtask test` -> `cargo xtask setup`, `cargo xtask build-ebpf --release`, `cargo build`).
# Each RUN names the step it mirrors with `# mirrors: <id>`; tests/tests/deploy.rs derives the
# steps from xtask's source and fails when the two drift apart (another package list, another
# bpf-linker version or feature, another build command). The toolchain steps come before the
# source is copied so that they stay cached; `cargo xtask build-ebpf` then runs `xtask setup`
# again inside the build, which verifies them (packages, rust-src, bpf-linker version, and that
# the nightly and bpf-linker use the same LLVM) and stops the build if they do not fit.

# Debian bookworm with rustup and the workspace's stable toolchain (rust-version in Cargo.toml).
FROM docker.io/library/rust:1.95-bookworm AS build

# mirrors: setup:packages
# LLVM 22 comes from bookworm-security, which the Debian base image already lists.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends llvm-22-dev libpolly-22-dev bpftool iproute2 ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# mirrors: setup:nightly
RUN rustup toolchain install nightly --profile minimal --component rust-src

# mirrors: setup:bpf-linker
RUN LLVM_PREFIX=/usr/lib/llvm-22 cargo install bpf-linker --version 0.13.0 --no-default-features --features llvm-22

WORKDIR /src
COPY . .

# mirrors: test:build-ebpf
RUN cargo xtask build-ebpf --release

# mirrors: test:build-agent
RUN cargo build --release -p node-agent

# The runtime: the agent, plus bpftool and ip so that `kubectl exec` can inspect the pinned maps,
# routes and xfrm state (docs/bpftool.md), and the CA store the Kubernetes client loads.
FROM docker.io/library/debian:bookworm-slim

# mirrors: runtime:packages
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bpftool iproute2 ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# mirrors: runtime:route-protocol
# Names the agent's route protocol, so `ip route show proto node-agent` works in the container.
RUN mkdir -p /etc/iproute2/rt_protos.d && echo "201 node-agent" > /etc/iproute2/rt_protos.d/node-agent.conf

COPY --from=build /src/target/release/node-agent /usr/local/bin/node-agent
ENTRYPOINT ["/usr/local/bin/node-agent"]

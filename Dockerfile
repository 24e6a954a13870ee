# The node-agent image. Build it with `cargo xtask image` (docs/install.md, "Build the image").
#
# This file only packages: it copies the agent that xtask built onto debian:bookworm-slim with
# the inspection tools. The agent is built once, outside any container, by the very commands CI
# builds and tests it with (`cargo xtask build-ebpf --release`, then `cargo build --release -p
# node-agent`). A multi-stage build compiling it here would have to repeat the whole toolchain
# set-up of `cargo xtask setup` (LLVM 22 from bookworm-security, the nightly with rust-src,
# bpf-linker built from source): minutes before the first line of the agent compiles, and a
# second copy of that set-up to keep in step with the first. It would also ship another build
# than the one the tests ran. Packaging the built binary makes the image build take seconds on
# top of the cached base, and the image carries exactly the binary the tests ran;
# tests/tests/it/image.rs checks that byte for byte.
#
# The agent links glibc dynamically, so it is built on the base's release, Debian bookworm (as
# CI does; `cargo xtask image` runs it once on the base to prove it). .dockerignore lets only the
# binary into the build context. tests/tests/it/deploy.rs checks this file against xtask.

# debian:bookworm-slim: the release the agent is built and tested on. Where no registry is
# reachable, `cargo xtask image` passes a stand-in made with debootstrap (--build-arg BASE=...).
ARG BASE=docker.io/library/debian:bookworm-slim
FROM ${BASE}

# mirrors: runtime:packages
# bpftool and ip, so that `kubectl exec` can inspect the pinned maps, routes and xfrm state
# (docs/bpftool.md), and the CA store the Kubernetes client loads: the Debian packages the tests
# run the docs' commands with (`cargo xtask setup` installs them on the build machine).
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bpftool iproute2 ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# mirrors: runtime:route-protocol
# Names the agent's route protocol, so `ip route show proto node-agent` works in the container.
RUN mkdir -p /etc/iproute2/rt_protos.d && echo "201 node-agent" > /etc/iproute2/rt_protos.d/node-agent.conf

COPY target/release/node-agent /usr/local/bin/node-agent
ENTRYPOINT ["/usr/local/bin/node-agent"]

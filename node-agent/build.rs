//! Embeds the eBPF object when `cargo xtask build-ebpf` has produced it.
//!
//! The object is built by the nightly toolchain outside this workspace's stable build, so its
//! absence must not break `cargo build`: without it the agent still compiles and fails at start-up
//! with the command that builds it.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let object = manifest.join("../target/ebpf/node-agent.bpf.o");
    println!("cargo::rustc-check-cfg=cfg(ebpf_object)");
    println!("cargo::rerun-if-changed={}", object.display());
    if object.is_file() {
        println!("cargo::rustc-cfg=ebpf_object");
        println!(
            "cargo::rustc-env=NODE_AGENT_EBPF_OBJECT={}",
            object.display()
        );
    }
}

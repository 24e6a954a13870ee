//! `cargo xtask`: the tasks around the cargo build that cargo cannot express itself.

mod apt;
mod bench;
mod build_ebpf;
mod cmd;
mod demo;
mod docs;
mod image;
mod setup;
mod test;
mod vm;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Install or verify every prerequisite (Debian packages, nightly rust-src, bpf-linker on
    /// LLVM 22, bpftool). Idempotent; seconds on a ready machine.
    Setup,
    /// Build the eBPF object (runs `setup` first) into target/ebpf/node-agent.bpf.o.
    BuildEbpf(build_ebpf::Args),
    /// Set up, then run examples/nodes.yaml as a cluster in a sandbox (a namespace, an agent and a
    /// pod made by the reference CNI plugins per node), ping and TCP between pods across nodes,
    /// restart one agent after nodes went away, show the deletes it synthesizes, check the
    /// traffic again (as root).
    Demo,
    /// Run the demo and write every recorded output in README.md and docs/ (a ```text block
    /// after `<!-- recorded: PARTS -->`) from what it printed; `--check` changes nothing and
    /// fails on a stale one (as root).
    Docs(docs::Args),
    /// Set up, build the eBPF object, and run every test tier: unit, kernel, end to end, and the
    /// VM tier on Debian 6.1 and 6.12 (as root).
    Test(test::Args),
    /// Build the container image: the release agent (built as `build-ebpf --release` and `cargo
    /// build --release -p node-agent` build it) on debian:bookworm-slim, with bpftool and ip. Uses
    /// a debootstrap stand-in for the base when no registry is reachable; prints the size.
    Image(image::Args),
    /// Run every benchmark in release builds (as root); each prints `bench: <name> <value> <unit>`.
    Bench,
    /// Boot Debian kernels (6.1, 6.12) under QEMU and run the kernel-tier tests inside, where
    /// ESP exists. Downloads and caches each kernel under target/vm/ on first use.
    VmTest(vm::Args),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Setup => setup::run(),
        Command::BuildEbpf(args) => {
            setup::run()?;
            build_ebpf::run(&args)
        }
        Command::Test(args) => test::run(&args),
        Command::Demo => demo::run(&[]).map(drop),
        Command::Docs(args) => docs::run(&args),
        Command::Image(args) => image::run(&args),
        Command::Bench => bench::run(),
        Command::VmTest(args) => match vm::run(&args)? {
            0 => Ok(()),
            rc => std::process::exit(rc),
        },
    }
}

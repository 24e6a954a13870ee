//! Every integration test of the workspace, in one binary: one link instead of one per file,
//! and one process for the VM tier to run (it selects the kernel-tier modules by name).
//!
//! | module | tier | what |
//! | --- | --- | --- |
//! | `datapath` | kernel | the eBPF programs with real packets, the loader, pins, link takeover |
//! | `backends` | kernel | map, routes, xfrm policies against the real kernel |
//! | `xfrm` | kernel (VM for states) | xfrm states and policies |
//! | `ipsec` | VM | pod traffic between node namespaces, encrypted: the wire sees only ESP; rotation; restart with churn |
//! | `pods` | kernel | pods made by the CNI plugins on four nodes keep talking across a map growth, a restart, a kill and a node removed while down |
//! | `caps` | kernel (VM for IPsec) | the agent under exactly the manifest's capabilities, and one line naming each missing one |
//! | `agent` | end to end | the real binary against NodeList files: restarts, the brake, crashes |
//! | `rollback` | end to end | the documented rollback to the previous release, against its recorded route shape (or its binary) |
//! | `rules` | end to end | one test per rule of `docs/design.md`, through the CLI only |
//! | `invariants` | end to end | random histories, every invariant checked after every step |
//! | `endpoints` | end to end | `/metrics`, `/healthz`, `/readyz` |
//! | `input_gate` | none | every kind of file at the path of every file the agent reads, through the agent's own readers |
//! | `faults` | end to end | a full or vanished state directory, a NodeList that does not parse, drift |
//! | `kube` | end to end | the agent against the API-server stand-in |
//! | `apiserver` | none | the stand-in's own behaviour, against kube's client |
//! | `source` | none | the agent's Kubernetes source in-process against the stand-in: failures, probes, readiness |
//! | `deploy`, `docs` | none | manifests, Dockerfile, alert rules (promtool), every command the docs show |
//! | `image` | end to end | the container image, built with podman, its binaries run from its filesystem |
//! | `bench` | kernel | benchmarks, run by `cargo xtask bench`: backends against their floors, the agent at 5,000 and 65,000 nodes, the daemon while it waits |

mod agent;
mod apiserver;
mod backends;
mod bench;
mod caps;
mod datapath;
mod deploy;
mod docs;
mod endpoints;
mod faults;
mod image;
mod input_gate;
mod invariants;
mod ipsec;
mod kube;
mod nexthops;
mod pods;
mod rollback;
mod rules;
mod source;
mod xfrm;

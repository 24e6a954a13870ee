//! Kernel tier: the xfrm backend (policies and ESP states) and the IPsec key file.
//!
//! Each kernel test runs in its own network and mount namespace (`node_agent_tests::sandbox`),
//! with a current-thread tokio runtime built inside it, so the backend's netlink socket is
//! opened in the sandbox's namespace.
//!
//! xfrm *states* need ESP, which the development machines' kernel lacks: those tests detect it
//! with `XfrmBackend::probe_esp()` and print `SKIPPED <test>: <why>` there. In the QEMU guest
//! (`NODE_AGENT_VM=1`) ESP exists, and a skip is a failure. The no-ESP error path itself is
//! tested for real on the machines' kernel, and the success path in the guest.
//!
//! The benchmark (`bench_policies_against_ip_batch`) runs only with `NODE_AGENT_BENCH=1`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::process::Command;
use std::time::Instant;

use ipnet::IpNet;
use node_agent::backends::Backend;
use node_agent::backends::xfrm::{IpsecKey, KeyBook, KeyFile};
use node_agent::backends::xfrm::{ProbeError, XfrmBackend};
use node_agent_tests::fixture::{
    XFRM_SPI as SPI, all_ok, deletes, upserts, xfrm_policy, xfrm_state,
};
use node_agent_tests::ip_xfrm;
use node_agent_tests::require_sandbox;
use node_agent_tests::runtime;
use node_agent_tests::{can_sandbox, ip, ip_batch, report, sandbox, skip, skip_without_esp};
use state::objects::{KernelObject, Op, Spi, SpiLayout, XfrmDir, XfrmPolicy, XfrmState, mark};
use state::testing::{id as node_id, ip as addr, net};

/// A key whose hex the tests look for in every message they see.
const KEY_HEX: &str = "a1b2c3d4e5f60718293a4b5c6d7e8f9001122334";

fn key() -> IpsecKey {
    IpsecKey::parse(&format!("{SPI} rfc4106(gcm(aes)) 0x{KEY_HEX} 128\n"), None).unwrap()
}

fn policy(id: u16, dst: &str, tmpl_dst: &str) -> XfrmPolicy {
    xfrm_policy(id, dst, tmpl_dst)
}

fn state(id: u16, src: &str, dst: &str, dir: XfrmDir) -> XfrmState {
    xfrm_state(id, src, dst, dir, key().tag())
}

/// Two nodes, each with a v4 and a v6 pod CIDR.
fn our_policies() -> Vec<KernelObject> {
    vec![
        policy(7, "10.7.0.0/24", "10.0.0.7"),
        policy(7, "fd07::/64", "fd00::7"),
        policy(8, "10.8.0.0/24", "10.0.0.8"),
        policy(8, "fd08::/64", "fd00::8"),
    ]
    .into_iter()
    .map(KernelObject::XfrmPolicy)
    .collect()
}

/// OUT and IN states toward two nodes, both families.
fn our_states() -> Vec<KernelObject> {
    let mut v = Vec::new();
    for (id, v4, v6) in [(7, "10.0.0.7", "fd00::7"), (8, "10.0.0.8", "fd00::8")] {
        v.push(state(id, "10.0.0.1", v4, XfrmDir::Out));
        v.push(state(id, v4, "10.0.0.1", XfrmDir::In));
        v.push(state(id, "fd00::1", v6, XfrmDir::Out));
        v.push(state(id, v6, "fd00::1", XfrmDir::In));
    }
    v.into_iter().map(KernelObject::XfrmState).collect()
}

fn set(objs: impl IntoIterator<Item = KernelObject>) -> BTreeSet<KernelObject> {
    objs.into_iter().collect()
}

fn ip_text(args: &[&str]) -> String {
    String::from_utf8(ip(args).stdout).unwrap()
}

/// Number of entries in `ip xfrm policy` / `ip xfrm state` output (each starts with `src`).
fn count(listing: &str) -> usize {
    listing.lines().filter(|l| l.starts_with("src ")).count()
}

/// Whether the kernel has ESP, asked independently of the backend: with the `ip` command.
/// `Ok(true)`: an AEAD ESP state can be created; `Ok(false)`: ESP is missing; `Err`: ESP exists
/// but the AEAD algorithm does not.
fn ip_says_esp() -> Result<bool, String> {
    let add = |alg: &[&str]| {
        let mut c = Command::new("ip");
        c.args([
            "xfrm",
            "state",
            "add",
            "src",
            "192.0.2.11",
            "dst",
            "192.0.2.12",
            "proto",
            "esp",
            "spi",
            "0x777",
            "reqid",
            "9",
            "mode",
            "tunnel",
        ])
        .args(alg);
        let out = c.output().unwrap();
        let _ = Command::new("ip").args(["xfrm", "state", "flush"]).status();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let hex = format!("0x{}", "00".repeat(20));
    if add(&["aead", "rfc4106(gcm(aes))", &hex, "128"]).0 {
        return Ok(true);
    }
    let (ok, err) = add(&["enc", "ecb(cipher_null)", ""]);
    if ok {
        Err("ESP works but rfc4106(gcm(aes)) does not".into())
    } else {
        assert!(
            err.contains("Requested type not found"),
            "unexpected failure from ip: {err}"
        );
        Ok(false)
    }
}

// ---------------------------------------------------------------------------------------------
// Policies: these run on every kernel.

#[test]
fn policies_round_trip_v4_and_v6() {
    require_sandbox!();
    sandbox(|_| {
        runtime().block_on(async {
            let mut b = XfrmBackend::new(KeyBook::default()).unwrap();
            let ours = our_policies();
            assert!(b.dump().await.unwrap().is_empty());
            all_ok(b.apply(&upserts(&ours)).await);
            assert_eq!(set(b.dump().await.unwrap()), set(ours.clone()));

            // The kernel sees exactly what we meant.
            let listing = ip_text(&["xfrm", "policy"]);
            assert_eq!(count(&listing), 4, "{listing}");
            let m7 = mark::encode(node_id(7), SPI, XfrmDir::Out);
            assert!(
                listing.contains(&format!("mark {m7:#x}/0xffffff00")),
                "{listing}"
            );
            assert!(
                listing.contains("src 0.0.0.0/0 dst 10.7.0.0/24"),
                "{listing}"
            );
            assert!(listing.contains("src ::/0 dst fd08::/64"), "{listing}");
            assert!(
                listing.contains("tmpl src fd00::1 dst fd00::8"),
                "{listing}"
            );
            assert!(
                listing.contains("proto esp spi 0x00000003 reqid 1 mode tunnel"),
                "{listing}"
            );

            // Delete one node's policies, then the rest; deleting again is not an error.
            all_ok(b.apply(&deletes(&ours[..2])).await);
            assert_eq!(set(b.dump().await.unwrap()), set(ours[2..].to_vec()));
            all_ok(b.apply(&deletes(&ours)).await);
            assert!(b.dump().await.unwrap().is_empty());
            assert_eq!(count(&ip_text(&["xfrm", "policy"])), 0);
        })
    });
}

/// A large apply sends its xfrm writes a few dozen to a system call at most (the kernel does a
/// batch's work inside the call, while the agent's runtime waits), and writes every one.
#[test]
fn a_large_apply_sends_xfrm_writes_a_few_dozen_to_a_call() {
    require_sandbox!();
    sandbox(|_| {
        runtime().block_on(async {
            let mut b = XfrmBackend::new(KeyBook::default()).unwrap();
            let n = 200u16;
            let ours: Vec<KernelObject> = (1..=n)
                .map(|i| KernelObject::XfrmPolicy(policy(i, &format!("fd{i:02x}::/64"), "fd00::7")))
                .collect();
            all_ok(b.apply(&upserts(&ours)).await);
            assert_eq!(set(b.dump().await.unwrap()), set(ours.clone()));
            let (calls, largest) = b.batches_sent();
            assert!(largest <= 32, "{largest} requests in one call");
            assert!(
                calls >= u64::from(n).div_ceil(32),
                "{n} policies in {calls} calls"
            );
            report(&format!(
                "xfrm batches: {n} policies in {calls} system calls, at most {largest} in one"
            ));
        })
    });
}

#[test]
fn policy_upserts_are_idempotent_and_replace_in_place() {
    require_sandbox!();
    sandbox(|_| {
        runtime().block_on(async {
            let mut b = XfrmBackend::new(KeyBook::default()).unwrap();
            let ours = our_policies();
            all_ok(b.apply(&upserts(&ours)).await);
            let dump1 = set(b.dump().await.unwrap());
            let listing1 = ip_text(&["xfrm", "policy"]);

            all_ok(b.apply(&upserts(&ours)).await);
            assert_eq!(set(b.dump().await.unwrap()), dump1);
            assert_eq!(
                ip_text(&["xfrm", "policy"]),
                listing1,
                "second apply changed the SPD"
            );

            // Node 7 moved to another address: same identity, new template, replaced in place.
            let moved = KernelObject::XfrmPolicy(policy(7, "10.7.0.0/24", "10.0.0.77"));
            all_ok(b.apply(&[Op::Replace(moved.clone())]).await);
            let mut want = dump1.clone();
            want.remove(&ours[0]);
            want.insert(moved);
            assert_eq!(set(b.dump().await.unwrap()), want);
            assert_eq!(count(&ip_text(&["xfrm", "policy"])), 4);
        })
    });
}

#[test]
fn foreign_policies_are_never_listed_nor_touched() {
    require_sandbox!();
    sandbox(|_| {
        runtime().block_on(async {
            let tmpl = [
                "tmpl", "src", "10.0.0.1", "dst", "10.0.0.7", "proto", "esp", "reqid", "1", "mode",
                "tunnel",
            ];
            let base = [
                "xfrm",
                "policy",
                "add",
                "src",
                "0.0.0.0/0",
                "dst",
                "10.7.0.0/24",
                "dir",
            ];
            // Same selector as ours, no mark.
            ip(&[&base[..], &["out"], &tmpl[..]].concat());
            // Same selector, a foreign mark.
            ip(&[
                &base[..],
                &["out", "mark", "0x1234", "mask", "0xffff"],
                &tmpl[..],
            ]
            .concat());
            // Our mark's value under another mask is not ours either.
            let m7 = format!("{:#x}", mark::encode(node_id(7), SPI, XfrmDir::Out));
            ip(&[
                &base[..],
                &["out", "mark", &m7, "mask", "0xffffffff"],
                &tmpl[..],
            ]
            .concat());
            // A forward policy, a v6 one without mark.
            ip(&[&base[..], &["fwd"], &tmpl[..]].concat());
            ip(&[
                "xfrm",
                "policy",
                "add",
                "src",
                "::/0",
                "dst",
                "fd07::/64",
                "dir",
                "out",
                "tmpl",
                "src",
                "fd00::1",
                "dst",
                "fd00::7",
                "proto",
                "esp",
                "reqid",
                "1",
                "mode",
                "tunnel",
            ]);
            let foreign = ip_text(&["xfrm", "policy"]);
            assert_eq!(count(&foreign), 5);

            let mut b = XfrmBackend::new(KeyBook::default()).unwrap();
            assert!(
                b.dump().await.unwrap().is_empty(),
                "foreign policies listed"
            );
            let ours = our_policies();
            all_ok(b.apply(&upserts(&ours)).await);
            assert_eq!(set(b.dump().await.unwrap()), set(ours.clone()));
            assert_eq!(count(&ip_text(&["xfrm", "policy"])), 9);
            all_ok(b.apply(&deletes(&ours)).await);
            assert!(b.dump().await.unwrap().is_empty());
            assert_eq!(
                ip_text(&["xfrm", "policy"]),
                foreign,
                "a foreign policy was touched"
            );
            // This kernel matches marks exactly (the deletes above just showed it), and the
            // start-up probe that asks says so and leaves nothing behind.
            b.probe_policy_marks()
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                ip_text(&["xfrm", "policy"]),
                foreign,
                "the probe's policy stayed"
            );
        })
    });
}

// ---------------------------------------------------------------------------------------------
// States: need ESP.

/// Runs `body` with a keyed backend when this kernel has ESP; skips (or fails, in the VM)
/// otherwise.
fn with_esp<F, Fut>(name: &str, body: F)
where
    F: FnOnce(XfrmBackend) -> Fut + Send,
    Fut: std::future::Future<Output = ()>,
{
    if let Err(why) = can_sandbox() {
        skip(name, &why);
        return;
    }
    sandbox(|_| {
        runtime().block_on(async {
            let b = XfrmBackend::new(KeyBook::new(vec![key()])).unwrap();
            match b.probe_esp().await {
                Ok(()) => body(b).await,
                Err(e) => skip_without_esp(name, &e.to_string()),
            }
        })
    });
}

#[test]
fn states_round_trip_v4_and_v6() {
    with_esp(node_agent_tests::test_name!(), |mut b| async move {
        let ours = our_states();
        assert!(b.dump().await.unwrap().is_empty());
        all_ok(b.apply(&upserts(&ours)).await);
        assert_eq!(set(b.dump().await.unwrap()), set(ours.clone()));
        let listing = ip_text(&["xfrm", "state"]);
        assert_eq!(count(&listing), 8, "{listing}");
        let m = mark::encode(node_id(8), SPI, XfrmDir::In);
        assert!(
            listing.contains(&format!("mark {m:#x}/0xffffff00")),
            "{listing}"
        );
        assert!(listing.contains("rfc4106(gcm(aes))"), "{listing}");
        assert!(listing.contains("src fd00::8 dst fd00::1"), "{listing}");

        all_ok(b.apply(&deletes(&ours[..4])).await);
        assert_eq!(set(b.dump().await.unwrap()), set(ours[4..].to_vec()));
        all_ok(b.apply(&deletes(&ours)).await);
        assert!(b.dump().await.unwrap().is_empty());
        assert_eq!(count(&ip_text(&["xfrm", "state"])), 0);
    });
}

/// The benchmarks' `ip -batch` baselines (`node_agent_tests::ip_xfrm`) write what the agent
/// writes: the states and policies of both families, in both SPI layouts, added by their lines,
/// are the same objects as the agent's backend reads them back (endpoints, SPI, mark, key with
/// its ESN replay window); their change lines readdress every peer to what the agent would hold;
/// their delete lines leave none.
#[test]
fn ip_batch_baselines_write_what_the_agent_writes() {
    with_esp(node_agent_tests::test_name!(), |mut b| async move {
        let mut objs = Vec::new();
        for layout in [SpiLayout::Key, SpiLayout::PerSender] {
            for o in our_states().into_iter().chain(our_policies()) {
                objs.push(match o {
                    KernelObject::XfrmState(s) => KernelObject::XfrmState(XfrmState {
                        spi: Spi::new(SPI, layout, s.src),
                        ..s
                    }),
                    KernelObject::XfrmPolicy(p) => KernelObject::XfrmPolicy(XfrmPolicy {
                        spi: Spi::new(SPI, layout, p.tmpl_src),
                        // The other layout's policies for other pod CIDRs: one policy a CIDR.
                        dst: match layout {
                            SpiLayout::Key => p.dst,
                            SpiLayout::PerSender => {
                                IpNet::new(p.dst.addr(), p.dst.prefix_len() + 1).unwrap()
                            }
                        },
                        ..p
                    }),
                    other => other,
                });
            }
        }
        ip_batch(&[], &ip_xfrm::adds(&objs, KEY_HEX));
        assert_eq!(set(b.dump().await.unwrap()), set(objs.clone()));
        // Every peer readdressed: OUT states and per-sender IN states change identity, IN
        // states of the key layout keep theirs (a source changed), every policy keeps its own
        // (a template changed).
        let moved: Vec<KernelObject> = objs.iter().map(readdressed).collect();
        let changes = ip_xfrm::changes(&objs, &moved, KEY_HEX);
        ip_batch(&[], &changes);
        assert_eq!(set(b.dump().await.unwrap()), set(moved.clone()));
        ip_batch(&[], &ip_xfrm::deletes(&moved));
        assert!(b.dump().await.unwrap().is_empty());
        report(&format!(
            "xfrm: {} states and policies of both families and both SPI layouts written by ip -batch lines dump as the agent's own, and {} change lines readdress every peer",
            objs.len(),
            changes.lines().count()
        ));
    });
}

/// `o` with its peer (every address but this node's `10.0.0.1` and `fd00::1`) moved by 16, and
/// the SPI its layout gives the new sender.
fn readdressed(o: &KernelObject) -> KernelObject {
    let away = |a: IpAddr| match a {
        _ if a == addr("10.0.0.1") || a == addr("fd00::1") => a,
        IpAddr::V4(v4) => std::net::Ipv4Addr::from(u32::from(v4) + 16).into(),
        IpAddr::V6(v6) => std::net::Ipv6Addr::from(u128::from(v6) + 16).into(),
    };
    match o.clone() {
        KernelObject::XfrmState(s) => KernelObject::XfrmState(XfrmState {
            src: away(s.src),
            dst: away(s.dst),
            spi: Spi::new(s.spi.key(), s.spi.layout(), away(s.src)),
            ..s
        }),
        KernelObject::XfrmPolicy(p) => KernelObject::XfrmPolicy(XfrmPolicy {
            tmpl_dst: away(p.tmpl_dst),
            ..p
        }),
        other => other,
    }
}

#[test]
fn state_upserts_are_idempotent() {
    with_esp(node_agent_tests::test_name!(), |mut b| async move {
        let ours = our_states();
        all_ok(b.apply(&upserts(&ours)).await);
        let writes = b.writes();
        assert_eq!(writes, ours.len() as u64);
        let dump1 = set(b.dump().await.unwrap());
        let listing1 = ip_text(&["xfrm", "state"]);

        all_ok(b.apply(&upserts(&ours)).await);
        assert_eq!(
            b.writes(),
            writes,
            "re-applying identical states wrote to the kernel"
        );
        assert_eq!(set(b.dump().await.unwrap()), dump1);
        assert_eq!(ip_text(&["xfrm", "state"]), listing1);

        // A new key under the same SPI: UPDSA would keep the old key, so each state is
        // deleted and re-added (two writes each) and the kernel then holds the new key, which
        // the dump tells by its tag.
        let new_hex = "99".repeat(20);
        let new_key =
            IpsecKey::parse(&format!("{SPI} rfc4106(gcm(aes)) 0x{new_hex} 128"), None).unwrap();
        let new_tag = new_key.tag();
        b.set_keys(std::sync::Arc::new(KeyBook::new(vec![new_key])));
        let stale = b.apply(&upserts(&ours)).await;
        assert!(
            stale.iter().all(|r| r
                .as_ref()
                .is_err_and(|e| e.to_string().contains("not the planned"))),
            "a state planned with the old key is refused: {stale:?}"
        );
        assert_eq!(b.writes(), writes);
        let ours: Vec<KernelObject> = ours
            .into_iter()
            .map(|o| match o {
                KernelObject::XfrmState(s) => {
                    KernelObject::XfrmState(XfrmState { key: new_tag, ..s })
                }
                o => o,
            })
            .collect();
        all_ok(b.apply(&upserts(&ours)).await);
        assert_eq!(b.writes(), writes * 3);
        let dump1 = set(ours.clone());
        assert_eq!(set(b.dump().await.unwrap()), dump1);
        let listing = ip_text(&["xfrm", "state"]);
        assert_eq!(
            listing.matches(&format!("0x{new_hex}")).count(),
            ours.len(),
            "{listing}"
        );
        let listing1 = listing;
        all_ok(b.apply(&upserts(&ours)).await);
        assert_eq!(b.writes(), writes * 3);
        assert_eq!(ip_text(&["xfrm", "state"]), listing1);

        // The node's address changed under the same daddr/SPI/mark (IN state): replaced.
        let moved = KernelObject::XfrmState(XfrmState {
            key: new_tag,
            ..state(7, "10.0.0.77", "10.0.0.1", XfrmDir::In)
        });
        all_ok(b.apply(&[Op::Replace(moved.clone())]).await);
        let mut want = dump1.clone();
        want.remove(&ours[1]);
        want.insert(moved);
        assert_eq!(set(b.dump().await.unwrap()), want);
        // Deleting the old object now finds the new one there and leaves it.
        all_ok(b.apply(&[Op::Delete(ours[1].clone())]).await);
        assert_eq!(set(b.dump().await.unwrap()), want);
    });
}

#[test]
fn foreign_states_are_left_alone() {
    with_esp(node_agent_tests::test_name!(), |mut b| async move {
        let hex = format!("0x{}", "11".repeat(20));
        let aead = ["aead", "rfc4106(gcm(aes))", hex.as_str(), "128"];
        let add = |spi: &str, extra: &[&str]| {
            ip(&[
                &[
                    "xfrm", "state", "add", "src", "10.0.0.1", "dst", "10.0.0.7", "proto", "esp",
                    "spi", spi, "reqid", "1", "mode", "tunnel",
                ][..],
                extra,
                &aead[..],
            ]
            .concat());
        };
        // Unmarked, another SPI; a foreign mark with our SPI and daddr.
        add("0x100", &[]);
        add("3", &["mark", "0x1234", "mask", "0xffff"]);
        let foreign = ip_text(&["xfrm", "state"]);
        assert_eq!(count(&foreign), 2);
        assert!(b.dump().await.unwrap().is_empty(), "foreign states listed");

        let ours = our_states();
        all_ok(b.apply(&upserts(&ours)).await);
        assert_eq!(set(b.dump().await.unwrap()), set(ours.clone()));
        all_ok(b.apply(&deletes(&ours)).await);
        assert!(b.dump().await.unwrap().is_empty());
        assert_eq!(
            ip_text(&["xfrm", "state"]),
            foreign,
            "a foreign state was touched"
        );

        // An unmarked foreign state with our daddr and SPI matches any mark in the kernel's
        // lookup: we refuse to create over it, and a delete of ours does not remove it.
        ip(&["xfrm", "state", "flush"]);
        add("3", &[]);
        let shadow = ip_text(&["xfrm", "state"]);
        let out = KernelObject::XfrmState(state(7, "10.0.0.1", "10.0.0.7", XfrmDir::Out));
        let r = b.apply(&[Op::Replace(out.clone())]).await;
        let e = r[0].as_ref().expect_err("created over a foreign state");
        assert!(e.to_string().contains("not ours"), "{e}");
        let r = b.apply(&[Op::Delete(out)]).await;
        assert!(
            r[0].is_err(),
            "a delete resolved to the foreign state must not succeed"
        );
        assert_eq!(ip_text(&["xfrm", "state"]), shadow);
    });
}

// ---------------------------------------------------------------------------------------------
// Missing kernel support.

#[test]
fn probe_esp_tells_the_truth_about_this_kernel() {
    require_sandbox!();
    sandbox(|_| {
        let expected = ip_says_esp();
        let probed = runtime().block_on(async {
            let b = XfrmBackend::new(KeyBook::new(vec![key()])).unwrap();
            b.probe_esp().await
        });
        match (expected, probed) {
            (Ok(true), Ok(())) => report("probe_esp: this kernel has ESP; probe says Ok"),
            (Ok(false), Err(e @ ProbeError::NoEsp(_))) => {
                let msg = e.to_string();
                assert!(
                    msg.starts_with("this kernel has no ESP support (CONFIG_INET_ESP): "),
                    "{msg}"
                );
                assert!(msg.contains("Requested type not found"), "{msg}");
                assert!(!msg.contains(KEY_HEX) && !format!("{e:?}").contains(KEY_HEX));
                report(&format!("probe_esp on this kernel: {msg}"));
                if node_agent_tests::in_vm_tier() {
                    panic!("the VM tier must have ESP: {msg}");
                }
            }
            (Err(why), Err(e @ ProbeError::NoAead { .. })) => {
                report(&format!("probe_esp: {why}; probe says: {e}"));
            }
            (expected, probed) => {
                panic!("ip says {expected:?}, probe_esp says {probed:?}")
            }
        }
        // The probe leaves nothing behind.
        assert_eq!(count(&ip_text(&["xfrm", "state"])), 0);
    });
}

#[test]
fn state_errors_and_logs_never_show_the_key() {
    require_sandbox!();
    sandbox(|_| {
        runtime().block_on(async {
            let mut b = XfrmBackend::new(KeyBook::new(vec![key()])).unwrap();
            let ours = our_states();
            // On a kernel without ESP every upsert fails; with ESP, a state of another SPI does.
            let mut ops = upserts(&ours);
            ops.push(Op::Replace(KernelObject::XfrmState(XfrmState {
                spi: Spi::from_wire(9).unwrap(),
                ..state(9, "10.0.0.1", "10.0.0.9", XfrmDir::Out)
            })));
            let results = b.apply(&ops).await;
            let mut seen = 0;
            for r in &results {
                if let Err(e) = r {
                    seen += 1;
                    for s in [e.to_string(), format!("{e:?}")] {
                        assert!(!s.contains(KEY_HEX), "key in error: {s}");
                    }
                }
            }
            assert!(seen >= 1);
            let e = results.last().unwrap().as_ref().unwrap_err().to_string();
            assert!(
                e.contains("the IPsec key file has no key with SPI 9"),
                "{e}"
            );
            let dbg = format!("{:?}", b.keys());
            assert!(!dbg.contains(KEY_HEX) && !dbg.contains("161, 178"), "{dbg}");
            if let Err(e) = b.probe_esp().await {
                assert!(!format!("{e} {e:?}").contains(KEY_HEX));
            }
        })
    });
}

// ---------------------------------------------------------------------------------------------
// The key file (no kernel needed).

#[test]
fn key_file_loads_and_warns_when_group_or_others_can_read_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("node-agent-key-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ipsec.keys");
    std::fs::write(
        &path,
        format!(
            "# rotated\n2 rfc4106(gcm(aes)) 0x{} 128\n{SPI} rfc4106(gcm(aes)) 0x{KEY_HEX} 96\n",
            "00".repeat(20)
        ),
    )
    .unwrap();

    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let k = KeyFile::load(&path).unwrap();
    assert!(k.warnings.is_empty(), "{:?}", k.warnings);
    assert_eq!(
        (
            k.newest().spi(),
            k.newest().icv_bits(),
            k.newest().key_len()
        ),
        (SPI, 96, 20)
    );

    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let k = KeyFile::load(&path).unwrap();
    assert_eq!(k.warnings.len(), 1);
    assert!(
        k.warnings[0].contains(&path.display().to_string()),
        "{:?}",
        k.warnings
    );
    assert!(k.warnings[0].contains("0644"), "{:?}", k.warnings);
    let dbg = format!("{k:?}");
    assert!(!dbg.contains(KEY_HEX), "{dbg}");

    // A bad line names the line, and the key never shows.
    std::fs::write(
        &path,
        format!(
            "{SPI} rfc4106(gcm(aes)) 0x{KEY_HEX} 128\n\n{SPI} rfc4106(gcm(aes)) 0x{KEY_HEX}0 128\n"
        ),
    )
    .unwrap();
    let e = KeyFile::load(&path).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("line 3"), "{msg}");
    assert!(msg.contains("odd number"), "{msg}");
    assert!(
        !msg.contains(KEY_HEX) && !format!("{e:?}").contains(KEY_HEX),
        "{msg}"
    );

    let e = KeyFile::load(&dir.join("missing")).unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// Benchmark.

#[test]
fn bench_policies_against_ip_batch() {
    const N: u16 = 5000;
    if std::env::var("NODE_AGENT_BENCH").as_deref() != Ok("1") {
        report("SKIPPED bench_policies_against_ip_batch: set NODE_AGENT_BENCH=1 to run it");
        return;
    }
    require_sandbox!();
    let policies: Vec<XfrmPolicy> = (1..=N)
        .map(|i| XfrmPolicy {
            src: net("0.0.0.0/0"),
            dst: IpNet::new(IpAddr::from([10, (i >> 8) as u8, i as u8, 0]), 24).unwrap(),
            dir: XfrmDir::Out,
            node_id: node_id(i),
            tmpl_src: addr("172.16.0.1"),
            tmpl_dst: IpAddr::from([172, 17, (i >> 8) as u8, i as u8]),
            spi: Spi::from_wire(SPI.into()).unwrap(),
        })
        .collect();
    sandbox(|_| {
        // The floor: iproute2 doing the same work, one request at a time, in one process.
        let objs: Vec<KernelObject> = policies
            .iter()
            .cloned()
            .map(KernelObject::XfrmPolicy)
            .collect();
        let (add, del) = (ip_xfrm::adds(&objs, KEY_HEX), ip_xfrm::deletes(&objs));
        let t = Instant::now();
        ip_batch(&[], &add);
        let ip_add = t.elapsed();
        let t = Instant::now();
        let listing = ip_text(&["xfrm", "policy"]);
        let ip_dump = t.elapsed();
        assert_eq!(count(&listing), N as usize);
        let t = Instant::now();
        ip_batch(&[], &del);
        let ip_del = t.elapsed();
        assert_eq!(count(&ip_text(&["xfrm", "policy"])), 0);

        let (ours_add, ours_dump, ours_del) = runtime().block_on(async {
            let mut b = XfrmBackend::new(KeyBook::default()).unwrap();
            let t = Instant::now();
            all_ok(b.apply(&upserts(&objs)).await);
            let a = t.elapsed();
            let t = Instant::now();
            let dump = b.dump().await.unwrap();
            let d = t.elapsed();
            assert_eq!(dump.len(), N as usize);
            let t = Instant::now();
            all_ok(b.apply(&deletes(&objs)).await);
            let r = t.elapsed();
            assert!(b.dump().await.unwrap().is_empty());
            (a, d, r)
        });
        for (what, ours, floor) in [
            ("add", ours_add, ip_add),
            ("dump", ours_dump, ip_dump),
            ("delete", ours_del, ip_del),
        ] {
            report(&format!(
                "bench: xfrm policy {what} {N} {:.1} ms (ip -batch floor {:.1} ms, ratio {:.2}x)",
                ours.as_secs_f64() * 1e3,
                floor.as_secs_f64() * 1e3,
                ours.as_secs_f64() / floor.as_secs_f64()
            ));
        }
    });
}

/// How adding states and policies grows with their number, for iproute2 and for the backend:
/// at each size of `NODE_AGENT_BENCH_XFRM_SIZES` (5,000 and 20,000 nodes by default; an OUT
/// and an IN state and an OUT policy per node), the time per object. Needs ESP: the VM tier
/// runs it (`cargo xtask vm-test --release -- bench_xfrm_scaling`, with `NODE_AGENT_BENCH=1`).
#[test]
fn bench_xfrm_scaling() {
    if std::env::var("NODE_AGENT_BENCH").as_deref() != Ok("1") {
        report("SKIPPED bench_xfrm_scaling: set NODE_AGENT_BENCH=1 to run it");
        return;
    }
    let sizes: Vec<u16> = std::env::var("NODE_AGENT_BENCH_XFRM_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![5_000, 20_000]);
    for n in sizes {
        for layout in [SpiLayout::Key, SpiLayout::PerSender] {
            xfrm_scaling(n, layout);
        }
    }
}

/// `n` remote nodes' states (both directions) and policies in `layout`: the floor (iproute2
/// adding the same states, same endpoints, SPIs, marks and key, one request at a time), then
/// ours adding them, adding the policies, and deleting both. The kernel finds a state by
/// destination, SPI and protocol in one hash chain and only then compares marks: in the key
/// layout every IN state (this node's address, the key's SPI) shares one chain.
fn xfrm_scaling(n: u16, layout: SpiLayout) {
    with_esp(node_agent_tests::test_name!(), |mut b| async move {
        let remote = |i: u16| IpAddr::from([172, 16, (i >> 8) as u8, i as u8]);
        let mut states = Vec::new();
        let mut policies = Vec::new();
        for i in 1..=n {
            for (src, dst, dir) in [
                (addr("10.0.0.1"), remote(i), XfrmDir::Out),
                (remote(i), addr("10.0.0.1"), XfrmDir::In),
            ] {
                states.push(KernelObject::XfrmState(XfrmState {
                    src,
                    dst,
                    spi: Spi::new(SPI, layout, src),
                    ..state(i, "10.0.0.1", "10.0.0.2", dir)
                }));
            }
            let dst = IpNet::new(
                IpAddr::from([
                    10,
                    128 + (i >> 10) as u8,
                    (i >> 2) as u8,
                    (i as u8 & 3) << 6,
                ]),
                26,
            )
            .unwrap();
            let p = policy(i, "10.1.0.0/24", "10.0.0.2");
            policies.push(KernelObject::XfrmPolicy(XfrmPolicy {
                dst,
                tmpl_dst: remote(i),
                spi: Spi::new(SPI, layout, p.tmpl_src),
                ..p
            }));
        }
        let add = ip_xfrm::adds(&states, KEY_HEX);
        let t = Instant::now();
        ip_batch(&[], &add);
        let ip_states = t.elapsed();
        ip(&["xfrm", "state", "flush"]);

        let creates =
            |objs: &[KernelObject]| -> Vec<Op> { objs.iter().cloned().map(Op::Create).collect() };
        let t = Instant::now();
        all_ok(b.apply(&creates(&states)).await);
        let ours_states = t.elapsed();
        let t = Instant::now();
        all_ok(b.apply(&creates(&policies)).await);
        let ours_policies = t.elapsed();
        let t = Instant::now();
        all_ok(b.apply(&deletes(&states)).await);
        all_ok(b.apply(&deletes(&policies)).await);
        let ours_delete = t.elapsed();
        let per = |d: std::time::Duration, k: usize| d.as_secs_f64() * 1e6 / k as f64;
        let layout = layout.name().replace('-', "_");
        report(&format!(
            "bench: xfrm_scaling_{layout}_{n} states {}: ip -batch {:.0} us each, ours {:.0} us each; policies {}: ours {:.0} us each; deleting both: ours {:.0} us each",
            states.len(),
            per(ip_states, states.len()),
            per(ours_states, states.len()),
            policies.len(),
            per(ours_policies, policies.len()),
            per(ours_delete, states.len() + policies.len()),
        ));
    });
}

//! Reading dumped states and policies back into our objects. Only what carries one of our marks
//! under exactly our mask is ours (invariant 6); everything else is never listed, so it can
//! never reach a delete.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use netlink_packet_xfrm::{
    Address, AlgAead, IPPROTO_ESP, Mark, XFRM_POLICY_IN, XFRM_POLICY_OUT, XFRM_STATE_ESN,
    XfrmAttrs, policy, state as sa,
};
use state::node::Family;
use state::objects::{
    GuardRole, KeyTag, NodeId, Spi, SpiLayout, XfrmDir, XfrmGuard, XfrmPolicy, XfrmState, mark,
};

use super::keys::tag;
use super::message::{REPLAY_WINDOW, any_net, guard_direction, guard_mark, guard_message};

pub fn ip_of(a: &Address, family: u16) -> Option<IpAddr> {
    match i32::from(family) {
        libc::AF_INET => Some(IpAddr::V4(a.to_ipv4())),
        libc::AF_INET6 => Some(IpAddr::V6(a.to_ipv6())),
        _ => None,
    }
}

pub fn find_mark(nlas: &[XfrmAttrs]) -> Option<Mark> {
    nlas.iter().find_map(|a| match a {
        XfrmAttrs::Mark(m) => Some(*m),
        _ => None,
    })
}

pub fn find_aead(nlas: &[XfrmAttrs]) -> Option<&AlgAead> {
    nlas.iter().find_map(|a| match a {
        XfrmAttrs::EncryptionAlgAead(x) => Some(x),
        _ => None,
    })
}

/// The node, SPI and direction of a mark that is ours: decodes and has exactly our mask.
fn our_mark(nlas: &[XfrmAttrs]) -> Option<(NodeId, u8, XfrmDir)> {
    let m = find_mark(nlas)?;
    if m.mask != mark::MASK {
        return None;
    }
    mark::decode(m.value)
}

/// The tag of the key a dumped state holds (see [`super::keys::tag`]); the default tag when it
/// has no AEAD (never one of ours, so it is replaced).
pub fn state_tag(nlas: &[XfrmAttrs]) -> KeyTag {
    find_aead(nlas).map_or(KeyTag::default(), |a| {
        let name = a.alg_name.split(|b| *b == 0).next().unwrap_or(&[]);
        let bytes = (a.alg_key_len as usize).div_ceil(8).min(a.alg_key.len());
        tag(
            &String::from_utf8_lossy(name),
            a.alg_icv_len,
            &a.alg_key[..bytes],
        )
    })
}

/// Whether a state has the replay protection the agent writes now: ESN and [`REPLAY_WINDOW`].
fn current_shape(m: &sa::ModifyMessage) -> bool {
    m.user_sa_info.flags & XFRM_STATE_ESN != 0
        && m.nlas
            .iter()
            .any(|a| matches!(a, XfrmAttrs::ReplayStateEsn(r) if r.replay_window == REPLAY_WINDOW))
}

pub fn parse_state(m: &sa::ModifyMessage) -> Option<XfrmState> {
    let (node_id, spi, dir) = our_mark(&m.nlas)?;
    let info = &m.user_sa_info;
    let src = ip_of(&info.saddr, info.family)?;
    let dst = ip_of(&info.id.daddr, info.family)?;
    let Some(wire) =
        Spi::from_wire(info.id.spi).filter(|w| w.key() == spi && info.id.proto == IPPROTO_ESP)
    else {
        tracing::warn!(
            %src, %dst, kernel_spi = info.id.spi, mark_spi = spi, proto = info.id.proto,
            "xfrm state with our mark that node-agent never creates (SPI or protocol differs from the mark); leaving it alone"
        );
        return None;
    };
    Some(XfrmState {
        src,
        dst,
        spi: wire,
        dir,
        node_id,
        key: match current_shape(m) {
            true => state_tag(&m.nlas),
            // Written by an older agent (no ESN, another window): read as another key, so
            // the planner replaces it.
            false => KeyTag::default(),
        },
    })
}

/// A dumped policy of ours: a node's policy, a guard, or `None` for anything else.
pub enum ParsedPolicy {
    Node(XfrmPolicy),
    Guard(XfrmGuard),
}

pub fn parse_policy(m: &policy::ModifyMessage) -> Option<ParsedPolicy> {
    if let Some(g) = parse_guard(m) {
        return Some(ParsedPolicy::Guard(g));
    }
    parse_node_policy(m).map(ParsedPolicy::Node)
}

/// A guard is recognised by its mark (the direction bits under [`mark::DIR_MASK`]), its
/// direction and an any -> any selector; one whose action, priority or template is not what the
/// agent writes is listed as not intact, and the planner replaces it.
fn parse_guard(m: &policy::ModifyMessage) -> Option<XfrmGuard> {
    let found = find_mark(&m.nlas)?;
    let info = &m.user_policy_info;
    let role = [GuardRole::Block, GuardRole::AcceptDecrypted]
        .into_iter()
        .find(|r| guard_mark(*r) == found && guard_direction(*r) == info.direction)?;
    let family = match i32::from(info.selector.family) {
        libc::AF_INET => Family::V4,
        libc::AF_INET6 => Family::V6,
        _ => return None,
    };
    let sel = &info.selector;
    let any = any_net(family);
    let src = IpNet::new(ip_of(&sel.saddr, sel.family)?, sel.prefixlen_s).ok()?;
    let dst = IpNet::new(ip_of(&sel.daddr, sel.family)?, sel.prefixlen_d).ok()?;
    if src != any || dst != any {
        return None;
    }
    let want = guard_message(&XfrmGuard {
        family,
        role,
        intact: true,
    });
    let tmpl = |m: &policy::ModifyMessage| {
        m.nlas.iter().find_map(|a| match a {
            XfrmAttrs::Template(t) => Some(t.clone()),
            _ => None,
        })
    };
    let intact = info.action == want.user_policy_info.action
        && info.priority == want.user_policy_info.priority
        && tmpl(m) == tmpl(&want);
    Some(XfrmGuard {
        family,
        role,
        intact,
    })
}

fn parse_node_policy(m: &policy::ModifyMessage) -> Option<XfrmPolicy> {
    let (node_id, spi, dir) = our_mark(&m.nlas)?;
    let info = &m.user_policy_info;
    let policy_dir = match info.direction {
        XFRM_POLICY_OUT => XfrmDir::Out,
        XFRM_POLICY_IN => XfrmDir::In,
        _ => return None, // forward and socket policies are never a node's
    };
    let sel = &info.selector;
    let src = IpNet::new(ip_of(&sel.saddr, sel.family)?, sel.prefixlen_s).ok()?;
    let dst = IpNet::new(ip_of(&sel.daddr, sel.family)?, sel.prefixlen_d).ok()?;
    if policy_dir != dir {
        tracing::warn!(%src, %dst, "xfrm policy with our mark but the other direction's bits; leaving it alone");
        return None;
    }
    let tmpl = m.nlas.iter().find_map(|a| match a {
        XfrmAttrs::Template(t) => t.first().copied(),
        _ => None,
    });
    // A policy of ours without a usable template (none, or an SPI of neither layout or of
    // another key than the mark's) still carries our mark: list it with unspecified endpoints
    // and the mark's key, so the planner replaces or removes it.
    let unspecified = || match sel.family as i32 {
        libc::AF_INET6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    let usable = tmpl.and_then(|t| {
        let spi = Spi::from_wire(t.id.spi).filter(|w| w.key() == spi)?;
        Some((
            ip_of(&t.saddr, t.family)?,
            ip_of(&t.id.daddr, t.family)?,
            spi,
        ))
    });
    let (tmpl_src, tmpl_dst, spi) = usable.unwrap_or_else(|| {
        let src = unspecified();
        (src, src, Spi::new(spi, SpiLayout::Key, src))
    });
    Some(XfrmPolicy {
        src,
        dst,
        dir,
        node_id,
        tmpl_src,
        tmpl_dst,
        spi,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::xfrm::keys::{IpsecKey, StateKey};
    use crate::backends::xfrm::message::{policy_message, state_message};

    const LAYOUTS: [SpiLayout; 2] = [SpiLayout::Key, SpiLayout::PerSender];

    fn pol(node: u16, dst: &str, layout: SpiLayout) -> XfrmPolicy {
        let tmpl_src = "10.0.0.1".parse().unwrap();
        XfrmPolicy {
            src: "0.0.0.0/0".parse().unwrap(),
            dst: dst.parse().unwrap(),
            dir: XfrmDir::Out,
            node_id: NodeId::new(node).unwrap(),
            tmpl_src,
            tmpl_dst: "10.0.0.2".parse().unwrap(),
            spi: Spi::new(3, layout, tmpl_src),
        }
    }

    fn node_policy(m: &policy::ModifyMessage) -> Option<XfrmPolicy> {
        match parse_policy(m) {
            Some(ParsedPolicy::Node(p)) => Some(p),
            _ => None,
        }
    }

    #[test]
    fn policy_message_round_trips_through_the_dump_parser() {
        for layout in LAYOUTS {
            let p = pol(7, "10.7.0.0/24", layout);
            let mut m = policy_message(&p).unwrap();
            assert_eq!(node_policy(&m), Some(p.clone()));
            // A template under another key's SPI, or one of neither layout, is not usable:
            // listed with unspecified endpoints, to be replaced.
            for wrong in [p.spi.wire() ^ 1, 0x100, u32::MAX] {
                if let Some(XfrmAttrs::Template(t)) = m.nlas.first_mut() {
                    t[0].id.spi = wrong;
                }
                let parsed = node_policy(&m).unwrap();
                assert!(
                    parsed.tmpl_src.is_unspecified() && parsed != p,
                    "{wrong:#x}"
                );
            }
        }
    }

    #[test]
    fn guards_round_trip_and_are_never_taken_for_a_node_policy() {
        for family in [Family::V4, Family::V6] {
            for g in XfrmGuard::all(family) {
                let mut m = guard_message(&g);
                assert!(matches!(parse_policy(&m), Some(ParsedPolicy::Guard(x)) if x == g));
                m.user_policy_info.action ^= 1;
                assert!(
                    matches!(parse_policy(&m), Some(ParsedPolicy::Guard(x)) if !x.intact),
                    "a changed guard is listed as one to replace"
                );
            }
        }
    }

    #[test]
    fn a_state_message_carries_the_tag_of_its_key_in_either_layout() {
        for layout in LAYOUTS {
            state_round_trip(layout);
        }
    }

    fn state_round_trip(layout: SpiLayout) {
        let key = IpsecKey::parse(
            "3 rfc4106(gcm(aes)) 0x0102030405060708090a0b0c0d0e0f1011121314 128",
            None,
        )
        .unwrap();
        let src = "10.0.0.1".parse().unwrap();
        let s = XfrmState {
            src,
            dst: "10.0.0.2".parse().unwrap(),
            spi: Spi::new(3, layout, src),
            dir: XfrmDir::Out,
            node_id: NodeId::new(7).unwrap(),
            key: key.tag(),
        };
        let sk = StateKey {
            key: &key,
            derived: None,
        };
        let mut m = state_message(&s, &sk).unwrap();
        assert_eq!(parse_state(&m), Some(s.clone()));
        for wrong in [s.spi.wire() ^ 1, 0x100] {
            let mut other = state_message(&s, &sk).unwrap();
            other.user_sa_info.id.spi = wrong;
            assert_eq!(
                parse_state(&other),
                None,
                "SPI {wrong:#x} is not the mark's key"
            );
        }
        m.user_sa_info.flags = 0;
        assert_eq!(
            parse_state(&m).map(|p| p.key),
            Some(KeyTag::default()),
            "a state without ESN is one to replace"
        );
    }

    #[test]
    fn foreign_marks_are_not_ours() {
        let p = pol(7, "10.7.0.0/24", SpiLayout::Key);
        let mut m = policy_message(&p).unwrap();
        m.nlas = vec![XfrmAttrs::Mark(Mark {
            value: 0x1234,
            mask: 0xffff,
        })];
        assert!(parse_policy(&m).is_none());
        m.nlas = vec![XfrmAttrs::Mark(Mark {
            value: mark::encode(NodeId::new(7).unwrap(), 3, XfrmDir::Out),
            mask: 0xffff_ffff,
        })];
        assert!(parse_policy(&m).is_none(), "our value under another mask");
        m.nlas = vec![XfrmAttrs::Mark(Mark {
            value: mark::OUT,
            mask: mark::DIR_MASK,
        })];
        assert!(
            parse_policy(&m).is_none(),
            "a guard's mark on a selector that is not any -> any"
        );
        m.nlas.clear();
        assert!(parse_policy(&m).is_none(), "no mark at all");
    }
}

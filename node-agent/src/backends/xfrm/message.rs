//! Building the netlink messages of our states, policies and guards: the one place that knows
//! how an object of ours looks to the kernel (the dump parser in [`super::parse`] reads the same
//! shapes back).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use netlink_packet_xfrm::{
    Address, AlgAead, IPPROTO_ESP, Mark, ReplayEsn, UserPolicyId, UserPolicyInfo, UserSaId,
    UserSaInfo, UserTemplate, XFRM_MODE_TUNNEL, XFRM_POLICY_ALLOW, XFRM_POLICY_BLOCK,
    XFRM_POLICY_FWD, XFRM_POLICY_IN, XFRM_POLICY_OUT, XFRM_STATE_ESN, XfrmAttrs, XfrmMessage,
    policy, state as sa,
};
use state::node::Family;
use state::objects::{GuardRole, XfrmDir, XfrmGuard, XfrmPolicy, XfrmState, mark};

use super::keys::StateKey;

/// The reqid of every state and policy template we create.
pub const REQID: u32 = 1;
/// Anti-replay window of our states, in packets (Cilium's). With extended sequence numbers
/// (ESN, 64 bits) a state never runs out of sequence numbers: with 32 bits it would stop
/// sending after 2^32 packets, a little over an hour at a million packets a second.
pub const REPLAY_WINDOW: u32 = 1024;
/// Priority of the guards: the lowest precedence there is (the kernel picks the lowest number),
/// so that every node's own OUT policy (priority 0) wins over the block guard.
pub const GUARD_PRIORITY: u32 = u32::MAX;

/// The mark of a node's policy.
pub fn policy_mark(p: &XfrmPolicy) -> Mark {
    Mark {
        value: mark::encode(p.node_id, p.spi.key(), p.dir),
        mask: mark::MASK,
    }
}

/// The mark of a node's state.
pub fn state_mark(s: &XfrmState) -> Mark {
    Mark {
        value: mark::encode(s.node_id, s.spi.key(), s.dir),
        mask: mark::MASK,
    }
}

/// The mark of a guard: only the direction bits, so it matches every node and SPI.
pub fn guard_mark(role: GuardRole) -> Mark {
    Mark {
        value: match role {
            GuardRole::Block => mark::OUT,
            GuardRole::AcceptDecrypted => mark::IN,
        },
        mask: mark::DIR_MASK,
    }
}

/// The kernel direction of a guard.
pub fn guard_direction(role: GuardRole) -> u8 {
    match role {
        GuardRole::Block => XFRM_POLICY_OUT,
        GuardRole::AcceptDecrypted => XFRM_POLICY_FWD,
    }
}

fn family_mismatch(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{what} are of different address families"),
    )
}

fn esp_tunnel_template(src: IpAddr, dst: IpAddr, spi: u32) -> UserTemplate {
    let mut tmpl = UserTemplate::default();
    tmpl.source(&src);
    tmpl.destination(&dst);
    tmpl.protocol(IPPROTO_ESP);
    tmpl.mode(XFRM_MODE_TUNNEL);
    tmpl.reqid(REQID);
    tmpl.spi(spi);
    tmpl
}

/// A node's OUT policy: selector any -> the pod CIDR, our mark, one ESP tunnel template.
pub fn policy_message(p: &XfrmPolicy) -> io::Result<policy::ModifyMessage> {
    if p.src.addr().is_ipv4() != p.dst.addr().is_ipv4() {
        return Err(family_mismatch("selector source and destination"));
    }
    if p.tmpl_src.is_ipv4() != p.tmpl_dst.is_ipv4() {
        return Err(family_mismatch("template source and destination"));
    }
    let mut info = UserPolicyInfo::default();
    set_selector(&mut info, p.src, p.dst);
    info.direction = match p.dir {
        XfrmDir::Out => XFRM_POLICY_OUT,
        XfrmDir::In => XFRM_POLICY_IN,
    };
    info.action = XFRM_POLICY_ALLOW;
    Ok(policy::ModifyMessage {
        user_policy_info: info,
        nlas: vec![
            XfrmAttrs::Template(vec![esp_tunnel_template(
                p.tmpl_src,
                p.tmpl_dst,
                p.spi.wire(),
            )]),
            XfrmAttrs::Mark(policy_mark(p)),
        ],
    })
}

/// A guard: selector any -> any of its family, the direction bits of our marks, the lowest
/// priority; the block guard blocks, the accept guard allows with an ESP tunnel template that
/// names no endpoint (any state of ours that decrypted the packet satisfies it).
pub fn guard_message(g: &XfrmGuard) -> policy::ModifyMessage {
    let any = any_net(g.family);
    let mut info = UserPolicyInfo::default();
    set_selector(&mut info, any, any);
    info.direction = guard_direction(g.role);
    info.priority = GUARD_PRIORITY;
    let mut nlas = vec![XfrmAttrs::Mark(guard_mark(g.role))];
    match g.role {
        GuardRole::Block => info.action = XFRM_POLICY_BLOCK,
        GuardRole::AcceptDecrypted => {
            info.action = XFRM_POLICY_ALLOW;
            let mut tmpl = UserTemplate {
                family: family_number(g.family),
                ..UserTemplate::default()
            };
            tmpl.protocol(IPPROTO_ESP);
            tmpl.mode(XFRM_MODE_TUNNEL);
            tmpl.reqid(REQID);
            nlas.insert(0, XfrmAttrs::Template(vec![tmpl]));
        }
    }
    policy::ModifyMessage {
        user_policy_info: info,
        nlas,
    }
}

/// The request that deletes a policy: its selector, direction and mark.
pub fn del_policy_message(m: &policy::ModifyMessage) -> XfrmMessage {
    let info = &m.user_policy_info;
    let mark = m.nlas.iter().find_map(|a| match a {
        XfrmAttrs::Mark(m) => Some(*m),
        _ => None,
    });
    XfrmMessage::DeletePolicy(policy::DelGetMessage {
        user_policy_id: UserPolicyId {
            selector: info.selector,
            index: 0,
            direction: info.direction,
        },
        nlas: mark.map(XfrmAttrs::Mark).into_iter().collect(),
    })
}

pub fn set_selector(info: &mut UserPolicyInfo, src: IpNet, dst: IpNet) {
    info.selector.saddr = Address::from_ip(&src.network());
    info.selector.prefixlen_s = src.prefix_len();
    info.selector.daddr = Address::from_ip(&dst.network());
    info.selector.prefixlen_d = dst.prefix_len();
    info.selector.family = family(&dst.addr());
}

/// An ESP tunnel-mode state with `key`'s AEAD, our reqid and mark, extended sequence numbers
/// and a [`REPLAY_WINDOW`] anti-replay window.
pub fn state_message(s: &XfrmState, key: &StateKey<'_>) -> io::Result<sa::ModifyMessage> {
    if s.src.is_ipv4() != s.dst.is_ipv4() {
        return Err(family_mismatch("state source and destination"));
    }
    let mut info = UserSaInfo::default();
    info.source(&s.src);
    info.destination(&s.dst);
    info.selector.family = info.family;
    info.id.spi = s.spi.wire();
    info.id.proto = IPPROTO_ESP;
    info.mode = XFRM_MODE_TUNNEL;
    info.reqid = REQID;
    info.flags = XFRM_STATE_ESN;
    let k = key.key;
    Ok(sa::ModifyMessage {
        user_sa_info: info,
        nlas: vec![
            XfrmAttrs::EncryptionAlgAead(aead(k.algorithm(), key.bytes(), k.icv_bits())),
            XfrmAttrs::Mark(state_mark(s)),
            XfrmAttrs::ReplayStateEsn(ReplayEsn {
                bmp_len: REPLAY_WINDOW / 32,
                replay_window: REPLAY_WINDOW,
                bmp: vec![0; (REPLAY_WINDOW / 32) as usize],
                ..ReplayEsn::default()
            }),
        ],
    })
}

pub fn del_state_message(s: &XfrmState) -> XfrmMessage {
    XfrmMessage::DeleteSa(sa::DelGetMessage {
        user_sa_id: sa_id(s.dst, s.spi.wire()),
        nlas: vec![XfrmAttrs::Mark(state_mark(s))],
    })
}

pub fn get_state_message(s: &XfrmState) -> XfrmMessage {
    XfrmMessage::GetSa(sa::DelGetMessage {
        user_sa_id: sa_id(s.dst, s.spi.wire()),
        nlas: vec![XfrmAttrs::Mark(state_mark(s))],
    })
}

pub fn sa_id(dst: IpAddr, spi: u32) -> UserSaId {
    UserSaId {
        daddr: Address::from_ip(&dst),
        spi,
        family: family(&dst),
        proto: IPPROTO_ESP,
    }
}

pub fn aead(algorithm: &str, key: &[u8], icv_bits: u32) -> AlgAead {
    AlgAead {
        alg_name: name::<64>(algorithm),
        alg_key_len: (key.len() * 8) as u32,
        alg_icv_len: icv_bits,
        alg_key: key.to_vec(),
    }
}

pub fn name<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0; N];
    let n = s.len().min(N - 1);
    out[..n].copy_from_slice(&s.as_bytes()[..n]);
    out
}

pub fn family(a: &IpAddr) -> u16 {
    match a {
        IpAddr::V4(_) => libc::AF_INET as u16,
        IpAddr::V6(_) => libc::AF_INET6 as u16,
    }
}

pub fn family_number(f: Family) -> u16 {
    match f {
        Family::V4 => libc::AF_INET as u16,
        Family::V6 => libc::AF_INET6 as u16,
    }
}

pub fn any_net(f: Family) -> IpNet {
    match f {
        Family::V4 => IpNet::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        Family::V6 => IpNet::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
    }
    .expect("a zero-length prefix is valid")
}

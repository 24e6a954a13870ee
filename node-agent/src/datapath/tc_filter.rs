//! What sits at the place of our classifier on a kernel without tcx links (before 6.6), read
//! before it is replaced.
//!
//! There the classifier is a cls_bpf filter at a fixed priority and handle, and taking over a
//! previous agent's filter is a replace at that place: the kernel replaces whatever filter is
//! there, of the same kind. A filter of someone else's at that place must be reported and left
//! alone, so the agent reads it first (one filter dump of the interface's clsact hook) and takes
//! over only a bpf filter running one of our programs.

use std::io;

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_packet_route::tc::{
    TcAttribute, TcFilterBpfOption, TcHandle, TcHeader, TcMessage, TcOption,
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// A filter found at our place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    /// `bpf`, `matchall`, `u32`...
    pub kind: String,
    /// The program's name, for a bpf filter that has one.
    pub prog: Option<String>,
}

impl Filter {
    /// Whether it runs one of our programs.
    pub fn is_ours(&self) -> bool {
        self.kind == "bpf"
            && self.prog.as_deref().is_some_and(|p| {
                [
                    node_agent_common::INGRESS_PROG,
                    node_agent_common::EGRESS_PROG,
                    node_agent_common::POD_PROG,
                ]
                .contains(&p)
            })
    }
}

impl std::fmt::Display for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.prog {
            Some(p) => write!(f, "a {} filter running {p}", self.kind),
            None => write!(f, "a {} filter", self.kind),
        }
    }
}

/// `TC_H_CLSACT`'s parent handles of the two hooks: `ffff:fff2` (ingress), `ffff:fff3` (egress).
pub fn clsact_parent(ingress: bool) -> TcHandle {
    TcHandle {
        major: 0xffff,
        minor: if ingress { 0xfff2 } else { 0xfff3 },
    }
}

/// The filter at `priority` and `handle` on interface `index`'s clsact hook `parent`, if any.
pub fn at(index: u32, parent: TcHandle, priority: u16, handle: u32) -> io::Result<Option<Filter>> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let mut msg = TcMessage::default();
    msg.header = TcHeader {
        index: i32::try_from(index).map_err(io::Error::other)?,
        parent,
        // The priority in the upper half: the kernel lists only the filters at it.
        info: u32::from(priority) << 16,
        ..TcHeader::default()
    };
    let mut req = NetlinkMessage::new(
        NetlinkHeader::default(),
        NetlinkPayload::from(RouteNetlinkMessage::GetTrafficFilter(msg)),
    );
    req.header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    req.header.sequence_number = 1;
    req.finalize();
    let mut buf = vec![0; req.buffer_len()];
    req.serialize(&mut buf);
    socket.send(&buf, 0)?;

    let mut found = None;
    let mut rx = vec![0; 64 << 10];
    loop {
        let n = socket.recv(&mut &mut rx[..], 0)?;
        let mut rest = &rx[..n];
        while let Ok(frame) = NetlinkBuffer::new_checked(rest) {
            let len = (frame.length() as usize).min(rest.len());
            let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rest[..len]);
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
            let Ok(msg) = msg else {
                // A filter of a kind this parser does not read: not ours, which this parser
                // reads. If it sits at our place, the exclusive create finds it there.
                tracing::warn!(
                    "a tc filter at priority {priority:#x} could not be decoded; skipped"
                );
                continue;
            };
            match msg.payload {
                NetlinkPayload::Done(_) => return Ok(found),
                NetlinkPayload::Error(e) if e.code.is_some() => return Err(e.to_io()),
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewTrafficFilter(f))
                    if (f.header.info >> 16) as u16 == priority
                        && u32::from(f.header.handle) == handle =>
                {
                    found = Some(filter(&f));
                }
                _ => {}
            }
        }
        if n == 0 {
            return Ok(found);
        }
    }
}

fn filter(m: &TcMessage) -> Filter {
    let mut out = Filter {
        kind: String::new(),
        prog: None,
    };
    for a in &m.attributes {
        match a {
            TcAttribute::Kind(k) => out.kind = k.clone(),
            TcAttribute::Options(opts) => {
                for o in opts {
                    if let TcOption::Bpf(TcFilterBpfOption::ProgName(p)) = o {
                        out.prog = Some(p.clone());
                    }
                }
            }
            _ => {}
        }
    }
    out
}

//! The nexthop netlink messages (`RTM_NEWNEXTHOP`, `RTM_DELNEXTHOP`, `RTM_GETNEXTHOP`, from
//! `linux/nexthop.h`): netlink-packet-route has none, so this is their wire form, the `nhmsg`
//! header and the few attributes the agent writes or must recognise.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use netlink_packet_core::{
    DecodeError, NetlinkDeserializable, NetlinkHeader, NetlinkSerializable, NlasIterator,
};

pub const RTM_NEWNEXTHOP: u16 = 104;
pub const RTM_DELNEXTHOP: u16 = 105;
pub const RTM_GETNEXTHOP: u16 = 106;

const NHA_ID: u16 = 1;
const NHA_GROUP: u16 = 2;
const NHA_BLACKHOLE: u16 = 4;
const NHA_OIF: u16 = 5;
const NHA_GATEWAY: u16 = 6;
const NHA_ENCAP: u16 = 8;
const NHA_GROUPS: u16 = 9;
const NHA_FDB: u16 = 11;

/// `sizeof(struct nhmsg)`: family, scope, protocol, a reserved byte and 32 bits of flags.
const HEADER_LEN: usize = 8;

const AF_UNSPEC: u8 = 0;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// Which of the three messages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Verb {
    #[default]
    Get,
    New,
    Del,
}

/// One nexthop message: the header fields and attributes the agent uses. A nexthop in a shape
/// the agent never writes (a group, a blackhole, an FDB or encapsulating nexthop) is flagged
/// by `other`, so it is never taken for one of ours.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NexthopMessage {
    pub verb: Verb,
    pub family: u8,
    pub protocol: u8,
    pub id: Option<u32>,
    pub oif: Option<u32>,
    pub gateway: Option<IpAddr>,
    pub other: bool,
    /// A group's members (`NHA_GROUP`): deleting one of them changes the group, and the last
    /// one deletes it with every route through it.
    pub group: Vec<u32>,
    /// On a dump request: groups only (`NHA_GROUPS`, a filter the kernel applies).
    pub groups_only: bool,
}

impl NexthopMessage {
    /// A request for every nexthop of the namespace (with `NLM_F_DUMP`).
    pub fn dump() -> Self {
        Self::default()
    }

    /// A request for every nexthop group of the namespace (with `NLM_F_DUMP`).
    pub fn dump_groups() -> Self {
        Self {
            groups_only: true,
            ..Self::default()
        }
    }

    /// A nexthop through `gateway` on device `oif`, marked with `protocol`.
    pub fn new(id: u32, gateway: IpAddr, oif: u32, protocol: u8) -> Self {
        Self {
            verb: Verb::New,
            family: family_of(&gateway),
            protocol,
            id: Some(id),
            oif: Some(oif),
            gateway: Some(gateway),
            other: false,
            group: Vec::new(),
            groups_only: false,
        }
    }

    /// Deletes the nexthop `id`. The kernel takes no protocol on a delete: it matches the ID
    /// alone.
    pub fn del(id: u32) -> Self {
        Self {
            verb: Verb::Del,
            id: Some(id),
            ..Self::default()
        }
    }

    /// Asks for the nexthop `id`.
    pub fn get(id: u32) -> Self {
        Self {
            verb: Verb::Get,
            id: Some(id),
            ..Self::default()
        }
    }

    fn attributes(&self) -> Vec<(u16, Vec<u8>)> {
        let mut out = Vec::new();
        if let Some(id) = self.id {
            out.push((NHA_ID, id.to_ne_bytes().to_vec()));
        }
        if let Some(oif) = self.oif {
            out.push((NHA_OIF, oif.to_ne_bytes().to_vec()));
        }
        match self.gateway {
            Some(IpAddr::V4(a)) => out.push((NHA_GATEWAY, a.octets().to_vec())),
            Some(IpAddr::V6(a)) => out.push((NHA_GATEWAY, a.octets().to_vec())),
            None => {}
        }
        if self.groups_only {
            out.push((NHA_GROUPS, Vec::new()));
        }
        out
    }
}

fn family_of(ip: &IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => AF_INET,
        IpAddr::V6(_) => AF_INET6,
    }
}

/// An attribute's length on the wire: its 4-byte header and value, padded to 4 bytes.
fn padded(value_len: usize) -> usize {
    (4 + value_len).next_multiple_of(4)
}

impl NetlinkSerializable for NexthopMessage {
    fn message_type(&self) -> u16 {
        match self.verb {
            Verb::Get => RTM_GETNEXTHOP,
            Verb::New => RTM_NEWNEXTHOP,
            Verb::Del => RTM_DELNEXTHOP,
        }
    }

    fn buffer_len(&self) -> usize {
        HEADER_LEN
            + self
                .attributes()
                .iter()
                .map(|(_, v)| padded(v.len()))
                .sum::<usize>()
    }

    fn serialize(&self, buffer: &mut [u8]) {
        buffer.fill(0);
        buffer[0] = if self.verb == Verb::New {
            self.family
        } else {
            AF_UNSPEC
        };
        // Scope, reserved byte and flags stay 0; the kernel refuses a protocol on a get or a
        // delete.
        if self.verb == Verb::New {
            buffer[2] = self.protocol;
        }
        let mut at = HEADER_LEN;
        for (kind, value) in self.attributes() {
            let len = 4 + value.len();
            buffer[at..at + 2].copy_from_slice(&(len as u16).to_ne_bytes());
            buffer[at + 2..at + 4].copy_from_slice(&kind.to_ne_bytes());
            buffer[at + 4..at + len].copy_from_slice(&value);
            at += padded(value.len());
        }
    }
}

impl NetlinkDeserializable for NexthopMessage {
    type Error = DecodeError;

    fn deserialize(header: &NetlinkHeader, payload: &[u8]) -> Result<Self, DecodeError> {
        let verb = match header.message_type {
            RTM_NEWNEXTHOP => Verb::New,
            RTM_DELNEXTHOP => Verb::Del,
            RTM_GETNEXTHOP => Verb::Get,
            other => return Err(format!("not a nexthop message: type {other}").into()),
        };
        if payload.len() < HEADER_LEN {
            return Err(format!("nexthop message of {} bytes", payload.len()).into());
        }
        let mut msg = Self {
            verb,
            family: payload[0],
            protocol: payload[2],
            ..Self::default()
        };
        for nla in NlasIterator::new(&payload[HEADER_LEN..]) {
            let nla = nla?;
            let v = nla.value();
            let u32_of = |v: &[u8]| -> Result<u32, DecodeError> {
                Ok(u32::from_ne_bytes(v.try_into().map_err(|_| {
                    DecodeError::from(format!(
                        "nexthop attribute {} of {} bytes",
                        nla.kind(),
                        v.len()
                    ))
                })?))
            };
            match nla.kind() & 0x3fff {
                NHA_ID => msg.id = Some(u32_of(v)?),
                NHA_OIF => msg.oif = Some(u32_of(v)?),
                NHA_GATEWAY => {
                    msg.gateway = Some(match v.len() {
                        4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(v).expect("4 bytes"))),
                        16 => {
                            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(v).expect("16 bytes")))
                        }
                        n => return Err(format!("nexthop gateway of {n} bytes").into()),
                    })
                }
                NHA_GROUP => {
                    msg.other = true;
                    // `struct nexthop_grp`: a u32 ID, then weight and reserved bytes (8 bytes).
                    msg.group = v
                        .chunks_exact(8)
                        .map(|e| u32::from_ne_bytes([e[0], e[1], e[2], e[3]]))
                        .collect();
                }
                NHA_BLACKHOLE | NHA_ENCAP | NHA_FDB => msg.other = true,
                _ => {}
            }
        }
        Ok(msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_nexthop_reads_back_as_written() {
        for gw in ["10.0.0.2", "fd00::2"] {
            let m = NexthopMessage::new(201_400_005, gw.parse().unwrap(), 7, 201);
            let mut buf = vec![0xAA; m.buffer_len()];
            m.serialize(&mut buf);
            let mut header = NetlinkHeader::default();
            header.message_type = m.message_type();
            assert_eq!(NexthopMessage::deserialize(&header, &buf).unwrap(), m);
        }
    }

    #[test]
    fn a_delete_carries_the_id_alone_and_a_short_message_is_an_error() {
        let m = NexthopMessage::del(9);
        let mut buf = vec![0xAA; m.buffer_len()];
        m.serialize(&mut buf);
        assert_eq!(buf.len(), HEADER_LEN + 8);
        assert_eq!(
            &buf[..HEADER_LEN],
            &[0; HEADER_LEN],
            "no family, no protocol"
        );
        let mut header = NetlinkHeader::default();
        header.message_type = RTM_NEWNEXTHOP;
        assert!(NexthopMessage::deserialize(&header, &buf[..4]).is_err());
        header.message_type = 24;
        assert!(NexthopMessage::deserialize(&header, &buf).is_err());
    }
}

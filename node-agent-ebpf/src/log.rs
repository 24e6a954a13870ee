//! aya-log records, written to a BTF ring buffer.
//!
//! `aya-log-ebpf` 0.2 declares its `AYA_LOGS` ring buffer as a legacy `maps`-section map, which
//! libbpf 1.x (and so `bpftool prog loadall`) refuses to open. This module declares `AYA_LOGS`
//! as a `#[btf_map]` instead and writes records in aya-log's wire format through
//! `aya-log-common`'s own `Header`/`Field` encoders, so userspace `aya_log::EbpfLogger` forwards
//! them unchanged while every map in the object carries BTF.

use aya_ebpf::{Global, btf_maps::RingBuf};
use aya_log_common::{Argument, DisplayHint, Field, Header, Level, LogValueLength};

/// The ring buffer `aya_log::EbpfLogger` reads, found by this name.
#[btf_map]
static AYA_LOGS: RingBuf<(), { 1 << 17 }> = RingBuf::new();

/// Highest level that is emitted; `aya_log` userspace may override it at load.
#[unsafe(no_mangle)]
static AYA_LOG_LEVEL: Global<u8> = Global::new(0xff);

use aya_ebpf::macros::btf_map;

/// Largest record we reserve; the miss record needs well under half of it.
const MAX_RECORD: usize = 256;

/// Logs `"<msg><ip>"` at debug level, the address rendered by aya-log's `:i` hint.
#[inline(always)]
pub fn debug_ip<A: Argument>(msg: &str, ip: A) {
    let level = Level::Debug;
    if level as u8 > AYA_LOG_LEVEL.load() {
        return;
    }
    let _ = write_record(level, msg, ip);
}

/// One record: the length prefix, the header, then the three fields. A plain function rather
/// than a closure: closures compile to BTF `FUNC`s whose environment argument has no name, which
/// the kernel's BTF checker rejects ("Invalid arg#1") when libbpf loads the object.
#[inline(always)]
fn write_record<A: Argument>(level: Level, msg: &str, ip: A) -> Option<()> {
    {
        let header = Header::new(module_path!(), level, module_path!(), file!(), line!(), 3)?;
        let (kind, text) = msg.as_argument();
        let text = Field::new(kind, text)?;
        let (kind, hint) = DisplayHint::Ip.as_argument();
        let hint = Field::new(kind, hint)?;
        let (kind, value) = ip.as_argument();
        let value = Field::new(kind, value)?;

        let mut size = size_of::<LogValueLength>();
        let mut measure = |s: &[u8]| {
            size += s.len();
            Some(())
        };
        header.with_bytes(&mut measure)?;
        text.with_bytes(&mut measure)?;
        hint.with_bytes(&mut measure)?;
        value.with_bytes(&mut measure)?;
        if size > MAX_RECORD {
            return None;
        }
        let size = core::hint::black_box(LogValueLength::try_from(size).ok()?);

        let mut buf = core::hint::black_box(AYA_LOGS.reserve_bytes(MAX_RECORD, 0)?);
        let mut pos = 0;
        let mut write = |s: &[u8]| {
            let dst = buf.get_mut(pos..)?.get_mut(..s.len())?;
            dst.copy_from_slice(s);
            pos += s.len();
            Some(())
        };
        let written = write(size.to_ne_bytes().as_ref()).is_some()
            && header.with_bytes(&mut write).is_some()
            && text.with_bytes(&mut write).is_some()
            && hint.with_bytes(&mut write).is_some()
            && value.with_bytes(&mut write).is_some();
        if written {
            buf.submit(0);
        } else {
            buf.discard(0);
        }
        Some(())
    }
}

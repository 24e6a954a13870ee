//! Reading a whole BPF map in a few syscalls (`BPF_MAP_LOOKUP_BATCH`, Linux 5.6) instead of
//! two per entry.
//!
//! aya reads a map with `BPF_MAP_GET_NEXT_KEY` then `BPF_MAP_LOOKUP_ELEM` for every key: 130,000
//! node-map entries cost 260,000 syscalls, and the 65,536-slot freed-ID record, read at every
//! start, cost more than the rest of a run without nodes. A batch returns thousands of entries
//! per call. Where the kernel or the map type has no batch lookup (before 5.6; LPM tries), the
//! caller walks the map as before: [`lookup_all`] says so with `Ok(None)`.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use aya::Pod;
use aya::maps::MapError;
use aya::sys::SyscallError;

/// `BPF_MAP_LOOKUP_BATCH` in `enum bpf_cmd`.
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// Entries asked for per call: large enough that a hash bucket always fits (a smaller count
/// than a bucket's length is ENOSPC), small enough that the buffers stay a few hundred KiB.
const CHUNK: usize = 8192;
/// The kernel's ENOTSUPP (not in libc): an operation the map type does not implement.
const ENOTSUPP: i32 = 524;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Every entry of the map behind `fd`, whose keys are `K` and values `V`; `Ok(None)` when the
/// kernel cannot batch this map, before anything was read.
pub fn lookup_all<K: Pod, V: Pod>(fd: BorrowedFd<'_>) -> Result<Option<Vec<(K, V)>>, MapError> {
    // The batch position: an opaque token the kernel writes to `out_batch` and reads back
    // from `in_batch`; a bucket or an index, never larger than a key or a u64.
    let token_size = size_of::<K>().max(size_of::<u64>());
    let mut token_in = vec![0u8; token_size];
    let mut token_out = vec![0u8; token_size];
    let mut keys: Vec<K> = Vec::with_capacity(CHUNK);
    let mut values: Vec<V> = Vec::with_capacity(CHUNK);
    let mut out = Vec::new();
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { token_in.as_ptr() as u64 },
            out_batch: token_out.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd.as_fd().as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        // SAFETY: `attr` is the batch member of bpf_attr with its exact size; the key and value
        // buffers hold CHUNK elements and the tokens `token_size` bytes, all outliving the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &mut attr as *mut BatchAttr,
                size_of::<BatchAttr>(),
            )
        };
        let err = (rc < 0).then(io::Error::last_os_error);
        let n = (attr.count as usize).min(CHUNK);
        // SAFETY: the kernel wrote `attr.count` (at most CHUNK) keys and values, each a Pod
        // type of the map's key and value size.
        unsafe {
            keys.set_len(n);
            values.set_len(n);
        }
        out.extend(keys.drain(..).zip(values.drain(..)));
        match err.as_ref().and_then(io::Error::raw_os_error) {
            None => {}
            // The end of the map; the entries of this last call are in.
            Some(libc::ENOENT) => return Ok(Some(out)),
            Some(libc::EINVAL | ENOTSUPP | libc::EOPNOTSUPP | libc::ENOSYS) if first => {
                return Ok(None);
            }
            Some(_) => {
                return Err(MapError::SyscallError(SyscallError {
                    call: "bpf_map_lookup_batch",
                    io_error: err.expect("an errno came from an error"),
                }));
            }
        }
        std::mem::swap(&mut token_in, &mut token_out);
        first = false;
    }
}

#[cfg(test)]
mod tests {
    use aya::maps::{Array, HashMap, IterableMap, MapData};

    use super::*;

    /// Needs root (map creation); a test without it says so and checks nothing.
    fn can_create_maps() -> bool {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        if !root {
            eprintln!("skipped: creating BPF maps needs root");
        }
        root
    }

    #[test]
    fn a_batch_read_returns_every_entry_of_a_hash_map_and_an_array() {
        if !can_create_maps() {
            return;
        }
        // More entries than one call returns, so the position token is exercised.
        let n = CHUNK as u32 * 2 + 17;
        let mut hash = HashMap::<MapData, u32, u64>::create(n, 0).unwrap();
        for k in 0..n {
            hash.insert(k * 7, u64::from(k) + 1, 0).unwrap();
        }
        let mut got = lookup_all::<u32, u64>(hash.map().fd().as_fd())
            .unwrap()
            .expect("hash maps batch since Linux 5.6");
        got.sort();
        let want: Vec<(u32, u64)> = (0..n).map(|k| (k * 7, u64::from(k) + 1)).collect();
        assert_eq!(got, want);

        let mut array = Array::<MapData, u64>::create(n, 0).unwrap();
        array.set(5, 99, 0).unwrap();
        let got = lookup_all::<u32, u64>(array.map().fd().as_fd())
            .unwrap()
            .expect("arrays batch since Linux 5.6");
        assert_eq!(got.len(), n as usize, "an array has every slot");
        assert_eq!(got[5], (5, 99));
        assert!(got.iter().filter(|(k, _)| *k != 5).all(|(_, v)| *v == 0));
    }
}

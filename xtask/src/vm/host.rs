//! The host side's Debian packages: QEMU, busybox for the guest, and the tools whose binaries
//! are copied into the guest. Nothing else is installed on the host; the kernels are only
//! downloaded and unpacked.

pub const PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "cpio",
    "iproute2",
    "bpftool",
    "xz-utils",
    "zstd",
    "lz4",
    // The reference CNI plugins the tests make their pods with (`xtask::cni`).
    "containernetworking-plugins",
];

/// Installs whatever is missing; one dpkg-query per package when everything is there.
pub fn ensure_packages() -> anyhow::Result<()> {
    crate::apt::ensure("vm-test: host packages", PACKAGES, "")
}

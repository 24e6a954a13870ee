//! What the property tests share.

/// Cases per property: `PROPTEST_CASES`, 256 by default.
pub fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

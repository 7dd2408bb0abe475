//! # Sizes for people
//!
//! One formatter for byte counts in messages, tables and logs, so that
//! `daxkv status`, `daxkv probe`, the bench and the server's log lines say
//! a size the same way.

#![forbid(unsafe_code)]

/// `bytes` in binary units when it is an exact multiple of one ("2 MiB",
/// "3 TiB"), else in bytes ("4097 B"): never rounded, so the number shown
/// is the number meant.
pub fn human(bytes: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_binary_units_else_bytes() {
        assert_eq!(human(2 << 20), "2 MiB");
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human(3 << 40), "3 TiB");
        assert_eq!(human(4096), "4 KiB");
        assert_eq!(human(3 << 19), "1536 KiB");
        assert_eq!(human(4097), "4097 B");
        assert_eq!(human(1000), "1000 B");
        assert_eq!(human(0), "0 B");
    }
}

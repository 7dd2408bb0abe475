//! The control plane's size grammar (docs/lmcache-dax-behavior.md §5.4),
//! computed exactly on integers.

/// The longest size string accepted, in characters, after stripping.
pub const MAX_SIZE_CHARS: usize = 64;

/// Parse a size string of the HTTP control plane into a byte count.
///
/// The grammar (LMCache's, docs/lmcache-dax-behavior.md §5.4):
///
/// - leading and trailing whitespace is stripped; an empty string, or one
///   longer than [`MAX_SIZE_CHARS`] characters, is invalid;
/// - the unit is the trailing ASCII letters, case-insensitive, one of `""`,
///   `b`, `k`, `kb`, `kib`, `m`, `mb`, `mib`, `g`, `gb`, `gib`, `t`, `tb`,
///   `tib`, **all powers of 1024**; whitespace may separate it from the
///   number;
/// - the number is `\d+` or `\d+\.\d+` (ASCII digits), parsed exactly: the
///   decimal is never rounded through a float, so `"1.5GiB"` is exactly
///   1610612736;
/// - bytes = the product truncated to an integer, and must be > 0 and fit
///   in a `u64`.
///
/// Returns `None` for anything invalid; the caller answers with a fixed
/// message that never echoes the input.
///
/// ```
/// use daxkv::control::http::parse_size;
/// assert_eq!(parse_size("2GiB"), Some(2_147_483_648));
/// assert_eq!(parse_size(" 1.5 gib "), Some(1_610_612_736));
/// assert_eq!(parse_size("4096"), Some(4096));
/// assert_eq!(parse_size("0.1"), None); // truncates to 0 bytes
/// assert_eq!(parse_size("many"), None);
/// ```
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    if t.is_empty() || t.chars().count() > MAX_SIZE_CHARS {
        return None;
    }
    let num_end = t.trim_end_matches(|c: char| c.is_ascii_alphabetic()).len();
    let (num, suffix) = (t[..num_end].trim_end(), &t[num_end..]);
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0u32,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    let (int, frac) = match num.split_once('.') {
        Some((i, f)) if !f.is_empty() => (i, f),
        Some(_) => return None,
        None => (num, ""),
    };
    let digits = |d: &str| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit());
    if !digits(int) || !(frac.is_empty() || digits(frac)) {
        return None;
    }
    // bytes = whole × 2^shift + floor(0.frac × 2^shift), both exact: the
    // fraction is multiplied digit by digit from the right (schoolbook, by
    // the unit), and what carries past the decimal point is its integer
    // part, however many digits it has.
    let mut whole: u128 = 0;
    for b in int.bytes() {
        whole = whole.checked_mul(10)?.checked_add(u128::from(b - b'0'))?;
    }
    let unit = 1u128 << shift;
    let mut carry: u128 = 0; // stays < unit
    for b in frac.bytes().rev() {
        carry = (u128::from(b - b'0') * unit + carry) / 10;
    }
    let bytes = whole.checked_mul(unit)?.checked_add(carry)?;
    u64::try_from(bytes).ok().filter(|&b| b > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNITS: &[(&str, u32)] = &[
        ("", 0),
        ("b", 0),
        ("k", 10),
        ("kb", 10),
        ("kib", 10),
        ("m", 20),
        ("mb", 20),
        ("mib", 20),
        ("g", 30),
        ("gb", 30),
        ("gib", 30),
        ("t", 40),
        ("tb", 40),
        ("tib", 40),
    ];

    #[test]
    fn the_documented_examples() {
        assert_eq!(parse_size("2GiB"), Some(2_147_483_648));
        assert_eq!(parse_size("1536MiB"), Some(1_610_612_736));
        assert_eq!(parse_size("1.5GiB"), Some(1_610_612_736));
        assert_eq!(parse_size("1.5 GiB"), Some(1_610_612_736));
        assert_eq!(parse_size("  100GiB\t"), Some(100 << 30));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("4096b"), Some(4096));
        assert_eq!(parse_size("4k"), Some(4096));
        assert_eq!(parse_size("1TB"), Some(1 << 40));
        assert_eq!(parse_size("0.5k"), Some(512));
        assert_eq!(parse_size("1.0000001k"), Some(1024)); // truncated
        assert_eq!(parse_size("0.1M"), Some(104_857)); // 104857.6 truncated
        assert_eq!(parse_size("007k"), Some(7 << 10));
    }

    #[test]
    fn invalid_strings() {
        let long = "9".repeat(65);
        let padded_ok = format!("{}1k", "0".repeat(62)); // 64 chars
        let padded_bad = format!("{}1k", "0".repeat(63)); // 65 chars
        assert_eq!(parse_size(&padded_ok), Some(1024));
        for bad in [
            "",
            "   ",
            "0",
            "0k",
            "0.0GiB",
            "0.1",
            "many",
            "1.",
            ".5G",
            "-1",
            "+1",
            "1e3",
            "1,5G",
            "1 0G",
            "1..5G",
            "1.5.G",
            "4 parsecs",
            "1GiBs",
            "1 G iB",
            "1i",
            "GiB",
            "1\u{0663}k",
            "\u{0661}",
            "18446744073709551616", // u64::MAX + 1
            "16777216TiB",          // 2^64 bytes
            long.as_str(),
            padded_bad.as_str(),
        ] {
            assert_eq!(parse_size(bad), None, "{bad:?}");
        }
        assert_eq!(parse_size("18446744073709551615"), Some(u64::MAX));
        assert_eq!(
            parse_size("16777215.9999TiB"),
            Some((16_777_215u64 << 40) + (1u64 << 40) * 9999 / 10000)
        );
    }

    /// Fractions longer than any integer type still count exactly.
    #[test]
    fn long_fractions() {
        let s = format!("0.{}1T", "0".repeat(60));
        assert_eq!(parse_size(&s), None);
        let s = format!("1.{}1T", "0".repeat(50));
        assert_eq!(parse_size(&s), Some(1 << 40));
        let s = format!("0.{}T", "9".repeat(60));
        assert_eq!(parse_size(&s), Some((1 << 40) - 1));
        let s = format!("0.{}1k", "0".repeat(2)); // 1.024 bytes
        assert_eq!(parse_size(&s), Some(1));
        let s = format!("1023.{}k", "9".repeat(58)); // just under 1 MiB
        assert_eq!(parse_size(&s), Some((1 << 20) - 1));
    }

    /// Every unit in every case, with and without spaces, over a grid of
    /// integers and fractions, against the product computed separately.
    #[test]
    fn exhaustive_grid() {
        let fracs: &[(&str, u128, u32)] = &[
            ("", 0, 0),
            (".0", 0, 1),
            (".5", 5, 1),
            (".25", 25, 2),
            (".125", 125, 3),
            (".1", 1, 1),
            (".333", 333, 3),
            (".0001", 1, 4),
            (".999999999", 999_999_999, 9),
        ];
        let mut checked = 0u32;
        for whole in 0u128..=130 {
            for &(fs, fv, fd) in fracs {
                for &(unit, shift) in UNITS {
                    let scale = 10u128.pow(fd);
                    let want = ((whole * scale + fv) << shift) / scale;
                    let want = u64::try_from(want).ok().filter(|&b| b > 0);
                    for u in case_variants(unit) {
                        for sep in ["", " ", "\t "] {
                            for pad in ["", " ", "\n"] {
                                let s = format!("{pad}{whole}{fs}{sep}{u}{pad}");
                                assert_eq!(parse_size(&s), want, "{s:?}");
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 100_000);
    }

    fn case_variants(unit: &str) -> Vec<String> {
        let n = unit.len();
        (0u32..1 << n)
            .map(|mask| {
                unit.chars()
                    .enumerate()
                    .map(|(i, c)| {
                        if mask & (1 << i) != 0 {
                            c.to_ascii_uppercase()
                        } else {
                            c
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// Random strings over the grammar's alphabet and some junk: never a
    /// panic, and every accepted string is consistent under the grammar's
    /// symmetries (case, an explicit `b`, surrounding whitespace, leading
    /// zeros).
    #[test]
    fn random_strings_are_consistent() {
        const ALPHABET: &[u8] = b"0123456789012345678901234567890123456789...  \tbBkKmMgGtTiIxe-+,";
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut accepted = 0u32;
        for _ in 0..200_000 {
            let len = (next() % 72) as usize;
            let s: String = (0..len)
                .map(|_| char::from(ALPHABET[(next() % ALPHABET.len() as u64) as usize]))
                .collect();
            let Some(n) = parse_size(&s) else { continue };
            accepted += 1;
            assert!(n > 0, "{s:?}");
            assert_eq!(parse_size(&s.to_ascii_uppercase()), Some(n), "{s:?}");
            assert_eq!(parse_size(&s.to_ascii_lowercase()), Some(n), "{s:?}");
            let t = s.trim();
            if t.len() < MAX_SIZE_CHARS {
                assert_eq!(parse_size(&format!(" {t}")), Some(n), "{s:?}");
                assert_eq!(parse_size(&format!("0{t}")), Some(n), "{s:?}");
                if t.ends_with(|c: char| c.is_ascii_digit()) {
                    assert_eq!(parse_size(&format!("{t}b")), Some(n), "{s:?}");
                }
            }
        }
        assert!(accepted > 100, "only {accepted} accepted");
        for n in [1u64, 7, 4096, 1 << 30, u64::MAX] {
            assert_eq!(parse_size(&n.to_string()), Some(n));
        }
    }
}

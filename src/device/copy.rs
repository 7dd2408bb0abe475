//! # Copies into and out of DAX memory
//!
//! `to_dax` writes with non-temporal (streaming) stores: the destination is a
//! far memory tier the CPU will not read back soon, so filling the cache with
//! it (and reading each line before writing it, as a plain store does) only
//! wastes bandwidth. On this class of machine a single thread moves ~15 GB/s
//! with AVX-512 streaming stores against ~6 GB/s with glibc `memcpy`, whose
//! own non-temporal threshold (~99 MiB) is far above our object sizes.
//!
//! The kernel is chosen once at run time (the memchr habit): AVX-512F, AVX2,
//! SSE2, or a portable `copy_nonoverlapping` fallback. Each streaming kernel
//! copies an unaligned head with plain stores until the destination is
//! vector-aligned, streams the aligned body, copies the tail with plain
//! stores, and ends with `sfence`, so a Release store that publishes the
//! data afterwards orders after the streaming stores.
//!
//! Copies shorter than [`NT_THRESHOLD_BYTES`] use plain stores: below it the
//! streaming kernels lose to `memcpy` (`benches/copy.rs`, `copy/to_dax/*`).
//!
//! `from_dax` uses plain loads (`copy_nonoverlapping`): DAX memory is mapped
//! write-back, where `movntdqa` is an ordinary load, and the destination is
//! caller memory that is about to be used.

use std::sync::OnceLock;

/// Below this length `to_dax` uses plain stores. Measured with
/// `cargo bench --bench copy -- copy/to_dax`: streaming wins from 2 KiB up on
/// the AVX-512 machine this was tuned on.
pub const NT_THRESHOLD_BYTES: usize = 2048;

/// A copy kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// AVX-512F streaming stores (64-byte `vmovntdq`).
    Avx512,
    /// AVX2 streaming stores (32 bytes at a time).
    Avx2,
    /// SSE2 streaming stores (16-byte `movntdq`).
    Sse2,
    /// `copy_nonoverlapping`: plain stores, any CPU.
    Portable,
}

impl Kernel {
    /// Every kernel, widest first (the order dispatch tries them in).
    pub const ALL: [Kernel; 4] = [Kernel::Avx512, Kernel::Avx2, Kernel::Sse2, Kernel::Portable];

    /// Whether this CPU can run the kernel.
    pub fn is_available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Kernel::Sse2 => std::arch::is_x86_feature_detected!("sse2"),
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Avx512 | Kernel::Avx2 | Kernel::Sse2 => false,
            Kernel::Portable => true,
        }
    }

    /// Short lowercase name (`"avx512"`, …), as benchmark ids use it.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Avx512 => "avx512",
            Kernel::Avx2 => "avx2",
            Kernel::Sse2 => "sse2",
            Kernel::Portable => "portable",
        }
    }

    /// Parse a kernel name (as `DAXKV_COPY_KERNEL` takes it).
    pub fn from_name(s: &str) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// The best kernel this CPU runs, or the one `DAXKV_COPY_KERNEL` names (if
/// available). Detected once.
pub fn selected() -> Kernel {
    static SELECTED: OnceLock<Kernel> = OnceLock::new();
    *SELECTED.get_or_init(|| {
        if let Some(k) = std::env::var("DAXKV_COPY_KERNEL")
            .ok()
            .and_then(|s| Kernel::from_name(&s))
            .filter(|k| k.is_available())
        {
            return k;
        }
        Kernel::ALL
            .into_iter()
            .find(|k| k.is_available())
            .unwrap_or(Kernel::Portable)
    })
}

/// Copy `len` bytes from `src` to `dst` with the selected kernel.
///
/// # Safety
/// 1. `src` is valid for reads of `len` bytes and `dst` for writes of `len`
///    bytes;
/// 2. the two ranges do not overlap;
/// 3. during the copy no other thread reads or writes `dst..dst+len`, and
///    none writes `src..src+len`.
#[inline]
pub unsafe fn to_dax(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: `to_dax_with`'s contract: this function's (the caller's), and
    // `selected` only returns kernels this CPU supports.
    unsafe { to_dax_with(selected(), dst, src, len) }
}

/// Copy `len` bytes from `src` (DAX) to `dst` (caller memory).
///
/// # Safety
/// The contract of [`to_dax`].
#[inline]
pub unsafe fn from_dax(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: valid and disjoint ranges (the contract's points 1 and 2), as
    // `copy_nonoverlapping` requires; race-free by point 3.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Copy `len` bytes from `src` (DAX) to `dst` (caller memory) with the
/// streaming kernel [`to_dax`] uses, fenced before returning: for a batch
/// larger than the caches, where keeping the destination cached buys
/// nothing and the plain copy's read-for-ownership of every destination
/// line costs a third of the traffic (`DaxStore::restore_into`).
///
/// # Safety
/// The contract of [`to_dax`].
#[inline]
pub unsafe fn from_dax_streaming(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: `to_dax`'s contract is this function's (the caller's).
    unsafe { to_dax(dst, src, len) }
}

test_hooks_pub! {
/// [`to_dax`] with an explicit kernel (tests and benches compare them).
/// Public with the `test-hooks` feature only.
///
/// # Safety
/// 1. the contract of [`to_dax`];
/// 2. `kernel.is_available()` is true.
unsafe fn to_dax_with(kernel: Kernel, dst: *mut u8, src: *const u8, len: usize) {
    if len < NT_THRESHOLD_BYTES {
        // SAFETY: valid and disjoint ranges (`to_dax`'s points 1 and 2), as
        // `copy_nonoverlapping` requires; race-free by its point 3.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    // SAFETY: `stream_with`'s contract is this function's (the caller's).
    unsafe { stream_with(kernel, dst, src, len) }
}
}

test_hooks_pub! {
/// Copy with `kernel`'s streaming stores whatever the length (no
/// threshold): what `copy/threshold/*` compares against `memcpy`. Public
/// with the `test-hooks` feature only.
///
/// # Safety
/// The contract of [`to_dax_with`].
unsafe fn stream_with(kernel: Kernel, dst: *mut u8, src: *const u8, len: usize) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the kernel's contract: AVX-512F is available (the
        // caller's point 2, `is_available`) and the ranges are `to_dax`'s
        // (point 1).
        Kernel::Avx512 => unsafe { x86::nt_avx512(dst, src, len) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, with AVX2.
        Kernel::Avx2 => unsafe { x86::nt_avx2(dst, src, len) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, with SSE2.
        Kernel::Sse2 => unsafe { x86::nt_sse2(dst, src, len) },
        // SAFETY: valid and disjoint ranges (`to_dax`'s points 1 and 2), as
        // `copy_nonoverlapping` requires; race-free by its point 3.
        _ => unsafe { std::ptr::copy_nonoverlapping(src, dst, len) },
    }
}
}

test_hooks_pub! {
/// Plain `memcpy` (the baseline the benches compare against). Public with
/// the `test-hooks` feature only.
///
/// # Safety
/// The contract of [`to_dax`].
unsafe fn plain_copy(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: valid and disjoint ranges (the contract's points 1 and 2), as
    // `copy_nonoverlapping` requires; race-free by point 3.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}
}

// The kernels cast `*u8` to vector pointers: loads are `loadu` (no alignment
// needed) and every streaming store's address is aligned by the head copy.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::cast_ptr_alignment)]
mod x86 {
    #[cfg(not(miri))]
    use std::arch::x86_64::_mm_stream_si128;
    use std::arch::x86_64::{
        __m128i, __m256i, __m512i, _mm256_loadu_si256, _mm256_stream_si256, _mm512_loadu_si512,
        _mm512_stream_si512, _mm_loadu_si128,
    };

    /// `_mm_stream_si128`, or under Miri (which cannot run the inline
    /// assembly behind it) the aligned plain store it stands for: the SSE2
    /// kernel's head / body / tail arithmetic is then checked by Miri.
    ///
    /// # Safety
    /// `dst` is 16-byte aligned and writable for 16 bytes, and no other
    /// thread reads or writes those bytes during the store.
    #[inline]
    unsafe fn stream128(dst: *mut __m128i, v: __m128i) {
        #[cfg(not(miri))]
        // SAFETY: the caller's contract is the intrinsic's.
        unsafe {
            _mm_stream_si128(dst, v);
        }
        #[cfg(miri)]
        // SAFETY: as above.
        unsafe {
            dst.write(v);
        }
    }

    /// `sfence`: orders the streaming stores before the Release store that
    /// publishes them. Miri cannot run `sfence` itself; there the kernels end
    /// with the strongest fence Miri models, so the kernels' pointer
    /// arithmetic still runs under Miri.
    #[inline]
    fn sfence() {
        #[cfg(not(miri))]
        // SAFETY: SSE is part of the x86_64 baseline.
        unsafe {
            std::arch::x86_64::_mm_sfence();
        }
        // ORDERING: SeqCst fence — Miri's stand-in for `sfence` (Miri cannot
        // run the intrinsic); the Release commit after it is what publishes.
        #[cfg(miri)]
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// Bytes of plain copy needed to bring `dst` to `align`.
    #[inline]
    fn head_len(dst: *mut u8, align: usize, len: usize) -> usize {
        let mis = dst as usize & (align - 1);
        if mis == 0 {
            0
        } else {
            (align - mis).min(len)
        }
    }

    /// # Safety
    /// 1. AVX-512F is available;
    /// 2. the contract of `super::to_dax`: `src` readable and `dst`
    ///    writable for `len` bytes, not overlapping, and during the copy no
    ///    other thread reads or writes `dst` or writes `src`.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn nt_avx512(dst: *mut u8, src: *const u8, len: usize) {
        const V: usize = 64;
        let head = head_len(dst, V, len);
        if head > 0 {
            // SAFETY: head <= len; ranges valid, disjoint and race-free (the
            // contract's point 2).
            unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        }
        // Whole vectors after the head; the loops walk pointers (no offset
        // arithmetic per store) and end at `end4` / `end`.
        let vectors = (len - head) / V;
        let done = head + vectors * V;
        // SAFETY:
        // 1. head + vectors * V = done <= len, so every pointer below stays
        //    inside the two ranges (or one past their vector part) and every
        //    load and store is in bounds;
        // 2. `to` starts at dst + head, which is 64-aligned (head brought it
        //    there), and moves in whole vectors, as `_mm512_stream_si512` requires;
        // 3. loads are unaligned loads.
        unsafe {
            let mut from = src.add(head).cast::<__m512i>();
            let mut to = dst.add(head).cast::<__m512i>();
            let end = to.add(vectors);
            let end4 = to.add(vectors & !3);
            // 4 vectors per iteration: enough loads in flight to saturate
            // the write-combining buffers without needing a prefetch.
            while to < end4 {
                let v0 = _mm512_loadu_si512(from);
                let v1 = _mm512_loadu_si512(from.add(1));
                let v2 = _mm512_loadu_si512(from.add(2));
                let v3 = _mm512_loadu_si512(from.add(3));
                _mm512_stream_si512(to, v0);
                _mm512_stream_si512(to.add(1), v1);
                _mm512_stream_si512(to.add(2), v2);
                _mm512_stream_si512(to.add(3), v3);
                from = from.add(4);
                to = to.add(4);
            }
            while to < end {
                _mm512_stream_si512(to, _mm512_loadu_si512(from));
                from = from.add(1);
                to = to.add(1);
            }
        }
        if done < len {
            // SAFETY: done < len; the tail is in bounds.
            unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done) };
        }
        // Streaming stores are weakly ordered: fence so the caller's Release
        // store that publishes this data cannot pass them.
        sfence();
    }

    /// # Safety
    /// 1. AVX2 is available;
    /// 2. the contract of `super::to_dax`: `src` readable and `dst`
    ///    writable for `len` bytes, not overlapping, and during the copy no
    ///    other thread reads or writes `dst` or writes `src`.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn nt_avx2(dst: *mut u8, src: *const u8, len: usize) {
        const V: usize = 32;
        let head = head_len(dst, V, len);
        if head > 0 {
            // SAFETY: head <= len; ranges valid, disjoint and race-free (the
            // contract's point 2).
            unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        }
        // Whole vectors after the head; the loops walk pointers (no offset
        // arithmetic per store) and end at `end4` / `end`.
        let vectors = (len - head) / V;
        let done = head + vectors * V;
        // SAFETY:
        // 1. head + vectors * V = done <= len, so every pointer below stays
        //    inside the two ranges (or one past their vector part) and every
        //    load and store is in bounds;
        // 2. `to` starts at dst + head, which is 32-aligned (head brought it
        //    there), and moves in whole vectors, as `_mm256_stream_si256` requires;
        // 3. loads are unaligned loads.
        unsafe {
            let mut from = src.add(head).cast::<__m256i>();
            let mut to = dst.add(head).cast::<__m256i>();
            let end = to.add(vectors);
            let end4 = to.add(vectors & !3);
            while to < end4 {
                let v0 = _mm256_loadu_si256(from);
                let v1 = _mm256_loadu_si256(from.add(1));
                let v2 = _mm256_loadu_si256(from.add(2));
                let v3 = _mm256_loadu_si256(from.add(3));
                _mm256_stream_si256(to, v0);
                _mm256_stream_si256(to.add(1), v1);
                _mm256_stream_si256(to.add(2), v2);
                _mm256_stream_si256(to.add(3), v3);
                from = from.add(4);
                to = to.add(4);
            }
            while to < end {
                _mm256_stream_si256(to, _mm256_loadu_si256(from));
                from = from.add(1);
                to = to.add(1);
            }
        }
        if done < len {
            // SAFETY: done < len; the tail is in bounds.
            unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done) };
        }
        sfence();
    }

    /// # Safety
    /// 1. SSE2 is available;
    /// 2. the contract of `super::to_dax`: `src` readable and `dst`
    ///    writable for `len` bytes, not overlapping, and during the copy no
    ///    other thread reads or writes `dst` or writes `src`.
    #[target_feature(enable = "sse2")]
    pub(crate) unsafe fn nt_sse2(dst: *mut u8, src: *const u8, len: usize) {
        const V: usize = 16;
        let head = head_len(dst, V, len);
        // SAFETY: head <= len; ranges valid, disjoint and race-free (the
        // contract's point 2).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let mut off = head;
        while off + V <= len {
            // SAFETY: in bounds and dst + off is 16-aligned.
            unsafe {
                let v = _mm_loadu_si128(src.add(off).cast::<__m128i>());
                stream128(dst.add(off).cast::<__m128i>(), v);
            }
            off += V;
        }
        // SAFETY: off <= len; the tail is in bounds.
        unsafe { std::ptr::copy_nonoverlapping(src.add(off), dst.add(off), len - off) };
        sfence();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Copy `len` bytes from `src[src_off..]` into a zeroed `dst[dst_off..]`
    /// with `kernel` and compare with `copy_nonoverlapping`, guard bytes
    /// included.
    fn check(kernel: Kernel, len: usize, src_off: usize, dst_off: usize, src: &[u8]) {
        let mut got = vec![0xA5u8; dst_off + len + 64];
        let mut want = got.clone();
        // SAFETY: both buffers are large enough and distinct.
        unsafe {
            stream_with(
                kernel,
                got.as_mut_ptr().add(dst_off),
                src.as_ptr().add(src_off),
                len,
            );
            std::ptr::copy_nonoverlapping(
                src.as_ptr().add(src_off),
                want.as_mut_ptr().add(dst_off),
                len,
            );
        }
        assert!(
            got == want,
            "{kernel:?} len={len} src_off={src_off} dst_off={dst_off}"
        );
    }

    /// The kernels' head / body / tail split under Miri (the exhaustive
    /// tests below are too slow to interpret): lengths where the split
    /// changes, around the streaming threshold, at a few misalignments.
    #[test]
    fn kernel_edges_match_memcpy() {
        let src = pattern(4096 + 128, 5);
        for kernel in Kernel::ALL.into_iter().filter(|k| k.is_available()) {
            for len in [
                0, 1, 15, 16, 17, 63, 64, 65, 127, 129, 2047, 2048, 2049, 4096,
            ] {
                for (src_off, dst_off) in [(0, 0), (1, 0), (0, 1), (13, 31), (63, 17)] {
                    check(kernel, len, src_off, dst_off, &src);
                }
            }
        }
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "exhaustive: too slow under Miri (kernel_edges_match_memcpy runs there)"
    )]
    fn every_length_and_misalignment_matches_memcpy() {
        let src = pattern(4096 + 128, 7);
        for kernel in Kernel::ALL.into_iter().filter(|k| k.is_available()) {
            for len in 0..=4096 {
                // Every destination misalignment for every length, with the
                // source misalignment walking through all 64 values too.
                for dst_off in 0..64 {
                    let src_off = (len * 7 + dst_off * 13) % 64;
                    check(kernel, len, src_off, dst_off, &src);
                }
            }
            // The full source x destination product on the lengths where the
            // head / body / tail split changes.
            for len in [
                0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1023, 1024, 1025, 2048, 4095, 4096,
            ] {
                for src_off in 0..64 {
                    for dst_off in 0..64 {
                        check(kernel, len, src_off, dst_off, &src);
                    }
                }
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "4 MiB copies: too slow under Miri")]
    fn large_random_lengths_match_memcpy() {
        let src = pattern((4 << 20) + 64, 11);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for kernel in Kernel::ALL.into_iter().filter(|k| k.is_available()) {
            for _ in 0..12 {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let len = (x >> 20) as usize % (4 << 20);
                check(
                    kernel,
                    len,
                    (x >> 8) as usize % 64,
                    (x >> 14) as usize % 64,
                    &src,
                );
            }
        }
    }

    #[test]
    fn from_dax_round_trips() {
        let src = pattern(10_000, 3);
        let mut dax = vec![0u8; 10_000];
        let mut back = vec![0u8; 10_000];
        // SAFETY: buffers are 10 000 bytes and distinct.
        unsafe {
            to_dax(dax.as_mut_ptr(), src.as_ptr(), src.len());
            from_dax(back.as_mut_ptr(), dax.as_ptr(), dax.len());
        }
        assert_eq!(back, src);
    }

    #[test]
    fn kernel_names_round_trip() {
        for k in Kernel::ALL {
            assert_eq!(Kernel::from_name(k.name()), Some(k));
        }
        assert!(Kernel::Portable.is_available());
        assert!(selected().is_available());
    }
}

//! The CPU quantizer's kernel ([`super::CpuQuantizer`]): recipe v2 computed from the BF16 bits,
//! byte for byte [`crate::reference::quantize`] (linear scales) at a few integer operations per
//! element.
//!
//! Per block of 16: the amax is the largest `bits & 0x7FFF` (magnitude bits order like the
//! magnitudes; above 0x7F80 is a NaN); the scale byte is the reference's own step 2
//! ([`block_scale_byte`], one division per block); each code is then read off a table of
//! thresholds over the magnitude bits. For a fixed `d`, the reference's step 4
//! ([`element_code`]) depends on the element only through its magnitude and its sign, and
//! monotonically: `q = RN(v / d)` is non-decreasing in `v` (a correctly rounded monotone function)
//! and odd in `v`, and the E2M1 index of `q` is non-decreasing in `|q|` (the infinite elements, the
//! largest magnitude, get index 7 either way; with `d = 0`, every element has index 7; with
//! `d = inf`, every finite one index 0). So, with `m = |v|`'s bits:
//!
//! - magnitude index = the number of k in 1..=7 with `m >= T_k`, `T_k` the least magnitude whose
//!   index is at least k;
//! - sign bit = `v` negative and `m >= Z`, `Z` the least magnitude whose negative gets the sign
//!   bit (`q < 0`: a quotient that underflows to -0.0, or the NaN of -0.0 / 0, has none).
//!
//! [`CodeTable::new`] finds the 8 thresholds of each of the 127 non-NaN scale bytes by evaluating
//! [`element_code`] itself (a bracketing search from the estimate `c_k d`: a few evaluations per
//! threshold), so the codes are the reference's by construction wherever the monotonicity holds;
//! the tests check every bf16 input against [`element_code`] for many decode scales.

use half::bf16;

use super::BLOCK;
use crate::format::{e4m3_decode, E4M3_NAN_BYTE};
use crate::reference::{block_scale_byte, element_code};

/// Magnitude bits of +Inf: the largest non-NaN magnitude.
const INF_BITS: u16 = 0x7F80;

/// A threshold no non-NaN magnitude reaches.
const NEVER: u16 = INF_BITS + 1;

/// The E2M1 decision points: index k (1..=7) starts near `DECISION_POINTS[k - 1] * d`.
const DECISION_POINTS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];

/// Everything the kernel needs for one decode scale g: per non-negative scale byte s,
/// `[Z, T_1, ..., T_7]` over magnitude bits (see the module docs), each stored minus one as i16
/// (`m >= T` is `m > T - 1`, a signed 16-bit compare; every value is in `-1..=0x7F80`).
pub(super) struct CodeTable {
    decode_scale: f32,
    below: [[i16; 8]; 128],
}

impl CodeTable {
    /// The thresholds of every scale byte 0x00..=0x7E for decode scale `g` (0x7F, the NaN scale,
    /// never reaches them; its row is unused).
    pub(super) fn new(decode_scale: f32) -> CodeTable {
        let mut below = [[NEVER as i16 - 1; 8]; 128];
        for (s, row) in below.iter_mut().enumerate().take(usize::from(E4M3_NAN_BYTE)) {
            let d = e4m3_decode(s as u8) * decode_scale;
            let code = |m: u16, negative: bool| {
                element_code(f32::from_bits((u32::from(m) << 16) | (u32::from(negative) << 31)), d)
            };
            row[0] = least_magnitude(1, |m| code(m, true) & 0x8 != 0) as i16 - 1;
            for (k, &c) in DECISION_POINTS.iter().enumerate() {
                // The bf16 bits (truncated) of c d: the threshold, or within a step or two of it.
                let estimate = ((c * d).to_bits() >> 16).min(u32::from(INF_BITS)) as u16;
                row[k + 1] = least_magnitude(estimate, |m| code(m, false) & 0x7 > k as u8) as i16 - 1;
            }
        }
        CodeTable { decode_scale, below }
    }

    /// The `[Z, T_1..T_7]` row of scale byte `s`.
    #[cfg(test)]
    fn row(&self, s: u8) -> [u16; 8] {
        self.below[usize::from(s & 0x7F)].map(|t| (t + 1) as u16)
    }
}

/// The least magnitude bits `m` in `0..=INF_BITS` with `holds(m)`, or [`NEVER`]; `holds` is
/// monotone (false, then true). Brackets the answer outward from `estimate` in doubling steps,
/// then bisects: exact for any estimate, and a few calls for a close one.
fn least_magnitude(estimate: u16, holds: impl Fn(u16) -> bool) -> u16 {
    let top = u32::from(INF_BITS);
    let at = |m: u32| holds(m as u16);
    let e = u32::from(estimate).min(top);
    // The answer lies in [lo, hi], where hi == top + 1 stands for "none".
    let (mut lo, mut hi);
    if at(e) {
        hi = e;
        let mut step = 1;
        loop {
            if hi == 0 {
                return 0;
            }
            let probe = hi.saturating_sub(step);
            if at(probe) {
                hi = probe;
                step *= 2;
            } else {
                lo = probe + 1;
                break;
            }
        }
    } else {
        lo = e + 1;
        let mut step = 1;
        loop {
            if lo > top {
                return NEVER;
            }
            let probe = (lo + step - 1).min(top);
            if at(probe) {
                hi = probe;
                break;
            }
            lo = probe + 1;
            step *= 2;
        }
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if at(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo as u16
}

/// One block on any target: (scale byte, 8 code bytes as a little-endian u64, element 2j in the
/// low nibble of byte j).
#[inline]
fn quantize_block(xb: &[bf16], table: &CodeTable) -> (u8, u64) {
    let amax = xb.iter().fold(0u16, |a, v| a.max(v.to_bits() & 0x7FFF));
    if amax > INF_BITS {
        return (E4M3_NAN_BYTE, 0);
    }
    let scale = block_scale_byte(f32::from_bits(u32::from(amax) << 16), table.decode_scale);
    let below = &table.below[usize::from(scale & 0x7F)];
    let mut packed = 0u64;
    for (i, v) in xb.iter().enumerate() {
        let b = v.to_bits();
        let m = (b & 0x7FFF) as i16;
        let index: u64 = below[1..].iter().map(|&t| u64::from(m > t)).sum();
        let sign = u64::from(b >> 15) & u64::from(m > below[0]);
        packed |= (index | (sign << 3)) << (4 * i);
    }
    (scale, packed)
}

/// [`quantize_blocks`] for any target.
fn quantize_blocks_portable(x: &[bf16], table: &CodeTable, codes: &mut [u8], scales: &mut [u8]) {
    for ((xb, cb), s) in x.chunks_exact(BLOCK).zip(codes.chunks_exact_mut(BLOCK / 2)).zip(scales.iter_mut()) {
        let (scale, packed) = quantize_block(xb, table);
        cb.copy_from_slice(&packed.to_le_bytes());
        *s = scale;
    }
}

/// [`quantize_blocks`] with AVX2: a block is one register of 16 x i16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_blocks_avx2(x: &[bf16], table: &CodeTable, codes: &mut [u8], scales: &mut [u8]) {
    use std::arch::x86_64::*;
    let low15 = _mm256_set1_epi16(0x7FFF);
    let sign_bit = _mm256_set1_epi16(0x8);
    let ones = _mm_set1_epi32(-1);
    // madd with (1, 16) per pair of i16 lanes: the i32 lane j is code[2j] | code[2j + 1] << 4.
    let pair = _mm256_set1_epi32(0x0010_0001);
    for ((xb, cb), s) in x.chunks_exact(BLOCK).zip(codes.chunks_exact_mut(BLOCK / 2)).zip(scales.iter_mut()) {
        // SAFETY: `xb` is 16 bf16, 32 readable bytes; an unaligned load.
        let v = unsafe { _mm256_loadu_si256(xb.as_ptr().cast()) };
        let mag = _mm256_and_si256(v, low15);
        // The largest of 16 magnitudes: max of the halves, then minpos of the complement.
        let half = _mm_max_epi16(_mm256_castsi256_si128(mag), _mm256_extracti128_si256::<1>(mag));
        let amax = !(_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(half, ones))) as u16);
        if amax > INF_BITS {
            cb.fill(0);
            *s = E4M3_NAN_BYTE;
            continue;
        }
        let scale = block_scale_byte(f32::from_bits(u32::from(amax) << 16), table.decode_scale);
        let below = &table.below[usize::from(scale & 0x7F)];
        // The sign bit (bit 15 moved to bit 3) where m >= Z, then +1 (minus a -1 mask) per
        // magnitude threshold passed.
        let sign = _mm256_and_si256(_mm256_srli_epi16::<12>(v), sign_bit);
        let mut code = _mm256_and_si256(sign, _mm256_cmpgt_epi16(mag, _mm256_set1_epi16(below[0])));
        for &t in &below[1..] {
            code = _mm256_sub_epi16(code, _mm256_cmpgt_epi16(mag, _mm256_set1_epi16(t)));
        }
        let bytes = _mm256_madd_epi16(code, pair);
        let words = _mm_packus_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256::<1>(bytes));
        let packed = _mm_cvtsi128_si64(_mm_packus_epi16(words, words)) as u64;
        cb.copy_from_slice(&packed.to_le_bytes());
        *s = scale;
    }
}

/// The bits of the largest finite `|x_i|` (0 for none): magnitude bits below 0x7F80 order like the
/// values. In 32 lanes of i16 (all values are below 0x8000) for the vectorizer.
pub(super) fn finite_amax_bits(x: &[bf16]) -> u16 {
    const LANES: usize = 32;
    #[inline(always)]
    fn finite_magnitude(v: &bf16) -> i16 {
        let m = (v.to_bits() & 0x7FFF) as i16;
        if m < INF_BITS as i16 {
            m
        } else {
            0
        }
    }
    let mut lanes = [0i16; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l = (*l).max(finite_magnitude(v));
        }
    }
    let tail = chunks.remainder().iter().map(finite_magnitude).fold(0, i16::max);
    lanes.iter().copied().fold(tail, i16::max) as u16
}

/// Quantizes consecutive blocks: `x` (a multiple of 16 elements) into `codes` (`x.len() / 2`
/// bytes) and `scales` (`x.len() / 16`), as the reference does for the linear layout.
pub(super) fn quantize_blocks(x: &[bf16], table: &CodeTable, codes: &mut [u8], scales: &mut [u8]) {
    debug_assert!(x.len().is_multiple_of(BLOCK) && codes.len() == x.len() / 2 && scales.len() == x.len() / BLOCK);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: this CPU has AVX2 (checked just above).
        unsafe { quantize_blocks_avx2(x, table, codes, scales) };
        return;
    }
    quantize_blocks_portable(x, table, codes, scales);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::WEIGHT_DECODE_SCALE_FACTOR;
    use crate::layout::ScaleLayout;
    use crate::rng::Rng;

    /// The kernels this machine runs: the dispatched one (AVX2 where the CPU has it) and the
    /// portable one.
    type Kernel = fn(&[bf16], &CodeTable, &mut [u8], &mut [u8]);
    const KERNELS: [(&str, Kernel); 2] = [("dispatched", quantize_blocks), ("portable", quantize_blocks_portable)];

    fn assert_like_reference(x: &[bf16], g: f32, what: &str) {
        let want = crate::reference::quantize(x, x.len() / BLOCK, BLOCK, g, ScaleLayout::Linear).unwrap();
        let table = CodeTable::new(g);
        for (kernel, f) in KERNELS {
            let (mut c, mut s) = (vec![0xAAu8; x.len() / 2], vec![0xAAu8; x.len() / BLOCK]);
            f(x, &table, &mut c, &mut s);
            assert_blocks_equal(x, g, &c, &s, &want, &format!("{what}, {kernel}"));
        }
    }

    fn assert_blocks_equal(x: &[bf16], g: f32, c: &[u8], s: &[u8], want: &crate::host::Nvfp4Host, what: &str) {
        if c != want.codes || s != want.scales {
            let b = (0..x.len() / BLOCK)
                .find(|&b| c[b * 8..b * 8 + 8] != want.codes[b * 8..b * 8 + 8] || s[b] != want.scales[b])
                .unwrap();
            let block: Vec<String> = x[b * BLOCK..][..BLOCK].iter().map(|v| format!("{:#06x}", v.to_bits())).collect();
            panic!(
                "{what}: g = {g:e} ({:#010x}), block {b} = [{}]: scale {:#04x} codes {:02x?}, the reference {:#04x} {:02x?}",
                g.to_bits(),
                block.join(", "),
                s[b],
                &c[b * 8..b * 8 + 8],
                want.scales[b],
                &want.codes[b * 8..b * 8 + 8]
            );
        }
    }

    /// Decode scales that stress the thresholds: ModelOpt's convention over many amax (powers of
    /// two included: short reciprocals, near ties), random ones, and the extremes (d underflowing
    /// to zero or subnormal, d overflowing to infinity, 6g overflowing).
    fn decode_scales(r: &mut Rng, random: usize) -> Vec<f32> {
        let mut gs = vec![
            f32::from_bits(1),
            f32::from_bits(0x0000_1234),
            f32::MIN_POSITIVE,
            1e-30,
            2f32.powi(-100),
            1.0,
            1.0 / 2688.0,
            2f32.powi(20),
            1e35,
            f32::MAX / 448.0,
            f32::MAX / 6.0,
            f32::MAX,
        ];
        for e in -30..=16 {
            gs.push(2f32.powi(e) * WEIGHT_DECODE_SCALE_FACTOR);
        }
        for amax in [0.0625f32, 0.1, 0.125, 0.2, 0.25, 1.0, 1.5, 3.0, 448.0 * 6.0] {
            gs.push(amax * WEIGHT_DECODE_SCALE_FACTOR);
        }
        for _ in 0..random {
            let amax = bf16::from_bits(r.range(0x0001, 0x7F80) as u16).to_f32();
            gs.push(amax * WEIGHT_DECODE_SCALE_FACTOR);
            gs.push(f32::from_bits(r.range(1, 0x7F80_0000) as u32));
        }
        gs.retain(|g| g.is_finite() && *g > 0.0);
        gs
    }

    /// Every bf16 input (NaNs aside) against `element_code`, for every scale byte: the thresholds
    /// hold exactly (this is the monotonicity the table relies on, checked).
    #[test]
    fn thresholds_give_the_reference_code_for_every_bf16_and_scale() {
        let mut r = crate::testing::test_rng();
        // 127 x 65536 inputs per g: a few seconds in all in release, a subset in debug builds.
        let every = if cfg!(debug_assertions) { 16 } else { 1 };
        for g in decode_scales(&mut r, 12).into_iter().step_by(every) {
            let table = CodeTable::new(g);
            for s in 0..0x7Fu8 {
                let d = e4m3_decode(s) * g;
                let [z, t @ ..] = table.row(s);
                for bits in 0..=u16::MAX {
                    let m = bits & 0x7FFF;
                    if m > INF_BITS {
                        continue;
                    }
                    let index = t.iter().filter(|&&t| m >= t).count() as u8;
                    let sign = (bits >> 15) as u8 & u8::from(m >= z);
                    let want = element_code(bf16::from_bits(bits).to_f32(), d);
                    assert_eq!(
                        index | (sign << 3),
                        want,
                        "g = {g:e} ({:#010x}), s = {s:#04x}, x = {bits:#06x}",
                        g.to_bits()
                    );
                }
            }
        }
    }

    /// Whole tensors against the reference: Gaussian weights with ModelOpt's g, varied block
    /// magnitudes, and blocks built from edge values (zeros of both signs, subnormals, the largest
    /// finite values, infinities, NaNs, E2M1 ties of the block's d).
    #[test]
    fn blocks_equal_the_reference() {
        let mut r = crate::testing::test_rng();
        for _ in 0..8 {
            let x = r.normal_bf16(1 << 14, 0.02);
            let g = crate::host::weight_decode_scale(&x).unwrap();
            assert_like_reference(&x, g, "normal");
            let x = r.varied_bf16(1 << 14);
            let g = crate::host::weight_decode_scale(&x).unwrap();
            assert_like_reference(&x, g, "varied");
        }
        let edges: Vec<u16> = vec![
            0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x8080, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80,
            0x7FC0, 0xFFC1, 0x7F81,
        ];
        for g in decode_scales(&mut r, 24) {
            let mut x = Vec::with_capacity(1 << 12);
            for b in 0..(1 << 12) / BLOCK {
                // A block scale from the block's largest element, then elements at the E2M1
                // decision points of its d (and their bf16 neighbours), or random bits, or edges.
                let kind = r.below(4);
                let amax = bf16::from_bits(r.range(0x0001, 0x7F80) as u16).to_f32();
                let d = e4m3_decode(block_scale_byte(amax, g)) * g;
                for i in 0..BLOCK {
                    let v = match (kind, i) {
                        (_, 0) => bf16::from_f32(if b % 2 == 0 { amax } else { -amax }).to_bits(),
                        (0, _) => {
                            let c = DECISION_POINTS[r.below(7) as usize] * d;
                            let near = bf16::from_f32(c).to_bits();
                            let bits = near.wrapping_add(r.below(3) as u16).wrapping_sub(1);
                            bits | ((r.below(2) as u16) << 15)
                        }
                        (1, _) => r.next_u32() as u16,
                        (2, _) => edges[r.below(edges.len() as u64 - 3) as usize],
                        _ => edges[r.below(edges.len() as u64) as usize],
                    };
                    x.push(bf16::from_bits(v));
                }
            }
            assert_like_reference(&x, g, "edges");
            // Whole blocks of one value.
            let mut x = Vec::new();
            for &e in &edges {
                x.extend(std::iter::repeat_n(bf16::from_bits(e), BLOCK));
            }
            assert_like_reference(&x, g, "uniform blocks");
        }
    }

    #[test]
    fn finite_amax_skips_inf_and_nan() {
        let mut r = crate::testing::test_rng();
        for n in [0usize, 1, 31, 32, 33, 1000, 4099] {
            let x: Vec<bf16> = (0..n).map(|_| bf16::from_bits(r.next_u32() as u16)).collect();
            let want = x.iter().map(|v| v.to_bits() & 0x7FFF).filter(|&m| m < INF_BITS).max().unwrap_or(0);
            assert_eq!(finite_amax_bits(&x), want, "n = {n}");
        }
        let x = [0x7F80u16, 0xFF80, 0x7FC0, 0x8000, 0x0001].map(bf16::from_bits);
        assert_eq!(finite_amax_bits(&x), 1);
    }

    /// CPU seconds of this thread (`CLOCK_THREAD_CPUTIME_ID`) or of the whole process.
    fn cpu_seconds(process: bool) -> f64 {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        let clock = if process { libc::CLOCK_PROCESS_CPUTIME_ID } else { libc::CLOCK_THREAD_CPUTIME_ID };
        // SAFETY: a valid clock id and a valid timespec to write.
        unsafe { libc::clock_gettime(clock, &mut ts) };
        ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
    }

    /// Speed of the kernels against the reference, on a Gaussian expert-sized matrix: MB of BF16
    /// input per second of wall time (best of 5) and per CPU second (the same run; robust against
    /// other load on the machine). `cargo test --release --no-default-features --lib
    /// convert::cpu::tests::speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn speed() {
        use crate::convert::{CpuQuantizer, Quantizer};
        let mut r = Rng::new(7);
        let (rows, cols) = (1536usize, 4096usize);
        let x = r.normal_bf16(rows * cols, 0.02);
        let g = crate::host::weight_decode_scale(&x).unwrap();
        let mb = (x.len() * 2) as f64 / 1e6;
        let want = crate::reference::quantize(&x, rows, cols, g, ScaleLayout::Linear).unwrap();
        let (mut c, mut s) = (vec![0u8; x.len() / 2], vec![0u8; x.len() / BLOCK]);
        let mut report = |what: &str, reps: usize, process: bool, f: &mut dyn FnMut(&mut [u8], &mut [u8])| {
            let (mut wall, mut cpu) = (f64::MAX, f64::MAX);
            for _ in 0..reps {
                c.fill(0);
                let (t, u) = (std::time::Instant::now(), cpu_seconds(process));
                f(&mut c, &mut s);
                wall = wall.min(t.elapsed().as_secs_f64());
                cpu = cpu.min(cpu_seconds(process) - u);
                assert!(c == want.codes && s == want.scales, "{what}");
            }
            eprintln!("{what:<34} {:>7.0} MB/s wall {:>7.0} MB/cpu-s", mb / wall, mb / cpu);
        };
        eprintln!("[{rows}, {cols}] normal bf16, {mb:.1} MB:");
        report("reference::quantize, 1 thread", 2, false, &mut |c, s| {
            let q = crate::reference::quantize(&x, rows, cols, g, ScaleLayout::Linear).unwrap();
            c.copy_from_slice(&q.codes);
            s.copy_from_slice(&q.scales);
        });
        let table = CodeTable::new(g);
        report("portable kernel, 1 thread", 5, false, &mut |c, s| quantize_blocks_portable(&x, &table, c, s));
        report("dispatched kernel, 1 thread", 5, false, &mut |c, s| quantize_blocks(&x, &table, c, s));
        for threads in [1, 2] {
            let what = format!("CpuQuantizer, {threads} thread(s)");
            report(&what, 5, true, &mut |c, s| {
                CpuQuantizer::with_threads(threads).quantize(&x, rows, cols, g, c, s).unwrap()
            });
        }
        let t = cpu_seconds(false);
        let table = CodeTable::new(g);
        eprintln!("CodeTable::new: {:.1} us", (cpu_seconds(false) - t) * 1e6);
        let t = cpu_seconds(false);
        let a = finite_amax_bits(std::hint::black_box(&x));
        eprintln!("finite_amax_bits: {:.0} MB/cpu-s", mb / (cpu_seconds(false) - t));
        assert_eq!(bf16::from_bits(a).to_f32() * WEIGHT_DECODE_SCALE_FACTOR, table.decode_scale);
    }
}

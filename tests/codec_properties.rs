//! Properties of the CPU NVFP4 codec (recipe v2 of `design/NVFP4.md`), with `proptest`:
//!
//! - the error bound: for every block, decoding exactly (in f64, `e2m1 x d`, where
//!   `d = RN_f32(e4m3(s) * g)` is the block's FP32 decode scale of recipe step 3) gives
//!   `|decode(encode(x)) - x| <= h(x) * d + ulp_f32(x)`, with `h(x)` half the E2M1 grid step at
//!   `|x| / d` (0.25 below 2, 0.5 below 4, 1 up to 6); saturated elements (`|x| > 6d`, which recipe
//!   step 4 rounds to 6, and infinities, step 5) are excepted. Decoded as the format's exact value
//!   `e2m1 x e4m3 x g` instead, the error can pass that bound by `|e2m1| x |e4m3 x g - d|` (the
//!   rounding of d in step 3; up to half an ulp of x more, near an E2M1 decision point): the test
//!   `the_format_value_differs_by_the_rounding_of_d` pins an example;
//! - the round trip: `encode(decode(q)) == q` for every encoded block `q` whose largest code
//!   magnitude is 6 and that has no code 8 (decode is the crate's BF16 dequantization, what the
//!   quantizer takes back; -0.0 would re-encode to code 0) and whose decoded values are finite
//!   (beyond the BF16 range a value decodes to an infinity, which saturates);
//! - the recipe-v2 rules: all-zero blocks (scale 0x38, codes 0), tiny scales (clamped to 2^-9, the
//!   codes kept), a quotient that underflows (t = 1), exact ties (to the even neighbour), NaN
//!   blocks (scale 0x7F, codes 0).
//!
//! Every property runs a fixed number of cases from one seed, printed at the start; set
//! `NVFP4MOE_TEST_SEED` to replay it (see `nvfp4_moe::testing::test_rng`).

use nvfp4_moe::format::{e2m1_decode, e4m3_decode, E2M1_MAGNITUDES};
use nvfp4_moe::reference::{dequantize_element, quantize_block, BlockQuant};
use nvfp4_moe::testing::test_rng;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

/// `cases` cases seeded from the test's seed (`NVFP4MOE_TEST_SEED` or a fresh one, printed), no
/// regression files (the seed replays a failure).
fn config(cases: u32) -> Config {
    Config {
        cases,
        rng_seed: RngSeed::Fixed(test_rng().seed()),
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    }
}

/// A positive, finite, normal f32 `(1 + m/2^23) * 2^e`.
fn f32_of(e: i32, m: u32) -> f32 {
    f32::from_bits((((e + 127) as u32) << 23) | (m & 0x7F_FFFF))
}

/// Decode scales g over most of the f32 range (normal, so 6g does not overflow).
fn decode_scale() -> impl Strategy<Value = f32> {
    (-126i32..=120, any::<u32>()).prop_map(|(e, m)| f32_of(e, m))
}

/// One element of a block whose magnitudes sit around `2^center`: zeros of both signs, values
/// spread over 2^-30 .. 2^3 around the center, and any bit pattern now and then.
fn element(center: i32) -> impl Strategy<Value = f32> {
    prop_oneof![
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        12 => (-30i32..=3, any::<u32>(), any::<bool>()).prop_map(move |(de, m, neg)| {
            let e = (center + de).clamp(-126, 127);
            let v = f32_of(e, m);
            if neg { -v } else { v }
        }),
        1 => any::<u32>().prop_map(f32::from_bits).prop_filter("finite", |v| v.is_finite()),
    ]
}

/// A block of 16 finite f32 around a random magnitude.
fn block() -> impl Strategy<Value = [f32; 16]> {
    (-120i32..=120).prop_flat_map(|c| proptest::array::uniform16(element(c)))
}

/// A block and a decode scale that put the block's amax/6g across the whole E4M3 range and beyond
/// it (tiny and clamped scales, and the underflow of t, included).
fn block_and_g() -> impl Strategy<Value = ([f32; 16], f32)> {
    (block(), decode_scale())
}

/// The distance from `x` to the next f32 away from zero (one ulp of `x`).
fn ulp(x: f32) -> f64 {
    let a = x.abs();
    if a == f32::MAX {
        return f64::from(a) - f64::from(f32::from_bits(a.to_bits() - 1));
    }
    f64::from(f32::from_bits(a.to_bits() + 1)) - f64::from(a)
}

/// Half the E2M1 grid step at magnitude `r` (in units of d): the grid is 0, 0.5, ..., 2 in steps
/// of 0.5, then 3, 4, then 6.
fn half_step(r: f64) -> f64 {
    if r < 2.0 {
        0.25
    } else if r < 4.0 {
        0.5
    } else {
        1.0
    }
}

/// The f64 value of a block's element exactly as the format defines it: e2m1 x e4m3 x g (the
/// product has at most 2 + 4 + 24 significant bits: exact in f64).
fn decode_format(q: &BlockQuant, i: usize, g: f32) -> f64 {
    f64::from(e2m1_decode(q.codes[i])) * f64::from(e4m3_decode(q.scale)) * f64::from(g)
}

/// The f64 value of a block's element against the block's FP32 decode scale d (recipe step 3):
/// e2m1 x d, exact in f64 (a zero code is 0 even where d overflowed to infinity: a block holding
/// an infinity has scale 448, and 448 g may pass the f32 range).
fn decode_with_d(q: &BlockQuant, i: usize, g: f32) -> f64 {
    let c = f64::from(e2m1_decode(q.codes[i]));
    if c == 0.0 {
        return c;
    }
    c * f64::from(e4m3_decode(q.scale) * g)
}

/// The bound of the module docs; returns the first element breaking it.
fn check_error_bound(x: &[f32; 16], g: f32) -> Result<(), TestCaseError> {
    let q = quantize_block(x, g);
    let d = e4m3_decode(q.scale) * g;
    // (A decode scale that overflows FP32 would make every bound infinite: such blocks say nothing.)
    prop_assume!(d.is_finite());
    for (i, &v) in x.iter().enumerate() {
        let r = f64::from(v).abs() / f64::from(d);
        // Saturation (recipe step 4; with d = 0 a quotient is infinite, or 0/0, which the recipe
        // counts as above every decision point).
        if r.is_nan() || r > 6.0 {
            continue;
        }
        let y = decode_with_d(&q, i, g);
        let err = (y - f64::from(v)).abs();
        let bound = half_step(r) * f64::from(d) + ulp(v);
        prop_assert!(
            err <= bound,
            "x[{i}] = {v:e} ({:#010x}), g = {g:e} ({:#010x}): scale {:#04x}, code {:#x}, decoded {y:e}, error {err:e} \
             > {bound:e} (d = {d:e}, |x|/d = {r})",
            v.to_bits(),
            g.to_bits(),
            q.scale,
            q.codes[i]
        );
    }
    Ok(())
}

/// A block whose amax gives scale byte `s` (amax = 6 e4m3(s) g) and whose other elements sit
/// within a few ulps of E2M1 decision points times the block's d (where the quotient's rounding
/// decides the code), for any g.
fn near_tie_block() -> impl Strategy<Value = ([f32; 16], f32)> {
    (1u8..=0x7E, decode_scale(), proptest::array::uniform15((0usize..7, -6i32..=6, any::<bool>()))).prop_map(
        |(s, g, near)| {
            let dd = f64::from(e4m3_decode(s)) * f64::from(g);
            let mut x = [0f32; 16];
            x[0] = (6.0 * dd) as f32;
            for (v, (t, k, neg)) in x[1..].iter_mut().zip(near) {
                let center = (f64::from(TIES[t].0) * dd) as f32;
                let n = f32::from_bits(center.to_bits().saturating_add_signed(k));
                *v = if neg { -n } else { n };
            }
            (x, g)
        },
    )
}

proptest! {
    #![proptest_config(config(20_000))]

    #[test]
    fn decoding_exactly_is_within_half_a_grid_step(xg in prop_oneof![block_and_g(), near_tie_block()]) {
        check_error_bound(&xg.0, xg.1)?;
    }
}

/// Near a decision point the format's exact value e2m1 x e4m3 x g can miss `h d + ulp(x)` (the
/// bound against d) by the rounding of d = RN_f32(e4m3 x g) in recipe step 3: here by 1/8 of an
/// ulp of x. Not a codec error (the codes are the recipe's): the bound for the format's value has
/// the term `|e2m1| x |e4m3 x g - d|`, which covers it.
#[test]
fn the_format_value_differs_by_the_rounding_of_d() {
    let g = f32::from_bits(0x453c_3a45);
    let mut x = [0f32; 16];
    x[0] = f32::from_bits(0x49c2_1c17); // 6 e4m3(0x6b) g: the block's scale is 0x6b
    x[1] = f32::from_bits(0x48e2_761a); // about 1.75 d, the decision point between 1.5 and 2
    let q = quantize_block(&x, g);
    assert_eq!(q.scale, 0x6b);
    let d = e4m3_decode(q.scale) * g;
    let r = f64::from(x[1]) / f64::from(d);
    let bound = half_step(r) * f64::from(d) + ulp(x[1]);
    let exact_d = f64::from(e4m3_decode(q.scale)) * f64::from(g);
    let rounding = f64::from(e2m1_decode(q.codes[1])).abs() * (exact_d - f64::from(d)).abs();
    let with_d = (decode_with_d(&q, 1, g) - f64::from(x[1])).abs();
    let format = (decode_format(&q, 1, g) - f64::from(x[1])).abs();
    assert!(with_d <= bound, "{with_d:e} > {bound:e}");
    assert!(format > bound, "{format:e} <= {bound:e}: the example no longer shows the difference");
    assert!(format <= bound + rounding, "{format:e} > {bound:e} + {rounding:e}");
    // The code is the recipe's: the f32 quotient x / d against the E2M1 decision points.
    assert_eq!(q.codes[1], nearest_code(x[1] / d));
}

/// Blocks built from codes: a scale byte, a decode scale and 16 grid values (one of magnitude
/// 6), as BF16 values; their encoding has the largest magnitude 6 when the scale is not clamped.
fn grid_block() -> impl Strategy<Value = ([f32; 16], f32)> {
    (1u8..=0x7E, decode_scale(), proptest::array::uniform16(0u8..16), 0usize..16).prop_map(|(s, g, codes, top)| {
        let mut x = [0f32; 16];
        for (i, v) in x.iter_mut().enumerate() {
            let c = if i == top { 7 | (codes[i] & 8) } else { codes[i] };
            *v = dequantize_element(c, s, g).to_f32();
        }
        (x, g)
    })
}

proptest! {
    // Arbitrary blocks mostly hold a negative that rounds to zero (code 8) or no code 7: rejected.
    #![proptest_config(Config { max_global_rejects: 1_000_000, ..config(20_000) })]

    /// `encode(decode(q)) == q` for every encoded block with a code of magnitude 6 and no code 8,
    /// from arbitrary blocks and from blocks built of grid values.
    #[test]
    fn encoding_the_decoded_block_gives_it_back(xg in prop_oneof![1 => block_and_g(), 3 => grid_block()]) {
        let (x, g) = xg;
        let q = quantize_block(&x, g);
        prop_assume!(q.codes.iter().any(|&c| c & 7 == 7) && !q.codes.contains(&8));
        let mut y = [0f32; 16];
        for (v, &c) in y.iter_mut().zip(&q.codes) {
            *v = dequantize_element(c, q.scale, g).to_f32();
        }
        // Decoding must give the block's values: where e2m1 x e4m3 x g is beyond the BF16 range
        // the decoded value is an infinity, another block (which saturates, recipe step 5).
        prop_assume!(y.iter().all(|v| v.is_finite()));
        let back = quantize_block(&y, g);
        prop_assert_eq!(back, q, "g = {:e} ({:#010x}), decoded {:?}", g, g.to_bits(), y);
    }

    /// An all-zero block (zeros of either sign) gets scale 1.0 (0x38) and codes 0, whatever g.
    #[test]
    fn all_zero_blocks_get_scale_one_and_codes_zero(signs in any::<u16>(), g in decode_scale()) {
        let x: [f32; 16] = std::array::from_fn(|i| if signs >> i & 1 == 1 { -0.0 } else { 0.0 });
        prop_assert_eq!(quantize_block(&x, g), BlockQuant { scale: 0x38, codes: [0; 16] });
    }

    /// A block whose t = amax / (6g) is below E4M3's smallest subnormal (but not 0) keeps scale
    /// 2^-9 (0x01) and its codes, each the nearest E2M1 value of x / d (d = 2^-9 g): never
    /// flushed to zero.
    #[test]
    fn tiny_scales_clamp_to_the_smallest_subnormal(g in (-100i32..=100, any::<u32>()).prop_map(|(e, m)| f32_of(e, m)),
                                                    f in proptest::array::uniform16(-1.0f32..1.0),
                                                    shrink in 1.0f32..64.0) {
        let d = e4m3_decode(0x01) * g;
        // amax below 6 * 2^-9 * g / shrink...: t < 2^-9 / shrink, at least one element above d / 4.
        let x: [f32; 16] = std::array::from_fn(|i| f[i] * 6.0 * d / shrink);
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let t = amax / (6.0 * g);
        prop_assume!(t > 0.0 && t < e4m3_decode(0x01));
        let q = quantize_block(&x, g);
        prop_assert_eq!(q.scale, 0x01);
        for (i, &v) in x.iter().enumerate() {
            prop_assert_eq!(q.codes[i], nearest_code(v / d), "x[{}] = {:e}, d = {:e}", i, v, d);
        }
    }
}

/// The nearest E2M1 code of `q` by search (ties to the even magnitude index, saturating at 6), with
/// the recipe's sign bit `q < 0`: independent of the codec's threshold counts.
fn nearest_code(q: f32) -> u8 {
    let a = f64::from(q.abs());
    let mut best = 0usize;
    for (i, &m) in E2M1_MAGNITUDES.iter().enumerate() {
        let (di, db) = ((f64::from(m) - a).abs(), (f64::from(E2M1_MAGNITUDES[best]) - a).abs());
        if di < db || (di == db && i % 2 == 0) {
            best = i;
        }
    }
    if a > 6.0 {
        best = 7;
    }
    best as u8 | (u8::from(q < 0.0) << 3)
}

/// The decision points of E2M1 and the magnitude index each rounds to exactly on it (ties to the
/// even mantissa: recipe step 4).
const TIES: [(f32, u8); 7] = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)];

#[test]
fn exact_ties_round_to_the_even_neighbour() {
    // Scale bytes with a power-of-two value and g a power of two: d is exact and so is every
    // x / d below, one ulp either side of a decision point included.
    let mut checked = 0;
    for s in (0x08u8..=0x78).step_by(8).chain([0x01, 0x02, 0x04]) {
        for ge in [-140i32, -100, -20, 0, 20, 100] {
            let g = 2f32.powi(ge);
            let d = e4m3_decode(s) * g;
            if !(d.is_normal() && (6.0 * d).is_finite() && (0.125 * d).is_normal()) {
                continue;
            }
            // amax = 6d gives t = e4m3(s) exactly, so the block keeps scale s.
            for (tie, at) in TIES {
                for sign in [1.0f32, -1.0] {
                    let mut x = [0f32; 16];
                    x[0] = 6.0 * d;
                    x[1] = sign * tie * d;
                    x[2] = sign * f32::from_bits((tie * d).to_bits() - 1);
                    x[3] = sign * f32::from_bits((tie * d).to_bits() + 1);
                    x[4] = -0.0;
                    let q = quantize_block(&x, g);
                    let neg = u8::from(sign < 0.0) << 3;
                    let i = TIES.iter().position(|&(t, _)| t == tie).unwrap() as u8;
                    assert_eq!(q.scale, s, "s {s:#04x}, g 2^{ge}");
                    assert_eq!(q.codes[0], 7);
                    assert_eq!(q.codes[1], at | neg, "tie {}{tie} x d, s {s:#04x}, g 2^{ge}", sign);
                    assert_eq!(q.codes[2], i | neg, "one ulp below {}{tie}", sign);
                    assert_eq!(q.codes[3], (i + 1) | neg, "one ulp above {}{tie}", sign);
                    // A negative value that rounds to zero keeps its sign (code 8); -0.0 does not.
                    assert_eq!(q.codes[4], 0, "-0.0 is not negative");
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 500, "{checked}");
    let mut x = [0f32; 16];
    x[0] = 6.0;
    x[1] = -0.1;
    x[2] = -0.0;
    let q = quantize_block(&x, 1.0);
    assert_eq!((q.scale, q.codes[1], q.codes[2]), (0x38, 8, 0));
}

/// When amax / (6g) underflows to 0 (a huge g, a tiny block) t becomes 1.0 (scale 0x38); a NaN
/// anywhere gives scale 0x7F and codes 0, an infinity saturates (scale 448, code 6).
#[test]
fn underflow_nan_and_infinity() {
    let mut rng = test_rng();
    for _ in 0..10_000 {
        let g = f32_of(100 + rng.below(27) as i32, rng.next_u32());
        let mut x: [f32; 16] = std::array::from_fn(|_| f32::from_bits(rng.next_u32() & 0x007F_FFFF)); // subnormal
        x[rng.below(16) as usize] = f32::from_bits(1);
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let t = amax / (6.0 * g);
        assert_eq!(t, 0.0, "amax {amax:e}, g {g:e} (seed {:#x})", rng.seed());
        let q = quantize_block(&x, g);
        assert_eq!(q.scale, 0x38, "g {g:e}");
        // d = g, and every |x| / g underflows: codes are 0 or 8.
        assert!(q.codes.iter().all(|&c| c & 7 == 0), "{q:?}");

        let mut y: [f32; 16] = std::array::from_fn(|_| rng.normal());
        let at = rng.below(16) as usize;
        y[at] = f32::NAN;
        y[(at + 1) % 16] = f32::INFINITY;
        assert_eq!(quantize_block(&y, g), BlockQuant { scale: 0x7F, codes: [0; 16] });
        y[at] = f32::NEG_INFINITY;
        let q = quantize_block(&y, 1.0);
        assert_eq!((q.scale, q.codes[at], q.codes[(at + 1) % 16]), (0x7E, 15, 7));
    }
}

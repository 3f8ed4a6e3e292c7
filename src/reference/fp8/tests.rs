//! The FP8 mode's oracle against the formats' definitions and its own invariants.

use super::*;
use crate::format::E2M1_MAGNITUDES;
use crate::rng::Rng;

/// E4M3's smallest normal: above it a rounding keeps 4 significant bits.
const E4M3_MIN_NORMAL: f64 = 1.0 / 64.0;

/// A random expert `[n, k]` quantized by the crate's recipe from Gaussian BF16 weights.
fn gaussian_expert(rng: &mut Rng, n: usize, k: usize) -> ExpertWeightsHost {
    quantize_expert(&rng.normal_bf16(n * k, 0.02), n, k).unwrap()
}

/// Weights of varied magnitudes: block scales spread over much of E4M3's range, zeros among them.
fn varied_expert(rng: &mut Rng, n: usize, k: usize) -> ExpertWeightsHost {
    quantize_expert(&rng.varied_bf16(n * k), n, k).unwrap()
}

fn e2m1_magnitude(w: &ExpertWeightsHost, r: usize, kk: usize) -> f32 {
    let byte = w.codes[r * (w.k / 2) + kk / 2];
    E2M1_MAGNITUDES[usize::from(if kk.is_multiple_of(2) { byte & 7 } else { (byte >> 4) & 7 })]
}

#[test]
fn least_scaled_pow2_is_the_least_that_fits() {
    let mut rng = Rng::new(0x005e_edf8);
    let mut amaxes: Vec<f32> =
        vec![f32::MIN_POSITIVE, 1e-40, 1e-30, 448.0, 672.0, 671.9, 1.0, 6.0 * 448.0, 3.0e38, f32::MAX];
    amaxes.extend((0..2000).map(|_| rng.uniform(0.5, 1.0) * (rng.range(0, 120) as f32 - 60.0).exp2()));
    for &amax in &amaxes {
        for (rule, c) in [(Fp8WeightScale::Pow2, 1.0f32), (Fp8WeightScale::ThreeHalvesPow2, 1.5)] {
            let s = rule.scale(amax);
            let k = (s / c).log2();
            assert_eq!(k, k.round(), "{rule:?} amax {amax}: S {s} is not {c} x 2^k");
            assert!(amax / s <= E4M3_MAX, "{rule:?} amax {amax}: S {s} lets it pass 448");
            if s > c * f32::MIN_POSITIVE {
                assert!(amax / (s / 2.0) > E4M3_MAX, "{rule:?} amax {amax}: S / 2 = {} fits too", s / 2.0);
            } else {
                // The least normal S of the form, for an amax too small for any S to reach 448.
                assert!(amax / s <= E4M3_MAX && s == c * f32::MIN_POSITIVE, "{rule:?} amax {amax}: S {s}");
            }
        }
        let s = Fp8WeightScale::AmaxOver448.scale(amax);
        assert!(s.is_normal() && amax / s <= E4M3_MAX * (1.0 + 1e-6), "amax / 448: {amax} / {s}");
    }
    for rule in Fp8WeightScale::ALL {
        assert_eq!(rule.scale(0.0), 1.0);
        assert_eq!(rule.scale(f32::NAN), 1.0);
        assert_eq!(rule.scale(f32::INFINITY), 1.0);
    }
}

/// Every rule: no finite product saturates or becomes NaN, each (row, block) has a product near
/// the top of E4M3's range (the least S), and each value is the product rounded to 4 significant
/// bits under S (half an ulp: 2^-4 relative above E4M3's smallest normal, 2^-10 S below it; plus,
/// under amax / 448, the f32 quotient's own rounding, which can make a tie: 2^-23 relative).
#[test]
fn reexpressed_weights_round_each_product_once() {
    let mut rng = Rng::new(0xf8_0001);
    for (n, k, block_k) in [(16usize, 256usize, 128usize), (8, 80, 64), (4, 48, 16), (8, 96, 1024)] {
        for w in [gaussian_expert(&mut rng, n, k), varied_expert(&mut rng, n, k)] {
            for rule in Fp8WeightScale::ALL {
                let q = reexpress_expert(&w, 0, block_k, rule).unwrap().q;
                assert_eq!(q.blocks(), k.div_ceil(block_k));
                for r in 0..n {
                    for b in 0..q.blocks() {
                        let s = f64::from(q.scales[r * q.blocks() + b]);
                        let mut top = 0f64;
                        for kk in b * block_k..((b + 1) * block_k).min(k) {
                            let u = f64::from(product(&w, 0, r, kk));
                            let byte = q.codes[r * k + kk];
                            assert!(byte & 0x7F != 0x7F, "{rule:?} ({r}, {kk}): NaN from the finite {u}");
                            let v = q.value(r, kk);
                            let err = (v - u).abs();
                            let slack =
                                u.abs() * if rule == Fp8WeightScale::AmaxOver448 { 2f64.powi(-23) } else { 1e-12 };
                            let ok = if (u / s).abs() >= E4M3_MIN_NORMAL {
                                err <= u.abs() / 16.0 + slack
                            } else {
                                err <= s / 1024.0 + slack
                            };
                            assert!(ok, "{rule:?} ({r}, {kk}) block {block_k}: {u} became {v} under S {s}");
                            top = top.max(u.abs() / s);
                        }
                        if top > 0.0 {
                            // The largest product lands in the top binade ([224, 448]) for the
                            // power-of-two forms (half of S would pass 448), and at 448 for
                            // amax / 448.
                            let least = if rule == Fp8WeightScale::AmaxOver448 { 447.0 } else { 224.0 };
                            assert!(
                                top > least && top <= 448.0 * (1.0 + 1e-6),
                                "{rule:?} row {r} block {b}: top {top}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The point of `S = 1.5 * 2^k`: a product whose E2M1 value is 1.5, 3 or 6 is kept exactly (within
/// E4M3's normal range), and `S = 2^k` keeps those of 0.5, 1, 2 and 4 exactly.
#[test]
fn the_scale_forms_keep_their_codes_exact() {
    let mut rng = Rng::new(0xf8_0002);
    let (n, k) = (32usize, 512usize);
    let w = gaussian_expert(&mut rng, n, k);
    for (rule, exact) in [
        (Fp8WeightScale::ThreeHalvesPow2, [1.5f32, 3.0, 6.0].as_slice()),
        (Fp8WeightScale::Pow2, &[0.5, 1.0, 2.0, 4.0]),
    ] {
        let q = reexpress_expert(&w, 0, 128, rule).unwrap().q;
        let (mut checked, mut other_inexact) = (0, 0);
        for r in 0..n {
            for kk in 0..k {
                let u = f64::from(product(&w, 0, r, kk));
                let s = f64::from(q.scales[r * q.blocks() + kk / 128]);
                if (u / s).abs() < E4M3_MIN_NORMAL {
                    continue;
                }
                if exact.contains(&e2m1_magnitude(&w, r, kk)) {
                    assert_eq!(q.value(r, kk), u, "{rule:?} ({r}, {kk})");
                    checked += 1;
                } else if q.value(r, kk) != u {
                    other_inexact += 1;
                }
            }
        }
        assert!(checked > n * k / 4, "{rule:?}: only {checked} products of the exact codes checked");
        // The other codes do round (else the test would not tell the forms apart).
        assert!(other_inexact > 0, "{rule:?}: every other product exact too");
    }
}

/// On weights quantized from Gaussian BF16 weights, `S = 1.5 * 2^k` re-expresses with less error
/// than `2^k` and than `amax / 448` (the choice issue 23 asks to measure, not assume).
#[test]
fn three_halves_pow2_is_the_most_accurate_form_on_gaussian_weights() {
    let mut rng = Rng::new(0xf8_0003);
    let (n, k) = (64usize, 1024usize);
    let w = gaussian_expert(&mut rng, n, k);
    let exact: Vec<f64> = (0..n * k).map(|i| f64::from(product(&w, 0, i / k, i % k))).collect();
    let err = |rule| {
        let q = reexpress_expert(&w, 0, 128, rule).unwrap().q;
        let y: Vec<f64> = (0..n * k).map(|i| q.value(i / k, i % k)).collect();
        relative_errors(&y, &exact, k).0
    };
    let (three_halves, pow2, amax) =
        (err(Fp8WeightScale::ThreeHalvesPow2), err(Fp8WeightScale::Pow2), err(Fp8WeightScale::AmaxOver448));
    eprintln!("weight re-expression error: 1.5 x 2^k {three_halves:.4}, 2^k {pow2:.4}, amax/448 {amax:.4}");
    assert!(three_halves < pow2 && three_halves < amax, "1.5 x 2^k {three_halves}, 2^k {pow2}, amax/448 {amax}");
    // Half an ulp of 4 significant bits bounds any of them.
    assert!(three_halves > 0.0 && amax < 1.0 / 16.0, "1.5 x 2^k {three_halves}, amax/448 {amax}");
}

/// A NaN block of the checkpoint (scale byte 0x7F) stays NaN and does not set its block's S.
#[test]
fn nan_blocks_stay_nan_and_do_not_scale_their_neighbours() {
    let mut rng = Rng::new(0xf8_0004);
    let (n, k) = (4usize, 128usize);
    let mut w = gaussian_expert(&mut rng, n, k);
    let clean = reexpress_expert(&w, 0, 128, Fp8WeightScale::ThreeHalvesPow2).unwrap().q;
    // Row 1's second 16-element block: NaN. Its scale was not the row's largest, so S is unchanged.
    let row1 = &mut w.scales[k / 16..2 * k / 16];
    let largest = row1.iter().enumerate().max_by_key(|(_, &s)| s).map(|(i, _)| i).unwrap();
    let nan_block = if largest == 1 { 2 } else { 1 };
    row1[nan_block] = 0x7F;
    let q = reexpress_expert(&w, 0, 128, Fp8WeightScale::ThreeHalvesPow2).unwrap().q;
    assert_eq!(q.scales, clean.scales);
    for kk in 0..k {
        let nan = (kk / 16) == nan_block;
        assert_eq!(q.codes[k + kk] & 0x7F == 0x7F, nan, "column {kk}");
        if !nan {
            assert_eq!(q.codes[k + kk], clean.codes[k + kk], "column {kk}");
        }
    }
}

#[test]
fn activations_round_once_per_block() {
    let mut rng = Rng::new(0xf8_0005);
    let (rows, cols) = (5usize, 200usize); // a last block of 8 with 64-wide blocks
    let mut x: Vec<f32> = (0..rows * cols).map(|_| rng.normal() * (rng.range(0, 16) as f32 - 8.0).exp2()).collect();
    // Row 2 block 0 all zero; row 3: an Inf and a NaN in block 1.
    x[2 * cols..2 * cols + 64].fill(0.0);
    x[3 * cols + 70] = f32::INFINITY;
    x[3 * cols + 71] = f32::NAN;
    for block_k in [64usize, 128, 200, 256] {
        let q = quantize_activations(&x, rows, cols, block_k).unwrap();
        assert_eq!(q.blocks(), cols.div_ceil(block_k));
        for r in 0..rows {
            for kk in 0..cols {
                let (v, a) = (x[r * cols + kk], f64::from(q.scales[r * q.blocks() + kk / block_k]));
                let got = q.value(r, kk);
                if v.is_nan() {
                    assert!(got.is_nan());
                } else if v.is_infinite() {
                    assert_eq!(got, 448.0 * a);
                } else {
                    let v = f64::from(v);
                    // (a = amax / 448: the f32 quotient's rounding can make a tie, 2^-23 relative.)
                    let slack = v.abs() * 2f64.powi(-23);
                    let ok = if (v / a).abs() >= E4M3_MIN_NORMAL {
                        (got - v).abs() <= v.abs() / 16.0 + slack
                    } else {
                        (got - v).abs() <= a / 1024.0 + slack
                    };
                    assert!(ok, "({r}, {kk}) block {block_k}: {v} became {got} under a {a}");
                }
            }
        }
        if block_k <= 64 {
            assert_eq!(q.scales[2 * q.blocks()], 1.0, "an all-zero block's scale");
        }
    }
    assert!(quantize_activations(&x, rows, cols, 0).is_err());
    assert!(quantize_activations(&x[..10], rows, cols, 64).is_err());
}

/// The GEMM is the sum of the quantized values' products, blocks of K with different scales
/// (weights and activations blocked differently, partial last blocks) included.
#[test]
fn gemm_sums_the_quantized_products() {
    let mut rng = Rng::new(0xf8_0006);
    for (t, n, k, wb, ab) in [(3usize, 8usize, 80usize, 64usize, 32usize), (2, 4, 256, 128, 128), (1, 16, 48, 16, 1000)]
    {
        let w = varied_expert(&mut rng, n, k);
        let q = reexpress_expert(&w, 0, wb, Fp8WeightScale::ThreeHalvesPow2).unwrap();
        let x: Vec<f32> = (0..t * k).map(|_| rng.normal()).collect();
        let xq = quantize_activations(&x, t, k, ab).unwrap();
        let y = gemm(&xq, &q).unwrap();
        for r in 0..t {
            for f in 0..n {
                let mut want = 0f64;
                for kk in 0..k {
                    let xv = f64::from(e4m3_decode(xq.codes[r * k + kk]))
                        * f64::from(xq.scales[r * k.div_ceil(ab) + kk / ab]);
                    let wv = f64::from(e4m3_decode(q.q.codes[f * k + kk]))
                        * f64::from(q.q.scales[f * k.div_ceil(wb) + kk / wb]);
                    want += xv * wv;
                }
                let want = want * f64::from(w.decode_scales[0]);
                assert!(
                    (y[r * n + f] - want).abs() <= 1e-12 * want.abs().max(1e-30),
                    "({r}, {f}): {} vs {want}",
                    y[r * n + f]
                );
            }
        }
    }
    let w = varied_expert(&mut rng, 4, 64);
    let q = reexpress_expert(&w, 0, 64, Fp8WeightScale::Pow2).unwrap();
    let xq = quantize_activations(&[1.0; 2 * 48], 2, 48, 16).unwrap();
    assert!(gemm(&xq, &q).is_err(), "K 48 against 64");
    assert!(reexpress_expert(&w, 1, 64, Fp8WeightScale::Pow2).is_err(), "expert 1 of 1");
    assert!(reexpress_expert(&w, 0, 24, Fp8WeightScale::Pow2).is_err(), "a block of 24");
}

/// The FP8 mode's expert block against the exact one on quantized Gaussian weights and Gaussian
/// hidden states: a few percent of added error, within issue 23's 6% with S = 1.5 * 2^k (its model
/// put that form at 4.3-5.0% at the full shapes, amax / 448 at 5.8-7.1%: the other forms are held
/// to 8% here), less with 1.5 * 2^k than with amax / 448, and never near zero (the mode does
/// round: the E4M3 activations alone cost ~4%).
#[test]
fn fp8_expert_block_adds_a_few_percent() {
    let mut rng = Rng::new(0xf8_0007);
    let (hidden, inter, t) = (512usize, 256usize, 12usize);
    let w13 = gaussian_expert(&mut rng, 2 * inter, hidden);
    let w2 = gaussian_expert(&mut rng, hidden, inter);
    let g_up = w13.decode_scales[0] * 1.25;
    let x = rng.normal_bf16(t * hidden, 1.0);
    let exact = expert_ffn_exact(&x, t, &w13, g_up, &w2, 0).unwrap();
    let mut errs = Vec::new();
    for rule in Fp8WeightScale::ALL {
        let y = expert_ffn_fp8(&x, t, &w13, g_up, &w2, 0, rule, Fp8Blocks::default()).unwrap();
        let (fro, worst) = relative_errors(&y, &exact, hidden);
        eprintln!("{rule:?}: relative Frobenius {fro:.4}, worst token {worst:.4}");
        let bound = if rule == Fp8WeightScale::ThreeHalvesPow2 { 0.06 } else { 0.08 };
        assert!(fro > 0.01 && fro < bound && worst < bound + 0.02, "{rule:?}: {fro} / {worst}");
        errs.push(fro);
    }
    assert!(errs[0] < errs[2], "1.5 x 2^k {} against amax / 448 {}", errs[0], errs[2]);
    // Shape errors are typed.
    assert!(expert_ffn_exact(&x, t, &w2, g_up, &w2, 0).is_err());
    assert!(expert_ffn_fp8(&x[..hidden], t, &w13, g_up, &w2, 0, Fp8WeightScale::Pow2, Fp8Blocks::default()).is_err());
}

/// What lets a kernel re-express without a division: for the two power-of-two forms, `u * RN(1 / S)`
/// gives the byte `u / S` gives, for every E2M1 magnitude, every finite E4M3 block scale and every
/// S a block of them can get (the exact quotient is never an E4M3 tie: module docs). So a kernel
/// can make the 8 magnitudes' bytes of a 16-element block once (a table) from the block's scale
/// byte and `RN(1 / S)`, and look its codes up. Exhaustive over scale bytes and exponents.
#[test]
fn reciprocal_multiply_gives_the_division_bytes_for_the_pow2_forms() {
    let mut checked = 0;
    for rule in [Fp8WeightScale::ThreeHalvesPow2, Fp8WeightScale::Pow2] {
        let c = if rule == Fp8WeightScale::ThreeHalvesPow2 { 1.5f32 } else { 1.0 };
        for scale_byte in 0u8..0x7F {
            let sb = e4m3_decode(scale_byte);
            // S from 2^-20 (every product far above 448: saturation) to 2^20 (every product far
            // below E4M3's subnormals: zero), through every binade a block can pick.
            for k in -20..=20 {
                let s = c * (k as f32).exp2();
                let inv = 1.0 / s;
                for &m in &E2M1_MAGNITUDES {
                    let u = m * sb;
                    for sign in [1.0f32, -1.0] {
                        let (div, mul) = (e4m3_encode(sign * u / s), e4m3_encode(sign * u * inv));
                        assert_eq!(div, mul, "{rule:?}: {m} x {sb} (byte {scale_byte:#04x}) under S {s}");
                        checked += 1;
                    }
                }
            }
        }
    }
    assert_eq!(checked, 2 * 127 * 41 * 8 * 2);
}

/// The exact block's gate / up convention is the GPU oracle's: its output equals W2 applied to
/// `swiglu_element`'s SwiGLU (rounded to BF16, the compact intermediate), element for element.
#[test]
fn exact_block_follows_the_swiglu_oracle() {
    let mut rng = Rng::new(0xf8_0008);
    let (hidden, inter, t) = (64usize, 48usize, 3usize);
    let w13 = gaussian_expert(&mut rng, 2 * inter, hidden);
    let w2 = gaussian_expert(&mut rng, hidden, inter);
    let (g_gate, g_up) = (w13.decode_scales[0], w13.decode_scales[0] * 0.75);
    let x = rng.normal_bf16(t * hidden, 1.0);
    let y = expert_ffn_exact(&x, t, &w13, g_up, &w2, 0).unwrap();
    for r in 0..t {
        let h: Vec<f64> = (0..inter)
            .map(|f| {
                let (_, sw) = crate::reference::swiglu_element(&x, &w13, 0, r, f, g_gate, g_up);
                f64::from(bf16::from_f64(sw).to_f32())
            })
            .collect();
        for o in 0..hidden {
            let want = f64::from(w2.decode_scales[0])
                * h.iter().enumerate().map(|(f, hv)| hv * f64::from(w2.weight(0, o, f))).sum::<f64>();
            let got = y[r * hidden + o];
            assert!((got - want).abs() <= 1e-12 * want.abs().max(1e-20), "({r}, {o}): {got} vs {want}");
        }
    }
}

#[test]
fn relative_errors_of_edge_cases() {
    assert_eq!(relative_errors(&[1.0, 2.0], &[1.0, 2.0], 2), (0.0, 0.0));
    assert_eq!(relative_errors(&[0.0, 0.0], &[0.0, 0.0], 1), (0.0, 0.0));
    assert_eq!(relative_errors(&[1.0, 0.0], &[0.0, 0.0], 1).0, f64::INFINITY);
    let (fro, worst) = relative_errors(&[1.0, 0.0, 3.0, 4.0], &[0.0, 0.0, 3.0, 3.0], 2);
    assert!((fro - (2.0f64 / 18.0).sqrt()).abs() < 1e-15 && (worst - (1.0f64 / 18.0).sqrt()).abs() < 1e-15);
    assert!(std::panic::catch_unwind(|| relative_errors(&[1.0], &[1.0, 2.0], 1)).is_err());
}

//! The oracle against the format's definition, ModelOpt's bytes and its own invariants.

use super::*;
use crate::format::{bf16_round, E2M1_MAGNITUDES};
use crate::host::WEIGHT_DECODE_SCALE_FACTOR;
use crate::layout::{grouped_region_start_row, swizzled_k_tiles};

use crate::rng::Rng;

/// Uniform in [-1, 1).
fn unit(rng: &mut Rng) -> f32 {
    ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// Values with a spread of magnitudes.
fn value(rng: &mut Rng) -> f32 {
    let exponent = rng.below(12) as i32 - 6;
    unit(rng) * 2f32.powi(exponent)
}

fn pow2(e: i32) -> f32 {
    2f32.powi(e)
}

/// Independent oracle for one block, using brute-force encoders (nearest value search) and
/// the recipe's f32 arithmetic, for cross-checking `quantize_block`.
fn block_oracle(x: &[f32; 16], g: f32) -> BlockQuant {
    if x.iter().any(|v| v.is_nan()) {
        return BlockQuant { scale: 0x7F, codes: [0; 16] };
    }
    let mut amax = 0.0f32;
    for v in x {
        if v.abs() > amax {
            amax = v.abs();
        }
    }
    // Recipe v2: a zero quotient becomes 1, then the clamp to [2^-9, 448].
    let mut target = if amax.is_infinite() { 448.0 } else { amax / (6.0 * g) };
    if target == 0.0 {
        target = 1.0;
    }
    let target = target.max(pow2(-9)).min(448.0);
    // Nearest E4M3 among 0..=0x7E by search, ties to even, saturating.
    let scale = if target >= 448.0 {
        0x7E
    } else {
        let mut best = 0u8;
        for b in 1..=0x7Eu8 {
            let db = (e4m3_decode(b) as f64 - target as f64).abs();
            let dbest = (e4m3_decode(best) as f64 - target as f64).abs();
            if db < dbest || (db == dbest && b & 1 == 0) {
                best = b;
            }
        }
        best
    };
    let d = e4m3_decode(scale) * g;
    let mut codes = [0u8; 16];
    for i in 0..16 {
        if x[i].is_infinite() {
            codes[i] = if x[i] < 0.0 { 15 } else { 7 };
            continue;
        }
        let q = x[i] / d;
        let a = q.abs() as f64;
        let mut best = 0usize;
        for (j, &m) in E2M1_MAGNITUDES.iter().enumerate().skip(1) {
            let dj = (m as f64 - a).abs();
            let dbest = (E2M1_MAGNITUDES[best] as f64 - a).abs();
            if dj < dbest || (dj == dbest && j % 2 == 0) {
                best = j;
            }
        }
        if a > 6.0 || q.is_nan() {
            best = 7; // saturation (distances to far-away values may tie in f64); NaN = 0/0
        }
        let sign = if q < 0.0 { 8 } else { 0 };
        codes[i] = sign | best as u8;
    }
    BlockQuant { scale, codes }
}

#[test]
fn all_zero_block_gets_scale_one() {
    // t = 0 becomes 1.0: scale 0x38, codes 0 (ModelOpt's `per_block_scale[== 0] = 1.0`).
    let q = quantize_block(&[0.0; 16], 1.0);
    assert_eq!(q, BlockQuant { scale: 0x38, codes: [0; 16] });
    let q = quantize_block(&[0.0; 16], 3.0e-7);
    assert_eq!(q, BlockQuant { scale: 0x38, codes: [0; 16] });
}

#[test]
fn negative_zero_gives_code_zero() {
    // The sign bit is `x / d < 0`, and -0.0 / d = -0.0 is not < 0.
    let mut x = [-0.0f32; 16];
    x[3] = 0.0;
    let q = quantize_block(&x, 0.5);
    assert_eq!(q, BlockQuant { scale: 0x38, codes: [0; 16] });
    x[5] = -1.0;
    let q = quantize_block(&x, 0.5);
    assert_eq!(q.codes[5], 15, "-1 / (e4m3(1/3) * 0.5) = -6.1 -> -6");
    assert!(q.codes.iter().enumerate().all(|(i, &c)| i == 5 || c == 0), "{:?}", q.codes);
}

#[test]
fn tiny_block_scale_is_clamped_not_flushed() {
    // amax / 6 = 0.005 / 6 < 2^-10: clamped to 2^-9 (scale 0x01), the codes are kept.
    let mut x = [0.0f32; 16];
    for (i, v) in x.iter_mut().enumerate() {
        *v = -0.0003 * i as f32;
    }
    x[15] = -0.005;
    x[0] = 0.004;
    let q = quantize_block(&x, 1.0);
    assert_eq!(q.scale, 0x01);
    assert_eq!(q, block_oracle(&x, 1.0));
    assert_eq!(q.codes[15], 13, "-0.005 / 2^-9 = -2.56 -> -3");
    assert_eq!(q.codes[0], 4, "0.004 / 2^-9 = 2.048 -> 2");
    assert_eq!(q.codes[1], 8, "-0.0003 / 2^-9 = -0.15 -> -0 with the sign kept");
    // Far below: a block 2^-20 of g still keeps scale 0x01 and its signs.
    let y: [f32; 16] = core::array::from_fn(|i| if i % 2 == 0 { 1e-9 } else { -1e-9 });
    let q = quantize_block(&y, 1.0);
    assert_eq!(q.scale, 0x01);
    assert_eq!(q.codes, core::array::from_fn(|i| if i % 2 == 0 { 0 } else { 8 }));
}

#[test]
fn nan_block_wins_over_inf() {
    let mut rng = crate::testing::test_rng();
    let seed = rng.seed();
    let nan_block = BlockQuant { scale: 0x7F, codes: [0; 16] };
    let mut x = [0.0f32; 16];
    for v in x.iter_mut() {
        *v = value(&mut rng);
    }
    let nan_at = rng.below(16) as usize;
    x[nan_at] = if rng.below(2) == 0 { f32::NAN } else { -f32::NAN };
    assert_eq!(quantize_block(&x, 1.0), nan_block, "NaN at {nan_at} (seed {seed:#x})");
    // Infinities before and after the NaN do not change that.
    x[(nan_at + 1) % 16] = f32::INFINITY;
    x[(nan_at + 15) % 16] = f32::NEG_INFINITY;
    assert_eq!(quantize_block(&x, 0.25), nan_block, "NaN at {nan_at} (seed {seed:#x})");
    let mut y = [1.0f32; 16];
    y[0] = f32::INFINITY;
    y[15] = f32::NAN;
    assert_eq!(quantize_block(&y, 1.0), nan_block);
}

#[test]
fn inf_block_saturates() {
    let mut rng = crate::testing::test_rng();
    let seed = rng.seed();
    let mut x = [0.0f32; 16];
    for v in x.iter_mut() {
        *v = value(&mut rng);
    }
    x[2] = f32::INFINITY;
    x[9] = f32::NEG_INFINITY;
    let q = quantize_block(&x, 1.0);
    assert_eq!(q.scale, 0x7E, "seed {seed:#x}");
    assert_eq!(q.codes[2], 7, "seed {seed:#x}");
    assert_eq!(q.codes[9], 15, "seed {seed:#x}");
    // d = 448: finite values below 64 are at most 64/448 = 0.14 -> codes 0 or 8 by sign.
    for i in (0..16).filter(|&i| i != 2 && i != 9) {
        let want = if x[i].is_sign_negative() { 8 } else { 0 };
        assert_eq!(q.codes[i], want, "element {i} = {} (seed {seed:#x})", x[i]);
    }
    assert_eq!(q, block_oracle(&x, 1.0));
}

#[test]
fn block_decode_underflow_follows_the_division() {
    // g = 2^-149 (smallest f32): amax = 2^-149 gives s = e4m3(1/6) = 0x23 (0.171875), and
    // d = 0.171875 * 2^-149 underflows to 0 in f32: x / 0 = ±Inf -> ±6, 0 / 0 = NaN -> 6
    // (PyTorch's searchsorted puts NaN past every bound; NaN < 0 is false).
    let g = f32::from_bits(1);
    let mut x = [0.0f32; 16];
    x[0] = -g;
    x[5] = g;
    assert_eq!(e4m3_encode(g / (6.0 * g)), 0x23);
    let q = quantize_block(&x, g);
    assert_eq!(q.scale, 0x23);
    assert_eq!(q.codes, core::array::from_fn(|i| if i == 0 { 15 } else { 7 }));
    assert_eq!(q, block_oracle(&x, g));
}

#[test]
fn huge_decode_scale_overflowing_d() {
    // g = f32::MAX: 6 * g = Inf, amax / Inf = 0 -> t = 1 -> scale 0x38, d = g: codes from
    // 1 / MAX and -2 / MAX, both far below 0.25 (signs kept).
    let mut x = [1.0f32; 16];
    x[1] = -2.0;
    let q = quantize_block(&x, f32::MAX);
    assert_eq!(q.scale, 0x38);
    assert_eq!(q.codes, core::array::from_fn(|i| if i == 1 { 8 } else { 0 }));
    // g = 2^125: 6g finite; amax = Inf -> s = 448, d = 448 * 2^125 = Inf: the Inf element is
    // +6 (the crate's rule), finite / Inf = ±0 -> code 0 for both signs (-0 is not < 0).
    x[0] = f32::INFINITY;
    let q = quantize_block(&x, pow2(125));
    assert_eq!(q.scale, 0x7E);
    assert_eq!(q.codes[0], 7);
    assert_eq!(q.codes[1], 0);
    assert_eq!(q.codes[2], 0);
    x[3] = f32::NEG_INFINITY;
    let q = quantize_block(&x, pow2(125));
    assert_eq!(q.codes[3], 15);
    assert_eq!(q, block_oracle(&x, pow2(125)));
}

#[test]
fn hand_worked_block() {
    // g = 0.5, amax = 5: amax / (6 * 0.5) = 5 / 3 = 1.6666666 (f32). E4M3 neighbours 1.625
    // (0x3D) and 1.75 (0x3E); 1.6667 is nearer 1.625 -> scale 0x3D, d = 1.625 * 0.5 = 0.8125.
    // Element / d and code:
    //   5.0      -> 6.1538 -> 6     code 7
    //  -1.0      -> -1.2308 -> -1   code 0xA
    //   0.2      -> 0.2462 -> 0     code 0
    //  -0.2      -> -0.2462 -> -0   code 8
    //   2.0      -> 2.4615 -> 2     code 4
    //   2.1      -> 2.5846 -> 3     code 5
    //   0.6      -> 0.7385 -> 0.5   code 1
    //   0.7      -> 0.8615 -> 1     code 2
    //   1.4      -> 1.7231 -> 1.5   code 3
    //   3.0      -> 3.6923 -> 4     code 6
    //  -4.5      -> -5.5385 -> -6   code 15
    //   4.0      -> 4.9231 -> 4     code 6
    //   1.015625 -> 1.25 exactly (tie) -> 1   code 2
    //   1.421875 -> 1.75 exactly (tie) -> 2   code 4
    //  -0.0      -> -0              code 0 (-0 / d is not < 0)
    //  -2.84375  -> -3.5 exactly (tie) -> -4  code 14
    let x = [5.0f32, -1.0, 0.2, -0.2, 2.0, 2.1, 0.6, 0.7, 1.4, 3.0, -4.5, 4.0, 1.015625, 1.421875, -0.0, -2.84375];
    let q = quantize_block(&x, 0.5);
    assert_eq!(q.scale, 0x3D);
    assert_eq!(q.codes, [7, 0xA, 0, 8, 4, 5, 1, 2, 3, 6, 15, 6, 2, 4, 0, 14]);
    // Packed through `quantize`: byte j = code[2j] | code[2j+1] << 4. All inputs except
    // 0.2 / 2.1 / 0.6 / 0.7 / 1.4 are exact in BF16; those round but stay in the same bins.
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let t = quantize(&xb, 1, 16, 0.5, ScaleLayout::Linear).unwrap();
    assert_eq!(t.scales, vec![0x3D]);
    assert_eq!(t.codes, vec![0xA7, 0x80, 0x54, 0x21, 0x63, 0x6F, 0x42, 0xE0]);
}

#[test]
fn packing_order_even_element_low_nibble() {
    // Codes 1, 2, ..., 7, 9, ..., 15 placed so that every byte holds two different nibbles.
    let mut x = [0.0f32; 32];
    for (i, v) in x.iter_mut().enumerate() {
        *v = e2m1_decode((i % 16) as u8 ^ ((i / 16) as u8 * 5));
    }
    x[0] = 6.0; // keep amax = 6 in block 0 so d = 1 with g = 1
    x[16] = -6.0;
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let t = quantize(&xb, 1, 32, 1.0, ScaleLayout::Linear).unwrap();
    assert_eq!(t.scales, vec![0x38, 0x38]);
    // Recipe v2: -0.0 (the decode of code 8) quantizes to code 0.
    let encode = |v: f32| if v == 0.0 { 0 } else { e2m1_encode(v) };
    for j in 0..16 {
        let lo = encode(x[2 * j]);
        let hi = encode(x[2 * j + 1]);
        assert_eq!(t.codes[j], lo | (hi << 4), "byte {j}");
    }
    assert!(x.contains(&-0.0) && t.codes.iter().all(|&b| b & 0xF != 8 && b >> 4 != 8));
    assert_eq!(t.codes[0] & 0xF, 7);
    assert_eq!(t.codes[8] & 0xF, 15);
}

#[test]
fn quantize_block_matches_oracle_across_the_e4m3_range() {
    let mut rng = crate::testing::test_rng();
    let seed = rng.seed();
    let mut scales_seen = [false; 256];
    for trial in 0..40_000 {
        // Block magnitude from 2^-40 to 2^40 and g from 2^-30 to 2^10, so amax / (6g) covers
        // everything from "rounds to zero" through the subnormals to saturation.
        let block_exp = rng.below(81) as i32 - 40;
        let g = pow2(rng.below(41) as i32 - 30) * (1.0 + unit(&mut rng).abs());
        let mut x = [0.0f32; 16];
        for v in x.iter_mut() {
            *v = bf16_round(value(&mut rng) * pow2(block_exp));
        }
        if trial % 7 == 0 {
            x[rng.below(16) as usize] = -0.0;
        }
        let q = quantize_block(&x, g);
        assert_eq!(q, block_oracle(&x, g), "x = {x:?}, g = {g:e} (seed {seed:#x})");
        scales_seen[q.scale as usize] = true;
    }
    // Coverage: the clamp at 2^-9, subnormal scales, normal scales, saturation.
    for b in [0x01usize, 0x05, 0x08, 0x38, 0x70, 0x7E] {
        assert!(scales_seen[b], "scale {b:#04x} never produced (seed {seed:#x})");
    }
}

#[test]
fn round_trip_is_exact_for_representable_inputs() {
    let mut rng = crate::testing::test_rng();
    let seed = rng.seed();
    for _ in 0..300 {
        let rows = 1 + rng.below(5) as usize;
        let cols = 16 * (1 + rng.below(6) as usize);
        let g_exp = rng.below(60) as i32 - 30;
        let g = pow2(g_exp);
        let mut want_codes = vec![0u8; rows * cols];
        let mut want_scales = vec![0u8; rows * cols / 16];
        let mut x = vec![bf16::ZERO; rows * cols];
        for (b, scale) in want_scales.iter_mut().enumerate() {
            *scale = 1 + rng.below(0x7E) as u8; // 0x01..=0x7E
            let codes = &mut want_codes[b * 16..(b + 1) * 16];
            for c in codes.iter_mut() {
                *c = rng.below(16) as u8;
            }
            // One element at magnitude 6 so amax / (6g) is exactly the scale.
            codes[rng.below(16) as usize] = 7 | (rng.below(2) as u8) << 3;
            for (i, c) in codes.iter_mut().enumerate() {
                let v = e2m1_decode(*c) * e4m3_decode(*scale) * g;
                assert_eq!(bf16_round(v), v, "not exact in bf16 (seed {seed:#x})");
                x[b * 16 + i] = bf16::from_f32(v);
                if *c == 8 {
                    *c = 0; // -0.0 quantizes to code 0 (recipe v2) and decodes to +0.0
                }
            }
        }
        for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled128x4] {
            let t = quantize(&x, rows, cols, g, layout).unwrap();
            for m in 0..rows {
                for k in 0..cols / 16 {
                    assert_eq!(
                        t.scales[scale_offset(layout, rows, cols, m, k)],
                        want_scales[m * cols / 16 + k],
                        "seed {seed:#x}"
                    );
                }
            }
            for (j, &byte) in t.codes.iter().enumerate() {
                assert_eq!(byte & 0xF, want_codes[2 * j], "seed {seed:#x}");
                assert_eq!(byte >> 4, want_codes[2 * j + 1], "seed {seed:#x}");
            }
            let back = dequantize(&t);
            for (a, b) in back.iter().zip(&x) {
                let want = if b.to_bits() == 0x8000 { 0 } else { b.to_bits() };
                assert_eq!(a.to_bits(), want, "seed {seed:#x}");
            }
        }
    }
}

#[test]
fn quantize_then_dequantize_matches_independent_decode() {
    let mut rng = crate::testing::test_rng();
    let seed = rng.seed();
    for (rows, cols) in [(1, 16), (127, 48), (129, 80), (300, 16), (3, 7168)] {
        let g = pow2(rng.below(20) as i32 - 16) * (1.0 + unit(&mut rng).abs());
        let x: Vec<bf16> = (0..rows * cols).map(|_| bf16::from_f32(value(&mut rng))).collect();
        for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled128x4] {
            let t = quantize(&x, rows, cols, g, layout).unwrap();
            assert_eq!(t.codes.len(), rows * cols / 2);
            assert_eq!(t.scales.len(), scale_len(layout, rows, cols));
            let back = dequantize(&t);
            assert_eq!(back.len(), rows * cols);
            let kt = (cols / 16).div_ceil(4);
            for m in 0..rows {
                for c in 0..cols {
                    let k = c / 16;
                    // Offsets and nibbles recomputed here from the definitions.
                    let off = match layout {
                        ScaleLayout::Linear => m * (cols / 16) + k,
                        ScaleLayout::Swizzled128x4 => {
                            (m / 128) * kt * 512 + (k / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + k % 4
                        }
                    };
                    let byte = t.codes[(m * cols + c) / 2];
                    let code = if c % 2 == 0 { byte & 0xF } else { byte >> 4 };
                    let e2m1 = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][(code & 7) as usize]
                        * if code & 8 != 0 { -1.0 } else { 1.0 };
                    let want = bf16::from_f32(e2m1 * e4m3_decode(t.scales[off]) * g);
                    assert_eq!(
                        back[m * cols + c].to_bits(),
                        want.to_bits(),
                        "{rows}x{cols} {layout:?} ({m},{c}) seed {seed:#x}"
                    );
                    // With a normal scale (relative rounding <= 1/16) the error is at most
                    // half the widest E2M1 step (d) plus the saturation of at most 0.4 d.
                    let xv = x[m * cols + c].to_f32();
                    let d = e4m3_decode(t.scales[off]) * g;
                    assert!(
                        !(0x08..0x7E).contains(&t.scales[off])
                            || (xv - back[m * cols + c].to_f32()).abs() <= d * 1.0 + xv.abs() * 0.01,
                        "{xv} vs {} scale {:#04x} g {g:e} {layout:?} ({m},{c}) seed {seed:#x}",
                        back[m * cols + c],
                        t.scales[off]
                    );
                }
            }
            if layout == ScaleLayout::Swizzled128x4 {
                // Padding bytes are 0: every byte not hit by a real (m, k) is zero.
                let mut real = vec![false; t.scales.len()];
                for m in 0..rows {
                    for k in 0..cols / 16 {
                        real[scale_offset(layout, rows, cols, m, k)] = true;
                    }
                }
                for (i, &b) in t.scales.iter().enumerate() {
                    if !real[i] {
                        assert_eq!(b, 0, "padding byte {i} ({rows}x{cols}) seed {seed:#x}");
                    }
                }
                assert!(real.iter().filter(|&&r| r).count() == rows * cols / 16);
            }
        }
    }
}

#[test]
fn dequantize_nan_scale_gives_nan() {
    let t = Nvfp4Host {
        rows: 1,
        cols: 16,
        layout: ScaleLayout::Linear,
        decode_scale: 1.0,
        codes: vec![0x21; 8],
        scales: vec![0x7F],
    };
    assert!(dequantize(&t).iter().all(|v| v.is_nan()));
    // quantize makes such a block from a NaN input.
    let mut x = vec![bf16::from_f32(-6.0); 32];
    x[20] = bf16::NAN;
    let t = quantize(&x, 1, 32, 1.0, ScaleLayout::Linear).unwrap();
    assert_eq!(t.scales, vec![0x38, 0x7F]);
    assert_eq!(t.codes, [[0xFF; 8], [0; 8]].concat());
    let back = dequantize(&t);
    assert!(back[..16].iter().all(|v| v.to_f32() == -6.0));
    assert!(back[16..].iter().all(|v| v.is_nan()));
}

#[test]
fn dequantize_order_is_product_then_g_then_bf16() {
    // Aim (e2m1 * e4m3) * g at f32 values that sit exactly on a BF16 tie; the other order,
    // e2m1 * (e4m3 * g), then often rounds to the neighbouring BF16 value. Both the pinned
    // order and the existence of such cases (so the test can tell orders apart) are checked.
    let mut rng = crate::testing::test_rng();
    let seed = rng.seed();
    let mut orders_differ = 0;
    for _ in 0..200_000 {
        let code = [3u8, 5, 11, 13][rng.below(4) as usize]; // ±1.5, ±3: inexact with g
        let scale = 1 + rng.below(0x7E) as u8;
        let product = e2m1_decode(code) * e4m3_decode(scale);
        // A BF16 tie: low 16 bits 0x8000, exponent around 2^-20 .. 2^20.
        let exponent = rng.below(40) as u32 + 107;
        let tie = f32::from_bits(exponent << 23 | (rng.next_u64() as u32 & 0x7F_0000) | 0x8000);
        let g = tie.abs() / product.abs();
        if !(g.is_finite() && g > 0.0) {
            continue;
        }
        let want = bf16::from_f32(product * g);
        let got = dequantize_element(code, scale, g);
        assert_eq!(got.to_bits(), want.to_bits(), "code {code} scale {scale:#04x} g {g:e} (seed {seed:#x})");
        if bf16::from_f32(e2m1_decode(code) * (e4m3_decode(scale) * g)) != want {
            orders_differ += 1;
        }
    }
    assert!(orders_differ > 0, "no case told the orders apart (seed {seed:#x})");
    let g = 0.3f32;
    for code in 0..16u8 {
        for scale in [0x01u8, 0x08, 0x33, 0x7E] {
            let want = bf16::from_f32((e2m1_decode(code) * e4m3_decode(scale)) * g);
            assert_eq!(dequantize_element(code, scale, g).to_bits(), want.to_bits());
        }
    }
}

#[test]
fn codes_use_true_division_at_e2m1_ties() {
    // d = e4m3(s) * g with g of 17 significant bits, so 6 * d and t * d (t a decision point,
    // at most 3 significant bits) are exact and x / d lands exactly on t. A reciprocal
    // multiply x * (1/d) is often an ulp off and rounds the other way.
    let mut rng = crate::testing::test_rng();
    let seed = rng.seed();
    let ties = [(0.25f32, 0u8), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)];
    let mut reciprocal_differs = 0;
    for _ in 0..20_000 {
        let g_mantissa = (rng.next_u64() as u32 & 0x7F_FF80) | 0x80_0000; // 17 bits
        let g = g_mantissa as f32 * pow2(rng.below(40) as i32 - 20 - 23);
        let scale = 0x08 + rng.below(0x76) as u8; // normal scales 0x08..=0x7D
        let d = e4m3_decode(scale) * g;
        let mut x = [0.0f32; 16];
        x[0] = 6.0 * d;
        for (i, v) in x.iter_mut().enumerate().skip(1) {
            let (t, _) = ties[i % 7];
            *v = if i >= 8 { -t * d } else { t * d };
        }
        assert_eq!(x[0] / (6.0 * g), e4m3_decode(scale), "setup (seed {seed:#x})");
        let q = quantize_block(&x, g);
        assert_eq!(q.scale, scale, "g {g:e} (seed {seed:#x})");
        assert_eq!(q.codes[0], 7);
        for i in 1..16 {
            let (t, at_tie) = ties[i % 7];
            assert_eq!(x[i] / d, if i >= 8 { -t } else { t }, "setup (seed {seed:#x})");
            let want = if i >= 8 { 8 | at_tie } else { at_tie };
            assert_eq!(q.codes[i], want, "element {i} = {t} d, g {g:e} (seed {seed:#x})");
            if e2m1_encode(x[i] * (1.0 / d)) != want {
                reciprocal_differs += 1;
            }
        }
        assert_eq!(q, block_oracle(&x, g), "g {g:e} (seed {seed:#x})");
    }
    assert!(reciprocal_differs > 0, "no case told division from reciprocal (seed {seed:#x})");
}

#[test]
fn scale_uses_one_division_by_six_g() {
    // amax placed at E4M3 rounding midpoints (times 6g, nudged by a few ulps) with g of full
    // precision, so 6 * g rounds: amax / (6 * g) and amax / 6 / g then differ at some ties.
    let mut rng = crate::testing::test_rng();
    let seed = rng.seed();
    let mut forms_differ = 0;
    for _ in 0..50_000 {
        let g = f32::from_bits(((rng.below(30) as u32 + 112) << 23) | (rng.next_u64() as u32 & 0x7F_FFFF));
        let lo = 1 + rng.below(0x7C) as u8;
        let mid = (e4m3_decode(lo) + e4m3_decode(lo + 1)) / 2.0;
        let nudge = rng.below(5) as i32 - 2;
        let amax = f32::from_bits(((mid * 6.0 * g).to_bits() as i32 + nudge) as u32);
        let mut x = [0.0f32; 16];
        for v in x.iter_mut() {
            *v = amax * unit(&mut rng);
        }
        x[rng.below(16) as usize] = if rng.below(2) == 0 { amax } else { -amax };
        let q = quantize_block(&x, g);
        assert_eq!(q, block_oracle(&x, g), "amax {amax:e} g {g:e} (seed {seed:#x})");
        if e4m3_encode(amax / 6.0 / g) != q.scale {
            forms_differ += 1;
        }
    }
    assert!(forms_differ > 0, "no case told the two forms apart (seed {seed:#x})");
}

#[test]
fn quantize_f32_rounds_to_bf16_first() {
    let mut rng = crate::testing::test_rng();
    let seed = rng.seed();
    let x: Vec<f32> = (0..64).map(|_| value(&mut rng)).collect();
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let a = quantize_f32(&x, 2, 32, 0.01, ScaleLayout::Swizzled128x4).unwrap();
    let b = quantize(&xb, 2, 32, 0.01, ScaleLayout::Swizzled128x4).unwrap();
    assert_eq!(a, b, "seed {seed:#x}");
    // A value that lands on an E2M1 tie only after BF16 rounding: g = 1, amax = 6 -> d = 1;
    // 1.2504 rounds to bf16 1.25 (tie -> code 2), unrounded it would give code 3.
    let mut y = [0.0f32; 16];
    y[0] = 6.0;
    y[1] = 1.2504;
    assert_eq!(quantize_block(&y, 1.0).codes[1], 3);
    let t = quantize_f32(&y, 1, 16, 1.0, ScaleLayout::Linear).unwrap();
    assert_eq!(t.codes[0] >> 4, 2);
}

#[test]
fn weight_decode_scale_uses_finite_amax() {
    let mut rng = crate::testing::test_rng();
    let seed = rng.seed();
    let mut x: Vec<bf16> = (0..100).map(|_| bf16::from_f32(value(&mut rng))).collect();
    x[7] = bf16::INFINITY;
    x[8] = bf16::NEG_INFINITY;
    x[9] = bf16::NAN;
    let mut amax = 0.0f32;
    for (i, v) in x.iter().enumerate() {
        if !(7..=9).contains(&i) && v.to_f32().abs() > amax {
            amax = v.to_f32().abs();
        }
    }
    assert!(amax > 0.0);
    let g = weight_decode_scale(&x).unwrap();
    assert_eq!(g, amax * (1.0 / 2688.0), "seed {seed:#x}");
    // With that g the amax block gets scale 448 and its amax element code 6.
    assert!(weight_decode_scale(&[bf16::ZERO; 32]).is_err());
    assert!(weight_decode_scale(&[bf16::NAN, bf16::INFINITY, bf16::NEG_ZERO]).is_err());
    assert!(weight_decode_scale(&[]).is_err());
    let y = [bf16::from_f32(-3.0), bf16::from_f32(2.0)];
    assert_eq!(weight_decode_scale(&y).unwrap(), 3.0 * WEIGHT_DECODE_SCALE_FACTOR);
    let t = quantize(&y.repeat(8), 1, 16, 3.0 * WEIGHT_DECODE_SCALE_FACTOR, ScaleLayout::Linear).unwrap();
    // The multiply by RN(1/2688) is not the division: they differ by one ulp for 28 of the
    // 128 bf16 values in [1, 2) (measured with PyTorch on the H200); g follows the multiply.
    let mut differ = 0;
    for m in 0..128u16 {
        let a = bf16::from_bits(0x3F80 | m);
        let g = weight_decode_scale(&[a]).unwrap();
        assert_eq!(g, a.to_f32() * WEIGHT_DECODE_SCALE_FACTOR);
        differ += (g != a.to_f32() / 2688.0) as usize;
    }
    assert_eq!(differ, 28);
    assert_eq!(t.scales, vec![0x7E]);
    assert_eq!(t.codes[0] & 0xF, 15);
}

#[test]
fn validation_rejects_bad_input() {
    for cols in [0usize, 8, 24, 17] {
        assert!(matches!(validate_quantize_shape(4, cols), Err(Error::InvalidShape(_))), "{cols}");
    }
    assert!(validate_quantize_shape(0, 16).is_ok());
    assert!(validate_quantize_shape(5, 7168).is_ok());
    assert!(validate_quantize_shape(usize::MAX, 16).is_err());
    for g in [0.0f32, -0.0, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert!(matches!(validate_decode_scale(g), Err(Error::InvalidDecodeScale(_))), "{g}");
    }
    assert!(validate_decode_scale(1e-45).is_ok(), "subnormal g > 0 is allowed");
    assert!(validate_decode_scale(f32::MAX).is_ok());
    let x = vec![bf16::ONE; 64];
    assert!(matches!(quantize(&x, 2, 48, 1.0, ScaleLayout::Linear), Err(Error::BufferTooSmall { .. })));
    assert!(matches!(quantize(&x, 1, 48, 1.0, ScaleLayout::Linear), Err(Error::InvalidShape(_))));
    assert!(quantize(&x, 2, 24, 1.0, ScaleLayout::Linear).is_err());
    assert!(quantize(&x, 4, 16, f32::NAN, ScaleLayout::Linear).is_err());
    assert!(quantize(&x, usize::MAX, 16, 1.0, ScaleLayout::Linear).is_err());
    let t = quantize(&[], 0, 16, 1.0, ScaleLayout::Swizzled128x4).unwrap();
    assert!(t.codes.is_empty() && t.scales.is_empty());
    // A hand-built inconsistent host is reported, not indexed out of bounds.
    let mut bad = quantize(&x, 4, 16, 1.0, ScaleLayout::Swizzled128x4).unwrap();
    bad.scales.truncate(4);
    assert!(try_dequantize(&bad).is_err());
}

#[test]
fn grouped_matches_per_expert_quantize() {
    let mut rng = crate::testing::test_rng();
    let seed = rng.seed();
    for trial in 0..40 {
        let num_experts = 1 + rng.below(6) as usize;
        let cols = 16 * (1 + rng.below(9) as usize);
        let mut offsets = vec![0i32];
        for _ in 0..num_experts {
            let n = match rng.below(3) {
                0 => 0,
                1 => rng.below(5),
                _ => rng.below(300),
            };
            offsets.push(offsets.last().unwrap() + n as i32);
        }
        let total = *offsets.last().unwrap() as usize;
        let x: Vec<bf16> = (0..total * cols).map(|_| bf16::from_f32(value(&mut rng))).collect();
        let per_expert = rng.below(2) == 0;
        let gs: Vec<f32> = if per_expert {
            (0..num_experts).map(|_| pow2(rng.below(8) as i32 - 6) * (1.0 + unit(&mut rng).abs())).collect()
        } else {
            vec![0.01]
        };
        let (codes, scales) = quantize_grouped(&x, &offsets, cols, &gs).unwrap();
        assert_eq!(codes.len(), total * cols / 2);
        assert_eq!(scales.len(), grouped_scale_len(total, num_experts, cols));
        let mut covered = vec![false; scales.len()];
        let tile_bytes = swizzled_k_tiles(cols) * 512;
        for e in 0..num_experts {
            let (b, end) = (offsets[e] as usize, offsets[e + 1] as usize);
            let g = gs[if per_expert { e } else { 0 }];
            let t = quantize(&x[b * cols..end * cols], end - b, cols, g, ScaleLayout::Swizzled128x4).unwrap();
            assert_eq!(&codes[b * cols / 2..end * cols / 2], &t.codes[..], "seed {seed:#x} trial {trial}");
            // The expert's region is contiguous from its 128-aligned start row.
            let start = grouped_region_start_row(b, e) / 128 * tile_bytes;
            let region = &scales[start..start + t.scales.len()];
            assert_eq!(region, &t.scales[..], "seed {seed:#x} trial {trial} expert {e}");
            for c in &mut covered[start..start + t.scales.len()] {
                assert!(!*c, "overlap, seed {seed:#x} trial {trial}");
                *c = true;
            }
        }
        for (i, &s) in scales.iter().enumerate() {
            if !covered[i] {
                assert_eq!(s, 0, "padding byte {i} seed {seed:#x} trial {trial}");
            }
        }
    }
}

#[test]
fn grouped_rejects_bad_input() {
    let x = vec![bf16::ONE; 10 * 16];
    assert!(quantize_grouped(&x, &[0, 4, 10], 16, &[1.0]).is_ok());
    assert!(quantize_grouped(&x, &[0, 4, 10], 16, &[1.0, 2.0]).is_ok());
    assert!(quantize_grouped(&x, &[0, 4, 10], 16, &[1.0, 2.0, 3.0]).is_err());
    assert!(quantize_grouped(&x, &[0, 4, 10], 16, &[]).is_err());
    assert!(quantize_grouped(&x, &[0, 4, 10], 16, &[1.0, 0.0]).is_err());
    assert!(quantize_grouped(&x, &[0, 11, 10], 16, &[1.0]).is_err());
    assert!(quantize_grouped(&x, &[0, 4, 11], 16, &[1.0]).is_err());
    assert!(quantize_grouped(&x, &[0, 4, 10], 24, &[1.0]).is_err());
    assert!(quantize_grouped(&x, &[1, 4, 10], 16, &[1.0]).is_err());
    assert!(quantize_grouped(&x, &[], 16, &[1.0]).is_err());
    assert!(quantize_grouped(&x, &[0, -4, 10], 16, &[1.0]).is_err());
    // Zero rows, all experts empty.
    let (c, s) = quantize_grouped(&[], &[0, 0, 0], 32, &[1.0]).unwrap();
    assert!(c.is_empty());
    assert_eq!(s, vec![0u8; grouped_scale_len(0, 2, 32)]);
}

/// The checked forms of the oracle's element helpers: the same value on valid arguments, an
/// error (not a panic) on each kind of bad one (issue 21's no-panic rule).
#[test]
fn try_forms_of_the_element_helpers_check_their_arguments() {
    let mut rng = crate::testing::test_rng();
    let ck = crate::testing::random_moe_checkpoint(&mut rng, 3, 32, 16);
    let w = &ck.w13; // [3, 32, 32]: gate rows [0, 16), up rows [16, 32)
    let rows = 4;
    let x = rng.normal_bf16(rows * w.k, 1.0);
    for (e, row, f) in [(0, 0, 0), (2, 3, 31), (1, 2, 7)] {
        assert_eq!(w.try_weight(e, f, w.k - 1).unwrap().to_bits(), w.weight(e, f, w.k - 1).to_bits());
        let want = grouped_gemm_element(&x, w, e, row, f);
        assert_eq!(try_grouped_gemm_element(&x, w, e, row, f).unwrap().to_bits(), want.to_bits());
    }
    let sw = try_swiglu_element(&x, w, 1, 2, 15, 0.5, 2.0).unwrap();
    let want = swiglu_element(&x, w, 1, 2, 15, 0.5, 2.0);
    assert_eq!((sw.0.to_bits(), sw.1.to_bits()), (want.0.to_bits(), want.1.to_bits()));

    let shape = |r: Result<f64>| assert!(matches!(r, Err(Error::InvalidShape(_))), "{r:?}");
    shape(try_grouped_gemm_element(&x, w, 3, 0, 0)); // expert
    shape(try_grouped_gemm_element(&x, w, 0, 0, 32)); // feature
    shape(try_grouped_gemm_element(&x, w, 0, rows, 0)); // row of x
    shape(try_grouped_gemm_element(&x, w, 0, usize::MAX, 0)); // row whose end overflows
    shape(w.try_weight(0, 0, w.k).map(f64::from));
    for (f, n) in [(16, 32), (0, 31)] {
        let mut odd = w.clone();
        odd.n = n;
        let r = try_swiglu_element(&x, &odd, 0, 0, f, 1.0, 1.0);
        assert!(matches!(r, Err(Error::InvalidShape(_))), "f = {f}, n = {n}: {r:?}");
    }
    // Buffers shorter than the shape: each named.
    for (name, edit) in [
        ("codes", (|w: &mut ExpertWeightsHost| w.codes.truncate(w.codes.len() - 1)) as fn(&mut ExpertWeightsHost)),
        ("scales", |w| w.scales.truncate(w.scales.len() - 1)),
        ("decode_scales", |w| w.decode_scales.truncate(w.decode_scales.len() - 1)),
    ] {
        let mut short = w.clone();
        edit(&mut short);
        let r = try_grouped_gemm_element(&x, &short, 0, 0, 0);
        assert!(matches!(r, Err(Error::BufferTooSmall { name: n, .. }) if n == name), "{name}: {r:?}");
        assert!(matches!(short.try_weight(0, 0, 0), Err(Error::BufferTooSmall { .. })));
    }
    let mut bad_k = w.clone();
    bad_k.k = 24;
    assert!(matches!(bad_k.try_weight(0, 0, 0), Err(Error::InvalidShape(_))));
    let mut huge = w.clone();
    huge.experts = usize::MAX;
    assert!(matches!(huge.validate(), Err(Error::InvalidShape(_))));
}

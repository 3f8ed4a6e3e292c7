//! Issue 23's error study, on the CPU: how much error the FP8-compute mode (W4A8) adds to one
//! expert's feed-forward block against the exact (BF16-compute) block, at the full expert shapes
//! of deepseek-v3 and mixtral-8x7b, with weights quantized by the crate's recipe from Gaussian and
//! from heavy-tailed (Student-t, 3 degrees of freedom) BF16 weights, Gaussian and heavy-tailed
//! hidden states, for each re-expression scale form and K block.
//!
//! ```text
//! cargo run --release --no-default-features --example fp8_error [TOKENS] [SEED]
//! ```
//!
//! Prints one line per case: the relative Frobenius error of the block's output over TOKENS tokens
//! (default 16) and the worst token's relative error. The error is per token (one expert, no
//! routing), so it does not depend on the layer's T; the layer-level report with routing and
//! combine comes with the GPU kernels (`bench --compute fp8`).

use std::time::Instant;

use half::bf16;
use nvfp4_moe::reference::fp8::{
    expert_ffn_exact, expert_ffn_fp8, quantize_expert, relative_errors, Fp8Blocks, Fp8WeightScale,
};
use nvfp4_moe::testing::Rng;

/// Weight or hidden-state distribution.
#[derive(Clone, Copy, Debug)]
enum Dist {
    Gaussian,
    StudentT3,
}

/// `n` values of `dist` times `scale`, rounded to BF16. Student-t with 3 degrees of freedom:
/// z / sqrt(chi2_3 / 3), unit scale (its variance is 3).
fn sample(rng: &mut Rng, dist: Dist, n: usize, scale: f32) -> Vec<bf16> {
    (0..n)
        .map(|_| {
            let v = match dist {
                Dist::Gaussian => rng.normal(),
                Dist::StudentT3 => {
                    let chi2: f32 = (0..3).map(|_| rng.normal().powi(2)).sum();
                    rng.normal() / (chi2 / 3.0).sqrt().max(1e-6)
                }
            };
            bf16::from_f32(v * scale)
        })
        .collect()
}

fn main() -> nvfp4_moe::Result<()> {
    let mut args = std::env::args().skip(1);
    let tokens: usize = args.next().map_or(16, |v| v.parse().expect("TOKENS: a number"));
    let seed: u64 =
        args.next().map_or(0xf8e4_2026, |v| u64::from_str_radix(v.trim_start_matches("0x"), 16).expect("SEED: hex"));
    println!("fp8_error: {tokens} tokens per case, seed {seed:#x}");
    println!("| shape | weights | hidden | S form | weight block | relative Frobenius | worst token |");
    println!("|---|---|---|---|---|---|---|");
    for (name, hidden, inter) in [("deepseek-v3", 7168usize, 2048usize), ("mixtral-8x7b", 4096, 14336)] {
        for wdist in [Dist::Gaussian, Dist::StudentT3] {
            let mut rng = Rng::new(seed ^ hidden as u64 ^ ((wdist as u64) << 32));
            let t0 = Instant::now();
            let w13 = quantize_expert(&sample(&mut rng, wdist, 2 * inter * hidden, 0.02), 2 * inter, hidden)?;
            let w2 = quantize_expert(&sample(&mut rng, wdist, hidden * inter, 0.02), hidden, inter)?;
            // The checkpoint's gate and up share W13's decode scale here (one tensor quantized).
            let g_up = w13.decode_scales[0];
            eprintln!("{name} {wdist:?}: weights quantized in {:.1} s", t0.elapsed().as_secs_f64());
            for xdist in [Dist::Gaussian, Dist::StudentT3] {
                let x = sample(&mut rng, xdist, tokens * hidden, 1.0);
                let t1 = Instant::now();
                let exact = expert_ffn_exact(&x, tokens, &w13, g_up, &w2, 0)?;
                eprintln!("  exact block in {:.1} s", t1.elapsed().as_secs_f64());
                let cases = [
                    (Fp8WeightScale::ThreeHalvesPow2, 128usize),
                    (Fp8WeightScale::ThreeHalvesPow2, usize::MAX),
                    (Fp8WeightScale::Pow2, 128),
                    (Fp8WeightScale::AmaxOver448, 128),
                    (Fp8WeightScale::AmaxOver448, usize::MAX),
                ];
                for (rule, wb) in cases {
                    // usize::MAX: one block per row (the widest K of the two GEMMs).
                    let weight_k = if wb == usize::MAX { hidden.max(inter).div_ceil(16) * 16 } else { wb };
                    let blocks = Fp8Blocks { weight_k, ..Fp8Blocks::default() };
                    let y = expert_ffn_fp8(&x, tokens, &w13, g_up, &w2, 0, rule, blocks)?;
                    let (fro, worst) = relative_errors(&y, &exact, hidden);
                    let block = if wb == usize::MAX { "row".to_string() } else { wb.to_string() };
                    println!(
                        "| {name} | {wdist:?} | {xdist:?} | {rule:?} | {block} | {:.2}% | {:.2}% |",
                        100.0 * fro,
                        100.0 * worst
                    );
                }
            }
        }
    }
    Ok(())
}

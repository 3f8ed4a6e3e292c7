//! The first MoE GEMM's epilogue flows, at the L1 shapes (n = 2I, k = H) of deepseek-v3,
//! qwen3-30b-a3b and mixtral-8x7b, T in {16, 1024, 8192} tokens x top-k rows, balanced routing,
//! L2 flushed before each timed step:
//!   a) Interleaved GEMM [rows, 2I] + swiglu_quantize (the old flow)
//!   b) SwigluBf16 GEMM [rows, I] + quantize_nvfp4_grouped (the target flow, to FP4)
//!   c) SwigluBf16 alone
//!   d) plain GEMM [rows, 2I] + a separate SwiGLU kernel (what other libraries do)
//!   e) plain GEMM alone (the full-width write the compact epilogue is compared with)
//!   f) SwigluNvfp4 alone: NVFP4 codes + scales packed in the epilogue (issue 6: at most 5%
//!      slower than c, faster than b)
//! The TB/s column counts the activation bytes each flow writes and reads after the GEMM's
//! inputs (GEMM output written, post-kernel reads and writes; a kernel that reads the 8-wide
//! SwiGLU pieces of the interleaved tensor touches every 32-byte sector of it, so it reads the
//! full width); TFLOP/s the GEMM's. The summary times the six flows in interleaved rounds (so
//! that clock drift between flows cancels) and prints the targets: time saved against
//! 80% of bytes saved / the copy bandwidth (`common::hbm_tbps`: 4.3 TB/s, the H200's, unless
//! `$NVFP4MOE_HBM_TBPS` says otherwise), and SwigluBf16 against the full-width plain GEMM.
//!
//! `cargo bench --bench swiglu [-- FILTER]`, e.g. `-- deepseek-v3/T8192`.

mod common;

use std::time::Duration;

use common::{balanced_offsets, flushed_us, hbm_tbps, median, presets, report, selected, Row, BF16_TFLOPS};
use criterion::{criterion_group, Criterion};
use cudarc::driver::CudaContext;
use half::bf16;
use nvfp4_moe::gemm::{GemmTile, GroupedGemm, Interleaved, PlainBf16, SwigluBf16, SwigluNvfp4, SwigluNvfp4Out};
use nvfp4_moe::layout::grouped_scale_len;
use nvfp4_moe::quantize::{quantize_nvfp4_grouped_into, swiglu_bf16_into, GroupedDesc, GroupedSource};
use nvfp4_moe::testing::random_device_weights;
use nvfp4_moe::testing::Rng;

const TOKENS: [usize; 3] = [16, 1024, 8192];

fn benches(c: &mut Criterion) {
    let ctx = CudaContext::new(0).expect("a CUDA GPU");
    let s = ctx.default_stream();
    let mut rng = Rng::from_entropy();
    let mut flush = s.alloc_zeros::<u8>(256 << 20).unwrap();
    let mut table = Vec::new();
    let mut targets = Vec::new();
    for p in &presets(&["deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b"]) {
        if !TOKENS.iter().any(|t| selected(&format!("{}/T{t}", p.name))) {
            continue;
        }
        let (inter, k, e) = (p.intermediate, p.hidden, p.experts);
        let n = 2 * inter;
        let w = random_device_weights(&s, &mut rng, e, n, k, true).unwrap();
        let max_rows = TOKENS.iter().max().unwrap() * p.top_k;
        let x = s.clone_htod(&rng.normal_bf16(max_rows * k, 1.0)).unwrap();
        let mut wide = s.alloc_zeros::<bf16>(max_rows * n).unwrap();
        let mut compact = s.alloc_zeros::<bf16>(max_rows * inter).unwrap();
        let mut codes = s.alloc_zeros::<u8>(max_rows * inter / 2).unwrap();
        let mut scales = s.alloc_zeros::<u8>(grouped_scale_len(max_rows, e, inter)).unwrap();
        let act_g = s.clone_htod(&(0..e).map(|_| rng.uniform(1e-2, 1e-1)).collect::<Vec<f32>>()).unwrap();
        let plain = GroupedGemm::<PlainBf16>::new(&w, GemmTile::Auto).unwrap();
        let interleaved = GroupedGemm::<Interleaved>::new(&w, GemmTile::Auto).unwrap();
        let swiglu = GroupedGemm::<SwigluBf16>::new(&w, GemmTile::Auto).unwrap();
        let swiglu_fp4 = GroupedGemm::<SwigluNvfp4>::new(&w, GemmTile::Auto).unwrap();
        for &t in &TOKENS {
            let rows = t * p.top_k;
            let base = format!("{}/T{t}", p.name);
            if !selected(&base) {
                continue;
            }
            let off = s.clone_htod(&balanced_offsets(rows, e)).unwrap();
            let flops = 2.0 * rows as f64 * n as f64 * k as f64;
            let (wide_b, compact_b, fp4_b) =
                ((rows * n * 2) as f64, (rows * inter * 2) as f64, (rows * inter) as f64 * 0.5625);
            // (name, activation bytes written + read after the GEMM inputs)
            let flows: [(&str, f64); 6] = [
                ("a_interleaved+swiglu_quantize", wide_b + wide_b + fp4_b),
                ("b_swiglu_bf16+quantize", compact_b + compact_b + fp4_b),
                ("c_swiglu_bf16", compact_b),
                ("d_plain+swiglu_kernel", wide_b + wide_b + compact_b),
                ("e_plain", wide_b),
                ("f_swiglu_nvfp4", fp4_b),
            ];
            let mut step = |fi: usize| {
                // Flows a and b quantize what their GEMM wrote.
                let quantize = match fi {
                    0 => {
                        interleaved.launch(&s, &x, rows, &off, &mut wide).unwrap();
                        Some((GroupedSource::InterleavedSwiglu, &wide))
                    }
                    1 => {
                        swiglu.launch(&s, &x, rows, &off, &mut compact).unwrap();
                        Some((GroupedSource::Contiguous, &compact))
                    }
                    2 => {
                        swiglu.launch(&s, &x, rows, &off, &mut compact).unwrap();
                        None
                    }
                    3 => {
                        plain.launch(&s, &x, rows, &off, &mut wide).unwrap();
                        swiglu_bf16_into(&s, &wide, rows, inter, &mut compact).unwrap();
                        None
                    }
                    4 => {
                        plain.launch(&s, &x, rows, &off, &mut wide).unwrap();
                        None
                    }
                    _ => {
                        swiglu_fp4
                            .launch_nvfp4(
                                &s,
                                &x,
                                rows,
                                &off,
                                SwigluNvfp4Out { act_decode_scales: &act_g, codes: &mut codes, scales: &mut scales },
                            )
                            .unwrap();
                        None
                    }
                };
                if let Some((source, input)) = quantize {
                    quantize_nvfp4_grouped_into(
                        &s,
                        source,
                        input,
                        &GroupedDesc { rows, cols: inter, expert_offsets: &off, decode_scales: &act_g },
                        &mut codes,
                        &mut scales,
                    )
                    .unwrap();
                }
            };
            let mut once = |fi: usize| flushed_us(&s, &mut flush, || step(fi));
            for (fi, (flow, _)) in flows.iter().enumerate() {
                let mut grp = c.benchmark_group("swiglu");
                grp.bench_function(format!("{base}/{flow}"), |bch| {
                    bch.iter_custom(|iters| Duration::from_secs_f64((0..iters).map(|_| once(fi)).sum::<f64>() * 1e-6))
                });
                grp.finish();
            }
            // The summary: 31 interleaved rounds of all six flows, median per flow.
            let mut samples = vec![Vec::new(); flows.len()];
            for _ in 0..31 {
                for (fi, v) in samples.iter_mut().enumerate() {
                    v.push(once(fi));
                }
            }
            let med: Vec<f64> = samples.iter_mut().map(|v| median(v)).collect();
            for ((flow, bytes), us) in flows.iter().zip(&med) {
                let name = format!("{base}/{flow}");
                table.push(Row { name, us: *us, bytes: *bytes, flops, floor_us: flops / (BF16_TFLOPS * 1e12) * 1e6 });
            }
            // Bytes saved: a -> b, the interleaved tensor written and read back at half width;
            // d -> c, the wide tensor written and read plus the compact one written.
            let need = |saved: f64| 0.8 * saved / (hbm_tbps().0 * 1e12) * 1e6;
            targets.push((
                base,
                med[0] - med[1],
                need(flows[0].1 - flows[1].1),
                med[3] - med[2],
                need(flows[3].1 - flows[2].1),
                med[2] / med[4],
                med[5] / med[2],
                med[5] < med[1],
            ));
        }
    }
    report("swiglu", &table);
    println!(
        "== swiglu: targets (saved us vs 80% of bytes saved / {:.2} TB/s; SwigluBf16 / plain full width <= 1.03) ==",
        hbm_tbps().0
    );
    println!("{:<24} {:>12} {:>10} {:>12} {:>10} {:>12}", "case", "a-b us", "need", "d-c us", "need", "c/e");
    for (base, ab, ab_need, dc, dc_need, ce, _, _) in &targets {
        println!(
            "{:<24} {:>12.1} {:>10.1} {:>12.1} {:>10.1} {:>12.3}  {}",
            base,
            ab,
            ab_need,
            dc,
            dc_need,
            ce,
            if *ab >= *ab_need && *dc >= *dc_need && *ce <= 1.03 { "met" } else { "missed" }
        );
    }
    println!("== swiglu: SwigluNvfp4 targets (f/c <= 1.05; f faster than b) ==");
    println!("{:<24} {:>10} {:>12}", "case", "f/c", "f < b");
    for (base, _, _, _, _, _, fc, fb) in &targets {
        println!("{:<24} {:>10.3} {:>12}  {}", base, fc, fb, if *fc <= 1.05 && *fb { "met" } else { "missed" });
    }
}

criterion_group! {
    name = group;
    config = common::short_criterion(300, 800);
    targets = benches
}
criterion::criterion_main!(group);

//! The NVFP4 grouped GEMM at MoE shapes: L1 (n = 2I, k = H) and L2 (n = H, k = I) of deepseek-v3,
//! qwen3-30b-a3b and mixtral-8x7b, T in {1, 16, 128, 1024, 8192} tokens x top-k rows, balanced
//! routing, L2 flushed (256 MiB write) before each timed launch. Reports microseconds, TB/s of
//! weight bytes (0.5625 B per weight of the experts that got rows) and TFLOP/s.
//!
//! `cargo bench --bench gemm [-- FILTER]`, e.g. `-- deepseek-v3/L1`.

mod common;

use std::time::Duration;

use common::{balanced_offsets, flushed_us, median, report, selected, Row, BF16_TFLOPS, HBM_TBPS, PRESETS, TOKENS};
use criterion::{criterion_group, Criterion};
use cudarc::driver::CudaContext;
use half::bf16;
use nvfp4_moe::gemm::{GemmTile, GroupedGemm, PlainBf16};
use nvfp4_moe::testing::random_device_weights;
use nvfp4_moe::testing::Rng;

fn benches(c: &mut Criterion) {
    let ctx = CudaContext::new(0).expect("a CUDA GPU");
    let s = ctx.default_stream();
    let mut rng = Rng::from_entropy();
    let mut flush = s.alloc_zeros::<u8>(256 << 20).unwrap();
    let mut table = Vec::new();
    for p in &PRESETS {
        for (layer, n, k) in [("L1", 2 * p.inter, p.hidden), ("L2", p.hidden, p.inter)] {
            let prefix = format!("{}/{layer}", p.name);
            if !TOKENS.iter().any(|t| selected(&format!("{prefix}/T{t}"))) {
                continue;
            }
            let w = random_device_weights(&s, &mut rng, p.experts, n, k, false).unwrap();
            let max_rows = TOKENS.iter().max().unwrap() * p.top_k;
            let x = s.clone_htod(&rng.normal_bf16(max_rows * k, 1.0)).unwrap();
            let mut out = s.alloc_zeros::<bf16>(max_rows * n).unwrap();
            for &t in &TOKENS {
                let name = format!("{prefix}/T{t}");
                if !selected(&name) {
                    continue;
                }
                let rows = t * p.top_k;
                let off = s.clone_htod(&balanced_offsets(rows, p.experts)).unwrap();
                let plan: GroupedGemm<PlainBf16> = GroupedGemm::new(&w, GemmTile::Auto).unwrap();
                // One timed launch after an L2 flush.
                let mut once = || flushed_us(&s, &mut flush, || plan.launch(&s, &x, rows, &off, &mut out).unwrap());
                let mut grp = c.benchmark_group("grouped_gemm");
                grp.bench_function(&name, |b| {
                    b.iter_custom(|iters| Duration::from_secs_f64((0..iters).map(|_| once()).sum::<f64>() * 1e-6))
                });
                grp.finish();
                let us = median(&mut (0..31).map(|_| once()).collect::<Vec<_>>());
                let active = p.experts.min(rows);
                let wbytes = active as f64 * n as f64 * k as f64 * 0.5625;
                let flops = 2.0 * rows as f64 * n as f64 * k as f64;
                let floor = (wbytes / (HBM_TBPS * 1e12)).max(flops / (BF16_TFLOPS * 1e12)) * 1e6;
                table.push(Row {
                    name: format!("{name} ({:?})", plan.tile_for(rows)),
                    us,
                    bytes: wbytes,
                    flops,
                    floor_us: floor,
                });
            }
        }
    }
    report("gemm", &table);
}

criterion_group! {
    name = group;
    config = common::short_criterion(300, 1000);
    targets = benches
}
criterion::criterion_main!(group);

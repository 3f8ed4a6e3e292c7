//! `quantize_nvfp4` / `dequantize_nvfp4` / `quantize_nvfp4_grouped` throughput on the GPU, timed
//! with CUDA events. Bytes counted: quantize 2 read + 0.5625 written per element; dequantize the
//! reverse. Each case gets two rows: L2 flushed before every run (`flushed_pairs_us`: runs after a
//! 256 MiB write, minus the writes alone; the number the targets use) and `.../single`, the
//! median of single back-to-back launches (the metric of the bench before 2026-12-02).
//! Target (H200): quantize bf16 [8192, 7168] at >= 80% of 4.3 TB/s, L2 flushed.
//!
//! `cargo bench --bench quantize [-- FILTER]`; criterion runs short (0.5 s warm-up, 1.5 s).

mod common;

use common::{balanced_offsets, flushed_pairs_us, hbm_tbps, median_us, report, selected, time_events, Row};
use criterion::{criterion_group, Criterion, Throughput};
use cudarc::driver::CudaContext;
use nvfp4_moe::layout::grouped_scale_len;
use nvfp4_moe::layout::{scale_len, ScaleLayout};
use nvfp4_moe::quantize::{
    dequantize_nvfp4_into, quantize_nvfp4_grouped_into, quantize_nvfp4_into, GroupedDesc, GroupedSource, Nvfp4Desc,
};
use nvfp4_moe::testing::Rng;

const SHAPES: [(usize, usize); 4] = [(8192, 7168), (65536, 2048), (16384, 14336), (128, 7168)];
/// Grouped activations (rows, cols, experts): deepseek-v3's SwiGLU intermediate at T = 8192 (top-8),
/// qwen3-30b-a3b's at T = 1024, mixtral-8x7b's at T = 1024 (top-2).
const GROUPED: [(usize, usize, usize); 3] = [(65536, 2048, 256), (8192, 768, 128), (2048, 14336, 8)];
const FLUSH_BYTES: usize = 256 << 20;

fn benches(c: &mut Criterion) {
    let ctx = CudaContext::new(0).expect("a CUDA GPU");
    let s = ctx.default_stream();
    let mut rng = Rng::from_entropy();
    let mut rows_out = Vec::new();
    let mut flush = s.alloc_zeros::<u8>(FLUSH_BYTES).unwrap();
    let (bw, _) = hbm_tbps();
    let push = |rows_out: &mut Vec<Row>, name: String, flushed: f64, single: f64, bytes: f64| {
        let floor_us = bytes / (bw * 1e12) * 1e6;
        rows_out.push(Row { name: name.clone(), us: flushed, bytes, flops: 0.0, floor_us });
        rows_out.push(Row { name: format!("{name}/single"), us: single, bytes, flops: 0.0, floor_us });
    };
    for &(rows, cols) in &SHAPES {
        for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled128x4] {
            let lname = match layout {
                ScaleLayout::Linear => "linear",
                ScaleLayout::Swizzled128x4 => "swizzled",
            };
            let qname = format!("quantize/{rows}x{cols}/{lname}");
            let dname = format!("dequantize/{rows}x{cols}/{lname}");
            if !selected(&qname) && !selected(&dname) {
                continue; // skip the data generation (seconds for the large shapes) too
            }
            let n = rows * cols;
            // Normal data like real weights and activations, and the weight convention
            // g = amax / (6 * 448): no block scale saturates.
            let xh = rng.normal_bf16(n, 1.0);
            let g = nvfp4_moe::reference::weight_decode_scale(&xh).unwrap();
            let x = s.clone_htod(&xh).unwrap();
            let mut codes = s.alloc_zeros::<u8>(n / 2).unwrap();
            let mut scales = s.alloc_zeros::<u8>(scale_len(layout, rows, cols)).unwrap();
            let mut out = s.alloc_zeros::<half::bf16>(n).unwrap();
            let bytes = n as f64 * 2.5625;
            let desc = Nvfp4Desc { rows, cols, layout, decode_scale: g };

            if selected(&qname) {
                let mut run = || quantize_nvfp4_into(&s, &x, desc, &mut codes, &mut scales).unwrap();
                let mut grp = c.benchmark_group("quantize");
                grp.throughput(Throughput::Bytes(bytes as u64));
                grp.bench_function(format!("{rows}x{cols}/{lname}"), |b| {
                    b.iter_custom(|it| time_events(&s, it, &mut run))
                });
                grp.finish();
                let single = median_us(&s, 5, 41, &mut run);
                let flushed = flushed_pairs_us(&s, &mut flush, 20, 5, &mut run);
                push(&mut rows_out, qname, flushed, single, bytes);
            }

            if selected(&dname) {
                quantize_nvfp4_into(&s, &x, desc, &mut codes, &mut scales).unwrap();
                let mut run = || dequantize_nvfp4_into(&s, &codes, &scales, desc, &mut out).unwrap();
                let mut grp = c.benchmark_group("dequantize");
                grp.throughput(Throughput::Bytes(bytes as u64));
                grp.bench_function(format!("{rows}x{cols}/{lname}"), |b| {
                    b.iter_custom(|it| time_events(&s, it, &mut run))
                });
                grp.finish();
                let single = median_us(&s, 5, 41, &mut run);
                let flushed = flushed_pairs_us(&s, &mut flush, 20, 5, &mut run);
                push(&mut rows_out, dname, flushed, single, bytes);
            }
        }
    }
    for &(rows, cols, experts) in &GROUPED {
        for source in [GroupedSource::Contiguous, GroupedSource::InterleavedSwiglu] {
            let sname = match source {
                GroupedSource::Contiguous => "contiguous",
                GroupedSource::InterleavedSwiglu => "interleaved",
            };
            let name = format!("quantize_grouped/{rows}x{cols}/E{experts}/{sname}");
            if !selected(&name) {
                continue;
            }
            let width = if source == GroupedSource::Contiguous { cols } else { 2 * cols };
            let x = s.clone_htod(&rng.normal_bf16(rows * width, 1.0)).unwrap();
            let off = s.clone_htod(&balanced_offsets(rows, experts)).unwrap();
            let g = s.clone_htod(&vec![2.5e-3f32; experts]).unwrap();
            let mut codes = s.alloc_zeros::<u8>(rows * cols / 2).unwrap();
            let mut scales = s.alloc_zeros::<u8>(grouped_scale_len(rows, experts, cols)).unwrap();
            let desc = GroupedDesc { rows, cols, expert_offsets: &off, decode_scales: &g };
            let mut run = || quantize_nvfp4_grouped_into(&s, source, &x, &desc, &mut codes, &mut scales).unwrap();
            let single = median_us(&s, 5, 41, &mut run);
            let flushed = flushed_pairs_us(&s, &mut flush, 20, 5, &mut run);
            push(&mut rows_out, name, flushed, single, rows as f64 * cols as f64 * 2.5625);
        }
    }
    report("quantize", &rows_out);
}

criterion_group! {
    name = group;
    config = common::short_criterion(500, 1500);
    targets = benches
}

criterion::criterion_main!(group);

//! `quantize_nvfp4` / `dequantize_nvfp4` throughput on the GPU, timed with CUDA events.
//! Bytes counted: quantize 2 read + 0.5625 written per element; dequantize the reverse.
//! Target (H200): quantize bf16 [8192, 7168] at >= 80% of 4.3 TB/s.
//!
//! `cargo bench --bench quantize [-- FILTER]`; criterion runs short (0.5 s warm-up, 1.5 s).

mod common;

use common::{median_us, report, selected, time_events, Row, HBM_TBPS};
use criterion::{criterion_group, Criterion, Throughput};
use cudarc::driver::CudaContext;
use nvfp4_moe::layout::{scale_len, ScaleLayout};
use nvfp4_moe::quantize::{dequantize_nvfp4_into, quantize_nvfp4_into, Nvfp4Desc};
use nvfp4_moe::testing::Rng;

const SHAPES: [(usize, usize); 4] = [(8192, 7168), (65536, 2048), (16384, 14336), (128, 7168)];

fn benches(c: &mut Criterion) {
    let ctx = CudaContext::new(0).expect("a CUDA GPU");
    let s = ctx.default_stream();
    let mut rng = Rng::from_entropy();
    let mut rows_out = Vec::new();
    for &(rows, cols) in &SHAPES {
        for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled128x4] {
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
            let lname = match layout {
                ScaleLayout::Linear => "linear",
                ScaleLayout::Swizzled128x4 => "swizzled",
            };

            let qname = format!("quantize/{rows}x{cols}/{lname}");
            if selected(&qname) {
                let mut run = || quantize_nvfp4_into(&s, &x, desc, &mut codes, &mut scales).unwrap();
                let mut grp = c.benchmark_group("quantize");
                grp.throughput(Throughput::Bytes(bytes as u64));
                grp.bench_function(format!("{rows}x{cols}/{lname}"), |b| {
                    b.iter_custom(|it| time_events(&s, it, &mut run))
                });
                grp.finish();
                let us = median_us(&s, 5, 41, &mut run);
                rows_out.push(Row { name: qname, us, bytes, flops: 0.0, floor_us: bytes / (HBM_TBPS * 1e12) * 1e6 });
            }

            let dname = format!("dequantize/{rows}x{cols}/{lname}");
            if selected(&dname) {
                quantize_nvfp4_into(&s, &x, desc, &mut codes, &mut scales).unwrap();
                let mut run = || dequantize_nvfp4_into(&s, &codes, &scales, desc, &mut out).unwrap();
                let mut grp = c.benchmark_group("dequantize");
                grp.throughput(Throughput::Bytes(bytes as u64));
                grp.bench_function(format!("{rows}x{cols}/{lname}"), |b| {
                    b.iter_custom(|it| time_events(&s, it, &mut run))
                });
                grp.finish();
                let us = median_us(&s, 5, 41, &mut run);
                rows_out.push(Row { name: dname, us, bytes, flops: 0.0, floor_us: bytes / (HBM_TBPS * 1e12) * 1e6 });
            }
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

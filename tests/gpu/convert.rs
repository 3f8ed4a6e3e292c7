//! `convert` on the GPU: the same directory, byte for byte, as the CPU path (the library's
//! `CudaQuantizer` against `CpuQuantizer`, and the command with `--device cuda` against
//! `--device cpu`), on tiny models and on matrices large enough for many GPU blocks.

use std::path::PathBuf;

use crate::common::{assert_ok, cli, TmpDir};
use crate::convert_fixture as fx;
use half::bf16;
use nvfp4_moe::convert::{convert, ConvertOptions, CpuQuantizer, CudaQuantizer, OutputFormat, Quantizer};
use nvfp4_moe::testing::Rng;

fn same_dirs(a: &std::path::Path, b: &std::path::Path) {
    let (sa, sb) = (fx::snapshot(a), fx::snapshot(b));
    assert_eq!(sa.keys().collect::<Vec<_>>(), sb.keys().collect::<Vec<_>>());
    for (k, v) in &sa {
        assert!(v == &sb[k], "{k} differs between {} and {}", a.display(), b.display());
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_path_equals_cpu_path_byte_for_byte() {
    let t = TmpDir::new("convert-gpu");
    let (fp8, _) = fx::fp8_model(0x1810, 128);
    for (tag, model, shards) in [
        ("bf16", fx::bf16_model(0x1811), 3),
        ("f32", fx::with_dtype(&fx::bf16_model(0x1812), safetensors::Dtype::F32, 7), 2),
        ("stacked", fx::stacked(&fx::bf16_model(0x1813)), 1),
        ("fp8", fp8, 2),
    ] {
        let input = PathBuf::from(t.path(tag));
        fx::write_model(&input, &model, shards);
        for format in [OutputFormat::CompressedTensors, OutputFormat::ModelOpt] {
            let options = ConvertOptions { format, ..Default::default() };
            let (a, b) = (
                PathBuf::from(t.path(&format!("{tag}-{}-cpu", format.name()))),
                PathBuf::from(t.path(&format!("{tag}-{}-gpu", format.name()))),
            );
            convert(&input, &a, &options, &mut CpuQuantizer::all_cores()).unwrap();
            convert(&input, &b, &options, &mut CudaQuantizer::new(0).unwrap()).unwrap();
            same_dirs(&a, &b);
        }
        // The command, both devices.
        let (a, b) = (t.path(&format!("{tag}-cli-cpu")), t.path(&format!("{tag}-cli-gpu")));
        let input = input.to_string_lossy().into_owned();
        assert_ok(&cli(&["convert", "--input", &input, "--output", &a, "--device", "cpu"]));
        assert_ok(&cli(&["convert", "--input", &input, "--output", &b, "--device", "cuda"]));
        same_dirs(a.as_ref(), b.as_ref());
    }
}

/// One quantizer reused over matrices of growing and shrinking sizes (its device buffers are kept
/// and grown), with special values: every byte equals the CPU quantizer's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_quantizer_reuses_its_buffers_and_matches_the_cpu() {
    let mut r = Rng::new(0x1814);
    let mut gpu = CudaQuantizer::new(0).unwrap();
    let mut cpu = CpuQuantizer::all_cores();
    for (rows, cols) in [(7usize, 16usize), (2048, 7168), (3, 64), (4096, 2048), (129, 80)] {
        let mut x = r.varied_bf16(rows * cols);
        if x.len() > 100 {
            x[5] = bf16::NAN;
            x[50] = bf16::INFINITY;
            x[99] = bf16::NEG_ZERO;
        }
        let g = nvfp4_moe::host::weight_decode_scale(&x).unwrap();
        let n = rows * cols;
        let (mut c1, mut s1, mut c2, mut s2) =
            (vec![0u8; n / 2], vec![0u8; n / 16], vec![1u8; n / 2], vec![1u8; n / 16]);
        cpu.quantize(&x, rows, cols, g, &mut c1, &mut s1).unwrap();
        gpu.quantize(&x, rows, cols, g, &mut c2, &mut s2).unwrap();
        assert!(c1 == c2 && s1 == s2, "{rows}x{cols}");
        eprintln!("err convert quantizer {rows}x{cols}: 0 bytes differ ({})", gpu.describe());
    }
}

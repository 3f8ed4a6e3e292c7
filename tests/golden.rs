//! Golden files: what `quantize` and `dequantize` (`--backend cpu`) wrote at nvfp4-moe 0.1.0
//! (commit 51f3dd3, the hand-written CLI), byte for byte. Every later CLI must reproduce them.
//!
//! `tests/golden/input.safetensors` holds `blk.w` (BF16 `[48, 64]`, tensor amax 2.75) and `w32`
//! (F32 `[8, 32]`, amax 0.6875 after rounding to BF16). The files were made with
//!
//! ```text
//! nvfp4-moe quantize --input input.safetensors --tensor blk.w --output q-bf16.safetensors \
//!     --prefix model.layers.0.mlp.gate_proj --backend cpu
//! nvfp4-moe quantize --input input.safetensors --tensor w32 --output q-f32.safetensors --backend cpu
//! nvfp4-moe dequantize --input q-bf16.safetensors --prefix model.layers.0.mlp.gate_proj --name deq \
//!     --output d-bf16.safetensors --backend cpu
//! nvfp4-moe dequantize --input q-f32.safetensors --output d-f32.safetensors --backend cpu
//! ```
//!
//! Why these inputs: the quantization recipe is being revised (issue 13, "recipe v2": an all-zero
//! block gets scale byte 0x38 instead of 0x00, a block whose scale would be <= 2^-10 is clamped to
//! 2^-9 instead of flushed, -0.0 gets code 0 instead of 8, and the weight decode scale becomes
//! `amax * RN_f32(1/2688)` instead of `amax / 2688`). The golden files pin the CLI (names, shapes,
//! dtypes, file layout, prefix handling, F32 rounding), not the recipe, so the inputs are ones on
//! which both recipes give the same bytes: no all-zero block, every block's amax at least 2^-8 of
//! the tensor's (block scales >= 1.75, far from any clamp), no -0.0, every non-zero element at least
//! 1/8 of its block's amax (so it never quantizes to a signed zero code), no NaN or Inf, and tensor
//! amaxes for which f32 `a / 2688` equals `a * RN(1/2688)` bit for bit.
//! [`inputs_are_neutral_to_the_recipe_revision`] checks all of that.

mod common;

use common::{assert_ok, cli, TmpDir};
use half::bf16;

const INPUT: &[u8] = include_bytes!("golden/input.safetensors");
const PREFIX: &str = "model.layers.0.mlp.gate_proj";

/// One golden case: the tensor, `--prefix` (or ""), the quantized file, `--name` (or "") and the
/// dequantized file.
struct Case {
    tensor: &'static str,
    prefix: &'static str,
    quantized: &'static [u8],
    name: &'static str,
    dequantized: &'static [u8],
}

const CASES: [Case; 2] = [
    Case {
        tensor: "blk.w",
        prefix: PREFIX,
        quantized: include_bytes!("golden/q-bf16.safetensors"),
        name: "deq",
        dequantized: include_bytes!("golden/d-bf16.safetensors"),
    },
    Case {
        tensor: "w32",
        prefix: "",
        quantized: include_bytes!("golden/q-f32.safetensors"),
        name: "",
        dequantized: include_bytes!("golden/d-f32.safetensors"),
    },
];

#[test]
fn inputs_are_neutral_to_the_recipe_revision() {
    let dir = TmpDir::new("golden-input");
    let input = dir.path("input.safetensors");
    std::fs::write(&input, INPUT).unwrap();
    for Case { tensor, .. } in CASES {
        let (x, rows, cols, _) = nvfp4_moe::io::read_matrix_bf16(&input, tensor).unwrap();
        assert_eq!(x.len(), rows * cols);
        assert!(x.iter().all(|v| v.is_finite()), "{tensor}: NaN or Inf");
        assert!(x.iter().all(|v| v.to_bits() != bf16::NEG_ZERO.to_bits()), "{tensor}: -0.0");
        let a = x.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
        assert_eq!((a / 2688.0).to_bits(), (a * (1.0f32 / 2688.0)).to_bits(), "{tensor}: amax {a}");
        assert_eq!(nvfp4_moe::host::weight_decode_scale(&x).unwrap().to_bits(), (a / 2688.0).to_bits());
        for (b, block) in x.chunks_exact(16).enumerate() {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
            assert!(amax >= a / 256.0, "{tensor}: block {b} amax {amax} < {a} / 2^8");
            for v in block {
                let v = v.to_f32().abs();
                assert!(v == 0.0 || v >= amax / 8.0, "{tensor}: block {b}: {v} < {amax} / 8");
            }
        }
    }
}

/// `quantize` then `dequantize` on `backend`, each output compared with its golden file.
fn reproduce(backend: &str) {
    let dir = TmpDir::new(&format!("golden-{backend}"));
    let input = dir.path("input.safetensors");
    std::fs::write(&input, INPUT).unwrap();
    for Case { tensor, prefix, quantized: q_golden, name, dequantized: d_golden } in CASES {
        let q = dir.path(&format!("q-{tensor}.safetensors"));
        let mut args = vec!["quantize", "--input", &input, "--tensor", tensor, "--output", &q, "--backend", backend];
        if !prefix.is_empty() {
            args.extend(["--prefix", prefix]);
        }
        assert_ok(&cli(&args));
        assert!(std::fs::read(&q).unwrap() == q_golden, "{tensor}: quantized file differs from the golden file");

        let d = dir.path(&format!("d-{tensor}.safetensors"));
        let mut args = vec!["dequantize", "--input", &q, "--output", &d, "--backend", backend];
        if !prefix.is_empty() {
            args.extend(["--prefix", prefix]);
        }
        if !name.is_empty() {
            args.extend(["--name", name]);
        }
        assert_ok(&cli(&args));
        assert!(std::fs::read(&d).unwrap() == d_golden, "{tensor}: dequantized file differs from the golden file");
    }
}

#[test]
fn cpu_reproduces_the_golden_files() {
    reproduce("cpu");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_reproduces_the_golden_files() {
    reproduce("cuda");
}

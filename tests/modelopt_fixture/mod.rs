//! The ModelOpt fixtures (tests/fixtures/modelopt_nvfp4_v2.safetensors, written by
//! tests/modelopt/generate_fixtures.py with nvidia-modelopt 0.47.0 on CUDA) and the comparison
//! helpers shared by the CPU test (tests/modelopt.rs) and the GPU tests (tests/gpu.rs).
#![allow(dead_code)] // each test binary uses a part

use std::collections::HashMap;

use half::bf16;
use nvfp4_moe::layout::{grouped_swizzled_offset, scale_cols, scale_offset, ScaleLayout};
use safetensors::{Dtype, SafeTensors};

/// tests/fixtures/modelopt_nvfp4_v2.safetensors, built into the test binaries (they also run from
/// the GPU bundle, away from the source tree).
pub const FIXTURE: &[u8] = include_bytes!("../fixtures/modelopt_nvfp4_v2.safetensors");

/// One ModelOpt quantization: input, output bytes and the decode scale it used.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub x: Vec<bf16>,
    /// `[rows, cols / 2]`, element 2j in the low nibble.
    pub codes: Vec<u8>,
    /// `[rows, cols / 16]` E4M3 bytes, linear.
    pub scales: Vec<u8>,
    pub g: f32,
    /// g was given to ModelOpt (the activation path); else ModelOpt derived it from x.
    pub given: bool,
}

fn tensor<'a>(st: &'a SafeTensors<'a>, name: &str, dtype: Dtype) -> (Vec<usize>, &'a [u8]) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(t.dtype(), dtype, "{name}");
    (t.shape().to_vec(), t.data())
}

/// Cases from any safetensors file in the fixture's naming (`C.x`, `C.codes`, `C.scales`, `C.g`;
/// a case named `given_*` had g given). `x` may come from a separate input file.
pub fn cases_from(bytes: &[u8], inputs: Option<&[u8]>) -> Vec<Case> {
    let st = SafeTensors::deserialize(bytes).expect("outputs parse");
    let st_in = inputs.map(|b| SafeTensors::deserialize(b).expect("inputs parse"));
    let src = st_in.as_ref().unwrap_or(&st);
    let mut names: Vec<String> =
        st.names().into_iter().filter_map(|n| n.strip_suffix(".codes").map(str::to_string)).collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let (shape, xb) = tensor(src, &format!("{name}.x"), Dtype::BF16);
            let (rows, cols) = (shape[0], shape[1]);
            let x = xb.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect();
            let (cs, codes) = tensor(&st, &format!("{name}.codes"), Dtype::U8);
            assert_eq!(cs, [rows, cols / 2], "{name}.codes");
            let (ss, scales) = tensor(&st, &format!("{name}.scales"), Dtype::U8);
            assert_eq!(ss, [rows, cols / 16], "{name}.scales");
            let (_, gb) = tensor(&st, &format!("{name}.g"), Dtype::F32);
            let g = f32::from_le_bytes(gb[..4].try_into().unwrap());
            let given = name.starts_with("given_");
            Case { name, rows, cols, x, codes: codes.to_vec(), scales: scales.to_vec(), g, given }
        })
        .collect()
}

/// The committed fixture's cases and its metadata (generator, ModelOpt and torch versions, device).
pub fn fixture() -> (Vec<Case>, HashMap<String, String>) {
    let (_, meta) = SafeTensors::read_metadata(FIXTURE).expect("fixture header");
    let meta = meta.metadata().clone().unwrap_or_default();
    (cases_from(FIXTURE, None), meta)
}

/// Linear `[rows, cols/16]` scales read back out of a buffer in `layout`.
pub fn linear_scales(layout: ScaleLayout, rows: usize, cols: usize, scales: &[u8]) -> Vec<u8> {
    let kb = scale_cols(cols);
    (0..rows * kb).map(|i| scales[scale_offset(layout, rows, cols, i / kb, i % kb)]).collect()
}

/// Linear scales read back out of a grouped (one 128-row-aligned region per expert) buffer.
pub fn linear_from_grouped(offsets: &[i32], rows: usize, cols: usize, scales: &[u8]) -> Vec<u8> {
    let kb = scale_cols(cols);
    (0..rows * kb).map(|i| scales[grouped_swizzled_offset(offsets, i / kb, i % kb, cols)]).collect()
}

/// Expert offsets that split `rows` into up to three experts (one of them empty), all with the
/// same decode scale, so grouped quantizers can be compared with a whole-tensor oracle.
pub fn three_way_offsets(rows: usize) -> Vec<i32> {
    let a = rows / 3;
    vec![0, a as i32, a as i32, rows as i32]
}

/// Where two byte strings first differ, with a window of context, for assertion messages.
pub fn describe_diff(what: &str, case: &str, got: &[u8], want: &[u8]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{case}: {what}: {} bytes, want {}", got.len(), want.len()));
    }
    let n = got.iter().zip(want).filter(|(a, b)| a != b).count();
    let i = got.iter().zip(want).position(|(a, b)| a != b)?;
    Some(format!("{case}: {what}: {n} bytes differ, first at {i}: got {:#04x}, ModelOpt {:#04x}", got[i], want[i]))
}

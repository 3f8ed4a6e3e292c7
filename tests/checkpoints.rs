//! Checkpoints in both NVFP4 dialects against the committed fixtures.

mod checkpoint_fixture;

use checkpoint_fixture::{bf16_experts, inputs, modelopt_checkpoint, root, EXPERTS, HIDDEN, INTERMEDIATE, PREFIX};
use nvfp4_moe::io::{load_experts, load_modelopt, Dialect, QuantScheme};

/// The committed fixture inputs are what the crate writes today (`NVFP4MOE_WRITE_FIXTURES=1`
/// rewrites them; then rerun scripts/fixtures/compressed_tensors.sh on a GPU machine).
#[test]
fn fixture_inputs_are_current() {
    let write = std::env::var_os("NVFP4MOE_WRITE_FIXTURES").is_some();
    for (rel, bytes) in inputs() {
        let path = root().join(&rel);
        if write {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &bytes).unwrap();
            continue;
        }
        let committed = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(committed == bytes, "{rel} differs from what the crate writes: rerun with NVFP4MOE_WRITE_FIXTURES=1");
    }
}

/// The ModelOpt fixture loads as ModelOpt W4A4 (declared by its hf_quant_config.json), holds
/// exactly what the crate's quantizer made of the BF16 experts, and keeps gate's and up's different
/// decode scales and expert 1's different up input scale.
#[test]
fn modelopt_fixture_loads_as_w4a4() {
    let dir = root().join("modelopt_w4a4");
    let got = load_experts(&dir, PREFIX).unwrap();
    assert_eq!((got.format.dialect, got.format.scheme), (Dialect::ModelOpt, QuantScheme::W4A4));
    assert_eq!(got.format.declared_in, Some(dir.join("hf_quant_config.json")));
    let want = modelopt_checkpoint(&bf16_experts());
    let c = &got.checkpoint;
    assert_eq!((c.experts, c.hidden, c.intermediate), (EXPERTS, HIDDEN, INTERMEDIATE));
    assert!(c.w13.codes == want.w13.codes && c.w13.scales == want.w13.scales);
    assert!(c.w2.codes == want.w2.codes && c.w2.scales == want.w2.scales);
    assert_eq!(c.w13.decode_scales, want.w13.decode_scales);
    assert_eq!(c.up_decode_scales, want.up_decode_scales);
    assert!(c.up_decode_scales.iter().zip(&c.w13.decode_scales).all(|(u, g)| u != g));
    let (l1, up) = (c.l1_input_scales.as_ref().unwrap(), c.up_input_scales.as_ref().unwrap());
    assert!(l1[1] != up[1] && l1[0] == up[0]);
    assert_eq!(load_modelopt(dir.join("model.safetensors"), PREFIX).unwrap().w2.decode_scales, want.w2.decode_scales);
}

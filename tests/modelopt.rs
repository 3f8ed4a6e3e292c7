//! Recipe v2 against ModelOpt itself: every CPU quantizer's bytes equal what nvidia-modelopt 0.47.0
//! wrote on CUDA for the committed fixtures (normal and heavy-tailed data, exact E2M1 ties, E4M3
//! rounding boundaries, all-zero, tiny, underflowing and subnormal blocks, -0.0, a tiny given g).
//! The GPU paths are compared with the same fixtures in tests/gpu.rs (`modelopt` module).

mod modelopt_fixture;

use modelopt_fixture::{describe_diff, fixture, linear_from_grouped, linear_scales, three_way_offsets};
use nvfp4_moe::convert::{CpuQuantizer, Quantizer};
use nvfp4_moe::layout::ScaleLayout;
use nvfp4_moe::{host, reference};

#[test]
fn fixture_is_modelopt_0_47_on_cuda() {
    let (cases, meta) = fixture();
    assert_eq!(meta.get("modelopt").map(String::as_str), Some("0.47.0"), "{meta:?}");
    assert!(meta.get("torch").is_some_and(|t| t.contains("+cu")), "a CUDA build of torch: {meta:?}");
    assert!(meta.get("device").is_some_and(|d| d.contains("NVIDIA")), "{meta:?}");
    assert!(cases.len() >= 14, "{} cases", cases.len());
    // What the fixture must exercise, so a regenerated file cannot quietly lose a case.
    let all_scales: Vec<u8> = cases.iter().flat_map(|c| c.scales.iter().copied()).collect();
    assert!(all_scales.contains(&0x38) && all_scales.contains(&0x01) && all_scales.contains(&0x7E));
    let zero_block = cases
        .iter()
        .any(|c| c.x.chunks_exact(16).zip(&c.scales).any(|(b, &s)| b.iter().all(|v| v.to_f32() == 0.0) && s == 0x38));
    assert!(zero_block, "an all-zero block with ModelOpt's scale 1.0");
    let neg_zero_code0 = cases.iter().any(|c| {
        c.x.iter().enumerate().any(|(i, v)| v.to_bits() == 0x8000 && (c.codes[i / 2] >> (4 * (i % 2))) & 0xF == 0)
    });
    assert!(neg_zero_code0, "-0.0 with code 0");
    assert!(cases.iter().any(|c| c.given) && cases.iter().any(|c| !c.given));
}

#[test]
fn cpu_quantizer_equals_modelopt() {
    let (cases, _) = fixture();
    let mut blocks = 0;
    for c in &cases {
        for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled128x4] {
            let q = reference::quantize(&c.x, c.rows, c.cols, c.g, layout).unwrap();
            let scales = linear_scales(layout, c.rows, c.cols, &q.scales);
            let what = format!("reference::quantize {layout:?}");
            assert!(
                describe_diff("codes", &c.name, &q.codes, &c.codes).is_none(),
                "{what}: {:?}",
                describe_diff("codes", &c.name, &q.codes, &c.codes)
            );
            assert!(
                describe_diff("scales", &c.name, &scales, &c.scales).is_none(),
                "{what}: {:?}",
                describe_diff("scales", &c.name, &scales, &c.scales)
            );
        }
        // The converter's CPU quantizer (threshold tables, not the reference's divisions).
        let (mut codes, mut scales) = (vec![0u8; c.rows * c.cols / 2], vec![0u8; c.rows * c.cols / 16]);
        CpuQuantizer::with_threads(2).quantize(&c.x, c.rows, c.cols, c.g, &mut codes, &mut scales).unwrap();
        assert!(
            describe_diff("codes", &c.name, &codes, &c.codes).is_none(),
            "CpuQuantizer: {:?}",
            describe_diff("codes", &c.name, &codes, &c.codes)
        );
        assert!(
            describe_diff("scales", &c.name, &scales, &c.scales).is_none(),
            "CpuQuantizer: {:?}",
            describe_diff("scales", &c.name, &scales, &c.scales)
        );
        blocks += c.scales.len();
    }
    eprintln!(
        "{} cases, {blocks} blocks: the CPU quantizers (reference, CpuQuantizer) equal ModelOpt byte for byte",
        cases.len()
    );
}

#[test]
fn cpu_grouped_quantizer_equals_modelopt() {
    let (cases, _) = fixture();
    for c in &cases {
        let offsets = three_way_offsets(c.rows);
        let (codes, scales) = reference::quantize_grouped(&c.x, &offsets, c.cols, &[c.g]).unwrap();
        let scales = linear_from_grouped(&offsets, c.rows, c.cols, &scales);
        assert_eq!(describe_diff("codes", &c.name, &codes, &c.codes), None, "reference::quantize_grouped");
        assert_eq!(describe_diff("scales", &c.name, &scales, &c.scales), None, "reference::quantize_grouped");
    }
}

#[test]
fn weight_decode_scale_equals_modelopt() {
    // ModelOpt's weight path: g = amax / (6 * 448) as PyTorch computes it on CUDA.
    let (cases, _) = fixture();
    let derived: Vec<_> = cases.iter().filter(|c| !c.given).collect();
    assert!(derived.len() >= 8);
    for c in derived {
        let g = host::weight_decode_scale(&c.x).unwrap();
        assert_eq!(g.to_bits(), c.g.to_bits(), "{}: ours {g:e}, ModelOpt {:e}", c.name, c.g);
    }
}

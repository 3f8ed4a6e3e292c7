//! MoE feed-forward shapes of public models (`shared/presets/moe-shapes.toml`) built into the
//! crate (the shapes of the CLI's `check` and `bench`).

use crate::error::{Error, Result};

/// One MoE layer shape: E experts, hidden size H, expert intermediate size I, top-k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preset {
    /// The name the CLI takes (`deepseek-v3`, ...).
    pub name: &'static str,
    /// Experts E.
    pub experts: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub intermediate: usize,
    /// Experts per token k.
    pub top_k: usize,
}

impl Preset {
    /// Bytes of one expert's NVFP4 weights (gate, up and down: `3 x H x I` elements at 4.5 bits,
    /// codes plus block-16 E4M3 scales).
    pub fn expert_bytes(&self) -> usize {
        3 * self.hidden * self.intermediate * 9 / 16
    }

    /// Bytes of all the layer's NVFP4 weights.
    pub fn layer_bytes(&self) -> usize {
        self.experts * self.expert_bytes()
    }
}

const fn p(name: &'static str, experts: usize, hidden: usize, intermediate: usize, top_k: usize) -> Preset {
    Preset { name, experts, hidden, intermediate, top_k }
}

/// The built-in presets (facts from the models' published configs).
pub const PRESETS: [Preset; 6] = [
    p("deepseek-v3", 256, 7168, 2048, 8),
    p("kimi-k2", 384, 7168, 2048, 8),
    p("qwen3-235b-a22b", 128, 4096, 1536, 8),
    p("qwen3-30b-a3b", 128, 2048, 768, 8),
    p("mixtral-8x7b", 8, 4096, 14336, 2),
    p("gpt-oss-120b", 128, 2880, 2880, 4),
];

/// The names of the built-in presets, comma-separated.
pub fn preset_names() -> String {
    PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
}

/// The built-in preset `name` (exact, case-sensitive); an error lists the valid names.
///
/// # Errors
/// [`Error::Invalid`] for an unknown name.
pub fn preset(name: &str) -> Result<Preset> {
    PRESETS
        .iter()
        .find(|p| p.name == name)
        .copied()
        .ok_or_else(|| Error::Invalid(format!("unknown preset `{name}` (valid: {})", preset_names())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_the_shapes_file() {
        // shared/presets/moe-shapes.toml: (name, experts, hidden, intermediate, top_k).
        let want = [
            ("deepseek-v3", 256, 7168, 2048, 8),
            ("kimi-k2", 384, 7168, 2048, 8),
            ("qwen3-235b-a22b", 128, 4096, 1536, 8),
            ("qwen3-30b-a3b", 128, 2048, 768, 8),
            ("mixtral-8x7b", 8, 4096, 14336, 2),
            ("gpt-oss-120b", 128, 2880, 2880, 4),
        ];
        assert_eq!(PRESETS.len(), want.len());
        for (name, e, h, i, k) in want {
            assert_eq!(preset(name).unwrap(), Preset { name, experts: e, hidden: h, intermediate: i, top_k: k });
        }
        // Every preset fits the layer's shape rules.
        for p in PRESETS {
            #[cfg(feature = "cuda")]
            {
                assert!(crate::gemm::check_gemm_shape(p.experts, 2 * p.intermediate, p.hidden).is_ok(), "{}", p.name);
                assert!(crate::gemm::check_gemm_shape(p.experts, p.hidden, p.intermediate).is_ok(), "{}", p.name);
            }
            assert!(p.top_k <= p.experts.min(32), "{}", p.name);
        }
        assert_eq!(preset("qwen3-30b-a3b").unwrap().layer_bytes(), 128 * 3 * 2048 * 768 * 9 / 16);
    }

    #[test]
    fn unknown_preset_lists_the_valid_names() {
        for bad in ["", "deepseek", "Qwen3-30B-A3B", "mixtral-8x7b "] {
            let msg = preset(bad).unwrap_err().to_string();
            assert!(msg.contains(&format!("unknown preset `{bad}`")), "{msg}");
            for p in PRESETS {
                assert!(msg.contains(p.name), "{msg}");
            }
        }
    }
}

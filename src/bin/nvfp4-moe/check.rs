//! `nvfp4-moe check`: the MoE layer of a preset shape on random weights, on the GPU, against the
//! CPU f64 reference.

use clap::ValueEnum;
use half::bf16;
use nvfp4_moe::presets::{self, Preset};
use serde_json::json;

use crate::common::{CliResult, Global};

pub const ABOUT: &str =
    "Run the MoE layer of a preset shape on random weights on the GPU and compare it with the CPU f64 reference";

/// Tolerance of `check`: relative Frobenius error, overall and of every token.
pub const CHECK_TOL: f64 = 1e-2;

/// Tolerances of `check --intermediate nvfp4` (overall, worst token): quantizing the SwiGLU
/// intermediate to NVFP4 alone costs ~9% relative RMS (simulated 8.8%), which the second GEMM
/// carries to the output; a token has only H outputs, so its error spreads more.
pub const CHECK_TOL_NVFP4: (f64, f64) = (0.15, 0.25);

/// The most tokens `check` takes (the f64 reference costs T x k x 3 x H x I multiply-adds).
pub const CHECK_MAX_TOKENS: usize = 4096;

/// The text after the options of `check --help`: what it does, the preset table, an example.
pub fn after_help() -> String {
    let mut s = String::from(
        "\
Generates a random NVFP4 checkpoint of the preset's shape on the host (random E2M1 codes, E4M3
block scales in 0.125..3.75, decode scales in [1e-3, 1e-2), up decode scales twice the gate's),
random hidden states and random routing (softmax top-k over random router logits, renormalized),
runs MoeLayer::forward on GPU 0, and compares the output with the CPU f64 reference layer.
Prints the relative Frobenius error overall and of the worst token; fails (exit 1) if either is
above 1e-2 (with --intermediate nvfp4: 0.15 overall, 0.25 for a token). Needs a CUDA GPU. The
host holds the whole checkpoint (E x 3 x H x I x 9/16 bytes: about 6.3 GB for deepseek-v3,
9.5 GB for kimi-k2).

Presets (experts, hidden, intermediate, top-k):
",
    );
    for p in presets::PRESETS {
        s.push_str(&format!("  {:<16}{:>4}{:>6}{:>7}{:>3}\n", p.name, p.experts, p.hidden, p.intermediate, p.top_k));
    }
    s.push_str("\nExample:\n  nvfp4-moe check --preset mixtral-8x7b --tokens 64 --intermediate nvfp4");
    s
}

/// What the first GEMM hands the second.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum IntermediateArg {
    /// Compact BF16 from the SwigluBf16 epilogue
    Bf16,
    /// NVFP4 packed in the first GEMM's epilogue, dequantized for the second
    Nvfp4,
}

impl IntermediateArg {
    pub fn name(self) -> &'static str {
        match self {
            IntermediateArg::Bf16 => "bf16",
            IntermediateArg::Nvfp4 => "nvfp4",
        }
    }
}

/// A positive count.
pub fn parse_count(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(_) => Err("must be a positive integer".to_string()),
    }
}

/// `check --tokens`: 1..=4096.
fn parse_check_tokens(s: &str) -> Result<usize, String> {
    let n = parse_count(s)?;
    if n > CHECK_MAX_TOKENS {
        return Err(format!("at most {CHECK_MAX_TOKENS} (the f64 reference grows with T)"));
    }
    Ok(n)
}

/// One built-in preset by name.
pub fn parse_preset(s: &str) -> Result<Preset, String> {
    presets::preset(s.trim()).map_err(|e| e.to_string())
}

/// The flags of `check`.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The layer shape (see the table below)
    #[arg(long, value_name = "NAME", default_value = "qwen3-30b-a3b", value_parser = parse_preset)]
    pub preset: Preset,
    /// Tokens in the forward, 1..=4096
    #[arg(long, value_name = "T", default_value = "4", value_parser = parse_check_tokens)]
    pub tokens: usize,
    /// What the first GEMM hands the second: nvfp4 is packed in its epilogue with a decode scale
    /// calibrated on these tokens (tolerance 0.15 overall, 0.25 per token: NVFP4's own error on
    /// SwiGLU data is ~9% RMS)
    #[arg(long, value_enum, value_name = "F", default_value = "bf16")]
    pub intermediate: IntermediateArg,
}

/// Whether `check` passes: both errors within `(overall, worst token)` tolerances (a NaN fails).
pub fn within_tol(overall: f64, worst: f64, tol: (f64, f64)) -> bool {
    overall <= tol.0 && worst <= tol.1
}

/// `||got - want|| / ||want||` (Frobenius); 0 when both are zero, infinite when only `want` is.
fn rel_frobenius(num_sq: f64, den_sq: f64) -> f64 {
    if num_sq == 0.0 {
        0.0
    } else if den_sq == 0.0 {
        f64::INFINITY
    } else {
        (num_sq / den_sq).sqrt()
    }
}

/// The relative Frobenius error of `got` against `want` (`[T, H]` each): `(overall, worst token,
/// its error)`. A NaN anywhere makes the errors NaN (and so fails every `<=` test).
pub fn rel_errors(got: &[bf16], want: &[f64], hidden: usize) -> (f64, usize, f64) {
    let (mut num, mut den) = (0f64, 0f64);
    let (mut worst_t, mut worst) = (0usize, 0f64);
    for (t, (g, w)) in got.chunks(hidden).zip(want.chunks(hidden)).enumerate() {
        let (mut n, mut d) = (0f64, 0f64);
        for (a, b) in g.iter().zip(w) {
            let diff = f64::from(a.to_f32()) - b;
            n += diff * diff;
            d += b * b;
        }
        num += n;
        den += d;
        let e = rel_frobenius(n, d);
        // The first NaN token is the worst; else the largest error.
        if t == 0 || (e.is_nan() && !worst.is_nan()) || e > worst {
            (worst_t, worst) = (t, e);
        }
    }
    (rel_frobenius(num, den), worst_t, worst)
}

/// The result of one check, for the text and JSON output.
pub struct Outcome {
    pub gpu: String,
    pub nvfp4_decode_scale: Option<f32>,
    pub overall: f64,
    pub worst_token: usize,
    pub worst: f64,
    pub seconds: f64,
}

pub fn run(args: &CheckArgs, global: Global) -> CliResult {
    use crate::common::{out, print_json, Fail};
    let p = args.preset;
    let tol = match args.intermediate {
        IntermediateArg::Bf16 => (CHECK_TOL, CHECK_TOL),
        IntermediateArg::Nvfp4 => CHECK_TOL_NVFP4,
    };
    let o = gpu_run::check(args)?;
    let passed = within_tol(o.overall, o.worst, tol);
    if global.json {
        print_json(&json!({
            "command": "check",
            "preset": p.name,
            "experts": p.experts,
            "hidden": p.hidden,
            "intermediate": p.intermediate,
            "top_k": p.top_k,
            "tokens": args.tokens,
            "intermediate_format": args.intermediate.name(),
            "nvfp4_decode_scale": o.nvfp4_decode_scale,
            "gpu": o.gpu,
            "error": { "overall": o.overall, "worst_token": o.worst_token, "worst_token_error": o.worst },
            "tolerance": { "overall": tol.0, "token": tol.1 },
            "passed": passed,
            "seconds": o.seconds,
        }));
    } else {
        let (e, h, i, k) = (p.experts, p.hidden, p.intermediate, p.top_k);
        out!("check {}: E={e} H={h} I={i} top-k={k}, {} token(s), GPU 0: {}", p.name, args.tokens, o.gpu);
        if let Some(g) = o.nvfp4_decode_scale {
            out!("NVFP4 intermediate, calibrated decode scale {g:.4e}");
        }
        out!(
            "relative Frobenius error: overall {:.3e}, worst token {}: {:.3e} (tolerance {} / {})",
            o.overall,
            o.worst_token,
            o.worst,
            tol.0,
            tol.1
        );
        if passed {
            out!("ok");
        }
    }
    if !passed {
        return Err(Fail::Run(format!(
            "check {} failed: relative error overall {:.3e}, token {} {:.3e} (tolerance {} / {})",
            p.name, o.overall, o.worst_token, o.worst, tol.0, tol.1
        )));
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod gpu_run {
    use std::time::Instant;

    use half::bf16;
    use nvfp4_moe::host::MoeCheckpoint;
    use nvfp4_moe::moe::MoeInput;
    use nvfp4_moe::reference;
    use nvfp4_moe::testing::{random_moe_checkpoint, Rng};
    use nvfp4_moe::{Intermediate, MoeLayer, MoeOptions, MoeWeights};
    use tracing::info;

    use super::{CheckArgs, IntermediateArg, Outcome};
    use crate::common::{fmt_bytes, fmt_dur, progress, run_chunked, spinner, CliResult};
    use crate::gpu::require_gpu;

    /// The f64 reference layer, tokens spread over all cores (one token per work item, so the
    /// progress bar moves).
    fn reference_layer(
        ck: &MoeCheckpoint,
        hidden: &[bf16],
        tokens: usize,
        ids: &[i32],
        weights: &[f32],
        top_k: usize,
    ) -> nvfp4_moe::Result<Vec<f64>> {
        let h = ck.hidden;
        let mut out = vec![0f64; tokens * h];
        let items: Vec<_> = out.chunks_mut(h).enumerate().map(|(t, o)| (1, (t, o))).collect();
        let pb = progress("cpu f64 reference", tokens as u64, "tokens");
        run_chunked(&pb, items, |(t, o): (usize, &mut [f64])| -> nvfp4_moe::Result<()> {
            let y = reference::routing::moe_layer(
                &hidden[t * h..(t + 1) * h],
                1,
                &ids[t * top_k..(t + 1) * top_k],
                &weights[t * top_k..(t + 1) * top_k],
                top_k,
                ck,
            )?;
            o.copy_from_slice(&y);
            Ok(())
        })?;
        pb.finish_and_clear();
        Ok(out)
    }

    pub fn check(args: &CheckArgs) -> CliResult<Outcome> {
        let (p, tokens) = (args.preset, args.tokens);
        let gpu = require_gpu("check")?;
        let (e, h, i, k) = (p.experts, p.hidden, p.intermediate, p.top_k);
        let t_all = Instant::now();
        if p.layer_bytes() >= 1 << 30 {
            info!("note: the random checkpoint is held on the host: {} of host memory", fmt_bytes(p.layer_bytes()));
        }

        let mut rng = Rng::from_entropy();
        let pb = spinner(&format!("generating a random checkpoint ({})", fmt_bytes(p.layer_bytes())));
        let t = Instant::now();
        let ck = random_moe_checkpoint(&mut rng, e, h, i);
        let logits: Vec<f32> = (0..tokens * e).map(|_| rng.normal()).collect();
        let (ids, weights) = reference::routing::softmax_topk(&logits, tokens, e, k, true)?;
        let hidden = rng.normal_bf16(tokens * h, 1.0);
        pb.finish_and_clear();
        info!("generated a random checkpoint of {} in {}", fmt_bytes(p.layer_bytes()), fmt_dur(t.elapsed()));

        let pb = spinner("uploading and preparing the weights on GPU 0");
        let t = Instant::now();
        let ctx = cudarc::driver::CudaContext::new(0)?;
        let stream = ctx.default_stream();
        let mut layer = MoeLayer::new(MoeWeights::from_checkpoint(&stream, &ck)?, MoeOptions::new(tokens, k))?;
        let mut ws = layer.workspace(&stream)?;
        let (hd, idd, wd) = (stream.clone_htod(&hidden)?, stream.clone_htod(&ids)?, stream.clone_htod(&weights)?);
        let mut nvfp4_decode_scale = None;
        if args.intermediate == IntermediateArg::Nvfp4 {
            let g = layer.calibrate_nvfp4_scale(&stream, &hd, tokens, &idd, k, &mut ws)?;
            nvfp4_decode_scale = Some(g);
            layer = layer.with_intermediate(Intermediate::Nvfp4 { decode_scale: g })?;
            ws = layer.workspace(&stream)?;
        }
        stream.synchronize()?;
        pb.finish_and_clear();
        info!("prepared the weights on GPU 0 in {}", fmt_dur(t.elapsed()));

        let t = Instant::now();
        let mut out_d = stream.alloc_zeros::<bf16>(tokens * h)?;
        let input = MoeInput { hidden: &hd, tokens, topk_ids: &idd, topk_weights: &wd, top_k: k };
        layer.forward(&stream, &input, &mut out_d, &mut ws)?;
        layer.check(&stream, &mut ws, k)?;
        let got = stream.clone_dtoh(&out_d)?;
        info!("ran the forward in {}", fmt_dur(t.elapsed()));
        drop((layer, ws, hd, idd, wd, out_d));

        let t = Instant::now();
        let want = reference_layer(&ck, &hidden, tokens, &ids, &weights, k)?;
        info!("computed the CPU f64 reference ({} multiply-adds) in {}", tokens * k * 3 * h * i, fmt_dur(t.elapsed()));

        let (overall, worst_token, worst) = super::rel_errors(&got, &want, h);
        Ok(Outcome { gpu, nvfp4_decode_scale, overall, worst_token, worst, seconds: t_all.elapsed().as_secs_f64() })
    }
}

#[cfg(not(feature = "cuda"))]
mod gpu_run {
    use super::{CheckArgs, Outcome};
    use crate::common::CliResult;
    use crate::gpu::require_gpu;

    pub fn check(_: &CheckArgs) -> CliResult<Outcome> {
        Err(require_gpu("check").unwrap_err())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_errors() {
        let want = vec![1.0, 0.0, 2.0, 2.0, -3.0, 4.0];
        let got: Vec<bf16> = want.iter().map(|&v| bf16::from_f64(v)).collect();
        assert_eq!(rel_errors(&got, &want, 2), (0.0, 0, 0.0));
        let mut g = got.clone();
        g[2] = bf16::from_f64(2.5); // token 1: |0.5, 0| / |2, 2|
        let (all, t, w) = rel_errors(&g, &want, 2);
        assert_eq!(t, 1);
        assert!((w - 0.5 / 8f64.sqrt()).abs() < 1e-12);
        assert!((all - 0.5 / 34f64.sqrt()).abs() < 1e-12);
        g[5] = bf16::NAN;
        let (all, t, w) = rel_errors(&g, &want, 2);
        assert!(all.is_nan() && w.is_nan() && t == 2);
        let tol = (CHECK_TOL, CHECK_TOL);
        assert!(!within_tol(all, w, tol) && !within_tol(0.0, w, tol) && within_tol(CHECK_TOL, 0.0, tol));
        assert!(!within_tol(all, w, CHECK_TOL_NVFP4) && within_tol(0.15, 0.25, CHECK_TOL_NVFP4));
        assert!(!within_tol(0.151, 0.0, CHECK_TOL_NVFP4) && !within_tol(0.0, 0.251, CHECK_TOL_NVFP4));
        // An all-zero reference token: 0 if matched, infinite otherwise.
        assert_eq!(rel_errors(&[bf16::ZERO], &[0.0], 1), (0.0, 0, 0.0));
        assert_eq!(rel_errors(&[bf16::ONE], &[0.0], 1).2, f64::INFINITY);
    }

    #[test]
    fn values() {
        assert_eq!(parse_count("4"), Ok(4));
        assert_eq!(parse_count(" 7 "), Ok(7));
        assert!(parse_count("0").unwrap_err().contains("at least 1"));
        assert!(parse_count("-1").is_err() && parse_count("1.5").is_err() && parse_count("").is_err());
        assert_eq!(parse_check_tokens("4096"), Ok(4096));
        assert!(parse_check_tokens("4097").unwrap_err().contains("at most 4096"));
        assert_eq!(parse_preset("gpt-oss-120b").unwrap().hidden, 2880);
        let e = parse_preset("llama").unwrap_err();
        assert!(e.contains("unknown preset `llama`") && e.contains("deepseek-v3") && e.contains("kimi-k2"), "{e}");
    }

    #[test]
    fn the_preset_table_is_the_built_in_one() {
        let help = after_help();
        for p in presets::PRESETS {
            let line = format!("{} {} {} {} {}", p.name, p.experts, p.hidden, p.intermediate, p.top_k);
            assert!(help.lines().any(|l| l.split_whitespace().collect::<Vec<_>>().join(" ") == line), "{line}");
        }
    }
}

//! `nvfp4-moe run`: one MoE layer of an NVFP4 checkpoint (ModelOpt or compressed-tensors) on given hidden states and
//! routing, on the GPU.

use clap::builder::NonEmptyStringValueParser;
use clap::ValueEnum;
use half::bf16;
use nvfp4_moe::io as nio;
use nvfp4_moe::Error;

use crate::common::{shape_text, CliResult, Global};

pub const ABOUT: &str =
    "Run one MoE layer of an NVFP4 checkpoint (ModelOpt or compressed-tensors) on given hidden states and routing";

pub const AFTER_HELP: &str = "\
--input holds
  hidden_states  BF16 [T, H]   (H: the checkpoint's hidden size)
  topk_ids       I32  [T, k]   (expert ids in [0, E), 1 <= k <= min(E, 32))
  topk_weights   F32  [T, k]
and --output gets out BF16 [T, H] with
out[t] = sum_j topk_weights[t, j] * down(silu(gate(x_t)) * up(x_t)) of expert topk_ids[t, j],
on GPU 0. An expert id outside [0, E) is an error. Needs a CUDA GPU.

Example:
  nvfp4-moe run --weights DeepSeek-V3-NVFP4/ --prefix model.layers.3.mlp.experts \\
      --input tokens.safetensors --output out.safetensors";

/// `--tile`: the GEMM tile configuration (`run` and `bench`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TileArg {
    /// Chosen from T x k and E
    Auto,
    /// 128 x 8 (at most 8 rows per expert)
    N8,
    /// 128 x 16 (decode)
    N16,
    /// 128 x 32
    N32,
    /// 128 x 64
    N64,
    /// 128 x 128 (prefill, 65-128 rows per expert)
    N128,
    /// 128 x 256 (prefill, more than 128 rows per expert; an expert's last <= 64 rows on 128 x 32 / 64)
    N256,
    /// One warp per 16 features, mma.sync (at most 8 rows in all)
    Warp,
}

#[cfg(feature = "cuda")]
impl TileArg {
    /// The library's tile for this flag.
    pub fn gemm_tile(self) -> nvfp4_moe::GemmTile {
        use nvfp4_moe::GemmTile;
        match self {
            TileArg::Auto => GemmTile::Auto,
            TileArg::N8 => GemmTile::M128N8,
            TileArg::N16 => GemmTile::M128N16,
            TileArg::N32 => GemmTile::M128N32,
            TileArg::N64 => GemmTile::M128N64,
            TileArg::N128 => GemmTile::M128N128,
            TileArg::N256 => GemmTile::M128N256,
            TileArg::Warp => GemmTile::WarpM16N8,
        }
    }
}

/// The flags of `run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// NVFP4 checkpoint, ModelOpt or compressed-tensors (detected): a .safetensors file, a sharded
    /// index .json, a directory holding one (a Hugging Face cache snapshot too), or a Hugging Face
    /// cache root models--org--name (through refs/main)
    #[arg(long, value_name = "W", value_parser = NonEmptyStringValueParser::new())]
    pub weights: String,
    /// The layer's experts, e.g. model.layers.3.mlp.experts (gate_proj/up_proj/down_proj,
    /// w1/w3/w2, gate_up_proj/down_proj or w13/w2 under {P}.{e}.)
    #[arg(long, value_name = "P")]
    pub prefix: String,
    /// safetensors file holding hidden_states, topk_ids and topk_weights
    #[arg(long, value_name = "FILE", value_parser = NonEmptyStringValueParser::new())]
    pub input: String,
    /// safetensors file to write (replaced if it exists): out BF16 [T, H]
    #[arg(long, value_name = "FILE", value_parser = NonEmptyStringValueParser::new())]
    pub output: String,
    /// GEMM tile
    #[arg(long, value_enum, value_name = "T", default_value = "auto")]
    pub tile: TileArg,
}

/// The inputs of `run`, validated.
#[derive(Debug)]
pub struct RunInputs {
    pub hidden: Vec<bf16>,
    pub ids: Vec<i32>,
    pub weights: Vec<f32>,
    pub tokens: usize,
    pub hidden_size: usize,
    pub top_k: usize,
}

/// An [`Error::Tensor`] for one of `run`'s input tensors (their names are fixed: nothing to
/// escape).
fn input_err(name: &str, what: impl Into<String>) -> Error {
    Error::Tensor { name: name.to_string(), what: what.into() }
}

/// Tensor `name` of `st`, of `dtype`, 2-D: `(view, rows, cols)`.
fn tensor_2d<'a>(
    st: &'a safetensors::SafeTensors<'a>,
    file: &str,
    name: &str,
    dtype: safetensors::Dtype,
    dims: &str,
) -> nvfp4_moe::Result<(safetensors::tensor::TensorView<'a>, usize, usize)> {
    let t = st.tensor(name).map_err(|_| {
        let mut names = st.names();
        names.sort();
        let held = if names.is_empty() {
            "none".to_string()
        } else {
            names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
        };
        input_err(name, format!("not found in `{file}` (it holds {held})"))
    })?;
    if t.dtype() != dtype {
        return Err(input_err(name, format!("dtype is {}, expected {dtype} {dims}", t.dtype())));
    }
    let &[rows, cols] = t.shape() else {
        return Err(input_err(name, format!("shape is {}, expected 2-D {dims}", shape_text(t.shape()))));
    };
    Ok((t, rows, cols))
}

/// Reads and validates `hidden_states` (BF16 `[T, H]`), `topk_ids` (I32 `[T, k]`) and
/// `topk_weights` (F32 `[T, k]`, finite) with T, H, k >= 1 and k <= 32.
///
/// # Errors
/// [`Error::Tensor`] naming the tensor: missing, of the wrong dtype or shape, or a weight that is
/// not finite (its index named).
pub fn parse_run_inputs(st: &safetensors::SafeTensors<'_>, file: &str) -> nvfp4_moe::Result<RunInputs> {
    use safetensors::Dtype;
    let (hs, tokens, hidden_size) = tensor_2d(st, file, "hidden_states", Dtype::BF16, "[T, H]")?;
    if tokens == 0 || hidden_size == 0 {
        return Err(input_err(
            "hidden_states",
            format!("shape is {}, expected [T, H] with T, H >= 1", shape_text(hs.shape())),
        ));
    }
    let (ti, t2, top_k) = tensor_2d(st, file, "topk_ids", Dtype::I32, "[T, k]")?;
    if t2 != tokens || top_k == 0 || top_k > 32 {
        return Err(input_err(
            "topk_ids",
            format!(
                "shape is {}, expected [{tokens}, k] with 1 <= k <= 32 (T = {tokens} from `hidden_states`)",
                shape_text(ti.shape())
            ),
        ));
    }
    let (tw, _, _) = tensor_2d(st, file, "topk_weights", Dtype::F32, "[T, k]")?;
    if tw.shape() != [tokens, top_k] {
        return Err(input_err(
            "topk_weights",
            format!("shape is {}, expected [{tokens}, {top_k}] (the shape of `topk_ids`)", shape_text(tw.shape())),
        ));
    }
    let hidden = hs.data().chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect();
    let ids = ti.data().chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let weights: Vec<f32> = tw.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    // A NaN or Inf weight would make the token's whole output row NaN or Inf.
    if let Some((i, w)) = weights.iter().enumerate().find(|(_, w)| !w.is_finite()) {
        return Err(input_err("topk_weights", format!("[{}, {}] is {w}, not finite", i / top_k, i % top_k)));
    }
    Ok(RunInputs { hidden, ids, weights, tokens, hidden_size, top_k })
}

/// `run`'s checks of the inputs against the checkpoint's shape: H, k <= min(E, 32), and every
/// expert id in `[0, E)`.
///
/// # Errors
/// [`Error::Tensor`] naming the input tensor that does not fit the checkpoint.
pub fn check_run_shape(inp: &RunInputs, experts: usize, hidden: usize) -> nvfp4_moe::Result<()> {
    if inp.hidden_size != hidden {
        return Err(input_err(
            "hidden_states",
            format!("shape is [{}, {}], but the checkpoint's hidden size is {hidden}", inp.tokens, inp.hidden_size),
        ));
    }
    if inp.top_k > experts.min(32) {
        return Err(input_err("topk_ids", format!("k = {} exceeds min(experts ({experts}), 32)", inp.top_k)));
    }
    if let Some((i, id)) =
        inp.ids.iter().enumerate().find(|(_, &id)| usize::try_from(id).map_or(true, |e| e >= experts))
    {
        return Err(input_err(
            "topk_ids",
            format!("[{}, {}] = {id} is not an expert id in [0, {experts})", i / inp.top_k, i % inp.top_k),
        ));
    }
    Ok(())
}

/// Everything `run` checks before it looks for a GPU: the inputs (a regular file, the three
/// tensors), the checkpoint (every tensor's dtype, shape and scale) and the inputs against it, so
/// a malformed file is reported on any machine.
pub fn load_and_validate(args: &RunArgs) -> CliResult<(RunInputs, nio::LoadedExperts)> {
    use std::time::Instant;

    use tracing::info;

    use crate::common::{fmt_dur, spinner, Fail};

    let (weights_path, prefix, input) = (args.weights.as_str(), args.prefix.as_str(), args.input.as_str());
    let t = Instant::now();
    // Mapped, not read whole (a regular file only: /dev/zero or a FIFO is refused up front).
    let file = nio::SafetensorsFile::open(input)?;
    let st = safetensors::SafeTensors::deserialize(file.mapped()?)
        .map_err(|e| Fail::Run(format!("`{input}` is not a valid safetensors file: {e}")))?;
    let inp = parse_run_inputs(&st, input)?;
    drop(st);
    drop(file);
    let (tokens, k) = (inp.tokens, inp.top_k);
    info!(
        "read {input}: hidden_states BF16 [{tokens}, {}], topk_ids I32 [{tokens}, {k}], topk_weights F32 [{tokens}, {k}] ({})",
        inp.hidden_size,
        fmt_dur(t.elapsed())
    );

    let t = Instant::now();
    let pb = spinner(&format!("loading `{prefix}` from {weights_path}"));
    let loaded = nio::load_experts(weights_path, prefix)?;
    pb.finish_and_clear();
    let ck = &loaded.checkpoint;
    check_run_shape(&inp, ck.experts, ck.hidden)?;
    info!(
        "loaded `{prefix}` ({}, {}, naming {}): E={} H={} I={} ({})",
        loaded.format.dialect,
        loaded.format.scheme,
        ck.naming,
        ck.experts,
        ck.hidden,
        ck.intermediate,
        fmt_dur(t.elapsed())
    );
    Ok((inp, loaded))
}

#[cfg(feature = "cuda")]
pub fn run(args: &RunArgs, global: Global) -> CliResult {
    use std::time::Instant;

    use nvfp4_moe::moe::MoeInput;
    use nvfp4_moe::{MoeLayer, MoeOptions, MoeWeights};
    use serde_json::json;
    use tracing::info;

    use crate::common::{fmt_bytes, fmt_dur, out, print_json, spinner};
    use crate::gpu::require_gpu;

    let (weights_path, prefix, input, output) =
        (args.weights.as_str(), args.prefix.as_str(), args.input.as_str(), args.output.as_str());
    let tile = args.tile.gemm_tile();
    let t_all = Instant::now();
    // The files first: a malformed input or checkpoint is reported whether or not a GPU is here.
    let (inp, loaded) = load_and_validate(args)?;
    let gpu = require_gpu("run")?;
    let (tokens, k) = (inp.tokens, inp.top_k);
    let ck = loaded.checkpoint;
    let (e, h, i) = (ck.experts, ck.hidden, ck.intermediate);
    let naming = ck.naming.to_string();

    let t = Instant::now();
    let pb = spinner(&format!("uploading and preparing the weights on GPU 0 ({gpu})"));
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let weights = MoeWeights::from_checkpoint(&stream, &ck)?;
    drop(ck);
    stream.synchronize()?;
    pb.finish_and_clear();
    info!("prepared the weights on GPU 0 in {}", fmt_dur(t.elapsed()));

    let layer = MoeLayer::new(weights, MoeOptions { tile, ..MoeOptions::new(tokens, k) })?;
    let mut ws = layer.workspace(&stream)?;
    let (hd, idd, wd) =
        (stream.clone_htod(&inp.hidden)?, stream.clone_htod(&inp.ids)?, stream.clone_htod(&inp.weights)?);
    let mut out_d = stream.alloc_zeros::<bf16>(tokens * h)?;
    stream.synchronize()?;
    let t = Instant::now();
    let moe_input = MoeInput { hidden: &hd, tokens, topk_ids: &idd, topk_weights: &wd, top_k: k };
    layer.forward(&stream, &moe_input, &mut out_d, &mut ws)?;
    layer.check(&stream, &mut ws, k)?;
    let fwd = t.elapsed();
    let tile_used = layer.gemm_tiles(tokens, k)?.0;
    let y = stream.clone_dtoh(&out_d)?;

    let t = Instant::now();
    nio::write_bf16(output, "out", &y, tokens, h)?;
    info!("wrote {output} in {}; total {}", fmt_dur(t.elapsed()), fmt_dur(t_all.elapsed()));
    if global.json {
        print_json(&json!({
            "command": "run",
            "weights": weights_path,
            "prefix": prefix,
            "naming": naming,
            "experts": e,
            "hidden": h,
            "intermediate": i,
            "input": input,
            "tokens": tokens,
            "top_k": k,
            "tile": format!("{tile_used:?}"),
            "gpu": gpu,
            "output": output,
            "seconds": { "forward": fwd.as_secs_f64(), "total": t_all.elapsed().as_secs_f64() },
        }));
    } else {
        out!(
            "forward of `{prefix}` (E={e} H={h} I={i}) on GPU 0 ({gpu}): {tokens} token(s) x top-{k}, tile {tile_used:?}, {} (wall clock, first call)",
            fmt_dur(fwd)
        );
        out!("wrote {output} ({}): out BF16 [{tokens}, {h}]", fmt_bytes(y.len() * 2));
    }
    Ok(())
}

/// Without the `cuda` feature: the files are still checked (so a malformed one is reported), then
/// the GPU is missing.
#[cfg(not(feature = "cuda"))]
pub fn run(args: &RunArgs, _: Global) -> CliResult {
    load_and_validate(args)?;
    crate::gpu::require_gpu("run").map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st_bytes(tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn run_inputs_are_validated() {
        use safetensors::{Dtype, SafeTensors};
        let (t, h, k) = (3usize, 64usize, 2usize);
        let hidden: Vec<u8> = (0..t * h).flat_map(|i| bf16::from_f32(i as f32).to_bits().to_le_bytes()).collect();
        let ids: Vec<u8> = [0i32, 5, 1, 2, 7, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        let w: Vec<u8> = [0.5f32, 0.5, 1.0, 0.0, 0.25, 0.75].iter().flat_map(|v| v.to_le_bytes()).collect();
        let good = vec![
            ("hidden_states", Dtype::BF16, vec![t, h], hidden.clone()),
            ("topk_ids", Dtype::I32, vec![t, k], ids.clone()),
            ("topk_weights", Dtype::F32, vec![t, k], w.clone()),
        ];
        let bytes = st_bytes(&good);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let inp = parse_run_inputs(&st, "x.safetensors").unwrap();
        assert_eq!((inp.tokens, inp.hidden_size, inp.top_k), (t, h, k));
        assert_eq!(inp.ids, vec![0, 5, 1, 2, 7, 3]);
        assert_eq!(inp.weights, vec![0.5, 0.5, 1.0, 0.0, 0.25, 0.75]);
        assert_eq!(inp.hidden[7].to_f32(), 7.0);
        assert!(check_run_shape(&inp, 8, h).is_ok());
        let e = check_run_shape(&inp, 8, 128).unwrap_err().to_string();
        assert!(e.contains("`hidden_states`") && e.contains("hidden size is 128"), "{e}");
        let e = check_run_shape(&inp, 1, h).unwrap_err().to_string();
        assert!(e.contains("`topk_ids`") && e.contains("k = 2"), "{e}");

        let i64_ids: Vec<u8> = [0i64, 5, 1, 2, 7, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        type Tensor = (&'static str, Dtype, Vec<usize>, Vec<u8>);
        let cases: Vec<(usize, Tensor, &str)> = vec![
            (
                0,
                ("hidden_states", Dtype::F32, vec![t, h / 2], hidden.clone()),
                "tensor `hidden_states`: dtype is F32, expected BF16",
            ),
            (
                0,
                ("hidden_states", Dtype::BF16, vec![t * h], hidden.clone()),
                "tensor `hidden_states`: shape is [192], expected 2-D",
            ),
            (
                0,
                ("hidden", Dtype::BF16, vec![t, h], hidden.clone()),
                "tensor `hidden_states`: not found in `x.safetensors` (it holds `hidden`, `topk_ids`, `topk_weights`)",
            ),
            (1, ("topk_ids", Dtype::I64, vec![t, k], i64_ids), "tensor `topk_ids`: dtype is I64, expected I32"),
            (
                1,
                ("topk_ids", Dtype::I32, vec![k, t], ids.clone()),
                "tensor `topk_ids`: shape is [2, 3], expected [3, k]",
            ),
            (
                1,
                ("topk_ids", Dtype::I32, vec![t, 2, 1], ids.clone()),
                "tensor `topk_ids`: shape is [3, 2, 1], expected 2-D",
            ),
            (
                2,
                ("topk_weights", Dtype::I32, vec![t, k], w.clone()),
                "tensor `topk_weights`: dtype is I32, expected F32",
            ),
            (
                2,
                ("topk_weights", Dtype::F32, vec![t * k, 1], w.clone()),
                "tensor `topk_weights`: shape is [6, 1], expected [3, 2]",
            ),
            (2, ("weights", Dtype::F32, vec![t, k], w.clone()), "tensor `topk_weights`: not found"),
        ];
        for (slot, replace, want) in cases {
            let mut ts = good.clone();
            ts[slot] = replace;
            let bytes = st_bytes(&ts);
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let e = parse_run_inputs(&st, "x.safetensors").unwrap_err().to_string();
            assert!(e.contains(want), "{e}\nwant: {want}");
        }
        // k above 32 and an empty T.
        let many: Vec<u8> = vec![0; t * 33 * 4];
        let mut ts = good.clone();
        ts[1] = ("topk_ids", Dtype::I32, vec![t, 33], many.clone());
        ts[2] = ("topk_weights", Dtype::F32, vec![t, 33], many);
        let bytes = st_bytes(&ts);
        let e = parse_run_inputs(&SafeTensors::deserialize(&bytes).unwrap(), "x").unwrap_err().to_string();
        assert!(e.contains("1 <= k <= 32"), "{e}");
        let ts = vec![
            ("hidden_states", Dtype::BF16, vec![0, h], vec![]),
            ("topk_ids", Dtype::I32, vec![0, k], vec![]),
            ("topk_weights", Dtype::F32, vec![0, k], vec![]),
        ];
        let bytes = st_bytes(&ts);
        let e = parse_run_inputs(&SafeTensors::deserialize(&bytes).unwrap(), "x").unwrap_err().to_string();
        assert!(e.contains("T, H >= 1"), "{e}");
    }

    fn assert_input_err(e: Error, tensor: &str, want: &str) {
        match &e {
            Error::Tensor { name, what } => assert!(name == tensor && what.contains(want), "{e}\nwant: {want}"),
            _ => panic!("expected Error::Tensor for `{tensor}`, got {e:?}"),
        }
    }

    /// A routing weight that is NaN or infinite, and an expert id outside [0, E), are typed errors
    /// naming the tensor and the first such [token, slot] (issue 21).
    #[test]
    fn bad_routing_values_are_named() {
        use safetensors::{Dtype, SafeTensors};
        let (t, h, k) = (3usize, 16usize, 2usize);
        let hidden: Vec<u8> = vec![0; t * h * 2];
        let ids = |v: [i32; 6]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let inputs = |ids: Vec<u8>, w: [f32; 6]| {
            st_bytes(&[
                ("hidden_states", Dtype::BF16, vec![t, h], hidden.clone()),
                ("topk_ids", Dtype::I32, vec![t, k], ids),
                ("topk_weights", Dtype::F32, vec![t, k], w.iter().flat_map(|x| x.to_le_bytes()).collect()),
            ])
        };
        let good = [0.5f32, 0.5, 1.0, 0.0, -0.25, 1.25];
        for (at, bad) in [(1usize, f32::NAN), (4, f32::INFINITY), (5, f32::NEG_INFINITY)] {
            let mut w = good;
            w[at] = bad;
            // A later bad weight does not change which one is named.
            if at < 5 {
                w[5] = f32::NAN;
            }
            let bytes = inputs(ids([0, 1, 2, 3, 0, 1]), w);
            let e = parse_run_inputs(&SafeTensors::deserialize(&bytes).unwrap(), "x").unwrap_err();
            assert_input_err(e, "topk_weights", &format!("[{}, {}] is {bad}, not finite", at / k, at % k));
        }
        let bytes = inputs(ids([0, 1, 2, 3, 0, 1]), good);
        let inp = parse_run_inputs(&SafeTensors::deserialize(&bytes).unwrap(), "x").unwrap();
        assert_eq!(inp.weights, good);
        assert!(check_run_shape(&inp, 4, h).is_ok());
        assert_input_err(
            check_run_shape(&inp, 3, h).unwrap_err(),
            "topk_ids",
            "[1, 1] = 3 is not an expert id in [0, 3)",
        );
        for (v, want) in [
            ([0, 1, 2, -1, 7, 0], "[1, 1] = -1 is not an expert id in [0, 4)"),
            ([0, 1, 2, 3, i32::MIN, i32::MAX], "[2, 0] = -2147483648 is not"),
        ] {
            let bytes = inputs(ids(v), good);
            let inp = parse_run_inputs(&SafeTensors::deserialize(&bytes).unwrap(), "x").unwrap();
            assert_input_err(check_run_shape(&inp, 4, h).unwrap_err(), "topk_ids", want);
        }
    }

    #[test]
    fn tiles() {
        assert_eq!(TileArg::from_str("auto", false), Ok(TileArg::Auto));
        assert_eq!(TileArg::from_str("n16", false), Ok(TileArg::N16));
        assert_eq!(TileArg::from_str("n8", false), Ok(TileArg::N8));
        assert_eq!(TileArg::from_str("n64", false), Ok(TileArg::N64));
        assert_eq!(TileArg::from_str("n128", false), Ok(TileArg::N128));
        assert_eq!(TileArg::from_str("warp", false), Ok(TileArg::Warp));
        assert!(TileArg::from_str("N16", false).is_err());
    }
}

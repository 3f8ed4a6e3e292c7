//! The `nvfp4-moe` binary end to end, on small safetensors files written here with random data.
//! Every test prints its seed (`NVFP4MOE_TEST_SEED=0x... cargo test NAME` replays it).

mod common;

use std::path::Path;

use common::{assert_fails, assert_ok, cli, cli_within, rng, round_trip, write_raw, TmpDir};
use half::bf16;
use nvfp4_moe::io::{read_matrix_bf16, read_modelopt, write_bf16};
use nvfp4_moe::layout::ScaleLayout;
use nvfp4_moe::{host, reference};
use safetensors::tensor::Dtype;

#[test]
fn cpu_round_trip_matches_reference() {
    let mut r = rng();
    let dir = TmpDir::new("rt");
    // Small, odd row counts, and more rows than one CPU work chunk (1024 rows at K = 32).
    for (rows, cols, prefix) in [(1usize, 16usize, ""), (37, 80, "model.layers.0.mlp.gate_proj"), (2500, 32, "e.7.")] {
        let x = r.varied_bf16(rows * cols);
        round_trip(&dir, &x, rows, cols, "cpu", prefix);
    }
}

#[test]
fn special_values_are_kept() {
    let mut r = rng();
    let dir = TmpDir::new("special");
    let (rows, cols) = (9usize, 64usize);
    let mut x = r.varied_bf16(rows * cols);
    x[3] = bf16::NAN;
    x[70] = bf16::INFINITY;
    x[200] = bf16::NEG_INFINITY;
    x[300] = bf16::from_f32(-0.0);
    let (q, _) = round_trip(&dir, &x, rows, cols, "cpu", "");
    assert!(!q.is_empty());
}

#[test]
fn default_name_and_no_prefix() {
    let mut r = rng();
    let dir = TmpDir::new("defaults");
    let (rows, cols) = (5usize, 48usize);
    let x = r.varied_bf16(rows * cols);
    let (input, q, d) = (dir.path("in.safetensors"), dir.path("q.safetensors"), dir.path("d.safetensors"));
    write_bf16(&input, "w", &x, rows, cols).unwrap();
    assert_ok(&cli(&["quantize", "--input", &input, "--tensor", "w", "--output", &q, "--backend=cpu"]));
    assert_ok(&cli(&["dequantize", "--input", &q, "--output", &d, "--backend", "cpu"]));
    let (y, ..) = read_matrix_bf16(&d, "weight").unwrap();
    assert_eq!(y.len(), rows * cols);
}

#[test]
fn quantize_is_deterministic() {
    let mut r = rng();
    let dir = TmpDir::new("det");
    let (rows, cols) = (300usize, 96usize);
    let x = r.varied_bf16(rows * cols);
    let (q1, d1) = round_trip(&dir, &x, rows, cols, "cpu", "p.");
    let (q2, d2) = round_trip(&dir, &x, rows, cols, "cpu", "p.");
    assert!(q1 == q2 && d1 == d2);
}

#[test]
fn f32_input_is_rounded_with_a_message() {
    let mut r = rng();
    let dir = TmpDir::new("f32");
    let (rows, cols) = (6usize, 32usize);
    let x: Vec<f32> = (0..rows * cols).map(|_| r.normal() * 0.02).collect();
    let input = dir.path("in.safetensors");
    let q = dir.path("q.safetensors");
    write_raw(&input, &[("w32", Dtype::F32, vec![rows, cols], x.iter().flat_map(|v| v.to_le_bytes()).collect())]);
    let run = cli(&["quantize", "--input", &input, "--tensor", "w32", "--output", &q, "--backend", "cpu"]);
    assert_ok(&run);
    // The result (stdout) names the source dtype; the note about rounding is a diagnostic (stderr).
    assert!(run.stdout.contains("F32") && !run.stdout.contains("rounded to BF16"), "{}", run.stdout);
    assert!(run.stderr.lines().any(|l| l.starts_with("note: ") && l.contains("rounded to BF16")), "{}", run.stderr);

    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let g = host::weight_decode_scale(&xb).unwrap();
    let want = reference::quantize_f32(&x, rows, cols, g, ScaleLayout::Linear).unwrap();
    let w = read_modelopt(&q, "").unwrap();
    assert_eq!(w.decode_scale.to_bits(), g.to_bits());
    assert!(w.codes == want.codes && w.scales == want.scales);
}

#[test]
fn usage_errors_exit_2() {
    let cases: &[(&[&str], &str)] = &[
        (&[], "no command"),
        (&["frobnicate"], "unknown command `frobnicate`"),
        (&["quantize"], "missing required flags --input, --tensor, --output"),
        (&["quantize", "--input", "a", "--output", "b"], "missing required flag --tensor"),
        (&["quantize", "--input", "a", "--tensor", "t", "--output", "b", "--bogus", "1"], "unknown flag `--bogus`"),
        (&["quantize", "--input", "a", "--tensor", "t", "--output"], "`--output` needs a value"),
        (&["quantize", "--input", "a", "--input", "b", "--tensor", "t", "--output", "c"], "`--input` given twice"),
        (
            &["quantize", "--input", "a", "--tensor", "t", "--output", "b", "--backend", "tpu"],
            "`--backend` is cpu or cuda (got `tpu`)",
        ),
        (&["quantize", "stray", "--input", "a"], "unexpected argument `stray`"),
        (&["dequantize", "--input", "a"], "missing required flag --output"),
        (&["dequantize", "--input", "a", "--output", "b", "--tensor", "x"], "unknown flag `--tensor`"),
        (&["info", "--verbose"], "unknown flag `--verbose`"),
        (&["help", "nope"], "unknown command `nope`"),
        (&["bench", "--intermediate", "fp8"], "`--intermediate` is bf16 or nvfp4 (got `fp8`)"),
        (&["check", "--intermediate", "fp4"], "`--intermediate` is bf16 or nvfp4 (got `fp4`)"),
        (&["bench", "--preset", "mixtral-8x7b", "--ep", "9"], "--ep 9: mixtral-8x7b has only 8 experts"),
        (&["bench", "--ep", "2", "--intermediate", "nvfp4"], "--ep takes the BF16 intermediate"),
        (&["bench", "--dispatched", "--tile", "warp"], "--dispatched takes a tile other than warp"),
        (&["bench", "--routing", "zipf"], "`--routing` is balanced or uniform or skewed (got `zipf`)"),
        (&["bench", "--routing", "skewed", "--ep", "2"], "`--routing` cannot be used with `--ep`"),
        (&["bench", "--routing", "skewed,balanced,skewed"], "--routing: `skewed` given twice"),
        (&["bench", "--dispatched", "--routing", "balanced,skewed"], "--dispatched takes balanced routing"),
        (&["bench", "--dispatched", "--routing", "uniform"], "--dispatched takes balanced routing"),
    ];
    for (args, msg) in cases {
        let r = cli(args);
        assert_fails(&r, 2, &[msg]);
        assert!(r.stderr.contains("Usage:"), "{}", r.stderr);
        assert!(r.stdout.is_empty(), "{}", r.stdout);
    }
}

#[test]
fn help_and_version() {
    for args in [&["--help"][..], &["-h"], &["help"]] {
        let r = cli(args);
        assert_ok(&r);
        for w in ["quantize", "dequantize", "info", "--backend cpu|cuda", "Exit status"] {
            assert!(r.stdout.contains(w), "{w}: {}", r.stdout);
        }
    }
    for args in [&["quantize", "--help"][..], &["help", "quantize"], &["quantize", "--input", "x", "-h"]] {
        let r = cli(args);
        assert_ok(&r);
        assert!(r.stdout.contains("--tensor <NAME>") && r.stdout.contains("weight_scale_2"), "{}", r.stdout);
        assert!(r.stdout.contains("Example:\n  nvfp4-moe quantize --input"), "{}", r.stdout);
    }
    let r = cli(&["dequantize", "--help"]);
    assert_ok(&r);
    assert!(r.stdout.contains("--name <NAME>"), "{}", r.stdout);
    // `help CMD` is `CMD --help`, for every command, each with an example.
    for cmd in ["quantize", "dequantize", "check", "run", "bench", "info"] {
        let (a, b) = (cli(&["help", cmd]), cli(&[cmd, "--help"]));
        assert_ok(&a);
        assert_eq!(a.stdout, b.stdout, "{cmd}");
        assert!(a.stdout.contains("Example:") && a.stdout.contains("--json"), "{cmd}: {}", a.stdout);
    }
    let r = cli(&["--version"]);
    assert_ok(&r);
    assert_eq!(r.stdout.trim(), format!("nvfp4-moe {}", env!("CARGO_PKG_VERSION")));
}

#[test]
fn info_runs() {
    let r = cli(&["info"]);
    assert_ok(&r);
    assert!(r.stdout.contains(env!("CARGO_PKG_VERSION")), "{}", r.stdout);
    #[cfg(feature = "cuda")]
    {
        for w in ["CUDA compiled against", "target archs", "CUTLASS", "CUDA runtime", "CUDA driver"] {
            assert!(r.stdout.contains(w), "{w}: {}", r.stdout);
        }
        assert!(r.stdout.contains("no CUDA GPU visible") || r.stdout.contains("compute capability"), "{}", r.stdout);
    }
    #[cfg(not(feature = "cuda"))]
    assert!(r.stdout.contains("without CUDA"), "{}", r.stdout);

    let r = cli(&["--json", "info"]);
    assert_ok(&r);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("one JSON document on stdout");
    assert_eq!(v["command"], "info");
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["cuda"], cfg!(feature = "cuda"));
    assert!(v["gpus"].is_array(), "{v}");
    if cfg!(feature = "cuda") {
        assert!(v["build"]["cuda_archs"].is_string() && v["build"]["cutlass"].is_string(), "{v}");
    } else {
        assert!(v["build"].is_null(), "{v}");
    }
}

#[test]
fn missing_tensor_and_file_exit_1() {
    let mut r = rng();
    let dir = TmpDir::new("missing");
    let input = dir.path("in.safetensors");
    let out = dir.path("q.safetensors");
    write_bf16(&input, "present", &r.varied_bf16(32), 2, 16).unwrap();
    let run = cli(&["quantize", "--input", &input, "--tensor", "absent", "--output", &out, "--backend", "cpu"]);
    assert_fails(&run, 1, &["`absent`", "not found", "`present`"]);
    assert!(!Path::new(&out).exists());

    let nofile = dir.path("nope.safetensors");
    let run = cli(&["quantize", "--input", &nofile, "--tensor", "w", "--output", &out, "--backend", "cpu"]);
    assert_fails(&run, 1, &["nope.safetensors"]);

    let junk = dir.path("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file at all").unwrap();
    let run = cli(&["quantize", "--input", &junk, "--tensor", "w", "--output", &out, "--backend", "cpu"]);
    assert_fails(&run, 1, &["junk.safetensors", "safetensors"]);

    // dequantize: a file without the ModelOpt tensors (or with another prefix).
    let run = cli(&["dequantize", "--input", &input, "--output", &out, "--backend", "cpu"]);
    assert_fails(&run, 1, &["`weight`", "not found"]);
    let q = dir.path("q2.safetensors");
    assert_ok(&cli(&[
        "quantize",
        "--input",
        &input,
        "--tensor",
        "present",
        "--output",
        &q,
        "--backend",
        "cpu",
        "--prefix",
        "a.b",
    ]));
    let run = cli(&["dequantize", "--input", &q, "--output", &out, "--backend", "cpu", "--prefix", "c"]);
    assert_fails(&run, 1, &["`c.weight`", "not found"]);
}

#[test]
fn bad_tensors_exit_1() {
    let mut r = rng();
    let dir = TmpDir::new("bad");
    let input = dir.path("in.safetensors");
    let out = dir.path("q.safetensors");
    let mut zeros = vec![0u8; 4 * 32 * 2];
    zeros[1] = 0x80; // one -0.0: still no non-zero element
    let mut only_nan = vec![0u8; 2 * 16 * 2];
    only_nan[0..2].copy_from_slice(&bf16::NAN.to_bits().to_le_bytes());
    write_raw(
        &input,
        &[
            ("zeros", Dtype::BF16, vec![4, 32], zeros),
            ("nan", Dtype::BF16, vec![2, 16], only_nan),
            ("odd_k", Dtype::BF16, vec![2, 24], r.bytes(2 * 24 * 2)),
            ("f16", Dtype::F16, vec![2, 16], r.bytes(64)),
            ("vec", Dtype::BF16, vec![64], r.bytes(128)),
        ],
    );
    let q = |t: &str| cli(&["quantize", "--input", &input, "--tensor", t, "--output", &out, "--backend", "cpu"]);
    assert_fails(&q("zeros"), 1, &["`zeros`"]);
    assert_fails(&q("nan"), 1, &["`nan`"]);
    assert_fails(&q("odd_k"), 1, &["`odd_k`", "24"]);
    assert_fails(&q("f16"), 1, &["`f16`", "F16"]);
    assert_fails(&q("vec"), 1, &["`vec`", "[64]"]);
    assert!(!Path::new(&out).exists());

    // A ModelOpt file with a wrong scale shape.
    let bad = dir.path("bad-mo.safetensors");
    write_raw(
        &bad,
        &[
            ("weight", Dtype::U8, vec![4, 16], r.bytes(64)),
            ("weight_scale", Dtype::F8_E4M3, vec![4, 4], vec![0x38; 16]),
            ("weight_scale_2", Dtype::F32, vec![], 0.5f32.to_le_bytes().to_vec()),
        ],
    );
    let run = cli(&["dequantize", "--input", &bad, "--output", &out, "--backend", "cpu"]);
    assert_fails(&run, 1, &["`weight_scale`", "[4, 2]"]);
}

/// Whether this build can see a GPU (never without the `cuda` feature).
fn gpu_visible() -> bool {
    #[cfg(feature = "cuda")]
    return !nvfp4_moe::info::gpus().is_empty();
    #[cfg(not(feature = "cuda"))]
    false
}

#[test]
fn cuda_without_gpu_is_a_clear_error() {
    if gpu_visible() {
        eprintln!("a GPU is visible: skipped");
        return;
    }
    let mut r = rng();
    let dir = TmpDir::new("nogpu");
    let input = dir.path("in.safetensors");
    let out = dir.path("q.safetensors");
    write_bf16(&input, "w", &r.varied_bf16(64), 2, 32).unwrap();
    let run = cli(&["quantize", "--input", &input, "--tensor", "w", "--output", &out, "--backend", "cuda"]);
    #[cfg(feature = "cuda")]
    assert_fails(&run, 1, &["--backend cuda", "no CUDA GPU"]);
    #[cfg(not(feature = "cuda"))]
    assert_fails(&run, 1, &["--backend cuda", "built without CUDA support"]);
    // Without --backend, the CPU is used.
    let run = cli(&["quantize", "--input", &input, "--tensor", "w", "--output", &out]);
    assert_ok(&run);
    assert!(run.stdout.contains("cpu"), "{}", run.stdout);
}

/// `--json` (before or after the command): stdout is one JSON document with the result, the
/// diagnostics stay on stderr; the text result is short and names what was written.
#[test]
fn json_and_text_results_on_stdout_diagnostics_on_stderr() {
    let mut r = rng();
    let dir = TmpDir::new("json");
    let (rows, cols) = (20usize, 48usize);
    let x = r.varied_bf16(rows * cols);
    let (input, q, d) = (dir.path("in.safetensors"), dir.path("q.safetensors"), dir.path("d.safetensors"));
    write_bf16(&input, "w", &x, rows, cols).unwrap();
    let g = host::weight_decode_scale(&x).unwrap();

    let run = cli(&["--json", "quantize", "--input", &input, "--tensor", "w", "--output", &q, "--backend", "cpu"]);
    assert_ok(&run);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("one JSON document on stdout");
    assert_eq!(v["command"], "quantize");
    assert_eq!((v["rows"].as_u64(), v["cols"].as_u64()), (Some(rows as u64), Some(cols as u64)));
    assert_eq!(
        (v["tensor"].as_str(), v["source_dtype"].as_str(), v["backend"].as_str()),
        (Some("w"), Some("BF16"), Some("cpu"))
    );
    assert!(v["gpu"].is_null() && v["seconds"]["kernel"].is_null(), "{v}");
    assert_eq!(v["decode_scale"].as_f64().map(|d| d as f32), Some(g));
    assert_eq!(v["output"].as_str(), Some(q.as_str()));
    assert_eq!(v["bytes"].as_u64(), Some(std::fs::metadata(&q).unwrap().len()));
    let names: Vec<&str> = v["tensors"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["weight", "weight_scale", "weight_scale_2"]);
    assert_eq!(v["tensors"][0]["shape"], serde_json::json!([rows, cols / 2]));
    assert_eq!(v["tensors"][1]["dtype"], "F8_E4M3");
    assert!(v["seconds"]["total"].as_f64().is_some_and(|t| t >= 0.0), "{v}");
    assert!(run.stderr.contains("read `w`"), "timings go to stderr: {}", run.stderr);

    let run = cli(&["dequantize", "--input", &q, "--output", &d, "--backend", "cpu", "--json", "--name", "y"]);
    assert_ok(&run);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("one JSON document on stdout");
    assert_eq!(
        (v["command"].as_str(), v["prefix"].as_str(), v["backend"].as_str()),
        (Some("dequantize"), Some(""), Some("cpu"))
    );
    assert_eq!(v["decode_scale"].as_f64().map(|d| d as f32), Some(g));
    assert_eq!(v["tensors"], serde_json::json!([{ "name": "y", "dtype": "BF16", "shape": [rows, cols] }]));

    // Text: two result lines on stdout; `-q` keeps stderr to warnings and errors (none here).
    let run = cli(&["quantize", "--input", &input, "--tensor", "w", "--output", &q, "--backend", "cpu"]);
    assert_ok(&run);
    assert_eq!(run.stdout.lines().count(), 2, "{}", run.stdout);
    assert!(run.stdout.contains("decode scale g =") && run.stdout.contains(&format!("wrote {q}")), "{}", run.stdout);
    assert!(!run.stderr.is_empty());
    let quiet = cli(&["-q", "quantize", "--input", &input, "--tensor", "w", "--output", &q, "--backend", "cpu"]);
    assert_ok(&quiet);
    assert_eq!(quiet.stdout, run.stdout);
    assert!(quiet.stderr.is_empty(), "{}", quiet.stderr);
    // A warning survives -q.
    let mut xn = x.clone();
    xn[5] = bf16::INFINITY;
    write_bf16(&input, "w", &xn, rows, cols).unwrap();
    let run = cli(&["--quiet", "quantize", "--input", &input, "--tensor", "w", "--output", &q, "--backend", "cpu"]);
    assert_ok(&run);
    assert!(run.stderr.starts_with("warning: `w` holds 1 non-finite element"), "{}", run.stderr);
}

/// `--prefix ""` is no prefix, and `--flag=value` works like `--flag value`.
#[test]
fn empty_prefix_and_equals_values() {
    let mut r = rng();
    let dir = TmpDir::new("prefix");
    let (rows, cols) = (3usize, 32usize);
    let x = r.varied_bf16(rows * cols);
    let (input, q1, q2) = (dir.path("in.safetensors"), dir.path("q1.safetensors"), dir.path("q2.safetensors"));
    write_bf16(&input, "w", &x, rows, cols).unwrap();
    assert_ok(&cli(&[
        "quantize",
        "--input",
        &input,
        "--tensor",
        "w",
        "--output",
        &q1,
        "--backend",
        "cpu",
        "--prefix",
        "",
    ]));
    let (i, o) = (format!("--input={input}"), format!("--output={q2}"));
    assert_ok(&cli(&["quantize", &i, "--tensor=w", &o, "--backend=cpu", "--prefix="]));
    assert!(std::fs::read(&q1).unwrap() == std::fs::read(&q2).unwrap());
    let w = read_modelopt(&q1, "").unwrap();
    assert_eq!((w.rows, w.cols), (rows, cols));
}

/// The GPU commands on a machine without a usable GPU: one `error:` line, exit 1 (their usage
/// errors are still exit 2, checked in `usage_errors_exit_2`).
#[test]
fn gpu_commands_without_a_gpu_fail_cleanly() {
    if gpu_visible() {
        eprintln!("a GPU is visible: skipped");
        return;
    }
    let dir = TmpDir::new("nogpu-cmds");
    // `run` checks its files first: good ones, so that the GPU is what is missing.
    let (w, prefix) = fixture_checkpoint();
    let hidden = nvfp4_moe::io::load_experts(&w, prefix).unwrap().checkpoint.hidden;
    let (x, y) = (dir.path("x.safetensors"), dir.path("y.safetensors"));
    write_run_inputs(&x, &mut rng(), hidden, [0.5; 6], [0, 1, 2, 0, 1, 2]);
    for args in [
        vec!["check", "--tokens", "2"],
        vec!["bench", "--tokens", "1"],
        vec!["bench", "--tokens", "1", "--ep", "2"],
        vec!["--json", "run", "--weights", &w, "--prefix", prefix, "--input", &x, "--output", &y],
    ] {
        let run = cli(&args);
        assert_fails(&run, 1, &["needs a CUDA GPU"]);
        assert!(run.stdout.is_empty(), "{}", run.stdout);
    }
}

/// `--output` replaces only a regular file (written beside it and renamed): a symlink, a FIFO or a
/// device is refused with everything left as it was, and an output name of 250 bytes works.
#[cfg(unix)]
#[test]
fn output_is_written_safely() {
    let mut r = rng();
    let dir = TmpDir::new("safe-out");
    let (rows, cols) = (4usize, 32usize);
    let input = dir.path("in.safetensors");
    write_bf16(&input, "w", &r.varied_bf16(rows * cols), rows, cols).unwrap();
    let victim = dir.path("victim.txt");
    std::fs::write(&victim, b"must not change").unwrap();
    let link = dir.path("link.safetensors");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let listing = || {
        let mut v: Vec<String> = std::fs::read_dir(Path::new(&dir.path("")))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let before = listing();
    for (out, what) in [(link.as_str(), "a symbolic link"), ("/dev/null", "a character device")] {
        let run = cli(&["quantize", "--input", &input, "--tensor", "w", "--output", out, "--backend", "cpu"]);
        assert_fails(&run, 1, &[out, what, "not a regular file"]);
        assert_eq!(listing(), before);
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"must not change");
    let long = dir.path(&format!("{}.safetensors", "q".repeat(250 - ".safetensors".len())));
    assert_ok(&cli(&["quantize", "--input", &input, "--tensor", "w", "--output", &long, "--backend", "cpu"]));
    assert!(read_modelopt(&long, "").is_ok());
}

/// The ModelOpt checkpoint fixture and its experts' prefix.
fn fixture_checkpoint() -> (String, &'static str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoints/modelopt_w4a4");
    (dir.to_string_lossy().into_owned(), "model.layers.0.mlp.experts")
}

/// `run`'s input file: `hidden` random rows (T = 3) routed to `ids` with `weights` (k = 2).
fn write_run_inputs(path: &str, r: &mut nvfp4_moe::testing::Rng, hidden: usize, weights: [f32; 6], ids: [i32; 6]) {
    let (t, k) = (3usize, 2usize);
    let x: Vec<u8> = r.varied_bf16(t * hidden).iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
    write_raw(
        path,
        &[
            ("hidden_states", Dtype::BF16, vec![t, hidden], x),
            ("topk_ids", Dtype::I32, vec![t, k], ids.iter().flat_map(|v| v.to_le_bytes()).collect()),
            ("topk_weights", Dtype::F32, vec![t, k], weights.iter().flat_map(|v| v.to_le_bytes()).collect()),
        ],
    );
}

/// A raw tensor: name, dtype, shape, bytes.
type Raw = (String, Dtype, Vec<usize>, Vec<u8>);

/// Copies the safetensors file `from` to `to` with `edit` applied to its tensors.
fn rewrite(from: &Path, to: &Path, edit: &dyn Fn(&mut Vec<Raw>)) {
    let file = nvfp4_moe::io::SafetensorsFile::open(from).unwrap();
    let mut ts: Vec<Raw> = file
        .names()
        .into_iter()
        .map(|n| {
            let t = file.get(n).unwrap();
            (n.to_string(), t.dtype, t.shape.clone(), file.read(n).unwrap())
        })
        .collect();
    edit(&mut ts);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = ts
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, to).unwrap();
}

/// How long a run on a tiny input may take before it counts as hung.
const LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// Every CLI input path that is a FIFO, `/dev/zero`, `/dev/null` or a directory (or a checkpoint
/// directory holding a FIFO) is refused with one `error:` line naming it, exit 1, without hanging,
/// reading without bound, or writing the output (issue 21).
#[cfg(unix)]
#[test]
fn non_regular_inputs_are_refused_for_every_command() {
    let mut r = rng();
    let dir = TmpDir::new("nonreg-cli");
    let fifo = dir.path("fifo.safetensors");
    let c = std::ffi::CString::new(fifo.as_str()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {fifo}");
    let sub = dir.path("subdir");
    std::fs::create_dir(&sub).unwrap();
    // A checkpoint directory whose only file is a FIFO.
    let fifo_dir = dir.path("fifo-model");
    std::fs::create_dir(&fifo_dir).unwrap();
    let fifo_model = format!("{fifo_dir}/model.safetensors");
    let c = std::ffi::CString::new(fifo_model.as_str()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {fifo_model}");

    let (ckpt, prefix) = fixture_checkpoint();
    let hidden = nvfp4_moe::io::load_experts(&ckpt, prefix).unwrap().checkpoint.hidden;
    let (x, q, inputs) = (dir.path("x.safetensors"), dir.path("q.safetensors"), dir.path("inputs.safetensors"));
    write_bf16(&x, "w", &r.varied_bf16(4 * 32), 4, 32).unwrap();
    assert_ok(&cli(&["quantize", "--input", &x, "--tensor", "w", "--output", &q, "--backend", "cpu"]));
    write_run_inputs(&inputs, &mut r, hidden, [0.5; 6], [0, 1, 2, 0, 1, 2]);
    let out = dir.path("out.safetensors");
    let out_dir = dir.path("out-dir");

    let files = [
        (fifo.as_str(), "a named pipe (FIFO), not a regular file"),
        ("/dev/zero", "a character device, not a regular file"),
        ("/dev/null", "a character device, not a regular file"),
    ];
    for (bad, what) in files.iter().copied().chain([(sub.as_str(), "a directory, not a regular file")]) {
        for args in [
            vec!["quantize", "--input", bad, "--tensor", "w", "--output", &out, "--backend", "cpu"],
            vec!["dequantize", "--input", bad, "--output", &out, "--backend", "cpu"],
            vec!["run", "--weights", &ckpt, "--prefix", prefix, "--input", bad, "--output", &out],
        ] {
            assert_fails(&cli_within(LIMIT, &args), 1, &[bad, what]);
        }
    }
    // Checkpoint paths: a directory is a checkpoint form, so an empty one is "holds no checkpoint".
    let fifo_in_dir = (fifo_model.as_str(), "a named pipe (FIFO), not a regular file");
    let empty_dir = (sub.as_str(), "holds no `.safetensors` file");
    for (path, (bad, what)) in
        files.iter().copied().map(|f| (f.0, f)).chain([(fifo_dir.as_str(), fifo_in_dir), (sub.as_str(), empty_dir)])
    {
        for args in [
            vec!["run", "--weights", path, "--prefix", prefix, "--input", &inputs, "--output", &out],
            vec!["info", "--weights", path, "--prefix", prefix],
            vec!["convert", "--input", path, "--output", &out_dir, "--device", "cpu"],
        ] {
            let run = cli_within(LIMIT, &args);
            assert_fails(&run, 1, &[bad, what]);
            assert!(run.stdout.is_empty(), "{}", run.stdout);
        }
    }
    assert!(!Path::new(&out).exists() && !Path::new(&out_dir).exists());
}

/// `dequantize --name __metadata__` would write a tensor under the header's metadata key: a usage
/// error before anything is read or written. `quantize --tensor __metadata__` finds no tensor.
#[test]
fn the_metadata_key_is_not_a_tensor_name() {
    let mut r = rng();
    let dir = TmpDir::new("meta-name");
    let (x, q, d) = (dir.path("x.safetensors"), dir.path("q.safetensors"), dir.path("d.safetensors"));
    write_bf16(&x, "w", &r.varied_bf16(2 * 32), 2, 32).unwrap();
    let run = cli(&["quantize", "--input", &x, "--tensor", "__metadata__", "--output", &q, "--backend", "cpu"]);
    assert_fails(&run, 1, &["`__metadata__`", "not found"]);
    assert_ok(&cli(&["quantize", "--input", &x, "--tensor", "w", "--output", &q, "--backend", "cpu"]));
    let run = cli(&["dequantize", "--input", &q, "--output", &d, "--name", "__metadata__", "--backend", "cpu"]);
    assert_fails(&run, 2, &["`--name`", "__metadata__", "not a tensor name"]);
    assert!(!Path::new(&d).exists());
    assert_ok(&cli(&["dequantize", "--input", &q, "--output", &d, "--name", "__metadata___", "--backend", "cpu"]));
    assert!(read_matrix_bf16(&d, "__metadata___").is_ok());
}

/// A zero-sized tensor (K = 0, N = 0) and a finite F32 beyond the BF16 range are errors naming
/// the tensor (and the element), exit 1, no output (issue 21).
#[test]
fn zero_sized_and_out_of_range_tensors_exit_1() {
    let dir = TmpDir::new("zero-cli");
    let (input, out) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    let g = 0.5f32.to_le_bytes().to_vec();
    for (w, s) in [(vec![4, 0], vec![4, 0]), (vec![0, 8], vec![0, 1]), (vec![0, 1usize << 62], vec![0, 1usize << 59])] {
        write_raw(
            &input,
            &[
                ("weight", Dtype::U8, w.clone(), vec![]),
                ("weight_scale", Dtype::F8_E4M3, s, vec![]),
                ("weight_scale_2", Dtype::F32, vec![], g.clone()),
            ],
        );
        let shape = format!("[{}, {}]", w[0], w[1]);
        let run = cli_within(LIMIT, &["dequantize", "--input", &input, "--output", &out, "--backend", "cpu"]);
        assert_fails(&run, 1, &["`weight`", &shape, "zero-sized"]);
    }
    for shape in [vec![0usize, 32], vec![4, 0]] {
        write_raw(&input, &[("w", Dtype::BF16, shape.clone(), vec![])]);
        let run = cli(&["quantize", "--input", &input, "--tensor", "w", "--output", &out, "--backend", "cpu"]);
        assert_fails(&run, 1, &["`w`", "zero-sized"]);
    }
    let mut r = rng();
    let (rows, cols) = (3usize, 16usize);
    let mut x: Vec<f32> = (0..rows * cols).map(|_| r.normal()).collect();
    let at = r.range(0, rows * cols);
    x[at] = -3.4e38;
    write_raw(&input, &[("w32", Dtype::F32, vec![rows, cols], x.iter().flat_map(|v| v.to_le_bytes()).collect())]);
    let run = cli(&["quantize", "--input", &input, "--tensor", "w32", "--output", &out, "--backend", "cpu"]);
    let element = format!("[{}, {}] (index {at})", at / cols, at % cols);
    assert_fails(&run, 1, &["`w32`", &element, "beyond the BF16 range"]);
    assert!(!run.stderr.contains("non-finite"), "{}", run.stderr);
    assert!(!Path::new(&out).exists());
}

/// `run` checks its input file and the checkpoint before it looks for a GPU: each problem is
/// reported (naming the tensor) on a machine without one; with good files, the missing GPU is.
#[test]
fn run_checks_its_files_before_looking_for_a_gpu() {
    let mut r = rng();
    let dir = TmpDir::new("run-order");
    let (ckpt, prefix) = fixture_checkpoint();
    let ck = nvfp4_moe::io::load_experts(&ckpt, prefix).unwrap().checkpoint;
    let (e, h) = (ck.experts as i32, ck.hidden);
    let (inputs, out) = (dir.path("inputs.safetensors"), dir.path("out.safetensors"));
    let run =
        |weights: &str| cli(&["run", "--weights", weights, "--prefix", prefix, "--input", &inputs, "--output", &out]);

    // Bad inputs, good checkpoint.
    for (w, ids, want) in [
        ([0.5, f32::NAN, 0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1, 0, 1], "tensor `topk_weights`: [0, 1] is NaN, not finite"),
        (
            [0.5, 0.5, 0.5, 0.5, f32::INFINITY, 0.5],
            [0, 1, 0, 1, 0, 1],
            "tensor `topk_weights`: [2, 0] is inf, not finite",
        ),
        ([0.5; 6], [0, 1, 0, e, 0, 1], &format!("tensor `topk_ids`: [1, 1] = {e} is not an expert id in [0, {e})")),
        ([0.5; 6], [0, 1, -1, 0, 0, 1], &format!("tensor `topk_ids`: [1, 0] = -1 is not an expert id in [0, {e})")),
    ] {
        write_run_inputs(&inputs, &mut r, h, w, ids);
        assert_fails(&run(&ckpt), 1, &[want]);
    }
    write_run_inputs(&inputs, &mut r, h + 16, [0.5; 6], [0, 1, 0, 1, 0, 1]);
    assert_fails(&run(&ckpt), 1, &["tensor `hidden_states`", &format!("hidden size is {h}")]);
    // k = 0: no expert for any token (the library would divide by it).
    let x: Vec<u8> = r.varied_bf16(3 * h).iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
    write_raw(
        &inputs,
        &[
            ("hidden_states", Dtype::BF16, vec![3, h], x),
            ("topk_ids", Dtype::I32, vec![3, 0], vec![]),
            ("topk_weights", Dtype::F32, vec![3, 0], vec![]),
        ],
    );
    assert_fails(&run(&ckpt), 1, &["tensor `topk_ids`", "1 <= k <= 32"]);

    // Good inputs, a malformed checkpoint.
    write_run_inputs(&inputs, &mut r, h, [0.5; 6], [0, 1, 2, 0, 1, 2]);
    let bad = dir.path("bad.safetensors");
    let scale = format!("{prefix}.1.up_proj.weight_scale");
    rewrite(&Path::new(&ckpt).join("model.safetensors"), Path::new(&bad), &|ts| {
        ts.iter_mut().filter(|t| t.0 == scale).for_each(|t| t.1 = Dtype::U8)
    });
    assert_fails(&run(&bad), 1, &[&format!("tensor `{scale}`"), "F8_E4M3"]);
    let two = format!("{prefix}.1.down_proj.weight");
    let mut header = std::fs::read(Path::new(&ckpt).join("model.safetensors")).unwrap();
    // The same header with one tensor's name given to another of the same length: named twice.
    let n = u64::from_le_bytes(header[..8].try_into().unwrap()) as usize;
    let text = String::from_utf8(header[8..8 + n].to_vec()).unwrap();
    let other = format!("{prefix}.2.down_proj.weight");
    let dup = text.replacen(&format!("\"{other}\""), &format!("\"{two}\""), 1);
    assert_ne!(dup, text);
    header.splice(8..8 + n, dup.into_bytes());
    std::fs::write(&bad, &header).unwrap();
    assert_fails(&run(&bad), 1, &[&format!("names tensor `{two}` twice")]);
    assert!(!Path::new(&out).exists());

    // Good files: the missing GPU is the error (a visible GPU would run the layer).
    if !gpu_visible() {
        assert_fails(&run(&ckpt), 1, &["needs a CUDA GPU"]);
    }
}

/// `info --weights W --prefix P` checks a checkpoint's layer on the CPU (no GPU needed) and
/// reports it; a malformed one is an error.
#[test]
fn info_checks_a_checkpoint() {
    let (ckpt, prefix) = fixture_checkpoint();
    let loaded = nvfp4_moe::io::load_experts(&ckpt, prefix).unwrap();
    let ck = &loaded.checkpoint;
    let run = cli(&["info", "--weights", &ckpt, "--prefix", prefix]);
    assert_ok(&run);
    let shape = format!("E={} H={} I={}", ck.experts, ck.hidden, ck.intermediate);
    assert!(run.stdout.contains("valid") && run.stdout.contains(&shape), "{}", run.stdout);
    let run = cli(&["--json", "info", "--weights", &ckpt, "--prefix", prefix]);
    assert_ok(&run);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("one JSON document on stdout");
    let c = &v["checkpoint"];
    assert_eq!((c["experts"].as_u64(), c["hidden"].as_u64()), (Some(ck.experts as u64), Some(ck.hidden as u64)));
    assert_eq!(c["dialect"].as_str(), Some(loaded.format.dialect.to_string().as_str()));
    assert!(cli(&["--json", "info"]).stdout.find("checkpoint").is_none());

    let dir = TmpDir::new("info-ckpt");
    let bad = dir.path("bad.safetensors");
    let name = format!("{prefix}.2.gate_proj.weight_scale_2");
    rewrite(&Path::new(&ckpt).join("model.safetensors"), Path::new(&bad), &|ts| {
        ts.iter_mut().filter(|t| t.0 == name).for_each(|t| t.3 = f32::NAN.to_le_bytes().to_vec())
    });
    let run = cli(&["info", "--weights", &bad, "--prefix", prefix]);
    assert_fails(&run, 1, &[&format!("tensor `{name}`"), "finite"]);
    assert!(run.stdout.is_empty(), "{}", run.stdout);
    assert_fails(&cli(&["info", "--weights", &ckpt]), 2, &["--prefix"]);
    assert_fails(&cli(&["info", "--prefix", prefix]), 2, &["--weights"]);
}

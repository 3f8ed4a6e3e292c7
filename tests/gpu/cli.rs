//! The `nvfp4-moe` commands that need a GPU: `quantize`/`dequantize --backend cuda` (the same bytes
//! as the CPU), `run` on written checkpoints, `check` and `bench`.

use crate::common::{assert_ok, cli, rng, round_trip, write_raw, TmpDir};
use crate::replay;
use half::bf16;
use nvfp4_moe::io::read_matrix_bf16;
use safetensors::tensor::Dtype;

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_writes_the_same_bytes_as_cpu() {
    let mut r = rng();
    let rp = replay();
    let dir = TmpDir::new("cuda");
    for (rows, cols) in [(1usize, 16usize), (129, 80), (1000, 2880), (4100, 64)] {
        let mut x = r.varied_bf16(rows * cols);
        // A few specials: NaN, ±Inf, -0.0.
        for (i, v) in [
            (0usize, bf16::NAN),
            (rows * cols / 3, bf16::INFINITY),
            (rows * cols / 2, bf16::NEG_INFINITY),
            (rows * cols - 1, bf16::NEG_ZERO),
        ] {
            if i < x.len() && rows * cols > 16 {
                x[i] = v;
            }
        }
        let (q_cpu, d_cpu) = round_trip(&dir, &x, rows, cols, "cpu", "layer.");
        let (q_gpu, d_gpu) = round_trip(&dir, &x, rows, cols, "cuda", "layer.");
        assert!(q_cpu == q_gpu, "{rows}x{cols}: quantized files differ: {rp}");
        assert!(d_cpu == d_gpu, "{rows}x{cols}: dequantized files differ: {rp}");
    }
}

/// `run` on ModelOpt checkpoints written here (DeepSeek and Mixtral names, gate and up with
/// different `weight_scale_2`), against the f64 reference of the layer: relative Frobenius error
/// <= 1e-2 per token and overall; an out-of-range expert id is a one-line error (exit 1).
#[test]
#[ignore = "needs a CUDA GPU"]
fn run_matches_reference_on_written_checkpoints() {
    use nvfp4_moe::{host::ExpertNaming, io::write_modelopt_experts};
    let mut r = rng();
    let rp = replay();
    let dir = TmpDir::new("run");
    let (e, h, i, t, k) = (8usize, 256usize, 192usize, 37usize, 2usize);
    for (naming, prefix) in [
        (ExpertNaming::GateUpDown, "model.layers.3.mlp.experts"),
        (ExpertNaming::W1W3W2, "model.layers.0.block_sparse_moe.experts"),
    ] {
        let mut ck = nvfp4_moe::testing::random_moe_checkpoint(&mut r, e, h, i);
        ck.naming = naming;
        let weights = dir.path(&format!("{naming:?}.safetensors"));
        write_modelopt_experts(&weights, prefix, naming, &ck).unwrap();
        // Skewed routing with empty experts: slots go to experts 0..3 only, two distinct per token.
        let ids: Vec<i32> = (0..t)
            .flat_map(|_| {
                let a = r.below(4) as i32;
                [a, (a + 1 + r.below(3) as i32) % 4]
            })
            .collect();
        let w: Vec<f32> = (0..t * k).map(|_| r.uniform(0.1, 1.0)).collect();
        let hidden = r.normal_bf16(t * h, 1.0);
        let input = dir.path("in.safetensors");
        write_raw(
            &input,
            &[
                ("hidden_states", Dtype::BF16, vec![t, h], hidden.iter().flat_map(|x| x.to_le_bytes()).collect()),
                ("topk_ids", Dtype::I32, vec![t, k], ids.iter().flat_map(|x| x.to_le_bytes()).collect()),
                ("topk_weights", Dtype::F32, vec![t, k], w.iter().flat_map(|x| x.to_le_bytes()).collect()),
            ],
        );
        let output = dir.path("out.safetensors");
        let run =
            cli(&["run", "--weights", &weights, "--prefix", prefix, "--input", &input, "--output", &output, "--json"]);
        assert_ok(&run);
        let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("one JSON document on stdout");
        assert_eq!((v["command"].as_str(), v["prefix"].as_str()), (Some("run"), Some(prefix)));
        assert_eq!(
            (v["experts"].as_u64(), v["hidden"].as_u64(), v["intermediate"].as_u64()),
            (Some(e as u64), Some(h as u64), Some(i as u64))
        );
        assert_eq!(
            (v["tokens"].as_u64(), v["top_k"].as_u64(), v["output"].as_str()),
            (Some(t as u64), Some(k as u64), Some(output.as_str()))
        );
        let (got, rows, cols, _) = read_matrix_bf16(&output, "out").unwrap();
        assert_eq!((rows, cols), (t, h));
        let want = nvfp4_moe::reference::routing::moe_layer(&hidden, t, &ids, &w, k, &ck).unwrap();
        let (mut num, mut den) = (0f64, 0f64);
        for tok in 0..t {
            let (mut n, mut d) = (0f64, 0f64);
            for o in 0..h {
                let (g, x) = (f64::from(got[tok * h + o].to_f32()), want[tok * h + o]);
                n += (g - x) * (g - x);
                d += x * x;
            }
            assert!((n / d).sqrt() <= 1e-2, "{naming:?}: token {tok}: {:.3e}: {rp}", (n / d).sqrt());
            num += n;
            den += d;
        }
        assert!((num / den).sqrt() <= 1e-2, "{naming:?}: overall {:.3e}: {rp}", (num / den).sqrt());

        // An expert id out of range: reported by the device-side error word, naming the slot.
        let mut bad = ids.clone();
        bad[2 * k + 1] = e as i32 + 5;
        write_raw(
            &input,
            &[
                ("hidden_states", Dtype::BF16, vec![t, h], hidden.iter().flat_map(|x| x.to_le_bytes()).collect()),
                ("topk_ids", Dtype::I32, vec![t, k], bad.iter().flat_map(|x| x.to_le_bytes()).collect()),
                ("topk_weights", Dtype::F32, vec![t, k], w.iter().flat_map(|x| x.to_le_bytes()).collect()),
            ],
        );
        let run = cli(&["run", "--weights", &weights, "--prefix", prefix, "--input", &input, "--output", &output]);
        assert_eq!(run.code, 1, "{}: {rp}", run.stderr);
        assert!(run.stderr.contains(&format!("{}", e + 5)), "{}: {rp}", run.stderr);
    }
}

/// `check` runs the layer against the CPU reference and says ok, with either intermediate.
#[test]
#[ignore = "needs a CUDA GPU"]
fn check_passes_on_the_gpu() {
    let run = cli(&["check", "--preset", "qwen3-30b-a3b", "--tokens", "3"]);
    assert_ok(&run);
    assert!(run.stdout.contains("relative Frobenius error") && run.stdout.trim_end().ends_with("ok"), "{}", run.stdout);
    assert!(run.stdout.contains("(tolerance 0.01 / 0.01)"), "{}", run.stdout);
    let run = cli(&["check", "--preset", "qwen3-30b-a3b", "--tokens", "5", "--intermediate", "nvfp4"]);
    assert_ok(&run);
    assert!(run.stdout.contains("NVFP4 intermediate, calibrated decode scale"), "{}", run.stdout);
    assert!(run.stdout.contains("(tolerance 0.15 / 0.25)"), "{}", run.stdout);
    assert!(run.stdout.trim_end().ends_with("ok"), "{}", run.stdout);
    // The same as JSON.
    let run = cli(&["check", "--preset", "qwen3-30b-a3b", "--tokens", "3", "--intermediate", "nvfp4", "--json"]);
    assert_ok(&run);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("one JSON document on stdout");
    assert_eq!(
        (v["command"].as_str(), v["preset"].as_str(), v["tokens"].as_u64()),
        (Some("check"), Some("qwen3-30b-a3b"), Some(3))
    );
    assert_eq!((v["intermediate_format"].as_str(), v["passed"].as_bool()), (Some("nvfp4"), Some(true)));
    assert!(v["nvfp4_decode_scale"].as_f64().is_some_and(|g| g > 0.0), "{v}");
    let overall = v["error"]["overall"].as_f64().unwrap();
    assert!(overall <= 0.15 && v["error"]["worst_token_error"].as_f64().unwrap() <= 0.25, "{v}");
    assert_eq!((v["tolerance"]["overall"].as_f64(), v["tolerance"]["token"].as_f64()), (Some(0.15), Some(0.25)));
}

/// `bench` on the GPU: the table on stdout, and with `--json` / `--json-file` one document with a
/// row per (preset, T).
#[test]
#[ignore = "needs a CUDA GPU"]
fn bench_prints_a_table_and_writes_json() {
    let dir = TmpDir::new("bench");
    let file = dir.path("layer.json");
    let run = cli(&["bench", "--preset", "qwen3-30b-a3b", "--tokens", "1,16", "--json-file", &file]);
    assert_ok(&run);
    assert_eq!(run.stdout.lines().filter(|l| l.starts_with("qwen3-30b-a3b")).count(), 2, "{}", run.stdout);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let run = cli(&["--json", "bench", "--preset", "qwen3-30b-a3b", "--tokens", "1,16"]);
    assert_ok(&run);
    let w: serde_json::Value = serde_json::from_str(&run.stdout).expect("one JSON document on stdout");
    for doc in [&v, &w] {
        assert_eq!((doc["command"].as_str(), doc["replays"].as_u64()), (Some("bench"), Some(20)), "{doc}");
        let rows = doc["rows"].as_array().unwrap();
        assert_eq!(rows.iter().map(|r| r["tokens"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 16]);
        for r in rows {
            assert_eq!(
                (r["preset"].as_str(), r["experts"].as_u64(), r["top_k"].as_u64()),
                (Some("qwen3-30b-a3b"), Some(128), Some(8))
            );
            assert!(r["us"].as_f64().is_some_and(|us| us > 0.0) && r["tbps"].as_f64().is_some_and(|t| t > 0.0), "{r}");
            assert!(r["tile"].as_str().is_some_and(|t| t.starts_with("M128N") || t == "WarpM16N8"), "{r}");
            assert_eq!(r["routing"].as_str(), Some("balanced"), "{r}");
        }
    }
    // --routing balanced,skewed: each T under each routing, in that order; skewed reaches fewer
    // experts at T = 16 (its popular ones repeat), so it reads fewer weight bytes.
    let run = cli(&["--json", "bench", "--preset", "qwen3-30b-a3b", "--tokens", "16", "--routing", "balanced,skewed"]);
    assert_ok(&run);
    let s: serde_json::Value = serde_json::from_str(&run.stdout).expect("one JSON document on stdout");
    let rows = s["rows"].as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["routing"].as_str().unwrap()).collect::<Vec<_>>(), ["balanced", "skewed"]);
    let bytes: Vec<f64> = rows.iter().map(|r| r["weight_bytes"].as_f64().unwrap()).collect();
    assert!(bytes[1] < bytes[0], "{bytes:?}");
    // --tile forces the tile (the library would take 128x16 at T = 1).
    let run = cli(&["--json", "bench", "--preset", "qwen3-30b-a3b", "--tokens", "1", "--tile", "n64"]);
    assert_ok(&run);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("one JSON document on stdout");
    assert_eq!(v["rows"][0]["tile"].as_str(), Some("M128N64"), "{v}");
}

//! Helpers shared by the CLI tests (`tests/cli.rs`, and `tests/gpu/cli.rs` for the commands that
//! need a GPU): the binary under test, a temporary directory, a run with its exit code and both
//! output streams, and a quantize/dequantize round trip through the CLI.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;
use nvfp4_moe::io::{read_matrix_bf16, read_modelopt, write_bf16};
use nvfp4_moe::layout::ScaleLayout;
use nvfp4_moe::testing::Rng;
use nvfp4_moe::{host, reference};
use safetensors::tensor::{Dtype, TensorView};

/// The CLI under test: the one cargo built, or `$NVFP4MOE_CLI` (the GPU bundle runs the binaries
/// on another machine, where cargo's build path does not exist).
pub fn bin() -> String {
    std::env::var("NVFP4MOE_CLI").unwrap_or_else(|_| env!("CARGO_BIN_EXE_nvfp4-moe").to_string())
}

/// A fresh temporary directory, removed on drop.
pub struct TmpDir(PathBuf);

impl TmpDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let p = std::env::temp_dir().join(format!(
            "nvfp4moe-cli-{}-{nanos}-{}-{tag}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        TmpDir(p)
    }

    pub fn path(&self, name: &str) -> String {
        self.0.join(name).to_string_lossy().into_owned()
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One finished run of the CLI.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

pub fn cli(args: &[&str]) -> Run {
    let Output { status, stdout, stderr } = Command::new(bin()).args(args).output().expect("run nvfp4-moe");
    let r = Run {
        code: status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    };
    eprintln!("$ nvfp4-moe {}\n-> exit {}\n{}{}", args.join(" "), r.code, r.stdout, r.stderr);
    r
}

/// As [`cli`], but a run still going after `limit` is killed and fails the test (an input that
/// could block, such as a FIFO, must not hang the suite).
pub fn cli_within(limit: std::time::Duration, args: &[&str]) -> Run {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run nvfp4-moe");
    // Drained on threads, so a full pipe cannot stall the child.
    let drain = |mut p: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = p.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("piped")));
    let err = drain(Box::new(child.stderr.take().expect("piped")));
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for nvfp4-moe") {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("nvfp4-moe {} still running after {limit:?}: killed", args.join(" "));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let r = Run {
        code: status.code().unwrap_or(-1),
        stdout: out.join().expect("stdout"),
        stderr: err.join().expect("stderr"),
    };
    eprintln!("$ nvfp4-moe {}\n-> exit {}\n{}{}", args.join(" "), r.code, r.stdout, r.stderr);
    r
}

pub fn assert_ok(r: &Run) {
    assert_eq!(r.code, 0, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
}

#[track_caller]
pub fn rng() -> Rng {
    nvfp4_moe::testing::test_rng()
}

/// Exit `code`; a usage error (2) has a first stderr line `error: ...` and a `Usage:` line, a
/// runtime error (1) exactly one `error: ...` line (after any notes); that line contains every one
/// of `parts`; no panic trace.
pub fn assert_fails(r: &Run, code: i32, parts: &[&str]) {
    assert_eq!(r.code, code, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    let errors: Vec<&str> = r.stderr.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "not one `error:` line:\n{}", r.stderr);
    let line = errors[0];
    assert!(line.starts_with("error: "), "{line}");
    if code == 2 {
        assert_eq!(r.stderr.lines().next(), Some(line), "a usage error starts with its `error:` line:\n{}", r.stderr);
        assert!(r.stderr.lines().any(|l| l.starts_with("Usage: nvfp4-moe")), "no `Usage:` line:\n{}", r.stderr);
    }
    for p in parts {
        assert!(line.contains(p), "`{line}` lacks `{p}`");
    }
    assert!(!r.stderr.contains("panicked") && !r.stderr.contains("RUST_BACKTRACE"), "{}", r.stderr);
    assert!(!r.stderr.contains("internal error"), "{}", r.stderr);
}

pub fn write_raw(path: &str, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, Path::new(path)).unwrap();
}

pub fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Quantizes `x` through the CLI on `backend` and checks the file against the reference; then
/// dequantizes it through the CLI and checks that too. Returns both files' bytes.
pub fn round_trip(
    dir: &TmpDir,
    x: &[bf16],
    rows: usize,
    cols: usize,
    backend: &str,
    prefix: &str,
) -> (Vec<u8>, Vec<u8>) {
    let input = dir.path("in.safetensors");
    let q = dir.path(&format!("q-{backend}.safetensors"));
    let d = dir.path(&format!("d-{backend}.safetensors"));
    write_bf16(&input, "blk.w", x, rows, cols).unwrap();

    let mut args = vec!["quantize", "--input", &input, "--tensor", "blk.w", "--output", &q, "--backend", backend];
    if !prefix.is_empty() {
        args.extend(["--prefix", prefix]);
    }
    let r = cli(&args);
    assert_ok(&r);
    assert!(r.stdout.contains(&format!("[{rows}, {cols}]")), "{}", r.stdout);
    assert!(r.stdout.contains(backend), "{}", r.stdout);

    let g = host::weight_decode_scale(x).unwrap();
    let want = reference::quantize(x, rows, cols, g, ScaleLayout::Linear).unwrap();
    let full_prefix =
        if prefix.is_empty() || prefix.ends_with('.') { prefix.to_string() } else { format!("{prefix}.") };
    let w = read_modelopt(&q, &full_prefix).unwrap();
    assert_eq!((w.rows, w.cols), (rows, cols));
    assert_eq!(w.decode_scale.to_bits(), g.to_bits());
    assert!(w.codes == want.codes, "codes differ from the reference");
    assert!(w.scales == want.scales, "scales differ from the reference");

    let mut args = vec!["dequantize", "--input", &q, "--output", &d, "--backend", backend, "--name", "deq"];
    if !prefix.is_empty() {
        args.extend(["--prefix", prefix]);
    }
    let r = cli(&args);
    assert_ok(&r);
    let (y, r2, c2, _) = read_matrix_bf16(&d, "deq").unwrap();
    assert_eq!((r2, c2), (rows, cols));
    assert!(bits(&y) == bits(&reference::dequantize(&want)), "dequantized values differ from the reference");
    (std::fs::read(&q).unwrap(), std::fs::read(&d).unwrap())
}

//! GPU tests: every kernel against the CPU reference on fresh random data, grouped by area as
//! modules of this one test binary (each statically linked test binary carries every kernel, and
//! what travels to the GPU is limited):
//!
//! - [`codec`]: the quantizer and dequantizer (bit-exact with the oracle, and with ModelOpt);
//! - [`gemm`]: the grouped GEMM, its epilogues, the grouped quantizers, graph capture;
//! - [`layer`]: routing, permutation, combine and the MoE layer;
//! - [`cli`]: the `nvfp4-moe` commands that need a GPU;
//! - [`convert`]: `convert` on the GPU writes the CPU path's bytes;
//! - [`sweep`]: a randomized shape sweep of the quantizers, GEMMs and layer (`NVFP4MOE_SWEEP_SIZE`,
//!   `NVFP4MOE_SWEEP_CASES`; small and medium sizes run under compute-sanitizer, see
//!   `scripts/gpu-sanitize.sh`);
//! - [`faults`]: bad expert ids, forwards after rejected ones, drop orders, concurrent streams and
//!   the NaN-isolation policy;
//! - [`shard`]: expert shards (expert parallelism): their FP32 outputs add up to the whole layer's;
//! - [`expert_parallel`]: the expert-parallel runner (N simulated ranks on one GPU, and NCCL with one rank).
//!
//! They need a CUDA GPU (sm_90a build) and are ignored by default; run them with
//! `cargo test --release --test gpu -- --include-ignored` (or the GPU bundle, see README). Every
//! case prints its max and mean error (`err` lines). Every randomized case's assertions end with the
//! line that replays it ([`replay`]: `replay: NVFP4MOE_TEST_SEED=0x... cargo test ...`, the sweep's
//! with its size and case count), whichever case failed.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;
use nvfp4_moe::layout::{scale_len, ScaleLayout};
use nvfp4_moe::quantize::{
    dequantize_nvfp4, dequantize_nvfp4_into, quantize_nvfp4, quantize_nvfp4_into, Nvfp4Desc, Nvfp4Tensor,
};
use nvfp4_moe::testing::{current_test_seed, test_rng, Rng, TEST_SEED_ENV};
use nvfp4_moe::Error;
use nvfp4_moe::{host, host::Nvfp4Host, reference};

mod c_abi;
#[path = "../checkpoint_fixture/mod.rs"]
mod checkpoint_fixture;
mod cli;
mod codec;
#[path = "../common/mod.rs"]
mod common;
mod convert;
#[path = "../convert_fixture/mod.rs"]
mod convert_fixture;
mod expert_parallel;
mod faults;
mod gemm;
mod layer;
#[path = "../modelopt_fixture/mod.rs"]
mod modelopt_fixture;
mod shard;
mod sweep;

/// Every wgmma tile of the grouped GEMM (the warp kernel, `WarpM16N8`, apart): the tile lists the
/// GEMM and layer tests run on.
const WGMMA_TILES: [nvfp4_moe::GemmTile; 6] = {
    use nvfp4_moe::GemmTile::*;
    [M128N8, M128N16, M128N32, M128N64, M128N128, M128N256]
};

/// The poison of u8 outputs ([`poisoned_u8`]).
const POISON: u8 = 0xA5;

/// The poison of bf16 outputs ([`poisoned_bf16`]): a signalling NaN (quiet bit clear), which no
/// conversion or kernel produces (they give the canonical quiet NaN), so an unwritten element
/// cannot pass as written. The one value every GPU test poisons bf16 outputs with.
const POISON_BF16: u16 = 0x7F81;

/// How to replay the running test, for the context of its assertions: its seed, the variable that
/// sets it and the test (`replay: NVFP4MOE_TEST_SEED=0x... cargo test ...`). The seed is the one
/// its first `test_rng` took, from which every generator of the test follows, so one variable
/// replays every case.
fn replay() -> String {
    replay_with("")
}

/// [`replay`] with more variables that the test reads (`env`: `NAME=value ...`; a sweep's size and
/// case count).
fn replay_with(env: &str) -> String {
    let Some(seed) = current_test_seed() else { return "no random seed drawn".into() };
    let test = std::thread::current().name().unwrap_or("NAME").to_string();
    let env = if env.is_empty() { String::new() } else { format!("{env} ") };
    format!(
        "replay: {TEST_SEED_ENV}={seed:#x} {env}cargo test --release --test gpu -- --include-ignored --exact {test}"
    )
}

/// The variable that splits a long test over processes ([`TestPart`]).
const TEST_PART_ENV: &str = "NVFP4MOE_TEST_PART";

/// `NVFP4MOE_TEST_PART=i/n` (0 <= i < n): a test that honours it runs only its units u with
/// u % n == i, so that `scripts/gpu-sanitize.sh` can spread it over processes. racecheck's host
/// memory grows with every launch of a process (1-2 GB per GEMM launch: a whole
/// `faults::nan_in_one_token_changes_only_its_row` outgrew the GPU machine's 128 GB, H200
/// 2026-12-03). Unset: every unit.
#[derive(Clone, Copy, Debug)]
struct TestPart {
    index: usize,
    count: usize,
}

impl TestPart {
    fn from_env() -> Self {
        let Ok(v) = std::env::var(TEST_PART_ENV) else { return TestPart { index: 0, count: 1 } };
        let parsed = v.split_once('/').and_then(|(i, n)| Some((i.trim().parse().ok()?, n.trim().parse().ok()?)));
        match parsed {
            Some((index, count)) if index < count => TestPart { index, count },
            _ => panic!("{TEST_PART_ENV}={v}: expected i/n with 0 <= i < n"),
        }
    }

    fn has(self, unit: usize) -> bool {
        unit % self.count == self.index
    }

    fn is_whole(self) -> bool {
        self.count == 1
    }

    /// The variable for a replay line ([`replay_with`]); empty for the whole test.
    fn env(self) -> String {
        if self.is_whole() {
            String::new()
        } else {
            format!("{TEST_PART_ENV}={}/{}", self.index, self.count)
        }
    }
}

fn stream() -> Arc<CudaStream> {
    CudaContext::new(0).expect("CUDA device 0").default_stream()
}

/// A device buffer filled with a poison byte, so an unwritten output byte cannot pass.
fn poisoned_u8(s: &Arc<CudaStream>, n: usize) -> CudaSlice<u8> {
    s.clone_htod(&vec![POISON; n]).unwrap()
}

/// A device buffer of `n` bf16 poison values ([`POISON_BF16`]).
fn poisoned_bf16(s: &Arc<CudaStream>, n: usize) -> CudaSlice<bf16> {
    s.clone_htod(&poison_bf16(n)).unwrap()
}

/// `n` bf16 poison values on the host (to poison a device buffer again with `memcpy_htod`).
fn poison_bf16(n: usize) -> Vec<bf16> {
    vec![bf16::from_bits(POISON_BF16); n]
}

/// Data kinds that stress the recipe.
#[derive(Clone, Copy, Debug)]
enum Data {
    Normal,
    Varied,
    Tiny,
    Huge,
    NonFinite,
    Ties,
}

/// Random inputs of one kind. `Ties` builds blocks whose elements sit exactly on E2M1 decision
/// points (and the scale exactly on the amax), assuming decode scale `g` is a power of two.
fn make_data(rng: &mut Rng, kind: Data, rows: usize, cols: usize, g: f32) -> Vec<bf16> {
    let n = rows * cols;
    match kind {
        Data::Normal => rng.normal_bf16(n, 1.0),
        Data::Varied => rng.varied_bf16(n),
        Data::Tiny => rng.normal_bf16(n, 1e-30),
        Data::Huge => rng.normal_bf16(n, 1e30),
        Data::NonFinite => {
            let mut v = rng.varied_bf16(n);
            for _ in 0..(n / 97).max(1) {
                let i = rng.below(n as u64) as usize;
                v[i] = match rng.below(4) {
                    0 => bf16::NAN,
                    1 => bf16::INFINITY,
                    2 => bf16::NEG_INFINITY,
                    _ => bf16::from_f32(-0.0),
                };
            }
            v
        }
        Data::Ties => {
            const POINTS: [f32; 14] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
            let mut v = Vec::with_capacity(n);
            for _ in 0..n / 16 {
                // A normal E4M3 scale with any mantissa; amax = 6 * s * g pins the scale to s.
                let s = nvfp4_moe::format::e4m3_decode((rng.range(8, 0x7E) as u8) & 0x7F);
                let d = s * g;
                let lead = rng.below(16) as usize;
                for i in 0..16 {
                    let t = if i == lead { 6.0 } else { POINTS[rng.below(POINTS.len() as u64) as usize] };
                    let sign = if rng.below(2) == 0 { 1.0 } else { -1.0 };
                    let x = sign * t * d;
                    let b = bf16::from_f32(x);
                    assert_eq!(b.to_f32(), x, "tie value must be exact in bf16");
                    v.push(b);
                }
            }
            v
        }
    }
}

/// Relative Frobenius error ||got - want|| / ||want|| accumulated over samples, with the max and
/// mean absolute error for the per-case `err` lines.
#[derive(Default)]
struct RelErr {
    num: f64,
    den: f64,
    max_abs: f64,
    sum_abs: f64,
    n: usize,
}

impl RelErr {
    fn add(&mut self, got: f64, want: f64) {
        self.num += (got - want) * (got - want);
        self.den += want * want;
        let d = (got - want).abs();
        self.max_abs = if d.is_nan() { f64::NAN } else { self.max_abs.max(d) };
        self.sum_abs += d;
        self.n += 1;
    }
    fn rel(&self) -> f64 {
        (self.num / self.den.max(1e-300)).sqrt()
    }
    /// Folds another accumulator in (per-expert or per-token errors into the case's).
    fn merge(&mut self, o: &RelErr) {
        self.num += o.num;
        self.den += o.den;
        self.max_abs = self.max_abs.max(o.max_abs);
        self.sum_abs += o.sum_abs;
        self.n += o.n;
    }
    /// Prints the case's line: `err <case>: max <abs>, mean <abs>, rel <frobenius> (<n> values)`.
    fn report(&self, case: &str) {
        let mean = self.sum_abs / self.n.max(1) as f64;
        eprintln!("err {case}: max {:.3e}, mean {mean:.3e}, rel {:.3e} ({} values)", self.max_abs, self.rel(), self.n);
    }
}

/// The sampled comparison of a grouped GEMM's output with the f64 reference, shared by the GEMM
/// tests and the sweep: for every expert with rows (`off`: the expert offsets), `samples` random
/// (row, column) pairs of its rows, columns in `0..cols`, each giving `N` (got, want) values
/// through `pair(expert, row, column)`. The relative (Frobenius) error of each of the `N` outputs
/// (named by `names` in the message) must be within `bound` for every expert; returns each
/// output's error over all experts, for the `err` lines.
#[allow(clippy::too_many_arguments)]
fn sampled_expert_errors<const N: usize>(
    rng: &mut Rng,
    off: &[i32],
    cols: usize,
    samples: usize,
    bound: f64,
    names: [&str; N],
    ctx: &str,
    mut pair: impl FnMut(usize, usize, usize) -> [(f64, f64); N],
) -> [RelErr; N] {
    let mut all: [RelErr; N] = std::array::from_fn(|_| RelErr::default());
    for ex in 0..off.len() - 1 {
        let (lo, hi) = (off[ex] as usize, off[ex + 1] as usize);
        if lo == hi {
            continue;
        }
        let mut errs: [RelErr; N] = std::array::from_fn(|_| RelErr::default());
        for _ in 0..samples {
            let (row, col) = (rng.range(lo, hi), rng.range(0, cols));
            for (err, (got, want)) in errs.iter_mut().zip(pair(ex, row, col)) {
                err.add(got, want);
            }
        }
        for ((err, all), name) in errs.iter().zip(&mut all).zip(names) {
            assert!(err.rel() <= bound, "{name} expert {ex}: relative error {:.3e} > {bound:e}: {ctx}", err.rel());
            all.merge(err);
        }
    }
    all
}

/// The `err` line of a bit-exact case: every byte compared equal, so the error is 0.
fn report_exact(case: &str, bytes: usize) {
    eprintln!("err {case}: max 0, mean 0 (bit-exact, {bytes} bytes)");
}

/// Layer inputs with top-2 routing to two distinct experts per token: hidden states bf16
/// `[t, h]` ~ N(0, 1), expert ids `[t, 2]`, routing weights `[t, 2]` in [0.1, 1).
fn two_expert_inputs(rng: &mut Rng, t: usize, h: usize, e: usize) -> (Vec<bf16>, Vec<i32>, Vec<f32>) {
    let ids: Vec<i32> = (0..t)
        .flat_map(|_| {
            let a = rng.below(e as u64) as i32;
            [a, (a + 1 + rng.below(e as u64 - 1) as i32) % e as i32]
        })
        .collect();
    let wts: Vec<f32> = (0..t * 2).map(|_| rng.uniform(0.1, 1.0)).collect();
    (rng.normal_bf16(t * h, 1.0), ids, wts)
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<(usize, u8, u8)> {
    a.iter().zip(b).enumerate().find(|(_, (x, y))| x != y).map(|(i, (x, y))| (i, *x, *y))
}

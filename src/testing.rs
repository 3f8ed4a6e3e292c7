//! Test-data generators: a seedable random generator and random NVFP4 weights of any shape, on the
//! host or made on the device. They serve the crate's tests and benches and the CLI's `check` and
//! `bench`; they are not part of the crate's stable API (hidden from the docs, may change in any
//! release).

#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use cudarc::driver::{CudaSlice, CudaStream};

#[cfg(feature = "cuda")]
use crate::error::Result;
#[cfg(feature = "cuda")]
use crate::gemm::{ExpertShape, Nvfp4Weights};
use crate::host::ExpertWeightsHost;
use crate::host::MoeCheckpoint;
pub use crate::rng::Rng;

/// The environment variable that fixes the seed of every randomized test: `NVFP4MOE_TEST_SEED=0x1f2e
/// cargo test name` replays a failing test (decimal or `0x` hex).
pub const TEST_SEED_ENV: &str = "NVFP4MOE_TEST_SEED";

/// The seed [`TEST_SEED_ENV`] gives, if set.
///
/// # Panics
/// If it is set but not a `u64` in decimal or `0x` hex (a test helper: a mistyped seed must not
/// silently run a fresh one); [`try_test_seed_from_env`] returns an error instead.
pub fn test_seed_from_env() -> Option<u64> {
    try_test_seed_from_env().unwrap_or_else(|e| panic!("{e}"))
}

/// The seed [`TEST_SEED_ENV`] gives, if set.
///
/// # Errors
/// [`crate::Error::Invalid`] if it is set but not a `u64` in decimal or `0x` hex.
pub fn try_test_seed_from_env() -> crate::Result<Option<u64>> {
    let Ok(v) = std::env::var(TEST_SEED_ENV) else { return Ok(None) };
    let t = v.trim();
    let parsed = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => t.parse(),
    };
    parsed
        .map(Some)
        .map_err(|_| crate::Error::Invalid(format!("{TEST_SEED_ENV}={v:?} is not a seed (a u64, decimal or 0x hex)")))
}

std::thread_local! {
    /// This thread's (test's) base seed and how many generators it has handed out.
    static TEST_SEED: std::cell::Cell<Option<(u64, u64)>> = const { std::cell::Cell::new(None) };
}

/// The random generator of a randomized test, replayable: the first call on a thread (the test
/// harness runs each test on its own) takes its seed from [`TEST_SEED_ENV`] if set, else a fresh
/// one, and prints it to stderr with the line that replays it (the harness shows a failing test's
/// stderr); later calls on the same thread derive their seeds from that one, so one variable
/// replays every generator of the test.
///
/// # Panics
/// As [`test_seed_from_env`].
#[track_caller]
pub fn test_rng() -> Rng {
    let at = std::panic::Location::caller();
    let (base, n) = TEST_SEED.with(|c| {
        let (base, n) = c.get().unwrap_or_else(|| {
            let (seed, from) = match test_seed_from_env() {
                Some(seed) => (seed, TEST_SEED_ENV),
                None => (Rng::from_entropy().next_u64(), "fresh"),
            };
            eprintln!(
                "test seed {seed:#x} ({from}; replay: {TEST_SEED_ENV}={seed:#x} cargo test ...), first drawn at {}:{}",
                at.file(),
                at.line()
            );
            (seed, 0)
        });
        c.set(Some((base, n + 1)));
        (base, n)
    });
    if n == 0 {
        // The first generator is `Rng::new(seed)` itself.
        return Rng::new(base);
    }
    Rng::new(Rng::new(base ^ n.wrapping_mul(0xD1B5_4A32_D192_ED03)).next_u64())
}

/// This thread's (test's) base seed: the value of [`TEST_SEED_ENV`] that replays every generator
/// [`test_rng`] has handed out on it, for a test's failure messages. `None` before its first
/// [`test_rng`].
pub fn current_test_seed() -> Option<u64> {
    TEST_SEED.with(|c| c.get().map(|(seed, _)| seed))
}

/// Random NVFP4 weights of `experts` experts `[n, k]`: random codes, scale bytes in
/// `0x20..0x48` (E4M3 0.125 .. 3.75: valid, positive), decode scales in `[1e-3, 1e-2)`.
fn random_expert_weights(rng: &mut Rng, experts: usize, n: usize, k: usize) -> ExpertWeightsHost {
    let code_len = experts * n * k / 2;
    let mut codes = vec![0u8; code_len];
    let mut chunks = codes.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    for b in chunks.into_remainder() {
        *b = rng.next_u64() as u8;
    }
    let scales = (0..experts * n * k / 16).map(|_| rng.range(0x20, 0x48) as u8).collect();
    let decode_scales = (0..experts).map(|_| rng.uniform(1e-3, 1e-2)).collect();
    ExpertWeightsHost { experts, n, k, codes, scales, decode_scales }
}

/// A random MoE checkpoint on the host (`GateUpDown` naming, no input scales): W13 `[E, 2I, H]`
/// with gate decode scales in `[1e-3, 1e-2)` and up decode scales twice the gate's, W2
/// `[E, H, I]`. `hidden` and `intermediate` must be multiples of 16 (the block size). Takes
/// `E x 3 x H x I x 9/16` bytes of host memory.
pub fn random_moe_checkpoint(rng: &mut Rng, experts: usize, hidden: usize, intermediate: usize) -> MoeCheckpoint {
    let w13 = random_expert_weights(rng, experts, 2 * intermediate, hidden);
    let up_decode_scales = w13.decode_scales.iter().map(|g| g * 2.0).collect();
    let w2 = random_expert_weights(rng, experts, hidden, intermediate);
    MoeCheckpoint::from_experts(w13, up_decode_scales, w2)
}

#[cfg(feature = "cuda")]
/// Device bytes of `len`, filled by replicating a 64 MiB block of `gen`'s bytes (fast: nothing
/// large on the host).
fn device_fill(s: &Arc<CudaStream>, len: usize, gen: &mut dyn FnMut() -> u8) -> Result<CudaSlice<u8>> {
    let block = 64usize << 20;
    let host: Vec<u8> = (0..block.min(len).max(1)).map(|_| gen()).collect();
    let src = s.clone_htod(&host)?;
    // SAFETY: every byte is written by the copies below before any read.
    let mut dst = unsafe { s.alloc::<u8>(len.max(1))? };
    let mut off = 0;
    while off < len {
        let m = host.len().min(len - off);
        s.memcpy_dtod(&src.slice(..m), &mut dst.slice_mut(off..off + m))?;
        off += m;
    }
    Ok(dst)
}

/// The experts `ids` of `c`, in that order (what a shard of them holds: tests of expert shards).
///
/// # Panics
/// If an id is not below `c.experts` (a test helper).
pub fn expert_subset(c: &MoeCheckpoint, ids: &[usize]) -> MoeCheckpoint {
    let pick_bytes = |v: &[u8], per: usize| ids.iter().flat_map(|&e| v[e * per..(e + 1) * per].to_vec()).collect();
    let pick = |v: &[f32]| ids.iter().map(|&e| v[e]).collect::<Vec<f32>>();
    let weights = |w: &ExpertWeightsHost| ExpertWeightsHost {
        experts: ids.len(),
        n: w.n,
        k: w.k,
        codes: pick_bytes(&w.codes, w.n * w.k / 2),
        scales: pick_bytes(&w.scales, w.n * w.k / 16),
        decode_scales: pick(&w.decode_scales),
    };
    MoeCheckpoint {
        experts: ids.len(),
        w13: weights(&c.w13),
        w2: weights(&c.w2),
        up_decode_scales: pick(&c.up_decode_scales),
        l1_input_scales: c.l1_input_scales.as_deref().map(pick),
        up_input_scales: c.up_input_scales.as_deref().map(pick),
        l2_input_scales: c.l2_input_scales.as_deref().map(pick),
        ..c.clone()
    }
}

#[cfg(feature = "cuda")]
/// Random prepared NVFP4 weights `[experts, n, k]` made on the device, for benchmarks (scales
/// valid E4M3 bytes in 0x20..0x48, decode scales in [1e-3, 1e-2), up's twice gate's for
/// `gate_up`, which prepares first-layer gate/up weights with `n = 2I`).
pub fn random_device_weights(
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    experts: usize,
    n: usize,
    k: usize,
    gate_up: bool,
) -> Result<Nvfp4Weights> {
    let mut r1 = Rng::new(rng.next_u64());
    let mut r2 = Rng::new(rng.next_u64());
    let codes = device_fill(s, experts * n * k / 2, &mut || r1.next_u64() as u8)?;
    let scales = device_fill(s, experts * n * k / 16, &mut || r2.range(0x20, 0x48) as u8)?;
    let g: Vec<f32> = (0..experts).map(|_| rng.uniform(1e-3, 1e-2)).collect();
    if gate_up {
        let u: Vec<f32> = g.iter().map(|v| v * 2.0).collect();
        Nvfp4Weights::prepare_gate_up(s, &codes, &scales, &g, &u, ExpertShape::new(experts, n, k))
    } else {
        Nvfp4Weights::prepare(s, &codes, &scales, &g, ExpertShape::new(experts, n, k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One seed replays every generator of a test: the first is `Rng::new(seed)`, the later ones
    /// are derived from it and differ from each other.
    #[test]
    fn test_rngs_replay_from_one_seed() {
        let seed = std::thread::spawn(|| {
            assert_eq!(current_test_seed(), None, "no seed before the first test_rng");
            let mut a = test_rng();
            let mut b = test_rng();
            let first = TEST_SEED.with(|c| c.get()).unwrap().0;
            assert_eq!(current_test_seed(), Some(first), "the seed that replays the test");
            assert_eq!(a.next_u64(), Rng::new(first).next_u64());
            assert_ne!(a.next_u64(), b.next_u64());
            first
        })
        .join()
        .unwrap();
        // The same base on a fresh thread gives the same generators.
        let replay = std::thread::spawn(move || {
            TEST_SEED.with(|c| c.set(Some((seed, 0))));
            let (mut a, mut b) = (test_rng(), test_rng());
            (a.next_u64(), b.next_u64())
        });
        let again = std::thread::spawn(move || {
            TEST_SEED.with(|c| c.set(Some((seed, 0))));
            let (mut a, mut b) = (test_rng(), test_rng());
            (a.next_u64(), b.next_u64())
        });
        assert_eq!(replay.join().unwrap(), again.join().unwrap());
    }

    #[test]
    fn random_checkpoint_is_valid() {
        let mut rng = test_rng();
        let (e, h, i) = (3usize, 64usize, 48usize);
        let ck = random_moe_checkpoint(&mut rng, e, h, i);
        assert_eq!((ck.experts, ck.hidden, ck.intermediate), (e, h, i));
        assert_eq!((ck.w13.experts, ck.w13.n, ck.w13.k), (e, 2 * i, h));
        assert_eq!((ck.w2.experts, ck.w2.n, ck.w2.k), (e, h, i));
        assert_eq!(ck.w13.codes.len(), e * 2 * i * h / 2);
        assert_eq!(ck.w13.scales.len(), e * 2 * i * h / 16);
        assert_eq!(ck.w2.codes.len(), e * h * i / 2);
        assert_eq!(ck.w2.scales.len(), e * h * i / 16);
        for w in [&ck.w13, &ck.w2] {
            assert!(w.scales.iter().all(|&s| (0x20..0x48).contains(&s)));
            assert!(w.decode_scales.iter().all(|&g| (1e-3..=1e-2).contains(&g)));
            assert_eq!(w.decode_scales.len(), e);
            // Codes are random: not all one value.
            assert!(w.codes.iter().any(|&c| c != w.codes[0]));
        }
        for (u, g) in ck.up_decode_scales.iter().zip(&ck.w13.decode_scales) {
            assert_eq!(*u, g * 2.0);
        }
        assert!(ck.l1_input_scales.is_none() && ck.up_input_scales.is_none() && ck.l2_input_scales.is_none());
        assert_eq!(ck.naming, crate::host::ExpertNaming::GateUpDown);
        ck.validate().unwrap();
    }
}

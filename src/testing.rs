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

    #[test]
    fn random_checkpoint_is_valid() {
        let mut rng = Rng::from_entropy();
        eprintln!("seed = {:#x}", rng.seed());
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

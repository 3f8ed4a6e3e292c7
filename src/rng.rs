//! A small, fast, seedable random generator (SplitMix64) for test data, benchmarks and the CLI's
//! random weights. Not cryptographic. Tests draw a fresh seed every run ([`Rng::from_entropy`]) and
//! print it, so any failure can be replayed with [`Rng::new`].

use half::bf16;

/// SplitMix64: 64 bits of state, passes BigCrush, and is trivially reproducible.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator with a fixed seed.
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// A generator seeded from the clock, the process id and a counter: different every call.
    pub fn from_entropy() -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::time::{SystemTime, UNIX_EPOCH};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        let c = COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut r = Rng::new(t ^ (u64::from(std::process::id()) << 32) ^ c.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r.next_u64();
        r
    }

    /// The seed to replay this generator's *next* draws: `Rng::new(r.seed())`.
    pub fn seed(&self) -> u64 {
        self.state
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The next 32 random bits (the high half of [`Rng::next_u64`]).
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in `[0, n)`; `n` must be > 0.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `[lo, hi)`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below((hi - lo) as u64) as usize
    }

    /// Uniform in `[0, 1)` with 24 random bits.
    pub fn f32(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 * (1.0 / 16_777_216.0)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.f32()
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = (self.f32() + 1.0 / 33_554_432.0).min(1.0);
        let u2 = self.f32();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
    }

    /// `n` normal values times `scale`, rounded to bf16.
    pub fn normal_bf16(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(self.normal() * scale)).collect()
    }

    /// `n` bf16 values whose magnitudes vary block to block over many orders (so block scales cover
    /// much of the E4M3 range), with occasional exact zeros and sign flips. Never all zero for n>0.
    pub fn varied_bf16(&mut self, n: usize) -> Vec<bf16> {
        let mut out = Vec::with_capacity(n);
        let mut block_scale = 1.0f32;
        for i in 0..n {
            if i % 16 == 0 {
                block_scale = 2f32.powi(self.range(0, 24) as i32 - 12);
            }
            let v = match self.below(64) {
                0 => 0.0,
                1 => -0.0,
                _ => self.normal() * block_scale,
            };
            out.push(bf16::from_f32(v));
        }
        if n > 0 && out.iter().all(|v| v.to_f32() == 0.0) {
            out[0] = bf16::ONE;
        }
        out
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

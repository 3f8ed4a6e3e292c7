// Device-side NVFP4 codec: the pinned recipe of shared/design/NVFP4.md, bit-exact with the crate's
// CPU reference (src/format.rs, src/reference.rs). Shared by the quantizer and (later) the fused
// SwiGLU epilogues, so everything here is a force-inlined CUTLASS_DEVICE helper.
//
// FP32 arithmetic here must not be contracted into FMAs where the recipe has separate roundings,
// so products use __fmul_rn and quotients __fdiv_rn explicitly.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cutlass/cutlass.h>

namespace nvfp4moe::codec {

// E4M3 (float8_e4m3fn) byte -> float. 0x7F / 0xFF are NaN; no infinities; max 448.
CUTLASS_DEVICE float e4m3_decode(uint32_t byte) {
  uint32_t sign = (byte & 0x80u) << 24;
  uint32_t exp = (byte >> 3) & 0xFu;
  uint32_t man = byte & 0x7u;
  if (exp == 0xFu && man == 0x7u) {
    return __uint_as_float(0x7FC00000u);
  }
  if (exp == 0) {
    // Subnormal: man * 2^-9, exact in FP32.
    float v = float(man) * 0.001953125f;
    return __uint_as_float(__float_as_uint(v) | sign);
  }
  return __uint_as_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// float -> E4M3 byte, round-to-nearest-even, saturating to +-448; NaN -> 0x7F.
CUTLASS_DEVICE uint32_t e4m3_encode(float x) {
  uint32_t bits = __float_as_uint(x);
  uint32_t sign = (bits >> 24) & 0x80u;
  float a = fabsf(x);
  if (isnan(x)) {
    return 0x7Fu;
  }
  if (a >= 448.0f) {
    return sign | 0x7Eu;  // saturate (Inf included)
  }
  if (a < 0.015625f) {
    // Subnormal range (below 2^-6): the step is 2^-9. a * 512 is exact (a power-of-two scaling
    // of a value that stays in range); rintf rounds half to even. 8 becomes 0x08 = 2^-6.
    uint32_t m = uint32_t(rintf(a * 512.0f));
    return sign | m;
  }
  uint32_t ab = __float_as_uint(a);
  uint32_t e = (ab >> 23) - 127u + 7u;  // biased E4M3 exponent, 1..15
  uint32_t man = ab & 0x7FFFFFu;
  uint32_t r = man >> 20;
  uint32_t rest = man & 0xFFFFFu;
  if (rest > 0x80000u || (rest == 0x80000u && (r & 1u))) {
    ++r;
  }
  if (r == 8u) {
    r = 0;
    ++e;
  }
  return sign | (e << 3) | r;  // a < 448 keeps this below 0x7E
}

// |q| -> E2M1 magnitude index (0..7), round-to-nearest-even with saturation (decision points
// 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5; ties to the even-mantissa neighbour). The FPU does the
// rounding: adding C = 2^22 * max(2^floor(log2 a), 1) rounds a to a multiple of ulp(C), which is
// the E2M1 grid step at a (0.5 below 2, then 1, then 2, ...), ties to even; subtracting C is exact.
// An E2M1 value v then maps to its index exactly as the FP32 bits of v * 2^-126, shifted right by
// 22 (the bits below are zero). The sign of q is ignored; NaN must not reach here.
// kAnySize: q may be >= 2^105 or Inf (clamps C); otherwise |q| < 2^100 is required.
template <bool kAnySize>
CUTLASS_DEVICE uint32_t e2m1_magnitude(float q) {
  uint32_t pow2 = __float_as_uint(q) & 0x7F800000u;
  if constexpr (kAnySize) {
    pow2 = min(pow2, 0x41000000u);  // C <= 2^25, so Inf and huge values round to >= 8
  }
  float c = __uint_as_float(max(pow2, 0x3F800000u) + (22u << 23));
  float r = fminf(__fsub_rn(__fadd_rn(fabsf(q), c), c), 6.0f);
  return __float_as_uint(__fmul_rn(r, 0x1p-126f)) >> 22;
}

CUTLASS_DEVICE float e2m1_decode(uint32_t code) {
  // E2M1 is a tiny float: exponent field e = bits 2..1, mantissa m = bit 0, bias 1.
  uint32_t e = (code >> 1) & 3u;
  uint32_t m = code & 1u;
  uint32_t mag = e == 0 ? (m ? 0x3F000000u : 0u) : (((e + 126u) << 23) | (m << 22));
  return __uint_as_float(mag | ((code & 8u) << 28));
}

// The rare exact path of step 4 (true division per element), taken per block so the fast path
// stays branch-free.
CUTLASS_DEVICE void quantize_codes_exact(const float (&x)[16], float d, uint32_t (&packed)[2]) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 16; ++i) {
    float q = __fdiv_rn(x[i], d);
    // Inf / Inf (an Inf element when d overflowed to Inf) is NaN: code 0, as in the CPU reference.
    uint32_t mag = isnan(q) ? 0u : e2m1_magnitude<true>(q);
    uint32_t code = mag | ((__float_as_uint(x[i]) >> 28) & 8u);
    packed[i / 8] |= code << (4 * (i % 8));
  }
}

// One NVFP4 block of 16 values: its scale byte and 8 packed code bytes (element 2j in the low
// nibble), by the pinned recipe. `x` holds the 16 inputs (already BF16 values widened to FP32).
struct Block16 {
  uint32_t scale;
  uint32_t codes_lo;  // elements 0..7
  uint32_t codes_hi;  // elements 8..15
};

CUTLASS_DEVICE Block16 quantize_block16(const float (&x)[16], float g) {
  // Step 1: amax, and whether a NaN is present (fmaxf would drop NaNs).
  float amax = 0.0f;
  bool has_nan = false;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 16; ++i) {
    amax = fmaxf(amax, fabsf(x[i]));
    has_nan |= isnan(x[i]);
  }
  Block16 out{0u, 0u, 0u};
  if (has_nan) {
    out.scale = 0x7Fu;  // NaN scale, zero codes: the NaN stays visible after decoding
    return out;
  }
  // Step 2: s = e4m3(amax / (6 g)), the product rounded first. Step 3: d = s * g.
  uint32_t s = e4m3_encode(__fdiv_rn(amax, __fmul_rn(6.0f, g)));
  float d = __fmul_rn(e4m3_decode(s), g);
  if (d == 0.0f) {
    return out;  // all-zero block or a scale that rounds to zero: scale 0, every code +0
  }
  out.scale = s;
  // Step 4: code_i = e2m1(x_i / d) with a true division. Fast path (Markstein): with r = RN(1/d),
  // q0 = RN(x r) is within an ulp of x/d and q0 + RN(x - d q0) r rounds to exactly RN(x/d),
  // provided nothing over- or underflows: with d in [2^-60, 2^60] and |x| <= 2^60 d (so |x/d| <=
  // 2^60; only a saturated scale allows more than ~12), every quotient near a decision point has
  // normal operands and an exact remainder. Anything else (an Inf element, a huge amax against a
  // tiny g) takes the exact division.
  bool fast = (d >= 0x1p-60f) && (d <= 0x1p60f) && (amax <= __fmul_rn(0x1p60f, d));
  uint32_t packed[2] = {0u, 0u};
  if (fast) {
    float r = __fdiv_rn(1.0f, d);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 16; ++i) {
      float q0 = __fmul_rn(x[i], r);
      float q = __fmaf_rn(__fmaf_rn(-q0, d, x[i]), r, q0);
      // Magnitude bits from the index, sign bit from x (so -0.0 gives code 8).
      packed[i / 8] |= (e2m1_magnitude<false>(q) << (4 * (i % 8))) |
                       ((__float_as_uint(x[i]) >> (28 - 4 * (i % 8))) & (8u << (4 * (i % 8))));
    }
  } else {
    quantize_codes_exact(x, d, packed);
  }
  out.codes_lo = packed[0];
  out.codes_hi = packed[1];
  return out;
}

// Offset of scale (m, k) in the 128x4 swizzled layout; k_tiles = ceil(cols/16/4).
CUTLASS_HOST_DEVICE int64_t swizzled_offset(int64_t m, int64_t k, int64_t k_tiles) {
  return (m / 128) * (k_tiles * 512) + (k / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + (k % 4);
}

}  // namespace nvfp4moe::codec

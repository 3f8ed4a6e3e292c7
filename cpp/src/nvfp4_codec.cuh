// Device-side NVFP4 codec: the pinned recipe of shared/design/NVFP4.md, bit-exact with the crate's
// CPU reference (src/format.rs, src/reference.rs). Shared by the quantizer and (later) the fused
// SwiGLU epilogues, so everything here is a force-inlined CUTLASS_DEVICE helper.
//
// FP32 arithmetic here must not be contracted into FMAs where the recipe has separate roundings,
// so products use __fmul_rn and quotients __fdiv_rn explicitly.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cutlass/cutlass.h>

namespace nvfp4moe::codec {

// E4M3 (float8_e4m3fn) byte -> float. 0x7F / 0xFF are NaN; no infinities; max 448.
CUTLASS_DEVICE float e4m3_decode(uint32_t byte) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // Exact through FP16 (every E4M3 value is an FP16 value).
  __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(byte), __NV_E4M3);
  return __half2float(__half(h));
#else
  uint32_t sign = (byte & 0x80u) << 24;
  uint32_t exp = (byte >> 3) & 0xFu;
  uint32_t man = byte & 0x7u;
  if (exp == 0xFu && man == 0x7u) {
    return __uint_as_float(0x7FC00000u);
  }
  if (exp == 0) {
    float v = float(man) * 0.001953125f;  // subnormal: man * 2^-9, exact
    return __uint_as_float(__float_as_uint(v) | sign);
  }
  return __uint_as_float(sign | ((exp + 120u) << 23) | (man << 20));
#endif
}

// float -> E4M3 byte, round-to-nearest-even (subnormals included), saturating to +-448 (Inf too);
// NaN -> 0x7F.
CUTLASS_DEVICE uint32_t e4m3_encode(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // cvt.rn.satfinite.e4m3x2.f32: one instruction, the same rounding and saturation.
  return uint32_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
#else
  uint32_t bits = __float_as_uint(x);
  uint32_t sign = (bits >> 24) & 0x80u;
  float a = fabsf(x);
  if (isnan(x)) {
    return 0x7Fu;
  }
  if (a >= 448.0f) {
    return sign | 0x7Eu;
  }
  if (a < 0.015625f) {
    // Subnormal range (below 2^-6): step 2^-9; a * 512 is exact, rintf rounds half to even, and
    // 8 becomes 0x08 = 2^-6.
    return sign | uint32_t(rintf(a * 512.0f));
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
#endif
}

// |q| -> E2M1 magnitude index (0..7), round-to-nearest-even with saturation (decision points
// 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5; ties to the even-mantissa neighbour). The FPU does the
// rounding: adding C = 2^22 * P, P = max(2^floor(log2 |q|), 1), rounds |q| to a multiple of
// ulp(C) = P/2, which is the E2M1 grid step at |q| (0.5 below 2, then 1, then 2), ties to even;
// subtracting C again is exact (both as one FFMA with the exact product P * 2^22). An E2M1 value v
// then maps to its index exactly as the FP32 bits of v * 2^-126, and this returns them: the index
// sits in bits 24..22, all other bits 0. The sign of q is ignored; NaN must not reach here.
// kAnySize: q may be huge or Inf (P is clamped to 8); otherwise |q| < 2^100 is required.
template <bool kAnySize>
CUTLASS_DEVICE uint32_t e2m1_magnitude_bits(float q) {
  uint32_t pow2 = __float_as_uint(q) & 0x7F800000u;
  if constexpr (kAnySize) {
    pow2 = min(pow2, 0x41000000u);  // P <= 8, so Inf and huge values round to >= 8
  }
  float p = __uint_as_float(max(pow2, 0x3F800000u));
  float r = __fmaf_rn(-p, 0x1p22f, __fmaf_rn(p, 0x1p22f, fabsf(q)));
  return __float_as_uint(__fmul_rn(fminf(r, 6.0f), 0x1p-126f));  // saturate at 6
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
    uint32_t mag = isnan(q) ? 0u : e2m1_magnitude_bits<true>(q) >> 22;
    uint32_t code = mag | ((__float_as_uint(x[i]) >> 28) & 8u);
    packed[i / 8] |= code << (4 * (i % 8));
  }
}

// One NVFP4 block of 16 values: its scale byte and 8 packed code bytes (element 2j in the low
// nibble), by the pinned recipe.
struct Block16 {
  uint32_t scale;
  uint32_t codes_lo;  // elements 0..7
  uint32_t codes_hi;  // elements 8..15
};

// Per-lane unsigned 16-bit max of two packed pairs (one instruction on sm_90).
CUTLASS_DEVICE uint32_t max_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return __vmaxu2(a, b);
#endif
}

// `w` holds the 16 inputs as 8 packed bf16 pairs (element 2j in the low half of w[j]);
// `six_g` is RN(6 * g), as step 2 rounds the product first.
CUTLASS_DEVICE Block16 quantize_block16(const uint32_t (&w)[8], float g, float six_g) {
  // Step 1: amax on the bf16 bits. |x| as an unsigned 16-bit integer orders like the value, and
  // any NaN (> 0x7F80) sorts above Inf, so one max finds both amax and whether a NaN is present.
  uint32_t m = 0;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 8; ++j) {
    m = max_u16x2(m, w[j] & 0x7FFF7FFFu);
  }
  uint32_t amax_bits = max(m & 0xFFFFu, m >> 16);
  Block16 out{0u, 0u, 0u};
  if (amax_bits > 0x7F80u) {
    out.scale = 0x7Fu;  // NaN scale, zero codes: the NaN stays visible after decoding
    return out;
  }
  float amax = __uint_as_float(amax_bits << 16);  // bf16 -> f32 is exact
  float x[16];
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 8; ++j) {
    x[2 * j] = __uint_as_float(w[j] << 16);
    x[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
  }
  // Step 2: s = e4m3(amax / (6 g)). Step 3: d = s * g.
  uint32_t s = e4m3_encode(__fdiv_rn(amax, six_g));
  float d = __fmul_rn(e4m3_decode(s), g);
  if (d == 0.0f) {
    return out;  // all-zero block or a scale that rounds to zero: scale 0, every code +0
  }
  out.scale = s;
  // Step 4: code_i = e2m1(x_i / d) with a true division. Fast path (Markstein): with r = RN(1/d),
  // q0 = RN(x r) is within an ulp of x/d and q0 + RN(x - d q0) r rounds to exactly RN(x/d),
  // provided nothing over- or underflows: with d in [2^-60, 2^60] every quotient near a decision
  // point has normal operands and an exact remainder, and an unsaturated scale keeps |x/d| <= 48
  // (6.4 for normal scales). Saturated scales (huge amax against g, Inf elements) and extreme d
  // take the exact division.
  bool fast = (s <= 0x7Du) && (d >= 0x1p-60f) && (d <= 0x1p60f);
  uint32_t packed[2] = {0u, 0u};
  if (fast) {
    float r = __fdiv_rn(1.0f, d);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 16; ++i) {
      float q0 = __fmul_rn(x[i], r);
      float q = __fmaf_rn(__fmaf_rn(-q0, d, x[i]), r, q0);
      // Magnitude bits from the index, sign bit from x (so -0.0 gives code 8).
      uint32_t mag_bits = e2m1_magnitude_bits<false>(q);  // index << 22
      const int kShift = 22 - 4 * (i % 8);  // to nibble i % 8 (a constant after unrolling)
      packed[i / 8] |= (kShift >= 0 ? mag_bits >> kShift : mag_bits << -kShift) |
                       ((__float_as_uint(x[i]) >> (28 - 4 * (i % 8))) & (8u << (4 * (i % 8))));
    }
  } else {
    quantize_codes_exact(x, d, packed);
  }
  out.codes_lo = packed[0];
  out.codes_hi = packed[1];
  return out;
}

// Decodes one block: 8 code bytes (element 2j in the low nibble) and its scale byte -> 16 bf16 at
// `dst` (two 16-byte stores). (e2m1 * e4m3) is exact in FP32; then one rounding for * g; then RNE
// to bf16. A NaN scale gives 16 canonical bf16 NaNs.
CUTLASS_DEVICE void dequantize_block16(uint2 codes, uint32_t scale_byte, float g, uint4* dst) {
  const float s = e4m3_decode(scale_byte);
  uint32_t packed[8];
  const uint32_t cw[2] = {codes.x, codes.y};
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 8; ++i) {
    uint32_t nib = cw[i / 4] >> (8 * (i % 4));
    float lo = __fmul_rn(__fmul_rn(e2m1_decode(nib & 0xFu), s), g);
    float hi = __fmul_rn(__fmul_rn(e2m1_decode((nib >> 4) & 0xFu), s), g);
    __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    packed[i] = isnan(s) ? 0x7FC07FC0u : *reinterpret_cast<uint32_t*>(&p);
  }
  dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

// Offset of scale (m, k) in the 128x4 swizzled layout; k_tiles = ceil(cols/16/4).
CUTLASS_HOST_DEVICE int64_t swizzled_offset(int64_t m, int64_t k, int64_t k_tiles) {
  return (m / 128) * (k_tiles * 512) + (k / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + (k % 4);
}

}  // namespace nvfp4moe::codec

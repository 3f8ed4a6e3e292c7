// Device-side NVFP4 codec: recipe v2 of shared/design/NVFP4.md (ModelOpt 0.47's bytes), bit-exact with the crate's
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

// One NVFP4 block of 16 values: its scale byte and 8 packed code bytes (element 2j in the low
// nibble), by recipe v2.
struct Block16 {
  uint32_t scale;
  uint32_t codes_lo;  // elements 0..7
  uint32_t codes_hi;  // elements 8..15
};

// max(|a|, |b|) per bf16 lane (the sign bit is the xor of the inputs' signs: mask it off), a NaN in
// either input giving NaN: one instruction for two lanes on sm_90.
CUTLASS_DEVICE uint32_t absmax_bf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// |x| bits of the block's largest element (bf16, sign cleared); any NaN gives bits > 0x7F80.
// (The last step maxes the two lanes with a half-swapped copy: PRMT, HMNMX2 and a mask.)
CUTLASS_DEVICE uint32_t block_amax_bits(const uint32_t (&w)[8]) {
  const uint32_t m = absmax_bf16x2(absmax_bf16x2(absmax_bf16x2(w[0], w[1]), absmax_bf16x2(w[2], w[3])),
                                   absmax_bf16x2(absmax_bf16x2(w[4], w[5]), absmax_bf16x2(w[6], w[7])));
  return absmax_bf16x2(m, __byte_perm(m, 0, 0x1032)) & 0x7FFFu;
}

// Recipe v2 steps 2-3 for one block: the scale byte s and d = e4m3(s) * g, and whether the codes may
// take the fast path (see quantize_codes_fast).
struct BlockScale {
  uint32_t scale;
  float d;
  bool fast;
};

CUTLASS_DEVICE BlockScale block_scale(uint32_t amax_bits, float g, float six_g) {
  const float amax = __uint_as_float(amax_bits << 16);  // bf16 -> f32 is exact
  // An infinite amax saturates (the crate's rule); 6g may overflow to Inf for a huge g, then a
  // finite amax gives t = 0 -> 1 as the recipe says.
  const float t_raw = amax_bits == 0x7F80u ? 448.0f : __fdiv_rn(amax, six_g);
  const float t = fminf(fmaxf(t_raw == 0.0f ? 1.0f : t_raw, 0x1p-9f), 448.0f);
  BlockScale b;
  b.scale = e4m3_encode(t);
  b.d = __fmul_rn(e4m3_decode(b.scale), g);
  // Fast path: the scale did not saturate (so |x / d| < 16) and d is in a range where the
  // Markstein quotient is exact near every decision point and a non-zero x / d never underflows
  // (|x| >= 2^-133 and d <= 2^16), so the code's sign is x's sign unless x is -0.0.
  // An infinite amax (an Inf element) takes the exact path, which gives Inf elements +-6.
  b.fast = (amax_bits < 0x7F80u) && (t_raw <= 448.0f) && (b.d >= 0x1p-60f) && (b.d <= 0x1p16f);
  return b;
}

// Steps 2-3's scale byte through the true quotient (amax finite or +Inf, not NaN).
CUTLASS_DEVICE uint32_t block_scale_byte(uint32_t amax_bits, float six_g) {
  const float amax = __uint_as_float(amax_bits << 16);
  const float t_raw = amax_bits == 0x7F80u ? 448.0f : __fdiv_rn(amax, six_g);
  return e4m3_encode(fminf(fmaxf(t_raw == 0.0f ? 1.0f : t_raw, 0x1p-9f), 448.0f));
}

// Step 4 on the rare exact path (true division per element), taken per block so the fast path
// stays branch-free. Matches ModelOpt's `searchsorted` semantics at the extremes: a NaN quotient
// (0/0 when d underflowed) has magnitude 6, and the sign bit is `q < 0`; an infinite element is
// +-6 (the crate's rule).
CUTLASS_DEVICE void quantize_codes_exact(const float (&x)[16], float d, uint32_t (&packed)[2]) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 16; ++i) {
    const float q = __fdiv_rn(x[i], d);
    uint32_t code;
    if (isinf(x[i])) {
      code = 7u | (x[i] < 0.0f ? 8u : 0u);
    } else {
      code = (isnan(q) ? 7u : e2m1_magnitude_bits<true>(q) >> 22) | (q < 0.0f ? 8u : 0u);
    }
    packed[i / 8] |= code << (4 * (i % 8));
  }
}

// Step 4 on the fast path. With r = RN(1/d), q0 = RN(x r) is within an ulp of x/d and
// q0 + RN(x - d q0) r rounds to exactly RN(x/d) (Markstein), given block_scale's range checks. The
// sign comes from that q: x = -0.0 gives q = +0.0 through the two FMAs (-0 + +0 = +0), a negative
// x gives a negative q, as ModelOpt's `x / d < 0` wants.
CUTLASS_DEVICE void quantize_codes_fast(const float (&x)[16], float d, uint32_t (&packed)[2]) {
  const float r = __frcp_rn(d);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 16; ++i) {
    const float q0 = __fmul_rn(x[i], r);
    const float q = __fmaf_rn(__fmaf_rn(-q0, d, x[i]), r, q0);
    const uint32_t mag_bits = e2m1_magnitude_bits<false>(q);  // index << 22
    const int kShift = 22 - 4 * (i % 8);  // to nibble i % 8 (a constant after unrolling)
    packed[i / 8] |= (kShift >= 0 ? mag_bits >> kShift : mag_bits << -kShift) |
                     ((__float_as_uint(q) >> (28 - 4 * (i % 8))) & (8u << (4 * (i % 8))));
  }
}

// The reciprocal paths (recipe v2, exact). For a block scale byte s and the tensor's g, with
// d = RN(e4m3(s) g) and r = RN(1/d):
// - every path below needs s in [0x09, 0x7D] (normal and not the saturating 448, so
//   |x / d| <= 6 (1 + 2^-4) (1 + 2^-22) < 7 for every x of a block with this scale: no saturation
//   step) and d in [2^-60, 2^16] (no overflow of r, no underflow of a non-zero x r, and the range in
//   which the Markstein correction below is exact near every decision point);
// - the plain product RN(x r) gives every bf16 x the same code as RN(x / d) when, for each E2M1
//   decision point c = m 2^j (m = 1, 3, 5, 7), m d is at least 8 FP32 ulps from every bf16 value
//   (the bf16 values are closed under 2^j): then |x / d - c| > 2^-21 c for every bf16 x, more than
//   the 1.5 ulps between RN(x r) and x / d, so both round to the same side of c and neither lands
//   on it. A random g passes for ~99.9% of the scale bytes; ModelOpt's weight convention
//   g = amax RN(1/2688) often does not (m s amax / 2688 is then often short: a near tie);
// - otherwise, kTuned (the per-CTA table, built once for ~20 blocks per thread): near such an m d
//   there is exactly one bf16 value X (its neighbours are 2^16 ulps away), and every x that can
//   meet a decision point there is X 2^j. So a reciprocal r' within an ulp of RN(1/d) serves every
//   input when, for each near m, RN(X r') lies on the same side of m as RN(X / d) (or both equal
//   m): the far decision points keep their margin (2^-21 relative against the 2^-22 error of
//   RN(x r')). r, r + 1 ulp and r - 1 ulp are tried, RN(X / d) taken as the Markstein quotient;
//   with ModelOpt's weight convention this saves the correction for ~93% of the scale bytes that
//   would need it;
// - otherwise q0 + RN(x - d q0) r with q0 = RN(x r) (Markstein) is RN(x / d) exactly.
// tests/codec_fast_path.rs checks these claims against the reference on every bf16 x for
// thousands of (g, s).
// RN(1/d) for d in [2^-60, 2^16]: the sequence __frcp_rn runs for operands away from the exponent
// extremes (MUFU.RCP and one Newton step), without its slow-path call, whose calling convention
// would cost the GEMM epilogue's quantizer warps spills.
CUTLASS_DEVICE float rcp_rn_normal(float d) {
  float r0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(d));
  return __fmaf_rn(-__fmaf_rn(d, r0, -1.0f), r0, r0);
}

struct ScaleRcp {
  float r;  // RN(1/d); 0: neither reciprocal path (the block takes the exact path)
  float d;  // d, negated when the plain product is not enough (Markstein)
};

template <bool kTuned = false>
CUTLASS_DEVICE ScaleRcp scale_reciprocal(uint32_t s, float g) {
  if (s < 0x09u || s > 0x7Du) {
    return ScaleRcp{0.0f, 0.0f};
  }
  const float d = __fmul_rn(e4m3_decode(s), g);
  if (!(d >= 0x1p-60f && d <= 0x1p16f)) {
    return ScaleRcp{0.0f, 0.0f};
  }
  const float r = rcp_rn_normal(d);
  // Bit m / 2 set: m d lies within 7 FP32 ulps of a bf16 value (low 16 bits of its FP32 bits).
  uint32_t near = 0;
  CUTLASS_PRAGMA_UNROLL
  for (int m = 1; m <= 7; m += 2) {
    const uint32_t y = __float_as_uint(__fmul_rn(float(m), d));
    near |= (((y + 7u) & 0xFFFFu) < 15u ? 1u : 0u) << (m / 2);
  }
  if (near == 0) {
    return ScaleRcp{r, d};
  }
  if constexpr (kTuned) {
    CUTLASS_PRAGMA_NO_UNROLL
    for (int c = 0; c < 3; ++c) {
      const float rc = __uint_as_float(__float_as_uint(r) + (c == 0 ? 0u : c == 1 ? 1u : 0xFFFFFFFFu));
      bool ok = true;
      CUTLASS_PRAGMA_UNROLL
      for (int m = 1; m <= 7; m += 2) {
        if (near & (1u << (m / 2))) {
          const float fm = float(m);
          const float x = __uint_as_float((__float_as_uint(__fmul_rn(fm, d)) + 0x8000u) & 0xFFFF0000u);
          const float q0 = __fmul_rn(x, r);
          const float t = __fmaf_rn(__fmaf_rn(-q0, d, x), r, q0);  // RN(x / d) (Markstein)
          const float q = __fmul_rn(x, rc);
          ok &= (t < fm) == (q < fm) && (t > fm) == (q > fm);
        }
      }
      if (ok) {
        return ScaleRcp{rc, d};
      }
    }
  }
  return ScaleRcp{r, -d};
}

// A tensor's decode scale with what the block-scale step needs: six_g = RN(6 g) (step 2 rounds the
// product first) and inv_six_g = RN(1 / six_g) for the fast scale estimate.
struct TensorScale {
  float g, six_g, inv_six_g;
};

CUTLASS_HOST_DEVICE TensorScale make_tensor_scale(float g) {
  TensorScale ts;
  ts.g = g;
#if defined(__CUDA_ARCH__)
  ts.six_g = __fmul_rn(6.0f, g);
  ts.inv_six_g = __frcp_rn(ts.six_g);
#else
  ts.six_g = 6.0f * g;  // IEEE single: RN
  ts.inv_six_g = 1.0f / ts.six_g;
#endif
  return ts;
}

// Where a block's ScaleRcp comes from: a table of scale_reciprocal over the 128 non-negative scale
// bytes (the plain quantizer builds one per CTA), or computed per block.
struct RcpTable {
  const ScaleRcp* table;  // (128) in shared memory
  CUTLASS_DEVICE ScaleRcp operator()(uint32_t s, float) const { return table[s & 0x7Fu]; }
};
struct RcpInline {
  CUTLASS_DEVICE ScaleRcp operator()(uint32_t s, float g) const { return scale_reciprocal<false>(s, g); }
};

// Step 4 on a reciprocal path (see scale_reciprocal): q = RN(x r + 0), Markstein-corrected when
// kCorrect (the +0 turns -0.0 into +0.0, as ModelOpt's `x / d < 0` wants; a non-zero x keeps its
// sign), no saturation (|q| < 7), then the E2M1 index as in e2m1_magnitude_bits and the sign bit.
template <bool kCorrect>
CUTLASS_DEVICE void quantize_codes_rcp(const uint32_t (&w)[8], float r, float d, uint32_t (&packed)[2]) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 16; ++i) {
    const float x = __uint_as_float(i % 2 == 0 ? w[i / 2] << 16 : w[i / 2] & 0xFFFF0000u);
    float q = __fmaf_rn(x, r, 0.0f);
    if constexpr (kCorrect) {
      q = __fmaf_rn(__fmaf_rn(-q, d, x), r, q);
    }
    const float p = __uint_as_float(max(__float_as_uint(q) & 0x7F800000u, 0x3F800000u));
    const float rounded = __fmaf_rn(-p, 0x1p22f, __fmaf_rn(p, 0x1p22f, fabsf(q)));
    const uint32_t mag_bits = __float_as_uint(__fmul_rn(rounded, 0x1p-126f));  // index << 22
    // The code as the top nibble, (index << 28) | (sign << 31), then moved down to nibble i % 8
    // and added in. Integer multiplies instead of shifts and ORs: this loop is bound by the integer
    // ALU pipe (70% busy, Nsight Compute 2026-12-02), the multiplies run on the FMA pipe. The
    // multipliers are not powers of two so that they stay multiplies: 1088 = 64 + 1024 (the 1024
    // term moves the index past bit 31), 2^(4 + 4n) + 1 (the +1 term only adds the nibble word itself
    // to the discarded low half, which cannot carry).
    const uint32_t nib = mag_bits * 1088u + (__float_as_uint(q) & 0x80000000u);
    const int n = i % 8;  // a constant after unrolling
    packed[i / 8] += n < 7 ? __umulhi(nib, (1u << (4 + 4 * n)) + 1u) : nib;
  }
}

// Steps 2-4 through the exact block scale and Markstein or true division (amax not NaN).
CUTLASS_DEVICE Block16 quantize_block16_exact(const uint32_t (&w)[8], uint32_t amax_bits, const TensorScale& ts) {
  float x[16];
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 8; ++j) {
    x[2 * j] = __uint_as_float(w[j] << 16);
    x[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
  }
  const BlockScale b = block_scale(amax_bits, ts.g, ts.six_g);
  uint32_t packed[2] = {0u, 0u};
  if (b.fast) {
    quantize_codes_fast(x, b.d, packed);
  } else {
    quantize_codes_exact(x, b.d, packed);
  }
  return Block16{b.scale, packed[0], packed[1]};
}

// `w` holds the 16 inputs as 8 packed bf16 pairs (element 2j in the low half of w[j]). Recipe v2
// (design/NVFP4.md): ModelOpt 0.47's bytes on every finite input; a NaN anywhere gives scale 0x7F
// and zero codes. Paths, all exact: an all-zero block (scale 1.0, codes 0); the reciprocal paths
// when `rcp` vouches for the block's scale byte (the Markstein correction is applied to the whole
// warp when any of its active lanes needs it, so the warp does not run both); otherwise (subnormal
// or saturated scales, Inf elements, extreme d) the exact block scale and Markstein or true
// division.
template <class Rcp>
CUTLASS_DEVICE Block16 quantize_block16(const uint32_t (&w)[8], const TensorScale& ts, const Rcp& rcp) {
  const uint32_t amax_bits = block_amax_bits(w);
  if (amax_bits == 0) {
    return Block16{0x38u, 0u, 0u};  // t = 0 -> 1, d = g > 0, every quotient +-0 -> code 0
  }
  if (amax_bits > 0x7F80u) {
    return Block16{0x7Fu, 0u, 0u};  // NaN scale, zero codes: the NaN stays visible after decoding
  }
  // The scale byte from RN(amax RN(1 / 6g)), within 3 ulps of the true quotient: the same byte
  // unless it lies within 8 ulps of an E4M3 rounding point (in the normal range, the FP32 values
  // whose low 20 bits are 0x80000), where the true quotient decides (rare for most g, frequent
  // when 1 / 6g is short, e.g. g = amax RN(1/2688) with amax a power of two).
  const float t1 = __fmul_rn(__uint_as_float(amax_bits << 16), ts.inv_six_g);
  uint32_t s1 = e4m3_encode(t1);
  if (((__float_as_uint(t1) + 8u - 0x80000u) & 0xFFFFFu) < 16u) {
    s1 = block_scale_byte(amax_bits, ts.six_g);
  }
  const ScaleRcp e = rcp(s1, ts.g);
  uint32_t packed[2] = {0u, 0u};
  if (e.r > 0.0f) {
    if (__any_sync(__activemask(), e.d < 0.0f)) {
      quantize_codes_rcp<true>(w, e.r, fabsf(e.d), packed);
    } else {
      quantize_codes_rcp<false>(w, e.r, e.d, packed);
    }
    return Block16{s1, packed[0], packed[1]};
  }
  return quantize_block16_exact(w, amax_bits, ts);
}

CUTLASS_DEVICE Block16 quantize_block16(const uint32_t (&w)[8], const TensorScale& ts) {
  return quantize_block16(w, ts, RcpInline{});
}

// The recipe through the exact block scale and Markstein or true division only: fewer registers
// than quantize_block16 (the GEMM epilogue's quantizer warps run on 40 registers in a kernel
// compiled for 80, where the reciprocal paths spill), the same bytes.
CUTLASS_DEVICE Block16 quantize_block16_compact(const uint32_t (&w)[8], const TensorScale& ts) {
  const uint32_t amax_bits = block_amax_bits(w);
  if (amax_bits > 0x7F80u) {
    return Block16{0x7Fu, 0u, 0u};
  }
  return quantize_block16_exact(w, amax_bits, ts);
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

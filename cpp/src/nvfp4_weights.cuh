// The prepared NVFP4 weight layout shared by prepare_weights.cu (writer) and the grouped GEMM
// mainloop (reader). One layout serves every tile configuration: chunks of 64 rows x 64 K.
//
// Chunk (e, mt, kc) = rows [64 mt, 64 mt + 64) and k [64 kc, 64 kc + 64) of expert e, at byte
// ((e * n/64 + mt) * k/64 + kc) * 2304:
//   codes  [0, 2048):   128 x 16 B. Consumer thread t (warp w = t/32, lane l, g = l/4, c = l%4)
//                       owns 16 B at t*16: one u32 per k-block kb (0..3). That u32 holds the 8
//                       values of t's wgmma A fragment (SM90 64x16 RS layout: value v = v0 + 2 v1
//                       + 4 v2 is row 16w + g + 8 v1, k 16 kb + 2c + v0 + 8 v2): pair j = v1 + 2 v2
//                       is (value 2j in the low 16-bit lane, value 2j+1 in the high lane), and each
//                       value's E2M1 bits (m0, m1, m2 = magnitude index, s = sign) sit in its lane
//                       at pair_bit(j, b), chosen so that pairs 0-2 decode with one shift and one
//                       mask, and pair 3 with three shifts and masks (pair_to_bf16x2_scaled).
//   scales [2048, 2304): 32 x 8 B. Entry (w, g) at (w*8 + g)*8 holds, for kb = 0..3, the byte
//                       pair {row 16w+g, row 16w+g+8}: each byte is the scale s encoded as
//                       ((E - 224) << 3) | m, where E and m are the BF16 exponent and top three
//                       mantissa bits of s * 2^118 (E in [236, 253] for every non-zero E4M3
//                       value), so (byte << 4) | 0x7000 is s * 2^118 in BF16.
// A decoded weight is then (e2m1 bits placed at BF16 bits 8..6 with the sign at 15 = value *
// 2^-126) * (s * 2^118) = value * s * 2^-8, exact in BF16; the epilogue multiplies by g * 2^8.
#pragma once

#include <cstdint>
#include <cutlass/cutlass.h>

namespace nvfp4moe::weights {

constexpr int kChunkRows = 64;
constexpr int kChunkK = 64;
constexpr int kChunkCodeBytes = kChunkRows * kChunkK / 2;    // 2048
constexpr int kChunkScaleBytes = kChunkRows * kChunkK / 16;  // 256
constexpr int kChunkBytes = kChunkCodeBytes + kChunkScaleBytes;
static_assert(kChunkBytes % 128 == 0, "chunks are copied with bulk copies into 128-byte aligned smem");

CUTLASS_HOST_DEVICE int64_t chunk_offset(int64_t e, int64_t mt, int64_t kc, int64_t n, int64_t k) {
  return ((e * (n / kChunkRows) + mt) * (k / kChunkK) + kc) * kChunkBytes;
}

// Lane bit positions of (m0, m1, m2, s) for pair j. A decoded BF16 lane wants m0 at bit 6 (the top
// mantissa bit), m1, m2 at bits 7, 8 (the two low exponent bits) and s at bit 15: the result is then
// the E2M1 value * 2^-126, exactly. Pair 0 is already in place, pairs 1 and 2 are 3 and 6 bits
// lower; only three such translates fit in 16 bits, so pair 3 takes the four bits left over.
// (A function, not a table, so that host and device code share it.) pair_bit(j, b):
//   j = 0: {6, 7, 8, 15}   j = 1: {3, 4, 5, 12}   j = 2: {0, 1, 2, 9}   j = 3: {10, 11, 13, 14}
CUTLASS_HOST_DEVICE constexpr int pair_bit(int j, int b) {
  return j == 3 ? (b == 0 ? 10 : b == 1 ? 11 : b == 2 ? 13 : 14) : (b == 3 ? 15 : b + 6) - 3 * j;
}

// The prepared word bits of E2M1 nibble `nib` (s m2 m1 m0) as value `lane` (0, 1) of pair j.
CUTLASS_HOST_DEVICE uint32_t place_nibble(uint32_t nib, int j, int lane) {
  uint32_t out = 0;
  for (int b = 0; b < 4; ++b) {
    out |= ((nib >> b) & 1u) << (pair_bit(j, b) + 16 * lane);
  }
  return out;
}
static_assert(pair_bit(0, 0) == 6 && pair_bit(0, 3) == 15 && pair_bit(1, 0) == 3 && pair_bit(1, 3) == 12 &&
                  pair_bit(2, 2) == 2 && pair_bit(2, 3) == 9 && pair_bit(3, 2) == 13 && pair_bit(3, 3) == 14,
              "the lane layout pair_to_bf16x2_scaled decodes");

// Pair j of a prepared k-block word -> two BF16 values * 2^-126 (sign at bits 15 and 31, magnitude
// index at bits 8..6 and 24..22): one or two instructions for pairs 0-2, six for pair 3.
template <int kJ>
CUTLASS_DEVICE uint32_t pair_to_bf16x2_scaled(uint32_t word) {
  constexpr uint32_t kMask = 0x81C081C0u;
  if constexpr (kJ == 0) {
    return word & kMask;
  } else if constexpr (kJ == 1) {
    return (word << 3) & kMask;
  } else if constexpr (kJ == 2) {
    return (word << 6) & kMask;
  } else {
    return ((word >> 4) & 0x00C000C0u) | ((word >> 5) & 0x01000100u) | ((word << 1) & 0x80008000u);
  }
}

// Two scale bytes, one in the low byte of each 16-bit lane (high bytes 0) -> BF16 s * 2^118 per lane.
CUTLASS_DEVICE uint32_t scale_pair_to_bf16x2(uint32_t b_pair) {
  return b_pair * 16u + 0x70007000u;  // == (b_pair << 4) | 0x70007000 (no overlapping bits); one IMAD
}

}  // namespace nvfp4moe::weights

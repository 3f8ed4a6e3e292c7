// The prepared NVFP4 weight layout shared by prepare_weights.cu (writer) and the grouped GEMM
// mainloop (reader). One layout serves every tile configuration: chunks of 64 rows x 64 K.
//
// Chunk (e, mt, kc) = rows [64 mt, 64 mt + 64) and k [64 kc, 64 kc + 64) of expert e, at byte
// ((e * n/64 + mt) * k/64 + kc) * 2304:
//   codes  [0, 2048):   128 x 16 B. Consumer thread t (warp w = t/32, lane l, g = l/4, c = l%4)
//                       owns 16 B at t*16: one u32 per k-block kb (0..3). That u32 holds the 8
//                       values of t's wgmma A fragment (SM90 64x16 RS layout: value v = v0 + 2 v1
//                       + 4 v2 is row 16w + g + 8 v1, k 16 kb + 2c + v0 + 8 v2) as E2M1 nibbles:
//                       value 2j at bits [4j, 4j+4), value 2j+1 at bits [16+4j, 16+4j+4), so
//                       (word >> 4j) puts the j-th bf16 pair's two nibbles at bits 0..3 and 16..19.
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

// Two E2M1 nibbles (bits 0..3 and 16..19 of `x`) -> two BF16 values * 2^-126, exactly: the three
// magnitude bits go to BF16 bits 8..6 (the two low exponent bits and the top mantissa bit), the
// sign to bit 15 (and 31).
CUTLASS_DEVICE uint32_t e2m1x2_to_bf16x2_scaled(uint32_t x) {
  return ((x & 0x00070007u) << 6) | ((x & 0x00080008u) << 12);
}

// Scale byte b (in the low byte of the 16-bit lane pair) -> BF16 s * 2^118 in both lanes.
CUTLASS_DEVICE uint32_t scale_pair_to_bf16x2(uint32_t b_pair) {
  return (b_pair << 4) | 0x70007000u;
}

}  // namespace nvfp4moe::weights

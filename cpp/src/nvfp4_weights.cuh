// The prepared NVFP4 weight layout shared by prepare_weights.cu (writer) and the grouped GEMM
// mainloop (reader). One layout serves every tile configuration: chunks of 64 rows x 64 K.
//
// Chunk (e, mt, kc) = rows [64 mt, 64 mt + 64) and k [64 kc, 64 kc + 64) of expert e, at byte
// ((e * n/64 + mt) * k/64 + kc) * 2304:
//   codes  [0, 2048):   128 x 16 B. Consumer thread t (warp w = t/32, lane l, g = l/4, c = l%4)
//                       owns 16 B at t*16: one u32 per k-block kb (0..3). That u32 holds the 8
//                       values of t's wgmma A fragment (SM90 64x16 RS layout: value v = v0 + 2 v1
//                       + 4 v2 is row 16w + g + 8 v1, k 16 kb + 2c + v0 + 8 v2): pair j = v1 + 2 v2
//                       decodes to one bf16x2 (value 2j in the low 16-bit lane, value 2j+1 in the
//                       high lane), and each value's E2M1 bits (m0, m1, m2 = magnitude index,
//                       s = sign) sit at word bits pair_bit(j, b, lane), chosen so that the four
//                       pairs decode in nine instructions (pair_to_bf16x2_scaled): pair 0 with one
//                       AND, pairs 1 and 2 with one shift or rotate and one AND, pair 3 with two
//                       shifts and two masks.
//   scales [2048, 2304): 32 x 8 B. Entry (w, g) at (w*8 + g)*8 holds, for kb = 0..3, the byte
//                       pair {row 16w+g, row 16w+g+8}: each byte is the scale s encoded as
//                       ((E - 224) << 3) | m, where E and m are the BF16 exponent and top three
//                       mantissa bits of s * 2^118 (E in [236, 253] for every non-zero E4M3
//                       value), so (byte << 4) | 0x7000 is s * 2^118 in BF16.
// A decoded weight is then (e2m1 bits placed at BF16 bits 8..6 with the sign at 15 = value *
// 2^-126) * (s * 2^118) = value * s * 2^-8, exact in BF16; the epilogue multiplies by g * 2^8.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
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

// Bit positions of (m0, m1, m2, s) = b 0..3 for pair j. A decoded BF16 lane wants m0 at bit 6 (the
// top mantissa bit), m1, m2 at bits 7, 8 (the two low exponent bits) and s at bit 15, every other
// bit 0: the result is then the E2M1 value * 2^-126, exactly. A decode moves each bit by a
// displacement, mod 16 within a lane (a 32-bit rotate moves both lanes' bits alike), and the 16
// bits of a lane hold the four pairs. Lane-local positions pair_lane_bit(j, b) = {m0, m1, m2, s}:
//   j = 0: {6, 7, 8, 15}    in place:           w & M                                  1 instr
//   j = 1: {0, 1, 2, 9}     all +6:             (w << 6) & M                           2
//   j = 2: {12, 13, 14, 5}  all +10 mod 16:     rotl(w, 26) & M                        2
//   j = 3: {10, 3, 4, 11}   m0 -4, m1 m2 s +4:  ((w >> 4) & 0x00400040)
//                                                 | ((w << 4) & 0x81808180)            4
// with M = 0x81C081C0. Nine is the fewest at one instruction per distinct non-zero displacement
// plus one mask per (pair, displacement) group: a displacement serves each bit b of one pair
// only, so the 16 (pair, bit) slots need at least four displacements, and four cannot do (no four
// translates of {6, 7, 8, 15} tile the 16 bits): five or more, four of them non-zero, and at
// least five groups.
// The rotate by 26 takes target bit p from word bit (p + 6) mod 32: the m bits of either value
// stay in their own 16-bit half, but pair 2's sign bit sits in the other half (value 2j's s at
// word bit 21, value 2j+1's at bit 5). pair_bit(j, b, lane) is the word bit of value `lane`.
// (Functions, not tables, so that host and device code share them.)
CUTLASS_HOST_DEVICE constexpr int pair_lane_bit(int j, int b) {
  return j == 0   ? (b == 3 ? 15 : 6 + b)
         : j == 1 ? (b == 3 ? 9 : b)
         : j == 2 ? (b == 3 ? 5 : 12 + b)
                  : (b == 0 ? 10 : b == 1 ? 3 : b == 2 ? 4 : 11);
}
CUTLASS_HOST_DEVICE constexpr int pair_bit(int j, int b, int lane) {
  return pair_lane_bit(j, b) + 16 * (lane ^ (j == 2 && b == 3 ? 1 : 0));
}

// The prepared word bits of E2M1 nibble `nib` (s m2 m1 m0) as value `lane` (0, 1) of pair j.
CUTLASS_HOST_DEVICE constexpr uint32_t place_nibble(uint32_t nib, int j, int lane) {
  uint32_t out = 0;
  for (int b = 0; b < 4; ++b) {
    out |= ((nib >> b) & 1u) << pair_bit(j, b, lane);
  }
  return out;
}
static_assert(pair_bit(0, 0, 0) == 6 && pair_bit(0, 3, 1) == 31 && pair_bit(1, 0, 0) == 0 &&
                  pair_bit(1, 3, 0) == 9 && pair_bit(2, 0, 0) == 12 && pair_bit(2, 3, 0) == 21 &&
                  pair_bit(2, 3, 1) == 5 && pair_bit(3, 0, 0) == 10 && pair_bit(3, 1, 1) == 19 &&
                  pair_bit(3, 3, 0) == 11,
              "the layout pair_to_bf16x2_scaled decodes");

// 32-bit rotate left by r (0 < r < 32): one SHF.L.W on the device.
CUTLASS_HOST_DEVICE constexpr uint32_t rotate_left(uint32_t x, int r) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(x, x, r);
#else
  return (x << r) | (x >> (32 - r));
#endif
}

// Pair j of a prepared k-block word -> two BF16 values * 2^-126 (sign at bits 15 and 31, magnitude
// index at bits 8..6 and 24..22): one instruction for pair 0, two for pairs 1 and 2, four for pair 3.
template <int kJ>
CUTLASS_HOST_DEVICE constexpr uint32_t pair_to_bf16x2_scaled(uint32_t word) {
  constexpr uint32_t kMask = 0x81C081C0u;
  if constexpr (kJ == 0) {
    return word & kMask;
  } else if constexpr (kJ == 1) {
    return (word << 6) & kMask;
  } else if constexpr (kJ == 2) {
    return rotate_left(word, 26) & kMask;
  } else {
    return ((word >> 4) & 0x00400040u) | ((word << 4) & 0x81808180u);
  }
}

#if !defined(__CUDA_ARCH__)
// Compile-time check (host pass of every file that includes this): decode(place) is exact.
// (1) Every pair's decode is a GF(2)-linear map of the word (shifts, rotates, ANDs, ORs of disjoint
//     masks), so checking each of the 32 single-bit words proves it for all 2^32 words: bit
//     pair_bit(j, b, lane) decodes, in pair j, to BF16 bit {6, 7, 8, 15}[b] + 16 lane and in every
//     other pair to nothing; every word bit belongs to exactly one (j, b, lane).
// (2) Directly, without relying on linearity: every pair j, every (lane 0, lane 1) nibble pair,
//     with the other pairs' bits all 0, all 1 and six pseudo-random fills.
namespace layout_check {
constexpr int kTarget[4] = {6, 7, 8, 15};
constexpr uint32_t decode(int j, uint32_t w) {
  return j == 0   ? pair_to_bf16x2_scaled<0>(w)
         : j == 1 ? pair_to_bf16x2_scaled<1>(w)
         : j == 2 ? pair_to_bf16x2_scaled<2>(w)
                  : pair_to_bf16x2_scaled<3>(w);
}
constexpr uint32_t expected(uint32_t nib0, uint32_t nib1) {
  uint32_t out = 0;
  for (int b = 0; b < 4; ++b) {
    out |= (((nib0 >> b) & 1u) << kTarget[b]) | (((nib1 >> b) & 1u) << (kTarget[b] + 16));
  }
  return out;
}
constexpr bool single_bits_ok() {
  uint32_t covered = 0;
  for (int j = 0; j < 4; ++j) {
    for (int b = 0; b < 4; ++b) {
      for (int lane = 0; lane < 2; ++lane) {
        covered |= 1u << pair_bit(j, b, lane);
      }
    }
  }
  if (covered != 0xFFFFFFFFu) return false;
  for (int i = 0; i < 32; ++i) {
    for (int j = 0; j < 4; ++j) {
      uint32_t want = 0;
      for (int b = 0; b < 4; ++b) {
        for (int lane = 0; lane < 2; ++lane) {
          if (pair_bit(j, b, lane) == i) want = 1u << (kTarget[b] + 16 * lane);
        }
      }
      if (decode(j, 1u << i) != want) return false;
    }
  }
  return decode(0, 0) == 0 && decode(1, 0) == 0 && decode(2, 0) == 0 && decode(3, 0) == 0;
}
constexpr bool nibbles_ok() {
  uint32_t fill = 0x9E3779B9u;  // an LCG stream: different fills for every (j, nibble pair)
  for (int j = 0; j < 4; ++j) {
    uint32_t own = place_nibble(0xF, j, 0) | place_nibble(0xF, j, 1);
    for (uint32_t n = 0; n < 256; ++n) {
      for (int f = 0; f < 8; ++f) {  // (more runs into nvcc's constexpr evaluation limit)
        fill = fill * 1664525u + 1013904223u;
        uint32_t other = f == 0 ? 0u : f == 1 ? 0xFFFFFFFFu : fill;
        uint32_t w = (other & ~own) | place_nibble(n & 0xF, j, 0) | place_nibble(n >> 4, j, 1);
        if (decode(j, w) != expected(n & 0xF, n >> 4)) return false;
      }
    }
  }
  return true;
}
static_assert(single_bits_ok(), "prepared layout: each word bit decodes to its pair's BF16 bit only");
static_assert(nibbles_ok(),
              "prepared layout: pair_to_bf16x2_scaled(place_nibble(...)) is the E2M1 value * 2^-126");
}  // namespace layout_check
#endif

// Two scale bytes, one in the low byte of each 16-bit lane (high bytes 0) -> BF16 s * 2^118 per lane.
CUTLASS_DEVICE uint32_t scale_pair_to_bf16x2(uint32_t b_pair) {
  return b_pair * 16u + 0x70007000u;  // == (b_pair << 4) | 0x70007000 (no overlapping bits); one IMAD
}

// K-block kb (0..3) of a thread's chunk words -> its A fragment for that k-block, exactly: four
// bf16x2 words, pair j = v1 + 2 v2 (row g + 8 v1, k 2c + 8 v2; the SM90 64x16 RS layout per warp,
// which is also mma.sync m16n8k16's A), each times its row's scale (scale byte pairs of k-blocks
// 0-1 in scales.x, 2-3 in scales.y). Shared by the wgmma mainloop and the warp kernel.
CUTLASS_DEVICE void decode_kblock(uint32_t code_word, uint2 scales, int kb, uint32_t (&a)[4]) {
  const uint32_t sw = kb < 2 ? scales.x : scales.y;
  // Bytes (row g, row g + 8) of this k-block -> BF16 (s_g, s_g8) in one word; each pair multiplies
  // by its row's half broadcast (an HMUL2 operand swizzle, no extra instruction).
  const uint32_t sel0 = (kb % 2) * 2, sel8 = sel0 + 1;
  const uint32_t s_both = scale_pair_to_bf16x2(__byte_perm(sw, 0, 0x4040 | sel0 | (sel8 << 8)));
  const __nv_bfloat162 s_r = __low2bfloat162(*reinterpret_cast<const __nv_bfloat162*>(&s_both));
  const __nv_bfloat162 s_r8 = __high2bfloat162(*reinterpret_cast<const __nv_bfloat162*>(&s_both));
  const uint32_t v[4] = {pair_to_bf16x2_scaled<0>(code_word), pair_to_bf16x2_scaled<1>(code_word),
                         pair_to_bf16x2_scaled<2>(code_word), pair_to_bf16x2_scaled<3>(code_word)};
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 4; ++j) {
    __nv_bfloat162 prod = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&v[j]), j % 2 ? s_r8 : s_r);
    a[j] = *reinterpret_cast<uint32_t*>(&prod);
  }
}

}  // namespace nvfp4moe::weights

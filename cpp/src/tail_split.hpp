// The 128x256 tile's tail split, host side: which launches one GEMM on that tile becomes, and the
// row parts they cover (Params::row_part, tail_lo, tail_hi; gemm_scheduler.cuh's expert_rows gives
// each launch's rows of an expert). Plain C++: grouped_gemm.cu launches the plan, and the GPU-free
// test cpp/tests/tail_split.cu checks that its launches cover every row of every expert once.
#pragma once

#include <cstring>

namespace nvfp4moe::gemm {

// Params::row_part's values, and the row tile the tail is taken from (the 128x256 tile's).
constexpr int kAllRows = 0, kHeadRows = 1, kTailRows = 2;
constexpr int kTailBlock = 256;

// The tail tiles in use: an expert's rows past its last whole kTailBlock-row tile (its rem), when
// at most 32, on the 128x32 tile (n32), when at most 64 (or 33-64 with n32) on the 128x64 tile
// (n64), when at most 128 (past what n32 and n64 take: 65-128 with n64) on the 128x128 tile
// (n128). None: no split.
struct TailTiles {
  bool n32, n64, n128;
  // The tail launches from the largest tail tile down (128x128 first) instead of from the smallest
  // (NVFP4MOE_TAIL_LARGEST_FIRST=1, an experiment): the launch that ends the GEMM then has the
  // shortest tiles, so its last wave is the least ragged.
  bool largest_first = false;
  constexpr int most() const { return n128 ? 128 : n64 ? 64 : n32 ? 32 : 0; }
};

// NVFP4MOE_TAIL_TILES's value (null: unset): "0" none; else a comma-separated ascending subset of
// 32, 64 and 128, each tile taking the tails of at most its rows that the smaller ones leave (e.g.
// "32,128": 1-32 rows on 128x32, 33-128 on 128x128; "32,64": the 65-128-row tails stay with the
// head); anything else (unset, empty, malformed) the default, all three.
inline TailTiles parse_tail_tiles(const char* v) {
  const TailTiles all{true, true, true};
  if (v == nullptr) return all;
  if (std::strcmp(v, "0") == 0) return TailTiles{false, false, false};
  TailTiles t{false, false, false};
  int last = 0;
  for (const char* c = v; *c != '\0';) {
    int x = 0, digits = 0;
    for (; *c >= '0' && *c <= '9' && digits < 4; ++c, ++digits) x = 10 * x + (*c - '0');
    if (digits == 0 || x <= last || (x != 32 && x != 64 && x != 128)) return all;
    (x == 32 ? t.n32 : x == 64 ? t.n64 : t.n128) = true;
    last = x;
    if (*c == ',') {
      ++c;
      if (*c == '\0') return all;  // a trailing comma
    } else if (*c != '\0') {
      return all;
    }
  }
  return last == 0 ? all : t;
}

// One launch of the plan: its tile's rows (kBlockN) and its Params::row_part, tail_lo, tail_hi.
struct TailLaunch {
  int block_n, row_part, tail_lo, tail_hi;
};
constexpr int kMaxTailLaunches = 4;

// The launches of one GEMM on the 128x256 tile, in order (each waits for the one before it, but
// when the tails overlap, grouped_gemm.cu's tail_overlap(); the tails smallest tile first, or
// largest first with TailTiles::largest_first):
// without tail tiles one launch of every row; else the head (every whole 256-row tile, and a last
// tile of more rows than the largest tail tile takes) on 128x256, then one launch per tail tile,
// taking the tails of (tail_lo, tail_hi] rows. Returns the number of launches written to `out`.
inline int tail_split_plan(TailTiles t, TailLaunch (&out)[kMaxTailLaunches]) {
  if (t.most() == 0) {
    out[0] = TailLaunch{kTailBlock, kAllRows, 0, 0};
    return 1;
  }
  int n = 0;
  out[n++] = TailLaunch{kTailBlock, kHeadRows, 0, t.most()};  // (tail_lo = 0: expert_rows's premise)
  int lo = 0;
  if (t.n32) {
    out[n++] = TailLaunch{32, kTailRows, lo, 32};
    lo = 32;
  }
  if (t.n64) {
    out[n++] = TailLaunch{64, kTailRows, lo, 64};
    lo = 64;
  }
  if (t.n128) out[n++] = TailLaunch{128, kTailRows, lo, 128};
  if (t.largest_first) {
    for (int i = 1, j = n - 1; i < j; ++i, --j) {
      const TailLaunch x = out[i];
      out[i] = out[j];
      out[j] = x;
    }
  }
  return n;
}

}  // namespace nvfp4moe::gemm

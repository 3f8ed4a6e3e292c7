// Stream-K for the grouped GEMM's decode tile (grouped_gemm_sm90.cuh): when a launch has too few
// tiles for whole waves of CTAs (T = 1 over 8 experts: 256-448 tiles on 264 CTA slots, or fewer
// tiles than slots), every CTA takes an equal share of the launch's K stages instead of whole tiles.
//
// The launch's work is U = tiles x stages units (tile-major, K stages in order); CTA c of G takes
// units [c U / G, (c + 1) U / G). Its share is a list of segments (tile, [kc_begin, kc_end)): at
// most one first segment that starts inside a tile (kc_begin > 0, a "tail"), whole tiles, and at most
// one last segment that ends inside a tile (a "head": it starts at kc_begin = 0). A tail's FP32
// partial sums go to the CTA's slot of the workspace and its flag is raised; the CTA holding the
// tile's head (it processes the head last, after its own tiles, so the tails are long done) adds
// every tail of the tile to its own sums in K order, so the sum order is fixed by (tiles, stages,
// G): bit-identical across runs, no atomics. It clears the flags it consumed, so every launch
// leaves the workspace as it found it (zero flags): CUDA-graph safe, no memset per launch.
//
// No deadlock: a head waits only for CTAs with higher indices, each of which writes its tail
// before anything else (a tail is a CTA's first segment) and never waits for a lower CTA; the grid
// is at most the CTA slots of the device. With fewer units than CTAs some shares are empty: those
// CTAs hold no tail, and a head does not wait for them.
//
// Workspace (GroupedGemmArgs::workspace): per CTA slot and consumer warpgroup, kAccum floats per
// thread as float4 (slot, cw, i4, thread), then one int flag per (slot, cw).
#pragma once

#include <cstdint>

#include <cutlass/cutlass.h>

namespace nvfp4moe::gemm::streamk {

constexpr int kAccum = 8;  // the N16 tile's accumulator floats per consumer thread
constexpr int64_t kPartialBytesPerSlot = 2 * 128 * kAccum * 4;
constexpr int64_t kFlagBytesPerSlot = 2 * 4;

CUTLASS_HOST_DEVICE int64_t workspace_bytes(int64_t slots) {
  return slots <= 0 ? 0 : (slots * (kPartialBytesPerSlot + kFlagBytesPerSlot) + 255) / 256 * 256;
}

// One piece of a CTA's share: K stages [kc_begin, kc_end) of `tile`.
struct Segment {
  int tile;
  int kc_begin;
  int kc_end;
};

// The first unit of CTA `cta`'s share.
CUTLASS_DEVICE int64_t share_begin(int cta, int ctas, int64_t units) { return units * cta / ctas; }

// CTA `cta` of `ctas`: its units in order, as segments.
struct Walk {
  int64_t u;
  int64_t u_end;
  int stages;

  CUTLASS_DEVICE Walk(int cta, int ctas, int tiles, int stages_) : stages(stages_) {
    const int64_t units = int64_t(tiles) * stages_;
    u = share_begin(cta, ctas, units);
    u_end = share_begin(cta + 1, ctas, units);
  }
  CUTLASS_DEVICE bool next(Segment& s) {
    if (u >= u_end) return false;
    s.tile = int(u / stages);
    s.kc_begin = int(u - int64_t(s.tile) * stages);
    s.kc_end = int(min(int64_t(stages), s.kc_begin + (u_end - u)));
    u += s.kc_end - s.kc_begin;
    return true;
  }
  // After next(): whether another segment follows (every later segment starts a tile).
  CUTLASS_DEVICE bool more() const { return u < u_end; }
};

// The CTA whose share holds unit `unit` (the largest c with c U / G <= unit).
CUTLASS_DEVICE int owner(int64_t unit, int ctas, int64_t units) { return int(((unit + 1) * ctas - 1) / units); }

CUTLASS_DEVICE float4* partial(void* ws, int slot, int cw) {
  return reinterpret_cast<float4*>(ws) + (int64_t(slot) * 2 + cw) * (kAccum / 4) * 128;
}
CUTLASS_DEVICE int* flag(void* ws, int slots, int slot, int cw) {
  return reinterpret_cast<int*>(reinterpret_cast<char*>(ws) + int64_t(slots) * kPartialBytesPerSlot) + slot * 2 + cw;
}

CUTLASS_DEVICE int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
CUTLASS_DEVICE void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// A tail: consumer warpgroup cw (thread t of 128, named barrier `bar`) stores its partial sums in
// the CTA's slot and raises the slot's flag.
template <class Accum>
CUTLASS_DEVICE void store_tail(void* ws, int slots, int slot, int cw, int t, int bar, const Accum& accum) {
  static_assert(kAccum % 4 == 0, "float4 pieces");
  float4* dst = partial(ws, slot, cw);
  CUTLASS_PRAGMA_UNROLL
  for (int i4 = 0; i4 < kAccum / 4; ++i4) {
    __stcg(dst + i4 * 128 + t, make_float4(accum(4 * i4), accum(4 * i4 + 1), accum(4 * i4 + 2), accum(4 * i4 + 3)));
  }
  __threadfence();
  cutlass::arch::NamedBarrier::sync(128, bar);
  if (t == 0) store_release(flag(ws, slots, slot, cw), 1);
}

// A head of a tile whose tails are in the non-empty shares of slots [first, last] (of `units`
// units): add them to accum in K order (slot order), then clear their flags.
template <class Accum>
CUTLASS_DEVICE void add_tails(void* ws, int slots, int64_t units, int first, int last, int cw, int t, int bar,
                              Accum& accum) {
  for (int s = first; s <= last; ++s) {
    if (share_begin(s, slots, units) == share_begin(s + 1, slots, units)) continue;  // an empty share
    const int* f = flag(ws, slots, s, cw);
    // Warp-uniform exit: with a per-thread exit ptxas keeps the pipeline state of the mainloop in
    // vector registers (a move to a uniform register per wgmma descriptor: 40 more instructions
    // per stage, SASS 2026-12-02).
    while (!__all_sync(0xFFFFFFFFu, load_acquire(f) != 0)) {
      __nanosleep(64);
    }
    const float4* src = partial(ws, s, cw);
    CUTLASS_PRAGMA_UNROLL
    for (int i4 = 0; i4 < kAccum / 4; ++i4) {
      const float4 v = __ldcg(src + i4 * 128 + t);
      accum(4 * i4) += v.x;
      accum(4 * i4 + 1) += v.y;
      accum(4 * i4 + 2) += v.z;
      accum(4 * i4 + 3) += v.w;
    }
  }
  // Every thread has seen every flag raised: clear them for the next launch (an empty share's flag
  // is 0 already). The loop's trip count is the same for every thread (see the wait above).
  cutlass::arch::NamedBarrier::sync(128, bar);
  for (int s0 = first; s0 <= last; s0 += 128) {
    if (s0 + t <= last) *flag(ws, slots, s0 + t, cw) = 0;
  }
}

}  // namespace nvfp4moe::gemm::streamk

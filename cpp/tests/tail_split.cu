// GPU-free: the 128x256 tile's tail split covers every row once. For each NVFP4MOE_TAIL_TILES
// setting, tail_split_plan's launches (grouped_gemm.cu runs the same plan), each through the
// kernels' own expert_rows (gemm_scheduler.cuh, compiled here for the host), must between them
// cover every row of every expert exactly once and nothing outside its rows, with each tail in one
// tile of its launch's tile and the head's last tile either whole or longer than any tail tile
// takes; in both row layouts (offsets, and the pre-dispatched stride and counts) and with
// malformed offsets (clamped spans). The GPU test tail_split_gives_the_unsplit_bits checks the
// bits; this one checks what it cannot see: that no row is computed twice or by the wrong launch.
#include "gemm_scheduler.cuh"

#include <cstdio>
#include <cstdlib>
#include <vector>

using namespace nvfp4moe::gemm;

namespace {

int failures = 0;
#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      if (++failures <= 20) {                                   \
        std::fprintf(stderr, "tail_split: %s:%d: ", __FILE__, __LINE__); \
        std::fprintf(stderr, __VA_ARGS__);                      \
        std::fputc('\n', stderr);                               \
      }                                                         \
    }                                                           \
  } while (0)

int2 launch_rows(const Params& p, int block_n, int e) {
  switch (block_n) {
    case 32: return expert_rows<32>(p, e);
    case 64: return expert_rows<64>(p, e);
    case 128: return expert_rows<128>(p, e);
    default: return expert_rows<256>(p, e);
  }
}

// The plan's launches over p's experts: every row of each expert's span once, and (well-formed
// rows only) every row of [0, total_rows) at most once over all experts.
void check_cover(const char* setting, const TailTiles& t, Params p, bool disjoint_experts) {
  TailLaunch plan[kMaxTailLaunches];
  const int launches = tail_split_plan(t, plan);
  std::vector<int> cover(size_t(p.total_rows), 0);
  for (int e = 0; e < p.experts; ++e) {
    const int2 span = expert_span(p, e);
    const int rows = span.y - span.x, rem = rows % kTailBlock;
    std::vector<int> mine(size_t(rows), 0);
    for (int i = 0; i < launches; ++i) {
      p.row_part = plan[i].row_part;
      p.tail_lo = plan[i].tail_lo;
      p.tail_hi = plan[i].tail_hi;
      const int2 rr = launch_rows(p, plan[i].block_n, e);
      if (rr.y <= rr.x) continue;
      CHECK(rr.x >= span.x && rr.y <= span.y, "%s: launch %d, expert %d: rows [%d, %d) outside [%d, %d)", setting, i,
            e, rr.x, rr.y, span.x, span.y);
      if (plan[i].row_part == kTailRows) {
        CHECK(rr.y == span.y && rr.y - rr.x == rem && rem <= plan[i].block_n,
              "%s: tail launch %d (N%d), expert %d of %d rows: rows [%d, %d)", setting, i, plan[i].block_n, e, rows,
              rr.x, rr.y);
      } else if (plan[i].row_part == kHeadRows) {
        const int last = (rr.y - rr.x) % kTailBlock;
        CHECK(rr.x == span.x && (last == 0 || last > t.most()),
              "%s: head, expert %d of %d rows: rows [%d, %d) end in a tile of %d rows", setting, e, rows, rr.x, rr.y,
              last);
      }
      for (int r = rr.x; r < rr.y; ++r) {
        if (r >= span.x && r < span.y) ++mine[size_t(r - span.x)];
        if (r >= 0 && r < p.total_rows) ++cover[size_t(r)];
      }
    }
    for (int r = 0; r < rows; ++r) {
      CHECK(mine[size_t(r)] == 1, "%s: expert %d of %d rows: row %d covered %d times", setting, e, rows, r,
            mine[size_t(r)]);
    }
  }
  if (disjoint_experts) {
    for (int r = 0; r < p.total_rows; ++r) CHECK(cover[size_t(r)] <= 1, "%s: row %d covered %d times", setting, r, cover[size_t(r)]);
  }
}

}  // namespace

int main() {
  struct Setting {
    const char* value;
    TailTiles expect;
    int launches;
  };
  const Setting settings[] = {
      {nullptr, {true, true, true}, 4}, {"", {true, true, true}, 4},    {"0", {false, false, false}, 1},
      {"32", {true, false, false}, 2},   {"64", {false, true, false}, 2}, {"32,64", {true, true, false}, 3},
      {"32,64,128", {true, true, true}, 4}, {"128", {false, false, true}, 2}, {"32,128", {true, false, true}, 3},
      {"64,128", {false, true, true}, 3},
      // Malformed: the default.
      {"128,32", {true, true, true}, 4}, {"32,32", {true, true, true}, 4}, {"48", {true, true, true}, 4},
      {"32,", {true, true, true}, 4}, {"32;64", {true, true, true}, 4}, {"00032", {true, true, true}, 4},
  };
  // Experts of 0 .. 1100 rows: every remainder of 256, more than four whole tiles.
  constexpr int kRowsMax = 1100;
  std::vector<int> offsets(1, 0), counts;
  for (int r = 0; r <= kRowsMax; ++r) {
    offsets.push_back(offsets.back() + r);
    counts.push_back(r);
  }
  const int experts = kRowsMax + 1;
  for (const Setting& s : settings) {
    const char* name = s.value ? s.value : "(unset)";
    const TailTiles t = parse_tail_tiles(s.value);
    CHECK(t.n32 == s.expect.n32 && t.n64 == s.expect.n64 && t.n128 == s.expect.n128, "%s: parsed as %d %d %d", name,
          t.n32, t.n64, t.n128);
    TailLaunch plan[kMaxTailLaunches];
    const int launches = tail_split_plan(t, plan);
    CHECK(launches == s.launches, "%s: %d launches, expected %d", name, launches, s.launches);
    // The head runs on the 128x256 tile with tail_lo = 0 (expert_rows<256> reads tail_hi only).
    CHECK(plan[0].block_n == kTailBlock && plan[0].tail_lo == 0, "%s: head N%d tail_lo %d", name, plan[0].block_n,
          plan[0].tail_lo);
    CHECK((launches == 1) == (plan[0].row_part == kAllRows), "%s: one launch must be kAllRows", name);
    for (int i = 1; i < launches; ++i) {
      CHECK(plan[i].row_part == kTailRows && plan[i].tail_lo < plan[i].tail_hi && plan[i].tail_hi <= plan[i].block_n &&
                plan[i].block_n < kTailBlock,
            "%s: launch %d: N%d part %d (%d, %d]", name, i, plan[i].block_n, plan[i].row_part, plan[i].tail_lo,
            plan[i].tail_hi);
    }

    Params p{};
    p.experts = experts;
    // Offsets.
    p.expert_offsets = offsets.data();
    p.total_rows = offsets.back() + 3;  // rows past offsets[E]: no launch's
    check_cover(name, t, p, true);
    // The pre-dispatched layout: expert e at e * stride, counts[e] rows.
    Params q{};
    q.experts = experts;
    q.expert_counts = counts.data();
    q.expert_stride = kRowsMax + 5;
    q.total_rows = experts * q.expert_stride;
    check_cover(name, t, q, true);
    // Malformed offsets (decreasing, negative, past total_rows): clamped spans, each still covered
    // once by its own launches.
    std::vector<int> bad = {0, 300, 100, -50, 700, 100000, 520, 520};
    Params m{};
    m.experts = int(bad.size()) - 1;
    m.expert_offsets = bad.data();
    m.total_rows = 600;
    check_cover(name, t, m, false);
    // The same launches largest tail tile first: the tails' tiles strictly descending, the same
    // rows covered.
    TailTiles tl = t;
    tl.largest_first = true;
    TailLaunch rev[kMaxTailLaunches];
    CHECK(tail_split_plan(tl, rev) == launches, "%s, largest first: launch count", name);
    CHECK(rev[0].block_n == plan[0].block_n && rev[0].row_part == plan[0].row_part && rev[0].tail_hi == plan[0].tail_hi,
          "%s, largest first: the head is not first", name);
    for (int i = 1; i < launches; ++i) {
      CHECK(rev[i].block_n == plan[launches - i].block_n && rev[i].tail_lo == plan[launches - i].tail_lo &&
                (i == 1 || rev[i].block_n < rev[i - 1].block_n),
            "%s, largest first: launch %d is N%d", name, i, rev[i].block_n);
    }
    check_cover(name, tl, p, true);
    check_cover(name, tl, q, true);
    check_cover(name, tl, m, false);
  }
  if (failures) {
    std::fprintf(stderr, "tail_split: %d failures\n", failures);
    return 1;
  }
  std::printf("tail_split: %zu settings, experts of 0-%d rows, two layouts and malformed offsets: every row once\n",
              sizeof(settings) / sizeof(settings[0]), kRowsMax);
  return 0;
}

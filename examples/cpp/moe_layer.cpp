// One NVFP4 MoE layer from C++ through the C ABI (nvfp4moe/nvfp4moe_c.h), checked against an f64
// CPU reference: random NVFP4 weights of a named preset's shape (as `nvfp4-moe check` makes them),
// random hidden states and routing, one forward, the relative Frobenius error overall and of the
// worst token against the crate's tolerance (1e-2, the BF16 intermediate), and the forward's time.
//
//   moe_layer [--preset qwen3-30b-a3b] [--tokens 16] [--experts E] [--seed 1]
//
// Exit status 0 when the errors are within the tolerance. Needs a CUDA GPU (sm_90a).
#include <nvfp4moe/nvfp4moe_c.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Preset {
  const char* name;
  int64_t experts, hidden, intermediate, top_k;
};
// ../shared/presets/moe-shapes.toml
constexpr Preset kPresets[] = {
    {"deepseek-v3", 256, 7168, 2048, 8},   {"kimi-k2", 384, 7168, 2048, 8}, {"qwen3-235b-a22b", 128, 4096, 1536, 8},
    {"qwen3-30b-a3b", 128, 2048, 768, 8},  {"mixtral-8x7b", 8, 4096, 14336, 2}, {"gpt-oss-120b", 128, 2880, 2880, 4},
};
constexpr double kTolerance = 1e-2;

#define CHECK_CUDA(call)                                                                               \
  do {                                                                                                 \
    cudaError_t e_ = (call);                                                                           \
    if (e_ != cudaSuccess) {                                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));      \
      std::exit(2);                                                                                    \
    }                                                                                                  \
  } while (0)
#define CHECK_NVFP4MOE(call)                                                                           \
  do {                                                                                                 \
    nvfp4moe_Status s_ = (call);                                                                       \
    if (s_ != 0) {                                                                                     \
      std::fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call, nvfp4moe_status_string(s_), \
                   nvfp4moe_last_error());                                                             \
      std::exit(2);                                                                                    \
    }                                                                                                  \
  } while (0)

// xorshift64*: reproducible from --seed.
struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 0x2545F4914F6CDD1Dull;
  }
  double uniform() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
};

// NVFP4 decoding (shared/design/NVFP4.md): E2M1 codes, E4M3 block scales.
double e2m1(unsigned code) {
  static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (code & 8 ? -1.0 : 1.0) * mag[code & 7];
}
double e4m3(unsigned byte) {
  const int e = (byte >> 3) & 15, m = byte & 7;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return byte & 0x80 ? -v : v;
}
uint16_t to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}
double from_bf16(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One projection [E, n, k] in checkpoint layout, random as `nvfp4-moe check` makes it: E2M1 codes,
// E4M3 block scales in 0.125..3.75 (exponent 4..8), decode scales g in [1e-3, 1e-2).
struct Projection {
  int64_t experts, n, k;
  std::vector<uint8_t> codes, scales;
  std::vector<float> g;
  // Weight (e, row, col), exactly, with decode scale `gs` (the row's: W13's up rows have their own).
  double weight(int64_t e, int64_t row, int64_t col, double gs) const {
    const int64_t r = e * n + row;
    const uint8_t byte = codes[size_t(r * (k / 2) + col / 2)];
    return e2m1(col % 2 ? byte >> 4 : byte & 15) * e4m3(scales[size_t(r * (k / 16) + col / 16)]) * gs;
  }
};
Projection random_projection(Rng& rng, int64_t experts, int64_t n, int64_t k) {
  Projection p{experts, n, k, std::vector<uint8_t>(size_t(experts * n * k / 2)),
               std::vector<uint8_t>(size_t(experts * n * k / 16)), std::vector<float>(size_t(experts))};
  for (auto& b : p.codes) b = uint8_t(rng.next() >> 56);
  for (auto& b : p.scales) b = uint8_t(((4 + rng.next() % 5) << 3) | (rng.next() % 8));
  for (auto& g : p.g) g = float(1e-3 + 9e-3 * rng.uniform());
  return p;
}

double silu(double x) { return x / (1.0 + std::exp(-x)); }

}  // namespace

int main(int argc, char** argv) {
  std::string preset_name = "qwen3-30b-a3b";
  int64_t tokens = 16, experts_override = 0;
  uint64_t seed = 1;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 == argc) {
      std::fprintf(stderr, "%s needs a value\n", flag.c_str());
      return 2;
    }
    if (flag == "--preset") preset_name = argv[i + 1];
    else if (flag == "--tokens") tokens = std::atoll(argv[i + 1]);
    else if (flag == "--experts") experts_override = std::atoll(argv[i + 1]);
    else if (flag == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 10);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const Preset* preset = nullptr;
  for (const Preset& p : kPresets) {
    if (preset_name == p.name) preset = &p;
  }
  if (!preset || tokens < 1) {
    std::fprintf(stderr, "usage: moe_layer [--preset NAME] [--tokens T >= 1] [--experts E] [--seed S]; presets:");
    for (const Preset& p : kPresets) std::fprintf(stderr, " %s", p.name);
    std::fprintf(stderr, "\n");
    return 2;
  }
  const int64_t E = experts_override > 0 ? experts_override : preset->experts, H = preset->hidden,
                I = preset->intermediate, K = preset->top_k < E ? preset->top_k : E;
  std::printf("nvfp4moe %d: %s, E = %lld, H = %lld, I = %lld, top-k = %lld, T = %lld\n", nvfp4moe_version(),
              preset->name, (long long)E, (long long)H, (long long)I, (long long)K, (long long)tokens);

  // Host data: W13 [E, 2I, H] (gate rows then up rows per expert; up decode scales twice the
  // gate's), W2 [E, H, I], hidden [T, H], top-k ids (distinct) and weights (summing to 1).
  Rng rng{seed * 0x9E3779B97F4A7C15ull + 1};
  const Projection w13 = random_projection(rng, E, 2 * I, H), w2 = random_projection(rng, E, H, I);
  std::vector<float> up_g(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) up_g[size_t(e)] = 2.0f * w13.g[size_t(e)];
  std::vector<uint16_t> hidden(size_t(tokens * H));
  for (auto& x : hidden) x = to_bf16(float(2.0 * rng.uniform() - 1.0));
  std::vector<int32_t> ids(size_t(tokens * K));
  std::vector<float> weights(size_t(tokens * K));
  for (int64_t t = 0; t < tokens; ++t) {
    float sum = 0;
    for (int64_t j = 0; j < K; ++j) {
      int32_t id;
      bool again;
      do {
        id = int32_t(rng.next() % uint64_t(E));
        again = false;
        for (int64_t i = 0; i < j; ++i) again |= ids[size_t(t * K + i)] == id;
      } while (again);
      ids[size_t(t * K + j)] = id;
      sum += weights[size_t(t * K + j)] = float(0.1 + rng.uniform());
    }
    for (int64_t j = 0; j < K; ++j) weights[size_t(t * K + j)] /= sum;
  }

  // Device: the checkpoint tensors, prepared into weights handles (then freed), a layer, its
  // workspace, the forward's buffers.
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  auto upload = [&](const void* src, size_t bytes) {
    void* d = nullptr;
    CHECK_CUDA(cudaMalloc(&d, bytes));
    CHECK_CUDA(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice));
    return d;
  };
  // A projection's checkpoint tensors uploaded, prepared into a handle, freed again. `up`: W13's
  // up rows' decode scales (gate and up: the SwiGLU epilogue's row order), null for W2.
  auto create_weights = [&](const Projection& p, const float* up) {
    void* codes = upload(p.codes.data(), p.codes.size());
    void* scales = upload(p.scales.data(), p.scales.size());
    nvfp4moe_WeightsCreateArgs a{};
    a.struct_size = sizeof a;
    a.codes = codes;
    a.scales = scales;
    a.experts = p.experts;
    a.n = p.n;
    a.k = p.k;
    a.decode_scales = p.g.data();
    a.up_decode_scales = up;
    nvfp4moe_weights* handle = nullptr;
    CHECK_NVFP4MOE(nvfp4moe_weights_create(&a, stream, &handle));  // synchronizes the stream
    CHECK_CUDA(cudaFree(codes));
    CHECK_CUDA(cudaFree(scales));
    return handle;
  };
  nvfp4moe_weights* w13_handle = create_weights(w13, up_g.data());
  nvfp4moe_weights* w2_handle = create_weights(w2, nullptr);
  nvfp4moe_layer* layer = nullptr;
  nvfp4moe_LayerCreateArgs la{};
  la.struct_size = sizeof la;
  la.w13 = w13_handle;
  la.w2 = w2_handle;
  la.options.max_tokens = tokens;
  la.options.max_top_k = K;  // the rest: tile kAuto, the BF16 intermediate, split-K allowed
  CHECK_NVFP4MOE(nvfp4moe_layer_create(&la, &layer));
  size_t ws_bytes = 0;
  CHECK_NVFP4MOE(nvfp4moe_layer_workspace_size(layer, &ws_bytes));
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&workspace, ws_bytes));
  CHECK_NVFP4MOE(nvfp4moe_layer_workspace_init(layer, workspace, ws_bytes, stream));
  void* d_hidden = upload(hidden.data(), hidden.size() * 2);
  void* d_ids = upload(ids.data(), ids.size() * 4);
  void* d_weights = upload(weights.data(), weights.size() * 4);
  void* d_out = nullptr;
  CHECK_CUDA(cudaMalloc(&d_out, size_t(tokens * H * 2)));
  CHECK_CUDA(cudaMemset(d_out, 0xFF, size_t(tokens * H * 2)));  // poison: every element must be written

  nvfp4moe_ForwardArgs f{};
  f.struct_size = sizeof f;
  f.args.hidden = d_hidden;
  f.args.tokens = tokens;
  f.args.top_k = K;
  f.args.topk_ids = static_cast<const int*>(d_ids);
  f.args.topk_weights = static_cast<const float*>(d_weights);
  f.args.out = d_out;
  f.args.workspace = workspace;
  f.args.workspace_bytes = int64_t(ws_bytes);
  CHECK_NVFP4MOE(nvfp4moe_layer_forward(layer, &f, stream));
  std::vector<uint16_t> out(size_t(tokens * H));
  CHECK_CUDA(cudaMemcpyAsync(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost, stream));
  int32_t found = 0, bad_id = 0;
  int64_t bad_token = 0, bad_slot = 0;
  CHECK_NVFP4MOE(nvfp4moe_layer_check(layer, workspace, ws_bytes, K, stream, &found, &bad_token, &bad_slot, &bad_id));
  if (found) {
    std::fprintf(stderr, "unexpected bad expert id %d at token %lld slot %lld\n", bad_id, (long long)bad_token,
                 (long long)bad_slot);
    return 1;
  }

  // Time: the mean of 50 forwards (weights hot in L2 where they fit: not the bench's measure).
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  constexpr int kIters = 50;
  CHECK_CUDA(cudaEventRecord(start, stream));
  for (int i = 0; i < kIters; ++i) CHECK_NVFP4MOE(nvfp4moe_layer_forward(layer, &f, stream));
  CHECK_CUDA(cudaEventRecord(stop, stream));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));

  // The host's cost of a forward through the C ABI: CPU time per nvfp4moe_layer_forward with the
  // GPU kept busy (as examples/host_cost.rs measures the Rust layer): rounds of 24 calls back to
  // back, the median of each round's calls after the first 4, the median of 20 rounds.
  std::vector<double> rounds;
  for (int r = 0; r < 20; ++r) {
    std::vector<double> calls;
    for (int i = 0; i < 24; ++i) {
      const auto c0 = std::chrono::steady_clock::now();
      CHECK_NVFP4MOE(nvfp4moe_layer_forward(layer, &f, stream));
      calls.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - c0).count());
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::sort(calls.begin() + 4, calls.end());
    rounds.push_back(calls[4 + (calls.size() - 4) / 2]);
  }
  std::sort(rounds.begin(), rounds.end());
  const double host_us = rounds[rounds.size() / 2];

  // The f64 reference: y_e(x) = W2_e (silu(gate_e x) * up_e x), out = sum_j w_j y_{id_j}(x).
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<double> want(static_cast<size_t>(tokens * H), 0.0), act(static_cast<size_t>(I));
  for (int64_t t = 0; t < tokens; ++t) {
    const uint16_t* x = &hidden[size_t(t * H)];
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = ids[size_t(t * K + j)];
      const double g = w13.g[size_t(e)], gu = up_g[size_t(e)], g2 = w2.g[size_t(e)];
      for (int64_t i = 0; i < I; ++i) {
        double gate = 0, up = 0;
        for (int64_t h = 0; h < H; ++h) {
          const double xv = from_bf16(x[h]);
          gate += xv * w13.weight(e, i, h, g);
          up += xv * w13.weight(e, I + i, h, gu);
        }
        act[size_t(i)] = silu(gate) * up;
      }
      for (int64_t h = 0; h < H; ++h) {
        double y = 0;
        for (int64_t i = 0; i < I; ++i) y += act[size_t(i)] * w2.weight(e, h, i, g2);
        want[size_t(t * H + h)] += double(weights[size_t(t * K + j)]) * y;
      }
    }
  }
  const double ref_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // Relative Frobenius errors, overall and per token (a NaN, or an unwritten 0xFFFF, fails).
  double num = 0, den = 0, worst = 0;
  int64_t worst_t = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    double n = 0, d = 0;
    for (int64_t h = 0; h < H; ++h) {
      const double got = from_bf16(out[size_t(t * H + h)]), w = want[size_t(t * H + h)];
      n += (got - w) * (got - w);
      d += w * w;
    }
    num += n;
    den += d;
    const double err = d > 0 ? std::sqrt(n / d) : (n > 0 ? INFINITY : 0);
    if (!(err <= worst)) {
      worst = err;
      worst_t = t;
    }
  }
  const double overall = den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0);
  const bool passed = overall <= kTolerance && worst <= kTolerance;
  std::printf("relative Frobenius error: overall %.3e, worst token %lld: %.3e (tolerance %.0e): %s\n", overall,
              (long long)worst_t, worst, kTolerance, passed ? "passed" : "FAILED");
  std::printf("forward: %.1f us (mean of %d, %lld tokens); host cost of nvfp4moe_layer_forward: %.2f us per call "
              "(median of 20 rounds of 20 calls); reference: %.1f s\n",
              1000.0 * ms / kIters, kIters, (long long)tokens, host_us, ref_s);

  CHECK_NVFP4MOE(nvfp4moe_layer_destroy(layer));
  CHECK_NVFP4MOE(nvfp4moe_weights_destroy(w13_handle));
  CHECK_NVFP4MOE(nvfp4moe_weights_destroy(w2_handle));
  for (void* p : {workspace, d_hidden, d_ids, d_weights, d_out}) CHECK_CUDA(cudaFree(p));
  CHECK_CUDA(cudaStreamDestroy(stream));
  return passed ? 0 : 1;
}

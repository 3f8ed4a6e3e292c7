// Issue 22's first measurement: the tensor pipe's BF16 rate with the A operand from shared memory
// (SS) against registers (RS, as the NVFP4 GEMM issues it: A is the converted weights), at the
// prefill tile's shape (two or three consumer warpgroups of m64 x N x k16 wgmmas, N = 128 or 256),
// with nothing but the MMAs, and RS with its A fragment made again for every 64-K stage (ALU work
// standing in for the E2M1/E4M3 -> BF16 conversion, double-buffered as the pipelined consumer
// does: the next stage's fragment is made while this stage's wgmmas run). One CTA per SM; every
// operand stays in shared memory or registers (no global loads), so the rates are the MMA issue
// path's alone. Prints TFLOP/s per case (median of 5 launches; compare with `torch.matmul` 8192^3
// in the same call, as gpu-bundle/run.sh measures it). The loops follow gemm_mainloop.cuh's
// pipelined consumer (the next fragment made, its group issued, then the wait for at most one
// group; the fragment registers pinned around the wgmmas): ptxas serializes none of them (no
// C7513), as it serializes none of the N128 kernel's (`-Xptxas -v`, CUDA 13.0, 2026-12-06).
//
// Build and run on the GPU machine (the CUTLASS headers from gpu-cpp/cutlass.tgz, or here with
// third_party/cutlass and the binary carried):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I<cutlass>/include \
//     scripts/wgmma-probe.cu -o wgmma-probe && ./wgmma-probe
// (scripts/gpu-wgmma-probe.sh does both on the GPU machine.)
#include <cute/atom/mma_atom.hpp>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace wgmma_probe {  // (named: an anonymous one is ambiguous with CuTe's in nvcc's host stubs)

using namespace cute;
namespace GMMA = cute::SM90::GMMA;

// kRSConvert makes the next stage's fragment while the previous stage's wgmmas run (the pipelined
// consumer's overlap); kRSConvertAfter makes it after waiting for them (no overlap).
enum class Mode { kSS, kRS, kRSConvert, kRSConvertAfter };

// A K-major, 128-byte-swizzled shared-memory operand descriptor: rows of 64 BF16 (128 bytes), 8-row
// groups 1024 bytes apart; `addr` is the operand's shared-memory byte address (1024-aligned).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  GmmaDescriptor d;
  d.desc_ = 0;
  d.bitfield.start_address_ = uint16_t(addr >> 4);
  d.bitfield.leading_byte_offset_ = 1;       // (unused for swizzled K-major)
  d.bitfield.stride_byte_offset_ = 1024 >> 4;  // 8 rows x 128 bytes
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = uint8_t(GMMA::LayoutType::B128);
  return d.desc_;
}

template <int N>
struct Ops;
template <>
struct Ops<128> {
  using SS = SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
  using RS = SM90_64x128x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
};
template <>
struct Ops<256> {
  using SS = SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
  using RS = SM90_64x256x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
};

template <class Op, size_t... I>
__device__ __forceinline__ void ss(uint64_t da, uint64_t db, float (&c)[sizeof...(I)], std::index_sequence<I...>) {
  Op::fma(da, db, c[I]..., GMMA::ScaleOut::One);
}
template <class Op, size_t... I>
__device__ __forceinline__ void rs(const uint32_t (&a)[4], uint64_t db, float (&c)[sizeof...(I)],
                                   std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], db, c[I]..., GMMA::ScaleOut::One);
}

// Stand-in for a stage's conversion of one thread's weights into its A fragment (4 registers of a
// k16 fragment, 4 per 64-K stage): per register a few byte permutes, logic ops and a bf16x2
// multiply, depending on the previous fragment so that nothing is hoisted.
template <int kOps>
__device__ __forceinline__ void convert(uint32_t (&next)[4][4], const uint32_t (&prev)[4][4], uint32_t salt) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      uint32_t v = prev[k][r] ^ salt;
#pragma unroll
      for (int o = 0; o < kOps; ++o) v = __byte_perm(v, v >> 4, 0x5140) ^ (v << 3);
      __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&v);
      h = __hmul2(h, __float2bfloat162_rn(1.0f));
      next[k][r] = *reinterpret_cast<uint32_t*>(&h) & 0x3F7F3F7Fu;  // finite BF16 pairs
    }
  }
}

// kWG consumer warpgroups, each `iters` stages of four m64 x N x k16 wgmmas (one 64-K stage) into
// its own accumulator, one stage in flight behind the one being issued.
template <Mode kMode, int N, int kWG, int kOps>
__global__ void __launch_bounds__(128 * kWG, 1) probe(int iters, float* out) {
  using OpSS = typename Ops<N>::SS;
  using OpRS = typename Ops<N>::RS;
  constexpr int kAcc = N / 2;  // 64 x N floats over 128 threads
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // (The swizzled operands need 1024-byte alignment: the base rounded up within the launch's pad.)
  uint8_t* smem = smem_raw + ((1024 - (__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);
  // (A: kWG x 64 rows x 64 K; B: N rows x 64 K; BF16, 128-byte rows.) Filled with small finite values.
  const int a_bytes = kWG * 64 * 128, b_bytes = N * 128;
  for (int i = threadIdx.x * 4; i < a_bytes + b_bytes; i += blockDim.x * 4) {
    *reinterpret_cast<uint32_t*>(smem + i) = 0x3C003C00u ^ (i & 0x00070007u);
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  const uint32_t base = uint32_t(__cvta_generic_to_shared(smem));
  const uint64_t da = sw128_desc(base + wg * 64 * 128), db = sw128_desc(base + a_bytes);
  float c[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) c[i] = 0.f;
  uint32_t frag[2][4][4];  // (buffer, k16, register)
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int r = 0; r < 4; ++r) frag[0][k][r] = frag[1][k][r] = 0x3C003C00u + threadIdx.x + k + r;
  auto fence = [&] {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) warpgroup_fence_operand(c[i]);
  };
  // As the NVFP4 consumer does (gemm_mainloop.cuh's fence_a): the fragment's registers pinned
  // around the asynchronous wgmmas that read them.
  auto fence_a = [](uint32_t (&a)[4][4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[k][r])::"memory");
  };
  auto stage = [&](uint32_t (&a)[4][4]) {
    fence_a(a);
    fence();
    warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      // k16 step: 32 bytes along the swizzled row (+2 in the descriptor's 16-byte address units).
      if constexpr (kMode == Mode::kSS) {
        ss<OpSS>(da + 2 * k, db + 2 * k, c, std::make_index_sequence<kAcc>{});
      } else {
        rs<OpRS>(a[k], db + 2 * k, c, std::make_index_sequence<kAcc>{});
      }
    }
    warpgroup_commit_batch();
    fence();
  };
  if constexpr (kMode == Mode::kRSConvertAfter) {
#pragma unroll 1
    for (int it = 0; it < iters; it += 2) {
      stage(frag[0]);
      warpgroup_wait<0>();
      fence_a(frag[0]);
      convert<kOps>(frag[1], frag[0], uint32_t(it));
      stage(frag[1]);
      warpgroup_wait<0>();
      fence_a(frag[1]);
      convert<kOps>(frag[0], frag[1], uint32_t(it + 1));
    }
  } else {
#pragma unroll 1
  for (int it = 0; it < iters; it += 2) {
    if constexpr (kMode == Mode::kRSConvert) convert<kOps>(frag[1], frag[0], uint32_t(it));
    stage(frag[1]);
    warpgroup_wait<1>();
    fence_a(frag[0]);
    if constexpr (kMode == Mode::kRSConvert) convert<kOps>(frag[0], frag[1], uint32_t(it + 1));
    stage(frag[0]);
    warpgroup_wait<1>();
    fence_a(frag[1]);
  }
  }
  warpgroup_wait<0>();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) s += c[i];
  if (s == 12345.f) out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // (keeps the MMAs live)
}

template <Mode kMode, int N, int kWG, int kOps = 0>
void run(const char* name, int sms, float* out) {
  auto k = probe<kMode, N, kWG, kOps>;
  // Operands + alignment pad, raised to 120 KB so that two CTAs cannot share an SM (228 KB): one
  // CTA per SM, as the prefill tile runs.
  const int smem = std::max(kWG * 64 * 128 + N * 128 + 1024, 120 * 1024);
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int iters = 4096;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  k<<<sms, 128 * kWG, smem>>>(64, out);  // warm-up
  std::vector<float> ms;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(a);
    k<<<sms, 128 * kWG, smem>>>(iters, out);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float t = 0.f;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaError_t e = cudaGetLastError();
  std::sort(ms.begin(), ms.end());
  const double flops = 2.0 * 64 * N * 16 * 4 * double(iters) * kWG * sms;
  std::printf("%-34s %8.1f TFLOP/s  (%.3f ms)%s%s\n", name, flops / (ms[2] * 1e-3) / 1e12, ms[2],
              e == cudaSuccess ? "" : "  error: ", e == cudaSuccess ? "" : cudaGetErrorString(e));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

}  // namespace wgmma_probe

int main() {
  using namespace wgmma_probe;
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, dev);
  std::printf("%s, %d SMs; one CTA per SM (120 KB of shared memory each), 4096 stages of 4 m64xNxk16 BF16 "
              "wgmmas per warpgroup\n", prop.name, sms);
  float* out = nullptr;
  cudaMalloc(&out, size_t(sms) * 384 * sizeof(float));
  run<Mode::kSS, 128, 2>("SS  N128, 2 consumer WGs", sms, out);
  run<Mode::kRS, 128, 2>("RS  N128, 2 consumer WGs", sms, out);
  run<Mode::kRSConvert, 128, 2, 2>("RS+convert(2) N128, 2 WGs", sms, out);
  run<Mode::kRSConvert, 128, 2, 6>("RS+convert(6) N128, 2 WGs", sms, out);
  run<Mode::kRSConvertAfter, 128, 2, 2>("RS, convert(2) after wait, N128", sms, out);
  run<Mode::kSS, 256, 2>("SS  N256, 2 consumer WGs", sms, out);
  run<Mode::kRS, 256, 2>("RS  N256, 2 consumer WGs", sms, out);
  run<Mode::kRSConvert, 256, 2, 2>("RS+convert(2) N256, 2 WGs", sms, out);
  run<Mode::kSS, 128, 3>("SS  N128, 3 consumer WGs", sms, out);
  run<Mode::kRS, 128, 3>("RS  N128, 3 consumer WGs", sms, out);
  cudaFree(out);
  return 0;
}

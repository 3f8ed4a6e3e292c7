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
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I<cutlass>/include -Icpp/src \
//     scripts/wgmma-probe.cu -o wgmma-probe && ./wgmma-probe
// (scripts/gpu-wgmma-probe.sh does both on the GPU machine.)
//
// Session 29 added the cases that decide between the two places a conversion can live, both with
// the kernels' real conversion (nvfp4_weights.cuh's decode_kblock on code and scale words read
// from shared memory, as the mainloop reads a stage's chunk):
// - kRSReal: the consumers convert the next stage's A fragment in registers while the previous
//   stage's wgmmas run (the shipped pipelined mainloop);
// - kSSConverter: kCWG converter warpgroups decode each stage's weights into a BF16 A operand in
//   shared memory (128-byte swizzle, 16-byte stores, the layout wgmma reads), fence it for the
//   async proxy and arrive on the buffer's full barrier; the consumers issue shared-memory-sourced
//   wgmmas from it and free it (its empty barrier) once the group that read it retired. kBuf
//   buffers in a ring.
// N = 64 too (the 128x64 tail tile's width), and two CTAs per SM (as the 128x32 / 128x64 tiles run).
// Needs -I cpp/src (the real conversion).
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/barrier.h>

#include "nvfp4_weights.cuh"

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
enum class Mode { kSS, kRS, kRSConvert, kRSConvertAfter, kRSReal, kSSConverter };

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
struct Ops<64> {
  using SS = SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
  using RS = SM90_64x64x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
};
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

// An mbarrier phase wait as a C++ loop around try_wait (so that the loop is visible to ptxas; with
// it alone the consumers' wgmmas were still serialized, C7514, until their first stage was peeled
// off the loop, below).
__device__ __forceinline__ void wait_phase(uint64_t* bar, uint32_t phase) {
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(bar));
  uint32_t ok = 0;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(ok)
        : "r"(addr), "r"(phase)
        : "memory");
  } while (!ok);
}

// Shared memory of one CTA (byte offsets from the 1024-aligned base): A (kWG x 64 rows x 64 K, or
// kBuf such buffers for kSSConverter), B (N rows x 64 K), the code chunks the real conversion reads
// (kCodeStages x kWG chunks of 64 features x 64 K as prepared, 2304 bytes each; stages cycle over
// them), the barriers.
constexpr int kCodeStages = 4;
template <Mode kMode, int N, int kWG, int kBuf>
struct Smem {
  static constexpr int kABytes = (kMode == Mode::kSSConverter ? kBuf : 1) * kWG * 64 * 128;
  static constexpr int kBOff = kABytes;
  static constexpr int kCodesOff = kBOff + N * 128;
  static constexpr int kBarOff = kCodesOff + kCodeStages * kWG * nvfp4moe::weights::kChunkBytes;
  static constexpr int kBytes = kBarOff + 2 * kBuf * 8;
};

// kWG consumer warpgroups, each `iters` stages of four m64 x N x k16 wgmmas (one 64-K stage) into
// its own accumulator, one stage in flight behind the one being issued; kSSConverter adds kCWG
// converter warpgroups (threads [128 kWG, 128 (kWG + kCWG))).
template <Mode kMode, int N, int kWG, int kOps, int kCWG, int kBuf, int kCtas>
__global__ void __launch_bounds__(128 * (kWG + kCWG), kCtas) probe(int iters, float* out) {
  using OpSS = typename Ops<N>::SS;
  using OpRS = typename Ops<N>::RS;
  using L = Smem<kMode, N, kWG, kBuf>;
  namespace W = nvfp4moe::weights;
  constexpr int kAcc = N / 2;  // 64 x N floats over 128 threads
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // (The swizzled operands need 1024-byte alignment: the base rounded up within the launch's pad.)
  uint8_t* smem = smem_raw + ((1024 - (__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);
  // Operands and codes: small finite BF16 values (A, B); codes and scale bytes that decode to
  // finite values (scale bytes below 0x70: BF16 exponents well inside the range).
  for (int i = threadIdx.x * 4; i < L::kBarOff; i += blockDim.x * 4) {
    *reinterpret_cast<uint32_t*>(smem + i) =
        i < L::kCodesOff ? 0x3C003C00u ^ (i & 0x00070007u) : (0x9E3779B9u * uint32_t(i)) & 0x6F6F6F6Fu;
  }
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty = full + kBuf;
  if (kMode == Mode::kSSConverter && threadIdx.x == 0) {
    for (int b = 0; b < kBuf; ++b) {
      cutlass::arch::ClusterBarrier::init(&full[b], 128 * kCWG);
      cutlass::arch::ClusterBarrier::init(&empty[b], 128 * kWG);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const uint32_t base = uint32_t(__cvta_generic_to_shared(smem));
  const uint8_t* codes = smem + L::kCodesOff;

  if constexpr (kMode == Mode::kSSConverter) {
    if (wg >= kWG) {
      // Converter: per stage the kWG x 512 16-byte chunks of the A buffer, in groups of four chunks
      // (one code word each, the words of a group read as one uint4, its scales as one uint2).
      const int ct = threadIdx.x - 128 * kWG;  // 0 .. 128 kCWG - 1
      constexpr int kGroups = kWG * 512 / 4 / (128 * kCWG);
      static_assert(kGroups * 4 * 128 * kCWG == kWG * 512, "whole groups per converter thread");
#pragma unroll 1
      for (int it = 0; it < iters; ++it) {
        const int buf = it % kBuf;
        if (it >= kBuf) wait_phase(&empty[buf], ((it / kBuf) - 1) & 1);
        uint8_t* a = smem + buf * (kWG * 64 * 128);
        const uint8_t* cs = codes + (it % kCodeStages) * kWG * W::kChunkBytes;
#pragma unroll
        for (int j = 0; j < kGroups; ++j) {
          const int g4 = ct + 128 * kCWG * j;        // group: chunks 4 g4 .. 4 g4 + 3
          const int chunk = g4 / 128, tt = g4 % 128;  // (the prepared chunk and thread slot it reads)
          const uint4 cw = reinterpret_cast<const uint4*>(cs + chunk * W::kChunkBytes)[tt];
          const uint2 sc = *reinterpret_cast<const uint2*>(cs + chunk * W::kChunkBytes + W::kChunkCodeBytes +
                                                           (tt % 64) * 8);
          const uint32_t w4[4] = {cw.x, cw.y, cw.z, cw.w};
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            uint32_t v[4];
            W::decode_kblock(w4[u], sc, u, v);
            const int q = 4 * g4 + u, r = q / 8, cc = q % 8;
            *reinterpret_cast<uint4*>(a + r * 128 + ((cc ^ (r & 7)) * 16)) = make_uint4(v[0], v[1], v[2], v[3]);
          }
        }
        cutlass::arch::fence_view_async_shared();  // the generic-proxy stores, before wgmma reads them
        cutlass::arch::ClusterBarrier::arrive(&full[buf]);
      }
      return;
    }
  }

  const uint64_t da = sw128_desc(base + wg * 64 * 128), db = sw128_desc(base + L::kBOff);
  float c[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) c[i] = 0.f;
  uint32_t frag[2][4][4];  // (buffer, k16, register)
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int r = 0; r < 4; ++r) frag[0][k][r] = frag[1][k][r] = 0x3C003C00u + threadIdx.x + k + r;
  auto fence = [&]() __attribute__((always_inline)) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) warpgroup_fence_operand(c[i]);
  };
  // As the NVFP4 consumer does (gemm_mainloop.cuh's fence_a): the fragment's registers pinned
  // around the asynchronous wgmmas that read them.
  auto fence_a = [](uint32_t (&a)[4][4]) __attribute__((always_inline)) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[k][r])::"memory");
  };
  // The real conversion of stage `it`'s chunk for this warpgroup (gemm_mainloop.cuh's
  // convert_chunk: one uint4 of codes, one uint2 of scales, four k-blocks).
  auto convert_real = [&](uint32_t (&a)[4][4], int it) __attribute__((always_inline)) {
    const uint8_t* ch = codes + ((it % kCodeStages) * kWG + wg) * W::kChunkBytes;
    const uint4 cw = reinterpret_cast<const uint4*>(ch)[t];
    const uint2 sc = *reinterpret_cast<const uint2*>(ch + W::kChunkCodeBytes + ((t / 32) * 8 + (t % 32) / 4) * 8);
    const uint32_t w4[4] = {cw.x, cw.y, cw.z, cw.w};
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) W::decode_kblock(w4[kb], sc, kb, a[kb]);
  };
  auto stage = [&](uint32_t (&a)[4][4], uint64_t da_s) __attribute__((always_inline)) {
    fence_a(a);
    fence();
    warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      // k16 step: 32 bytes along the swizzled row (+2 in the descriptor's 16-byte address units).
      if constexpr (kMode == Mode::kSS || kMode == Mode::kSSConverter) {
        ss<OpSS>(da_s + 2 * k, db + 2 * k, c, std::make_index_sequence<kAcc>{});
      } else {
        rs<OpRS>(a[k], db + 2 * k, c, std::make_index_sequence<kAcc>{});
      }
    }
    warpgroup_commit_batch();
    fence();
  };
  if constexpr (kMode == Mode::kSSConverter) {
    // (The buffer's descriptor: 16-byte units, kWG x 8 KB per buffer. The first stage is peeled
    // off: it frees no buffer, and with an `if (it > 0)` around the free inside the loop ptxas
    // serialized every wgmma, C7514.)
    wait_phase(&full[0], 0);
    stage(frag[0], da);
#pragma unroll 1
    for (int it = 1; it < iters; ++it) {
      const int buf = it % kBuf;
      wait_phase(&full[buf], (it / kBuf) & 1);
      stage(frag[0], da + uint64_t((buf * kWG * 64 * 128) >> 4));
      warpgroup_wait<1>();
      cutlass::arch::ClusterBarrier::arrive(&empty[(it - 1) % kBuf]);
    }
  } else if constexpr (kMode == Mode::kRSConvertAfter) {
#pragma unroll 1
    for (int it = 0; it < iters; it += 2) {
      stage(frag[0], da);
      warpgroup_wait<0>();
      fence_a(frag[0]);
      convert<kOps>(frag[1], frag[0], uint32_t(it));
      stage(frag[1], da);
      warpgroup_wait<0>();
      fence_a(frag[1]);
      convert<kOps>(frag[0], frag[1], uint32_t(it + 1));
    }
  } else {
#pragma unroll 1
    for (int it = 0; it < iters; it += 2) {
      if constexpr (kMode == Mode::kRSConvert) convert<kOps>(frag[1], frag[0], uint32_t(it));
      if constexpr (kMode == Mode::kRSReal) convert_real(frag[1], it + 1);
      stage(frag[1], da);
      warpgroup_wait<1>();
      fence_a(frag[0]);
      if constexpr (kMode == Mode::kRSConvert) convert<kOps>(frag[0], frag[1], uint32_t(it + 1));
      if constexpr (kMode == Mode::kRSReal) convert_real(frag[0], it + 2);
      stage(frag[0], da);
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

template <Mode kMode, int N, int kWG, int kOps = 0, int kCWG = 0, int kBuf = 1, int kCtas = 1>
void run(const char* name, int sms, float* out) {
  auto k = probe<kMode, N, kWG, kOps, kCWG, kBuf, kCtas>;
  using L = Smem<kMode, N, kWG, kBuf>;
  // Operands + alignment pad; one CTA per SM: raised to 120 KB so that two cannot share an SM (228
  // KB), as the prefill tile runs; two: at most 113 KB each.
  const int smem = std::max(L::kBytes + 1024, kCtas == 1 ? 120 * 1024 : 0);
  if (kCtas == 2 && smem > 113 * 1024) {
    std::printf("%-40s skipped: %d bytes of shared memory do not fit two CTAs per SM\n", name, smem);
    return;
  }
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int iters = 4096, ctas = sms * kCtas, threads = 128 * (kWG + kCWG);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  k<<<ctas, threads, smem>>>(64, out);  // warm-up
  std::vector<float> ms;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(a);
    k<<<ctas, threads, smem>>>(iters, out);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float t = 0.f;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaError_t e = cudaGetLastError();
  std::sort(ms.begin(), ms.end());
  const double flops = 2.0 * 64 * N * 16 * 4 * double(iters) * kWG * ctas;
  // Weights converted per second (kRSReal, kSSConverter): 64 x 64 per warpgroup and stage.
  const double gw = 64.0 * 64 * double(iters) * kWG * ctas / (ms[2] * 1e-3) / 1e9;
  std::printf("%-40s %8.1f TFLOP/s  (%.3f ms, %.0f G weights/s)%s%s\n", name, flops / (ms[2] * 1e-3) / 1e12, ms[2],
              gw, e == cudaSuccess ? "" : "  error: ", e == cudaSuccess ? "" : cudaGetErrorString(e));
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
  std::printf("%s, %d SMs; 4096 stages of 4 m64xNxk16 BF16 wgmmas per consumer warpgroup; one CTA per SM "
              "(120 KB of shared memory) unless \"2 CTAs\"\n", prop.name, sms);
  float* out = nullptr;
  cudaMalloc(&out, size_t(sms) * 2 * 640 * sizeof(float));
  // Session 20's cases.
  run<Mode::kSS, 128, 2>("SS  N128, 2 consumer WGs", sms, out);
  run<Mode::kRS, 128, 2>("RS  N128, 2 consumer WGs", sms, out);
  run<Mode::kRSConvert, 128, 2, 2>("RS+convert(2) N128, 2 WGs", sms, out);
  run<Mode::kRSConvertAfter, 128, 2, 2>("RS, convert(2) after wait, N128", sms, out);
  run<Mode::kSS, 256, 2>("SS  N256, 2 consumer WGs", sms, out);
  run<Mode::kRS, 256, 2>("RS  N256, 2 consumer WGs", sms, out);
  run<Mode::kRSConvert, 256, 2, 2>("RS+convert(2) N256, 2 WGs", sms, out);
  // Session 29: the real conversion in registers (RSReal) against a converter warpgroup writing
  // the A operand to shared memory (SSConv: converter WGs, buffers).
  run<Mode::kSS, 64, 2>("SS  N64, 2 WGs", sms, out);
  run<Mode::kRS, 64, 2>("RS  N64, 2 WGs", sms, out);
  run<Mode::kRSReal, 64, 2>("RSReal N64, 2 WGs", sms, out);
  run<Mode::kRSReal, 64, 2, 0, 0, 1, 2>("RSReal N64, 2 WGs, 2 CTAs", sms, out);
  run<Mode::kSSConverter, 64, 2, 0, 1, 4>("SSConv N64, 2 WGs, 1 conv WG, 4 bufs", sms, out);
  run<Mode::kSSConverter, 64, 2, 0, 2, 4>("SSConv N64, 2 WGs, 2 conv WGs, 4 bufs", sms, out);
  run<Mode::kSSConverter, 64, 2, 0, 1, 3, 2>("SSConv N64, 2 WGs, 1 conv, 3 bufs, 2 CTAs", sms, out);
  run<Mode::kRSReal, 128, 2>("RSReal N128, 2 WGs", sms, out);
  run<Mode::kSSConverter, 128, 2, 0, 1, 4>("SSConv N128, 2 WGs, 1 conv WG, 4 bufs", sms, out);
  run<Mode::kSSConverter, 128, 2, 0, 2, 4>("SSConv N128, 2 WGs, 2 conv WGs, 4 bufs", sms, out);
  run<Mode::kRSReal, 256, 2>("RSReal N256, 2 WGs", sms, out);
  run<Mode::kSSConverter, 256, 2, 0, 1, 4>("SSConv N256, 2 WGs, 1 conv WG, 4 bufs", sms, out);
  cudaFree(out);
  return 0;
}

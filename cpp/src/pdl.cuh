// Programmatic dependent launch (sm_90): overlapping one kernel's launch and prologue with the tail
// of the kernel before it in the stream (CUDA-graph safe: capture records programmatic edges).
//
// A kernel launched with the attribute may start while its predecessor still runs, so every such
// kernel calls wait_and_release() before its first global memory access: griddepcontrol.wait
// returns once the predecessor has completed and its writes are visible (at once when the kernel
// was launched without the attribute). The kernel then lets its own successor launch; that one
// waits in turn, so only launch latency and shared-memory setup overlap, never memory traffic.
// The one exception: the tail launches of the 128x256 tile's split (release() and wait() below)
// run beside the head's last tiles (grouped_gemm.cu's tail_overlap(); NVFP4MOE_TAIL_OVERLAP=0
// turns it off).
// (A successor's CTAs are placed only where this grid's CTAs leave room, and all of this grid's
// CTAs have started before it releases: no CTA can wait on one that is not resident.)
#pragma once

#include "env.hpp"

#include <cuda_runtime.h>
#include <cutlass/cutlass.h>

namespace nvfp4moe::pdl {

CUTLASS_DEVICE void wait_and_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The two halves of wait_and_release(), for a kernel that reads nothing its predecessor writes and
// may run beside it (a tail launch of the 128x256 tile's split, grouped_gemm.cu): release() at its
// start, wait() before it exits (so that its successor, which waits for this kernel only, also
// finds the predecessor's writes done). What it reads (x, the offsets or counts, the weights and
// scales) was written before the head: the head's CTAs release their dependents only after their
// own wait, and a tail after the first is released by a tail that the head released, so every
// such writer has completed when a tail starts. That chain is outside PDL's documented contract
// (griddepcontrol.wait gives visibility of the prerequisite grid's writes only), so such a kernel
// also issues fence_acquire() before its first load: a gpu-scope acquire fence, which keeps its
// loads from being served by stale L1 lines.
CUTLASS_DEVICE void fence_acquire() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
#endif
}
CUTLASS_DEVICE void release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
CUTLASS_DEVICE void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Whether a launch carries the attribute. NVFP4MOE_PDL=0 in the environment turns it off (for
// tools that do not handle programmatic dependencies; read once). Split-K cluster launches never
// carry it: launched early, mixtral-8x7b's L2 at T = 1 (clusters of 4) made the layer 13 us slower
// (115 vs 102 us), while the other launches gained (deepseek-v3 T = 1: 108 -> 87 us; H200,
// 2026-12-02, PERF_NOTES.md).
inline bool enabled(bool cluster_launch) {
  static const bool on = !env::switched_off("NVFP4MOE_PDL");
  return on && !cluster_launch;
}

// The launch attribute, for a cudaLaunchConfig_t's attribute list.
inline cudaLaunchAttribute attribute() {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

// kernel<<<grid, block, smem, stream>>>(args...) with the attribute. The kernel must call
// wait_and_release() before touching global memory.
template <class... Params, class... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args... args) {
  cudaLaunchAttribute attr[1] = {attribute()};
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = enabled(false) ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}

}  // namespace nvfp4moe::pdl

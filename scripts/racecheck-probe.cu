// What compute-sanitizer racecheck makes of a named-barrier producer/consumer hand-over
// (bar.arrive after the writes, bar.sync before the reads: ordered by the PTX memory model, and
// the pattern of SwigluNvfp4's epilogue hand-over to its quantizer warps), mode 0, against the
// same hand-over with __syncthreads, mode 1. On the H200 (2026-12-03, CUDA 13.0) racecheck reports
// mode 0's write and reads as a race and mode 1 as clean: it does not take bar.arrive as ordering
// the arriving threads' writes. So SwigluNvfp4's hand-over moved to mbarriers (session 15; until
// then scripts/gpu-sanitize.sh excluded those GEMM kernels from racecheck). Build and run on the
// GPU machine:
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -lineinfo scripts/racecheck-probe.cu -o probe
//   compute-sanitizer --tool racecheck ./probe
#include <cstdio>
__device__ __forceinline__ void arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__global__ void k(float* out, int mode) {
  __shared__ float buf[128];
  const int t = threadIdx.x;  // 0..127 producers, 128..223 consumers
  float acc = 0.f;
  if (mode == 0) {
    if (t >= 128) arrive(2, 224);  // buffer starts empty
    for (int it = 0; it < 8; ++it) {
      if (t < 128) {
        sync(2, 224);  // empty
        buf[t] = float(t + it);
        arrive(1, 224);  // full
      } else {
        sync(1, 224);
        for (int j = t - 128; j < 128; j += 96) acc += buf[j];
        arrive(2, 224);
      }
    }
    if (t < 128) sync(2, 224);
  } else {
    for (int it = 0; it < 8; ++it) {
      if (t < 128) buf[t] = float(t + it);
      __syncthreads();
      if (t >= 128) for (int j = t - 128; j < 128; j += 96) acc += buf[j];
      __syncthreads();
    }
  }
  out[blockIdx.x * 224 + t] = acc;
}
int main() {
  float* o; cudaMalloc(&o, 4 * 224 * 4);
  for (int m = 0; m < 2; ++m) { k<<<4, 224>>>(o, m); printf("mode %d: %s\n", m, cudaGetErrorString(cudaDeviceSynchronize())); }
  return 0;
}

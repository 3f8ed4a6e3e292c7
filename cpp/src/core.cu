// Status strings, the thread-local last error, and build information.
#include "nvfp4moe/nvfp4moe.h"
#include "status.hpp"

#include <cuda_runtime.h>
#include <cutlass/version.h>

#include <cstdarg>
#include <cstdio>

#ifndef NVFP4MOE_CUDA_ARCHS
#define NVFP4MOE_CUDA_ARCHS "unknown"
#endif

namespace nvfp4moe {
namespace {
thread_local char g_last_error[512] = "";
}

const char* status_string(Status status) noexcept {
  switch (status) {
    case Status::kSuccess: return "success";
    case Status::kInvalidShape: return "invalid shape";
    case Status::kMisaligned: return "misaligned pointer";
    case Status::kInvalidDecodeScale: return "invalid decode scale";
    case Status::kUnsupportedLayout: return "unsupported scale layout";
    case Status::kNullPointer: return "null pointer";
    case Status::kCudaError: return "CUDA error";
    case Status::kInvalidValue: return "invalid value";
    case Status::kInvalidHandle: return "invalid handle";
    case Status::kOutOfMemory: return "out of memory";
  }
  return "unknown status";
}

const char* last_error_message() noexcept { return g_last_error; }

Status fail(Status status, const char* fmt, ...) noexcept {
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(g_last_error, sizeof(g_last_error), fmt, ap);
  va_end(ap);
  return status;
}

Status check_launch(const char* what) noexcept {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return fail(Status::kCudaError, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  }
  return Status::kSuccess;
}

BuildInfo build_info() noexcept {
  return BuildInfo{CUDART_VERSION, NVFP4MOE_CUDA_ARCHS, CUTLASS_MAJOR, CUTLASS_MINOR, CUTLASS_PATCH};
}

int version() noexcept { return NVFP4MOE_VERSION; }

int runtime_version() noexcept {
  int v = 0;
  return cudaRuntimeGetVersion(&v) == cudaSuccess ? v : 0;
}

int driver_version() noexcept {
  int v = 0;
  return cudaDriverGetVersion(&v) == cudaSuccess ? v : 0;
}

}  // namespace nvfp4moe

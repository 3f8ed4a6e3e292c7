// Links against the installed core and calls it (no GPU needed): the headers' version is the
// library's, and an argument error comes back as a status with a message.
#include <nvfp4moe/nvfp4moe.h>

#include <cstdio>

int main() {
  const nvfp4moe::BuildInfo bi = nvfp4moe::build_info();
  nvfp4moe::QuantizeNvfp4Args args;  // rows 0, cols 0: a shape error
  const nvfp4moe::Status s = nvfp4moe::quantize_nvfp4(args, nullptr);
  std::printf("nvfp4moe %d (headers %d), CUDA %d, archs %s, CUTLASS %d.%d; bad arguments: %s (%s)\n",
              nvfp4moe::version(), NVFP4MOE_VERSION, bi.cuda_version, bi.cuda_archs, bi.cutlass_major,
              bi.cutlass_minor, nvfp4moe::status_string(s), nvfp4moe::last_error_message());
  return nvfp4moe::version() == NVFP4MOE_VERSION && s == nvfp4moe::Status::kInvalidShape ? 0 : 1;
}

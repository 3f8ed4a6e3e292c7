// One heavy instantiation per translation unit: the grouped GEMM, 128 x 16 tiles, SwigluNvfp4 epilogue.
#include "grouped_gemm_sm90.cuh"

namespace nvfp4moe::gemm {
template Status launch_grouped_gemm<ConfigN16<GemmEpilogue::kSwigluNvfp4>>(const CUtensorMap&, const Params&, int,
                                                                     cudaStream_t);
}  // namespace nvfp4moe::gemm

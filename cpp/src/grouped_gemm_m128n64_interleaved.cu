// One heavy instantiation per translation unit: the grouped GEMM, 128 x 64 tiles, Interleaved epilogue.
#include "grouped_gemm_sm90.cuh"

namespace nvfp4moe::gemm {
template Status launch_grouped_gemm<ConfigN64<GemmEpilogue::kInterleaved>>(const CUtensorMap&, const Params&, int,
                                                                     cudaStream_t);
}  // namespace nvfp4moe::gemm

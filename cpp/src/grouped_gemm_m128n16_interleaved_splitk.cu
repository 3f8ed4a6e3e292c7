// One heavy instantiation per translation unit: the grouped GEMM, 128 x 16 tiles split over K
// (clusters of 2 or 4 CTAs, gemm_splitk.cuh), Interleaved epilogue.
#include "grouped_gemm_sm90.cuh"

namespace nvfp4moe::gemm {
template Status launch_grouped_gemm<ConfigN16SplitK<GemmEpilogue::kInterleaved>>(const CUtensorMap&, const Params&, int,
                                                                          cudaStream_t);
}  // namespace nvfp4moe::gemm

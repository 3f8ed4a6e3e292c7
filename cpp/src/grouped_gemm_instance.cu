// One heavy GEMM instantiation per translation unit: the build (cpp/CMakeLists.txt,
// scripts/sass-check.sh) compiles this file once per tile of NVFP4MOE_GEMM_TILES
// (gemm_config.cuh) and epilogue, with NVFP4MOE_TILE (the tile's name) and NVFP4MOE_EPILOGUE
// (a GemmEpilogue enumerator) defined.
#include "grouped_gemm_sm90.cuh"

#if !defined(NVFP4MOE_TILE) || !defined(NVFP4MOE_EPILOGUE)
#error "compiled once per tile and epilogue with NVFP4MOE_TILE and NVFP4MOE_EPILOGUE defined"
#endif

#define NVFP4MOE_CAT_(a, b) a##b
#define NVFP4MOE_CAT(a, b) NVFP4MOE_CAT_(a, b)

namespace nvfp4moe::gemm {
template Status launch_grouped_gemm<NVFP4MOE_CAT(Config, NVFP4MOE_TILE)<GemmEpilogue::NVFP4MOE_EPILOGUE>>(
    const CUtensorMap&, const Params&, int, cudaStream_t);
template int max_active_clusters<NVFP4MOE_CAT(Config, NVFP4MOE_TILE)<GemmEpilogue::NVFP4MOE_EPILOGUE>>(int, int);
}  // namespace nvfp4moe::gemm

#!/usr/bin/env bash
# SASS check for the CUDA core (no GPU needed): every .cu compiles with ptxas reporting no C75xx
# warning (wgmma serialization, register pressure), no kernel spills to local memory, and the GEMM
# kernels use HGMMA (register-sourced wgmma), not the mma.sync path (HMMA).
set -euo pipefail
cd "$(dirname "$0")/.."
third_party/fetch.sh
cuda=third_party/cuda/bin
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail=0
# check_one SRC [TILE EPILOGUE]: the GEMM instance file is compiled once per tile and epilogue
# (as cpp/CMakeLists.txt builds it), every other .cu once.
check_one() {
  local src=$1 name defs=()
  name=$(basename "$src" .cu)
  if [ $# -eq 3 ]; then
    name=grouped_gemm_$2_$3
    defs=(-DNVFP4MOE_TILE="$2" -DNVFP4MOE_EPILOGUE="k$3")
  fi
  "$cuda/nvcc" -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
    -Icpp/include -Icpp/src -Ithird_party/cutlass/include -Ithird_party/cutlass/tools/util/include \
    "${defs[@]}" -Xptxas -v -c "$src" -o "$out/$name.o" >"$out/$name.log" 2>&1
}
export -f check_one; export out cuda
# The tile list, as cpp/CMakeLists.txt reads it.
tiles=$(sed -nE 's/^  X\(([A-Za-z0-9_]+),.*/\1/p' cpp/src/gemm_config.cuh)
[ -n "$tiles" ] || { echo "sass-check: no tiles found in cpp/src/gemm_config.cuh"; exit 1; }
# Two at a time (each heavy file takes ~4.6 GB); CMAKE_BUILD_PARALLEL_LEVEL caps it as it caps the core build.
{
  ls cpp/src/*.cu | grep -v grouped_gemm_instance.cu
  for t in $tiles; do
    for e in Plain Interleaved SwigluBf16 SwigluNvfp4; do echo "cpp/src/grouped_gemm_instance.cu $t $e"; done
  done
} | xargs -P "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" -I{} bash -c 'check_one {}'
for log in "$out"/*.log; do
  name=$(basename "$log" .log)
  if grep -E "C75[0-9][0-9]" "$log"; then echo "sass-check: $name: ptxas C75xx warning"; fail=1; fi
  if grep -E "[1-9][0-9]* bytes spill (stores|loads)" "$log"; then echo "sass-check: $name: spills"; fail=1; fi
done
for obj in "$out"/grouped_gemm_N*.o; do
  sass=$("$cuda/cuobjdump" --dump-sass "$obj")
  hg=$(grep -c "HGMMA" <<<"$sass" || true)
  hm=$(grep -cE "\bHMMA\b" <<<"$sass" || true)
  echo "sass-check: $(basename "$obj"): $hg HGMMA, $hm HMMA"
  if [ "$hg" -eq 0 ] || [ "$hm" -ne 0 ]; then echo "sass-check: $(basename "$obj"): expected HGMMA only"; fail=1; fi
done
[ $fail -eq 0 ] && echo "sass-check: ok (no C75xx warnings, no spills, GEMMs on HGMMA)"
exit $fail

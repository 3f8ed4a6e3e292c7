#!/usr/bin/env bash
# Fetches the pinned build toolchain into git-ignored folders under third_party/:
#   cuda/     CUDA 13.0 nvcc + nvvm + crt + cudart (static) + cccl, cuobjdump + nvdisasm (13.2, SASS
#             checks only), merged into one tree
#   cutlass/  CUTLASS 4.2 headers: include/, tools/util/include/, examples/
#   cmake/    CMake 4.x (only when no cmake >= 3.24 is on PATH)
# Every archive's sha256 is pinned in requirements.txt and checked by pip (--require-hashes).
# Idempotent: prints nothing and exits 0 when everything is already in place.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$here"
stamp_of() { sha256sum requirements.txt | cut -c1-16; }
want=$(stamp_of)

need_cmake=1
if command -v cmake >/dev/null 2>&1; then
  v=$(cmake --version | head -1 | awk '{print $3}')
  if [ "$(printf '%s\n3.24\n' "$v" | sort -V | head -1)" = "3.24" ]; then need_cmake=0; fi
fi
# The wheel ships libcudart.so.13 only; CMake's FindCUDAToolkit (CUDA::cudart, for the shared core
# library) looks for the development name. (Made on every run: older fetches lack it.)
dev_links() { [ ! -e cuda/lib/libcudart.so.13 ] || ln -sfn libcudart.so.13 cuda/lib/libcudart.so; }
if [ -f .stamp ] && [ "$(cat .stamp)" = "$want" ] && [ -x cuda/bin/nvcc ] \
   && [ -f cutlass/include/cutlass/cutlass.h ] && { [ $need_cmake = 0 ] || [ -x cmake/bin/cmake ]; }; then
  dev_links
  exit 0
fi

echo "third_party/fetch.sh: fetching the pinned CUDA 13.0 toolchain and CUTLASS 4.2 headers" >&2
py=${PYTHON:-python3}
dl=$here/.downloads
mkdir -p "$dl"
"$py" -m pip download -q --no-deps --require-hashes --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
  --python-version 3.11 --implementation py -d "$dl" -r requirements.txt

rm -rf cuda cutlass cmake .stage
mkdir -p .stage
for w in "$dl"/nvidia_cuda_*.whl "$dl"/nvidia_nvvm-*.whl; do
  case "$w" in *cuda_cccl*|*cuda_crt*|*cuda_nvcc*|*cuda_runtime*|*cuda_cuobjdump*|*cuda_nvdisasm*|*nvvm*) ;; *) continue ;; esac
  unzip -q -o "$w" 'nvidia/cu13/*' -d .stage
done
mv .stage/nvidia/cu13 cuda
# The wheels keep libraries in lib/ while nvcc looks in lib64/.
[ -e cuda/lib64 ] || ln -s lib cuda/lib64
dev_links
chmod +x cuda/bin/* cuda/nvvm/bin/* 2>/dev/null || true

rm -rf .stage && mkdir -p .stage
unzip -q -o "$dl"/nvidia_cutlass-4.2.0.0-*.whl 'cutlass_library/source/include/*' \
  'cutlass_library/source/tools/util/include/*' 'cutlass_library/source/examples/*' -d .stage
mkdir -p cutlass/tools/util
mv .stage/cutlass_library/source/include cutlass/include
mv .stage/cutlass_library/source/tools/util/include cutlass/tools/util/include
mv .stage/cutlass_library/source/examples cutlass/examples

if [ $need_cmake = 1 ]; then
  rm -rf .stage && mkdir -p .stage
  unzip -q -o "$dl"/cmake-*.whl 'cmake/data/*' -d .stage
  mv .stage/cmake/data cmake
  chmod +x cmake/bin/*
fi
rm -rf .stage
"$here/cuda/bin/nvcc" --version | tail -2 >&2
echo "$want" > .stamp
echo "third_party/fetch.sh: done" >&2

#!/usr/bin/env bash
# Link-time stand-ins for the CUDA libraries that candle's CUDA backend links dynamically (cuBLAS,
# cuBLASLt, cuRAND, NVRTC, the driver), which the fetched toolchain lacks: shared libraries with the
# real SONAMEs that define every such symbol the compiled crates refer to. A binary linked against
# them here loads the real libraries on the GPU machine (the stubs never travel, and abort if ever
# called). The CUDA runtime is not stubbed: the core's static runtime (libcudart_static) resolves
# every `cuda*` symbol, so the binary holds one runtime (an empty libcudart.so only satisfies -lcudart).
#   scripts/cuda-link-stubs.sh DIR TARGET_DIR/release
# Link with LIBRARY_PATH=DIR (the C compiler driver searches it for -l; cargo's fingerprints do not
# change).
set -euo pipefail
dir=$1 rel=$2
mkdir -p "$dir"
syms=$( { nm -u "$rel"/deps/*.rlib 2>/dev/null || true; find "$rel/build" -name '*.a' -exec nm -u {} + 2>/dev/null || true; } \
  | awk '{print $NF}' | grep -E '^(cu[A-Z]|nvrtc|curand|cublas)' | sort -u || true)
for l in cublasLt:libcublasLt.so.13 cublas:libcublas.so.13 curand:libcurand.so.10 nvrtc:libnvrtc.so.13 cuda:libcuda.so.1 cudart:libcudart.so.13; do
  name=${l%%:*} soname=${l#*:}
  case $name in
    cublasLt) pat='^cublasLt' ;;
    cublas) pat='^cublas([^L]|$)' ;;
    curand) pat='^curand' ;;
    nvrtc) pat='^nvrtc' ;;
    cuda) pat='^cu[A-Z]' ;;
    cudart) pat='^$' ;;
  esac
  {
    echo '#include <stdlib.h>'
    for s in $(grep -E "$pat" <<<"$syms" || true); do echo "void $s(void) { abort(); }"; done
  } >"$dir/$name.c"
  cc -shared -fPIC -Wl,-soname,"$soname" -o "$dir/lib$name.so" "$dir/$name.c"
done
echo "cuda-link-stubs: $(wc -w <<<"$syms") symbols stubbed in $dir" >&2

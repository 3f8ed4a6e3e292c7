#!/usr/bin/env bash
# The C++ core from source on the GPU machine, as a C++ user gets it (issue 19): configure and build
# cpp/ with the machine's nvcc and CMake, ctest (the GPU-free API tests), `cmake --install`, a
# find_package consumer, the C++ example (examples/cpp/) run on the GPU for three presets against
# its f64 reference; with HOST_COST_RUST (the bundle's examples/host_cost), the C ABI's host cost
# per forward against the Rust layer's, interleaved (issue 19); the PyTorch package (python/) built
# over the installed core (again with /usr/bin/g++ when it refuses the environment's compiler), its
# pytest suite, python/bench/bench_op.py and PyTorch's own layers (benches/torch_moe_baseline.py)
# side by side (python/bench/readme_table.py; issue 20) (PYTHON_PACKAGE=0: none of it), and when
# the tests fail a diagnosis (cpp-python-diag.log).
# The machine has no CUTLASS: it comes in the carried folder.
#   here:  bash scripts/gpu-cpp.sh pack          (writes gpu-cpp/cutlass.tgz, ~2.5 MB)
#   there: bash scripts/gpu-cpp.sh               (device tool, carry ["gpu-cpp"]; ~7 min on 16 cores)
# Logs go to $OUT (or ./gpu-out); the last lines are a summary table.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = pack ]; then
  third_party/fetch.sh
  mkdir -p gpu-cpp
  tar czf gpu-cpp/cutlass.tgz -C third_party cutlass/include cutlass/tools/util/include
  ls -la gpu-cpp/cutlass.tgz
  exit 0
fi
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
work=$(mktemp -d)
tar xzf gpu-cpp/cutlass.tgz -C "$work"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
summary=()
failed=0
step() {  # step NAME TIMEOUT COMMAND...: run, log, record
  local name=$1 limit=$2
  shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" >"$out/cpp-$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-24s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - start ))" "$(tail -1 "$out/cpp-$name.log" | cut -c1-100)")")
  [ $rc -eq 0 ] || { tail -15 "$out/cpp-$name.log"; failed=1; }
  return $rc
}
cmake --version | head -1
step configure 120 cmake -S cpp -B "$work/build" -DCMAKE_CUDA_COMPILER="$nvcc" -DCUTLASS_DIR="$work/cutlass" \
  -DCMAKE_BUILD_TYPE=Release &&
  step build 420 cmake --build "$work/build" -j"$(nproc)" &&
  step ctest 120 ctest --test-dir "$work/build" --output-on-failure &&
  step install 60 cmake --install "$work/build" --prefix "$work/prefix" &&
  step consumer 120 bash -c "cmake -S cpp/tests/consumer -B '$work/consumer' -DCMAKE_PREFIX_PATH='$work/prefix' \
    && cmake --build '$work/consumer' && '$work/consumer/consumer_shared' && '$work/consumer/consumer_static'" &&
  step example-build 120 bash -c "cmake -S examples/cpp -B '$work/example' -DCMAKE_PREFIX_PATH='$work/prefix' \
    && cmake --build '$work/example'" &&
  for run in "qwen3-30b-a3b 16" "mixtral-8x7b 4" "deepseek-v3 4"; do
    # (NVFP4MOE_CPP_EXAMPLES=0: built, not run.)
    [ "${NVFP4MOE_CPP_EXAMPLES:-1}" = 1 ] || break
    set -- $run
    step "example-$1" 300 "$work/example/moe_layer" --preset "$1" --tokens "$2"
  done
# Issue 19's host-cost target at equal shapes, in one process order: the C ABI's
# (nvfp4moe_layer_forward, examples/cpp) against the Rust layer's (HOST_COST_RUST: the bundle's
# examples/host_cost), two rounds interleaved.
if [ -n "${HOST_COST_RUST:-}" ] && [ -x "$work/example/moe_layer" ]; then
  # (The bundle's binaries travel gzipped.)
  [ -e "$HOST_COST_RUST.gz" ] && gunzip -f "$HOST_COST_RUST.gz"
  [ -e "$HOST_COST_RUST" ] && chmod +x "$HOST_COST_RUST"
  for r in 1 2; do
    for run in "qwen3-30b-a3b 16" "deepseek-v3 4"; do
      set -- $run
      echo "round $r $1 T=$2 C ABI: $(timeout 120 "$work/example/moe_layer" --preset "$1" --tokens "$2" 2>&1 | grep -o 'host cost[^;]*us')"
      echo "round $r $1 T=$2 Rust:  $(timeout 120 "$HOST_COST_RUST" "$1" "$2" 2>&1 | tail -1)"
    done
  done | tee "$out/cpp-host-cost.txt"
  # Eight numbers, or the comparison failed.
  n=$(grep -cE "host cost of .*: [0-9.]+ us" "$out/cpp-host-cost.txt")
  summary+=("$(printf '%-24s %s' host-cost "$n of 8 timings")")
  [ "$n" -eq 8 ] || failed=1
fi
# The PyTorch package (issue 20) over the installed core (no second kernel build), and its tests.
# The package refuses a compiler that links libstdc++ statically (python/cmake/check_cxx_runtime.cmake:
# the GPU machine's CXX=/opt/gcc/bin/g++ does, and that operator crashed the interpreter, session
# 16); then it is built again with the system's g++, as the error says.
if [ "${PYTHON_PACKAGE:-1}" = 1 ] && [ -d "$work/prefix" ]; then
  pybuild() {  # pybuild STEP [ENV...]
    local name=$1
    shift
    step "$name" 300 env NVFP4MOE_PREFIX="$work/prefix" SKBUILD_BUILD_DIR="$work/build-$name" "$@" \
      python3 -m pip install -v --no-build-isolation --no-deps --target "$work/site" ./python
  }
  before=$failed
  # (NVFP4MOE_PY_CXX=/usr/bin/g++: that compiler from the start, skipping the refusal's check.)
  if ! pybuild python-build ${NVFP4MOE_PY_CXX:+CXX=$NVFP4MOE_PY_CXX}; then
    if grep -q "NVFP4MOE_STATIC_LIBSTDCXX" "$out/cpp-python-build.log" && [ -x /usr/bin/g++ ]; then
      echo "python-build: refused CXX=${CXX:-c++} (a static C++ runtime); again with /usr/bin/g++"
      failed=$before  # the refusal is the check working; the rebuild decides
      rm -rf "$work/site"
      pybuild python-build-system-gxx CXX=/usr/bin/g++ CC=/usr/bin/gcc
    fi
  fi
  if [ -d "$work/site/nvfp4_moe" ]; then
    # (_C.<abi>.so: the extension module; libnvfp4_moe_ops.so where the build found no Python headers.)
    ops=$(ls "$work"/site/nvfp4_moe/_C.*.so "$work"/site/nvfp4_moe/libnvfp4_moe_ops*.so 2>/dev/null | head -1)
    echo "operator library $(basename "$ops"), NEEDED: $(readelf -d "$ops" | grep NEEDED | grep -o '\[.*\]' | tr '\n' ' ')"
    grep -E "nvfp4_moe: no Python development headers" "$out/cpp-python-build"*.log | head -1
    step python-tests 300 env PYTHONPATH="$work/site" python3 -m pytest -q -p no:cacheprovider python/tests &&
      step python-bench 300 env PYTHONPATH="$work/site:python/tests" python3 python/bench/bench_op.py \
        --tokens 1,16,1024,8192 --json "$out/bench_op.json" &&
      step torch-baseline 240 python3 benches/torch_moe_baseline.py --preset qwen3-30b-a3b,deepseek-v3,mixtral-8x7b \
        --tokens 1,16,1024,8192 --json "$out/torch_moe.json" &&
      step readme-table 30 python3 python/bench/readme_table.py "$out/bench_op.json" "$out/torch_moe.json" &&
      cp "$out/cpp-readme-table.log" "$out/python-readme-table.md" && cat "$out/python-readme-table.md"
    [ -f "$out/cpp-python-bench.log" ] && tail -15 "$out/cpp-python-bench.log"
    # When the tests fail: each failed test (or, after a crash that names none, each test) in its
    # own process, with the native backtrace of a crash (scripts/segv-backtrace.c, LD_PRELOADed).
    if grep -q "python-tests .*rc=[^0]" <(printf '%s\n' "${summary[@]}"); then
      gcc -shared -fPIC -O1 scripts/segv-backtrace.c -o "$work/segv.so" 2>/dev/null
      tests=$(grep -oE '^FAILED python/tests/[^ ]+' "$out/cpp-python-tests.log" | sed 's|^FAILED python/||')
      [ -n "$tests" ] ||
        tests=$(PYTHONPATH="$work/site" python3 -m pytest -q --collect-only -p no:cacheprovider python/tests 2>/dev/null | grep "::")
      for t in $tests; do
        echo "== $t"
        PYTHONPATH="$work/site" LD_PRELOAD="$work/segv.so" timeout 120 python3 -m pytest -q -p no:cacheprovider "python/$t" 2>&1 |
          grep -vE "^  File|^Extension modules|^\s*$" | tail -25
      done >"$out/cpp-python-diag.log" 2>&1
      echo "python diagnosis: $out/cpp-python-diag.log"
    fi
  fi
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
printf '%s\n' "${summary[@]}"
rm -rf "$work"
# Every step ran and passed (a failed step stops the ones after it).
[ $failed = 0 ] && [ ${#summary[@]} -ge 9 ]

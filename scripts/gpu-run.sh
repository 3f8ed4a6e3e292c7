#!/usr/bin/env bash
# Runs on the GPU machine from the bundle made by scripts/gpu-bundle.sh: every test binary with
# --include-ignored, every example once (NVFP4MOE_EXAMPLES=none skips them), then the dense BF16
# rate (PyTorch, for the GEMM bench's floors) and the benches (filter = the arguments;
# NVFP4MOE_BENCHES=none skips them), then a summary table. Logs and bench
# JSON go to $OUT (or ./gpu-out).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# The bundle's binaries travel gzipped (scripts/gpu-bundle.sh).
for f in "$here"/nvfp4-moe.gz "$here"/tests/*.gz "$here"/benches/*.gz "$here"/examples/*.gz; do
  [ -e "$f" ] && gunzip -f "$f" && chmod +x "${f%.gz}"
done
export NVFP4MOE_CLI="$here/nvfp4-moe"
# ModelOpt 0.47 for the recipe-v2 oracle test (scripts/modelopt-wheels.sh makes .whl/site.tgz).
export NVFP4MOE_MODELOPT_ORACLE="$here/oracle.py"
if [ -f .whl/site.tgz ] && [ ! -d /tmp/nvfp4moe-py/site ]; then
  mkdir -p /tmp/nvfp4moe-py && tar xzf .whl/site.tgz -C /tmp/nvfp4moe-py
fi
[ -d /tmp/nvfp4moe-py/site ] && export PYTHONPATH=/tmp/nvfp4moe-py/site${PYTHONPATH:+:$PYTHONPATH}
export NVFP4MOE_BENCH_JSON="$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
summary=()
fails=0
# NCCL for the expert-parallel tests (the bundle is built with the `nccl` feature).
[ -f "$here/nccl-env.sh" ] && . "$here/nccl-env.sh"
for t in "$here"/tests/*; do
  name=$(basename "$t")
  # NVFP4MOE_TESTS=substring runs only the matching test binaries.
  case "$name" in *"${NVFP4MOE_TESTS:-}"*) ;; *) continue ;; esac
  log="$out/test-$name.log"
  start=$(date +%s)
  timeout "${NVFP4MOE_TEST_TIMEOUT:-450}" "$t" --include-ignored --test-threads=2 >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  res=$(grep -E '^test result:' "$log" | tail -1 | sed 's/test result: //')
  [ $rc -eq 0 ] || { fails=$((fails + 1)); grep -E '^(test .* FAILED|---- |thread .* panicked|  left|  right)' "$log" | head -20; tail -5 "$log"; }
  summary+=("$(printf '%-28s rc=%-3s %4ss  %s' "$name" "$rc" "$secs" "$res")")
done
# The 128x256 tile's tail split with one tail tile, with two (65-128 rows stay with the head; the
# run above has 128x32, 128x64 and 128x128), with the tails after the head instead of beside it
# (NVFP4MOE_TAIL_OVERLAP=0), without a split, with the tail launches largest tile first
# (NVFP4MOE_TAIL_LARGEST_FIRST=1), with 33-128-row tails on 128x128 (NVFP4MOE_TAIL_TILES=32,128),
# and at each narrow-issue level below the default (2: the 128x128 tile's row tiles whole; 1: also
# 128x256's 129-192-row tiles 256 wide; 0: every tile whole; each setting is read once per
# process): the tests that compare it bit for bit.
if [ -x "$here/tests/test-gpu" ] && [[ test-gpu == *"${NVFP4MOE_TESTS:-}"* ]]; then
  # (A setting: environment assignments joined by "+", "NVFP4MOE_" left off.)
  for tt in TAIL_TILES=32 TAIL_TILES=64 TAIL_TILES=32,64 TAIL_OVERLAP=0 TAIL_OVERLAP=0+NVFP4MOE_TAIL_TILES=32,64 \
    TAIL_TILES=0 TAIL_LARGEST_FIRST=1 TAIL_TILES=32,128 NARROW_ISSUE=2 NARROW_ISSUE=1 NARROW_ISSUE=0; do
    log="$out/test-gpu-${tt//[=,+]/-}.log"
    IFS=+ read -ra kv <<<"NVFP4MOE_$tt"
    env "${kv[@]}" timeout 300 "$here/tests/test-gpu" --include-ignored --test-threads=2 tail_split \
      batch_invariant swiglu_nvfp4 swiglu_epilogues >"$log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || { fails=$((fails + 1)); grep -E '^(test .* FAILED|thread .* panicked)' "$log" | head -10; }
    summary+=("$(printf '%-28s rc=%-3s %4ss  %s' "test-gpu $tt" "$rc" "-" "$(grep -E '^test result:' "$log" | tail -1 | sed 's/test result: //')")")
  done
fi
# Each example once, as a user runs it (no arguments): its last line goes in the summary.
# candle_moe loads cuBLAS, cuRAND, NVRTC and the shared runtime: the pip-installed CUDA 13 ones.
if [ "${NVFP4MOE_EXAMPLES:-all}" != none ]; then
  cuda_libs=$(python3 -c '
import glob, os, site
dirs = set()
for sp in site.getsitepackages():
    for lib in ("libcublas.so.*", "libcublasLt.so.*", "libcurand.so.*", "libnvrtc.so.*", "libcudart.so.*"):
        dirs.update(os.path.dirname(f) for f in glob.glob(os.path.join(sp, "nvidia", "**", lib), recursive=True))
print(":".join(sorted(dirs)))' 2>/dev/null)
  for x in "$here"/examples/*; do
    [ -x "$x" ] || continue
    name=$(basename "$x")
    # (fp8_error is a CPU study of minutes: not a GPU example.)
    [ "$name" = fp8_error ] && continue
    log="$out/example-$name.log"
    start=$(date +%s)
    LD_LIBRARY_PATH="$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout "${NVFP4MOE_EXAMPLE_TIMEOUT:-120}" "$x" >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    [ $rc -eq 0 ] || { fails=$((fails + 1)); tail -5 "$log"; }
    summary+=("$(printf '%-28s rc=%-3s %4ss  %s' "example $name" "$rc" "$secs" "$(tail -1 "$log" | cut -c1-110)")")
  done
  [ -e "$here/examples/candle_moe" ] || summary+=("example candle_moe           not bundled: it did not link on the build machine")
fi
# The dense BF16 rate of this GPU at its clocks now (torch.matmul 8192^3, median of 10 event-timed
# runs after warm-up; a few seconds), for the GEMM bench's floors; a rate set by the caller wins.
if [ "${NVFP4MOE_BENCHES:-all}" != none ] && [ -z "${NVFP4MOE_BF16_TFLOPS:-}" ] && python3 -c "import torch" 2>/dev/null; then
  rate=$(timeout 60 python3 - <<'PY' 2>"$out/bf16-rate.err"
import torch
n = 8192
a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    torch.matmul(a, b, out=c)
ms = []
for _ in range(10):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.matmul(a, b, out=c)
    end.record()
    end.synchronize()
    ms.append(start.elapsed_time(end))
ms.sort()
print(f"{2 * n**3 / (ms[len(ms) // 2] * 1e-3) / 1e12:.1f}")
PY
  )
  if [[ "$rate" =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
    export NVFP4MOE_BF16_TFLOPS=$rate
    echo "dense BF16 rate (torch.matmul 8192^3, median of 10): $rate TFLOP/s"
    summary+=("$(printf '%-28s %s TFLOP/s (torch.matmul 8192^3, median of 10)' "dense BF16 rate" "$rate")")
  else
    echo "dense BF16 rate not measured (see $out/bf16-rate.err); the benches use their constant"
  fi
fi
# The copy bandwidth for the floors on a GPU other than the H200 (the issues' floors are the H200's
# 4.3 TB/s, the benches' default): a 2 GiB device-to-device copy, read + written bytes over the
# median of 10 event-timed copies. A value set by the caller wins.
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
if [ "${NVFP4MOE_BENCHES:-all}" != none ] && [ -z "${NVFP4MOE_HBM_TBPS:-}" ] && [[ "$gpu_name" != *H200* ]] &&
  python3 -c "import torch" 2>/dev/null; then
  bw=$(timeout 60 python3 - <<'PY' 2>"$out/hbm-rate.err"
import torch
n = 1 << 31
a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
a.fill_(1)
for _ in range(3):
    b.copy_(a)
ms = []
for _ in range(10):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    b.copy_(a)
    end.record()
    end.synchronize()
    ms.append(start.elapsed_time(end))
ms.sort()
print(f"{2 * n / (ms[len(ms) // 2] * 1e-3) / 1e12:.2f}")
PY
  )
  if [[ "$bw" =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
    export NVFP4MOE_HBM_TBPS=$bw
    echo "copy bandwidth ($gpu_name, 2 GiB copy, read + written, median of 10): $bw TB/s"
    summary+=("$(printf '%-28s %s TB/s (%s: 2 GiB copy, read + written, median of 10)' "copy bandwidth" "$bw" "$gpu_name")")
  else
    echo "copy bandwidth not measured (see $out/hbm-rate.err); the benches use the H200's 4.3 TB/s"
  fi
fi
if [ "${NVFP4MOE_BENCHES:-all}" != none ]; then
  for b in "$here"/benches/*; do
    name=$(basename "$b")
    timeout "${NVFP4MOE_BENCH_TIMEOUT:-400}" "$b" --bench "$@" 2>&1 | tee "$out/bench-$name.log" \
      | grep -vE '^(Benchmarking|\s*$)|time:|thrpt:|change:|outlier|^Found|(high|low) (mild|severe)' || true
  done
fi
# PyTorch's BF16 grouped GEMM at the GEMM bench's shapes, as the reference line
# (NVFP4MOE_TORCH=0 skips it; the filter is the first argument, as for the benches).
torch_table=""
if [ "${NVFP4MOE_BENCHES:-all}" != none ] && [ "${NVFP4MOE_TORCH:-1}" != 0 ] && python3 -c "import torch" 2>/dev/null; then
  timeout "${NVFP4MOE_BENCH_TIMEOUT:-400}" python3 "$here/torch_grouped_gemm.py" --filter "${1:-}" \
    --json "$out/torch_grouped_gemm.json" >"$out/torch.log" 2>&1 || true
  torch_table=$(sed -n '/== torch._grouped_mm/,$p' "$out/torch.log")
fi
echo
echo "================ GPU summary ($(date -u +%Y-%m-%d)) ================"
for s in "${summary[@]}"; do echo "$s"; done
if [ "${NVFP4MOE_BENCHES:-all}" != none ]; then
  for b in "$here"/benches/*; do
    sed -n '/== .*: summary/,$p' "$out/bench-$(basename "$b").log"
  done
fi
[ -n "$torch_table" ] && echo "$torch_table"
echo "test binaries and examples failed: $fails"
exit $fails

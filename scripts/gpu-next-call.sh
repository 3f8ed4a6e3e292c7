#!/usr/bin/env bash
# The next session's GPU calls (issue 22), on the GPU machine (device tool) from the repository
# root, over a slim bundle ($NVFP4MOE_BUNDLE, default gpu-slim: nvfp4-moe.gz, tests/test-gpu.gz and
# the .py files of gpu-bundle/) and optionally another build's CLI ($NVFP4MOE_BASE_CLI, default
# gpu-base/nvfp4-moe, gzipped or not), carried:
#   bash scripts/gpu-next-call.sh suite   # every GPU test of gemm::, layer::, layer_ and faults::;
#                                         # the tail tests at narrow issue 2 and 0 and with
#                                         # NVFP4MOE_TAIL_TILES=32,128; memcheck of the tail tests
#   bash scripts/gpu-next-call.sh sweep   # issue 22's balanced sweep with PyTorch BF16 beside it
#   bash scripts/gpu-next-call.sh probe-sweep  # the wgmma probe, then the sweep at all 14 T
#   bash scripts/gpu-next-call.sh ab128   # the 128x128 tile's tests, then `ab`'s timings (fewer rows)
#   bash scripts/gpu-next-call.sh t8192   # T = 8192 under three routings, torch._grouped_mm, ncu
#                                         # kernel durations against floors, memcheck of the tails
#   bash scripts/gpu-next-call.sh ab      # this build against $NVFP4MOE_BASE_CLI: the layer at
#                                         # T = 8192 (three presets and routings) and at T = 256-2048
# (Each stays under the device tool's 600 s per command with its timeouts.) Logs go to $OUT.
# Session 28's `ab` (its narrow issue level 4, since reverted) is in PERF_NOTES.md.
set -u
out=${OUT:-$PWD/gpu-out}; mkdir -p "$out"
b=${NVFP4MOE_BUNDLE:-gpu-slim}
base=${NVFP4MOE_BASE_CLI:-gpu-base/nvfp4-moe}
for f in $b/nvfp4-moe $b/tests/test-gpu $base; do [ -e $f.gz ] && gunzip -f $f.gz; chmod +x $f; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "build $(cat $b/REVISION), base $(cat $(dirname $base)/REVISION 2>/dev/null)"
t=$b/tests/test-gpu
tests() {  # tests NAME ENV... -- FILTERS...
  local name=$1 s rc; shift
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  s=$(date +%s)
  env "${envs[@]}" timeout --kill-after=10s ${TEST_TIMEOUT:-200} $t --include-ignored --test-threads=4 "$@" \
    >$out/$name.log 2>&1
  rc=$?
  echo "tests $name: rc=$rc $(( $(date +%s)-s ))s $(grep '^test result' $out/$name.log | tail -1)"
  grep -E '^(test .* FAILED|thread .* panicked)' $out/$name.log | head -5
}
case "${1:-suite}" in
probe-sweep)
  # The wgmma probe (carried pre-built as $b/wgmma-probe: scripts/wgmma-probe.cu), then the balanced
  # sweep at every T with PyTorch BF16 beside it, and the table.
  [ -e $b/wgmma-probe.gz ] && gunzip -f $b/wgmma-probe.gz
  [ -e $b/wgmma-probe ] && chmod +x $b/wgmma-probe && timeout 90 $b/wgmma-probe >$out/probe.txt 2>&1
  cat $out/probe.txt
  s=$(date +%s)
  timeout 290 $b/nvfp4-moe bench --preset deepseek-v3,qwen3-30b-a3b,mixtral-8x7b \
    --tokens 1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192 >$out/sweep.log 2>$out/sweep.err
  echo "sweep rc=$? $(( $(date +%s)-s ))s"
  bash "$0" sweep-torch
  ;;
t8192)
  # Issue 22's T = 8192 rows: the layer under three routings (two rounds), torch._grouped_mm on the
  # same GEMM shapes, the layer's kernel durations under ncu against their floors (deepseek-v3
  # balanced and skewed), memcheck of the tail tests.
  for r in 1 2; do
    s=$(date +%s)
    timeout 120 $b/nvfp4-moe bench --preset deepseek-v3,qwen3-30b-a3b,mixtral-8x7b --tokens 8192 \
      --routing balanced,uniform,skewed >$out/t8192.$r.log 2>$out/t8192.$r.err
    echo "t8192 round $r rc=$? $(( $(date +%s)-s ))s"; cat $out/t8192.$r.log
  done
  s=$(date +%s)
  (cd $b && timeout 100 python3 torch_grouped_gemm.py --filter T8192 --iters 10) >$out/grouped.log 2>&1
  echo "torch._grouped_mm rc=$? $(( $(date +%s)-s ))s"; tail -8 $out/grouped.log
  kernels='regex:route_fused_kernel|route_small_kernel|count_kernel|scan_kernel|scatter_kernel|gather_kernel|gather_tokens_kernel|combine_kernel|grouped_gemm'
  mkdir -p $out/kernels
  for r in balanced skewed; do
    s=$(date +%s)
    timeout 100 ncu --csv --clock-control none --metrics gpu__time_duration.sum --kernel-name "$kernels" \
      --launch-count 40 $b/nvfp4-moe bench --preset deepseek-v3 --tokens 8192 --routing $r \
      >$out/kernels/deepseek-v3.8192.$r.csv 2>$out/kernels/deepseek-v3.8192.$r.err
    echo "ncu $r rc=$? $(( $(date +%s)-s ))s"
  done
  python3 scripts/layer_kernels.py $out/kernels/*.csv 2>&1 | tail -40
  s=$(date +%s)
  timeout --kill-after=10s 120 compute-sanitizer --tool memcheck --error-exitcode 9 $t --include-ignored \
    --test-threads=1 tail_split batch_invariant >$out/memcheck.log 2>&1
  echo "memcheck rc=$? $(( $(date +%s)-s ))s $(grep -E 'ERROR SUMMARY' $out/memcheck.log | sort | uniq -c | tr '\n' ' ') $(grep '^test result' $out/memcheck.log | tail -1)"
  ;;
ab128)
  # Session 29's 128x128 tile with 128-K stages (PERF_NOTES.md): the tests that reach that tile,
  # then this build against $NVFP4MOE_BASE_CLI at T = 8192 (balanced, skewed) and at T = 512-4096
  # (balanced), two rounds.
  TEST_TIMEOUT=150 tests gemm -- tail_split batch_invariant grouped_gemm_matches_reference_per_expert \
    swiglu_epilogues swiglu_nvfp4 layer::layer_matches_reference
  SETTINGS="CLI=$base -" ROUNDS=2 TESTS=none PRESETS=deepseek-v3,qwen3-30b-a3b,mixtral-8x7b ROUTINGS=balanced,skewed \
    NVFP4MOE_BUNDLE=$b OUT=$out/t8192 timeout 120 bash scripts/gpu-tail-ab.sh
  SETTINGS="CLI=$base -" ROUNDS=2 TESTS=none PRESETS=deepseek-v3,qwen3-30b-a3b,mixtral-8x7b TOKENS=512,1024,2048,4096 \
    ROUTINGS=balanced NVFP4MOE_BUNDLE=$b OUT=$out/mid timeout 100 bash scripts/gpu-tail-ab.sh
  ;;
ab)
  SETTINGS="CLI=$base -" ROUNDS=2 TESTS=none PRESETS=deepseek-v3,qwen3-30b-a3b,mixtral-8x7b NVFP4MOE_BUNDLE=$b \
    OUT=$out/t8192 timeout 300 bash scripts/gpu-tail-ab.sh
  SETTINGS="CLI=$base -" ROUNDS=2 TESTS=none PRESETS=deepseek-v3,qwen3-30b-a3b,mixtral-8x7b TOKENS=256,512,1024,2048 \
    ROUTINGS=balanced,uniform NVFP4MOE_BUNDLE=$b OUT=$out/decode timeout 200 bash scripts/gpu-tail-ab.sh
  ;;
suite)
  tests suite -- gemm:: layer:: layer_ faults:: --skip sweep::
  for st in NVFP4MOE_NARROW_ISSUE=2 NVFP4MOE_NARROW_ISSUE=0 NVFP4MOE_TAIL_TILES=32,128; do
    TEST_TIMEOUT=60 tests "tail-${st#NVFP4MOE_}" "$st" -- tail_split batch_invariant
  done
  s=$(date +%s)
  timeout --kill-after=10s 120 compute-sanitizer --tool memcheck --error-exitcode 9 $t --include-ignored \
    --test-threads=1 tail_split batch_invariant >$out/memcheck.log 2>&1
  echo "memcheck rc=$? $(( $(date +%s)-s ))s $(grep -E 'ERROR SUMMARY' $out/memcheck.log | sort | uniq -c | tr '\n' ' ') $(grep '^test result' $out/memcheck.log | tail -1)"
  ;;
sweep)
  s=$(date +%s)
  timeout 150 $b/nvfp4-moe bench --preset deepseek-v3,qwen3-30b-a3b,mixtral-8x7b >$out/sweep.log 2>$out/sweep.err
  echo "sweep rc=$? $(( $(date +%s)-s ))s"
  bash "$0" sweep-torch
  ;;
sweep-torch)  # (the PyTorch half of sweep and probe-sweep, over $out/sweep.log)
  s=$(date +%s)
  timeout 150 python3 $b/torch_moe_baseline.py --no-fp8 --iters 10 --tokens 1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192 >$out/torch.log 2>&1
  echo "torch rc=$? $(( $(date +%s)-s ))s"
  python3 - $out/sweep.log $out/torch.log <<'PY'
import sys
ours = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) >= 5 and f[1].isdigit() and f[2] == "balanced":
        ours[(f[0], int(f[1]))] = float(f[4])
torch = {}
for line in open(sys.argv[2]):
    f = line.split()
    if len(f) >= 3 and f[0] in ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b") and f[1].isdigit():
        torch[(f[0], int(f[1]))] = float(f[2])
print("preset T ours torch_bf16 ratio")
for k in sorted(ours):
    t = torch.get(k)
    print(k[0], k[1], ours[k], t, round(t / ours[k], 3) if t else "-")
PY
  tail -3 $out/torch.log
  ;;
esac

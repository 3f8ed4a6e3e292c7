#!/usr/bin/env bash
# Session 28's GPU calls (issue 22), on the GPU machine (device tool) from the repository root, over
# a slim bundle ($NVFP4MOE_BUNDLE, default gpu-slim: nvfp4-moe.gz, tests/test-gpu.gz and the .py
# files of gpu-bundle/) and the previous build's CLI ($NVFP4MOE_BASE_CLI, default
# gpu-base/nvfp4-moe, gzipped or not), both carried:
#   bash scripts/gpu-next-call.sh ab      # call 1
#   bash scripts/gpu-next-call.sh suite   # call 2
#   bash scripts/gpu-next-call.sh sweep   # call 3
# (Each stays under the device tool's 600 s per command with its timeouts.)
# ab: the tail tests and the per-expert reference test at narrow issue level 4 (opt-in until they
#   pass here); the layer at T = 8192 (three presets, three routings, two rounds) under the previous
#   build, this build's default (level 3), level 4, level 4 with NVFP4MOE_TAIL_LARGEST_FIRST=1, and
#   level 4 with NVFP4MOE_TAIL_TILES=32,128; then at T = 256-2048 (the 128x64 tile's rows: 33-64
#   per expert) the previous build, this build and level 4, two rounds.
# suite: every GPU test of gemm::, layer::, layer_ and faults:: at level 4; the tail tests at the
#   default and levels 2 and 0; compute-sanitizer memcheck of the tail tests at level 4.
# sweep: issue 22's balanced sweep (level 4) with PyTorch BF16 beside it, and a table of the two.
# Logs go to $OUT.
# (If level 4 passes and wins, make it the default: grouped_gemm.cu's narrow_issue_level() and
# Params::narrow_issue.)
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
case "${1:-ab}" in
ab)
  TEST_TIMEOUT=100 tests tail4 NVFP4MOE_NARROW_ISSUE=4 -- tail_split batch_invariant swiglu_nvfp4 swiglu_epilogues \
    grouped_gemm_matches_reference_per_expert
  l4=NVFP4MOE_NARROW_ISSUE=4
  SETTINGS="CLI=$base - $l4 $l4+NVFP4MOE_TAIL_LARGEST_FIRST=1 $l4+NVFP4MOE_TAIL_TILES=32,128" ROUNDS=2 \
    TESTS=none PRESETS=deepseek-v3,qwen3-30b-a3b,mixtral-8x7b NVFP4MOE_BUNDLE=$b OUT=$out/t8192 \
    timeout 300 bash scripts/gpu-tail-ab.sh
  SETTINGS="CLI=$base - $l4" ROUNDS=2 TESTS=none PRESETS=deepseek-v3,qwen3-30b-a3b,mixtral-8x7b TOKENS=256,512,1024,2048 \
    ROUTINGS=balanced,uniform NVFP4MOE_BUNDLE=$b OUT=$out/decode timeout 110 bash scripts/gpu-tail-ab.sh
  ;;
suite)
  tests suite NVFP4MOE_NARROW_ISSUE=4 -- gemm:: layer:: layer_ faults:: --skip sweep::
  for lv in 3 2 0; do
    TEST_TIMEOUT=60 tests tail-narrow$lv NVFP4MOE_NARROW_ISSUE=$lv -- tail_split batch_invariant
  done
  s=$(date +%s)
  NVFP4MOE_NARROW_ISSUE=4 timeout --kill-after=10s 120 compute-sanitizer --tool memcheck --error-exitcode 9 $t --include-ignored \
    --test-threads=1 tail_split batch_invariant >$out/memcheck.log 2>&1
  echo "memcheck rc=$? $(( $(date +%s)-s ))s $(grep -E 'ERROR SUMMARY' $out/memcheck.log | sort | uniq -c | tr '\n' ' ') $(grep '^test result' $out/memcheck.log | tail -1)"
  ;;
sweep)
  s=$(date +%s)
  NVFP4MOE_NARROW_ISSUE=4 timeout 150 $b/nvfp4-moe bench --preset deepseek-v3,qwen3-30b-a3b,mixtral-8x7b >$out/sweep.log 2>$out/sweep.err
  echo "sweep rc=$? $(( $(date +%s)-s ))s"
  s=$(date +%s)
  timeout 120 python3 $b/torch_moe_baseline.py --no-fp8 --iters 10 --tokens 1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192 >$out/torch.log 2>&1
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

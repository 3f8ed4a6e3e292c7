#!/usr/bin/env bash
# The next session's GPU calls (issue 22), on the GPU machine (device tool) from the repository
# root, over a slim bundle ($NVFP4MOE_BUNDLE, default gpu-slim: nvfp4-moe.gz, tests/test-gpu.gz and
# the .py files of gpu-bundle/) and optionally another build's CLI ($NVFP4MOE_BASE_CLI, default
# gpu-base/nvfp4-moe, gzipped or not), carried:
#   bash scripts/gpu-next-call.sh suite   # every GPU test of gemm::, layer::, layer_ and faults::;
#                                         # the tail tests at narrow issue 2 and 0 and with
#                                         # NVFP4MOE_TAIL_TILES=32,128; memcheck of the tail tests
#   bash scripts/gpu-next-call.sh sweep   # issue 22's balanced sweep with PyTorch BF16 beside it
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

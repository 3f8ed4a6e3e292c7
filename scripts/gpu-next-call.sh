#!/usr/bin/env bash
# The GPU call session 27 could not make (device time), for the next session: on the GPU machine
# (device tool) from the repository root, over a slim bundle ($NVFP4MOE_BUNDLE, default gpu-slim:
# nvfp4-moe.gz, tests/test-gpu.gz and the .py files of gpu-bundle/, carried):
#   bash scripts/gpu-next-call.sh
# In order: the tail tests under NVFP4MOE_TAIL_LARGEST_FIRST=1 and its A/B at T = 8192 (three presets,
# three routings, two rounds), compute-sanitizer memcheck of the tail tests, issue 22's balanced
# sweep and PyTorch BF16 beside it, and a table of the two. Logs go to $OUT.
set -u
out=${OUT:-$PWD/gpu-out}; mkdir -p "$out"
b=${NVFP4MOE_BUNDLE:-gpu-slim}
for f in $b/nvfp4-moe $b/tests/test-gpu; do [ -e $f.gz ] && gunzip -f $f.gz; chmod +x $f; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
cat $b/REVISION
s=$(date +%s)
NVFP4MOE_TAIL_LARGEST_FIRST=1 timeout 100 $b/tests/test-gpu --include-ignored --test-threads=2 tail_split batch_invariant swiglu_nvfp4 swiglu_epilogues >$out/tail-largest-first.log 2>&1
echo "tail tests LARGEST_FIRST=1 rc=$? $(( $(date +%s)-s ))s $(grep '^test result' $out/tail-largest-first.log | tail -1)"
SETTINGS="- NVFP4MOE_TAIL_LARGEST_FIRST=1" ROUNDS=2 TESTS=none PRESETS=deepseek-v3,qwen3-30b-a3b,mixtral-8x7b NVFP4MOE_BUNDLE=$b timeout 120 bash scripts/gpu-tail-ab.sh
s=$(date +%s)
timeout --kill-after=10s 100 compute-sanitizer --tool memcheck --error-exitcode 9 $b/tests/test-gpu --include-ignored \
  --test-threads=1 tail_split batch_invariant >$out/memcheck.log 2>&1
echo "memcheck rc=$? $(( $(date +%s)-s ))s $(grep -E 'ERROR SUMMARY' $out/memcheck.log | sort | uniq -c | tr '\n' ' ') $(grep '^test result' $out/memcheck.log | tail -1)"
s=$(date +%s)
timeout 180 $b/nvfp4-moe bench --preset deepseek-v3,qwen3-30b-a3b,mixtral-8x7b >$out/sweep.log 2>$out/sweep.err
echo "sweep rc=$? $(( $(date +%s)-s ))s"
s=$(date +%s)
timeout 130 python3 $b/torch_moe_baseline.py --no-fp8 --iters 10 --tokens 1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192 >$out/torch.log 2>&1
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

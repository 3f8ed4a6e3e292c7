#!/usr/bin/env bash
# Everything one GPU session needs to measure, in one device call (~9 minutes on the H200;
# NVFP4MOE_BENCHES=none skips the GEMM bench and its PyTorch line, ~3 minutes less):
# every GPU test and every example (run.sh), compute-sanitizer on the kernels' tests, `check` at real shapes with both
# intermediates, the GEMM bench (with PyTorch's line),
# the SwiGLU epilogue flows, the layer bench and the PyTorch MoE baselines; summary tables last.
#   bash gpu-bundle/all.sh          (from the repository root, carry ["gpu-bundle"])
# Logs and JSON go to $OUT (or ./gpu-out).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export OUT=$out NVFP4MOE_BENCH_JSON=$out
NVFP4MOE_BENCH_TIMEOUT=200 bash "$here/run.sh" /L >"$out/run.log" 2>&1
timeout --kill-after=15s 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$here/tests/test-gpu" --include-ignored \
  --test-threads=1 one_hot swiglu_nvfp4 swiglu_epilogues grouped_dequantize grouped_quantize swiglu_quantize combine layer_ \
  --skip sweep:: --skip c_abi:: >"$out/sanitizer.log" 2>&1
# The epilogue tests under racecheck, but the two whose process outgrows the host's memory under it
# (scripts/gpu-sanitize.sh's racecheck-parts runs them in parts); the C ABI test is memcheck-layer's.
timeout --kill-after=15s 90 compute-sanitizer --tool racecheck --error-exitcode 9 \
  "$here/tests/test-gpu" --include-ignored --test-threads=1 swiglu --skip sweep:: \
  --skip swiglu_epilogues_match_reference --skip swiglu_nvfp4_equals_quantized_compact >"$out/racecheck.log" 2>&1
# The layer against the CPU f64 reference at real shapes, with either intermediate.
for pt in qwen3-30b-a3b:256 mixtral-8x7b:64 deepseek-v3:32; do
  for inter in bf16 nvfp4; do
    echo "== check --preset ${pt%:*} --tokens ${pt#*:} --intermediate $inter"
    timeout 60 "$here/nvfp4-moe" check --preset "${pt%:*}" --tokens "${pt#*:}" --intermediate "$inter" 2>&1
  done
done >"$out/check.log" 2>&1
timeout 150 "$here/benches/swiglu" --bench /T >"$out/bench-swiglu-all.log" 2>&1
timeout 150 "$here/nvfp4-moe" bench --preset deepseek-v3,qwen3-30b-a3b,mixtral-8x7b --tokens 1,16,128,1024,8192 \
  --json-file "$out/layer.json" >"$out/layer.log" 2>"$out/layer.err"
timeout 100 "$here/nvfp4-moe" bench --preset deepseek-v3,qwen3-30b-a3b,mixtral-8x7b --tokens 1,16,1024,8192 \
  --intermediate nvfp4 --json-file "$out/layer-nvfp4.json" >"$out/layer-nvfp4.log" 2>"$out/layer-nvfp4.err"
timeout 110 python3 "$here/torch_moe_baseline.py" --json "$out/torch_moe.json" >"$out/torch_moe.log" 2>"$out/torch_moe.err"
# The summary, also kept as one file (named to sort first: the device tool brings back only the first few files).
{
  sed -n '/GPU summary/,$p' "$out/run.log"
  echo "== examples (one line each: its last output line)"
  for f in "$out"/example-*.log; do [ -e "$f" ] && printf '%-24s %s\n' "$(basename "$f" .log)" "$(tail -1 "$f")"; done
  [ -e "$out/example-candle_moe.log" ] || echo "example-candle_moe       not bundled: it did not link on the build machine"
  grep -E "^test .*FAILED|ERROR SUMMARY|^test result" "$out/sanitizer.log"
  grep -E "^test .*FAILED|RACECHECK SUMMARY|^test result" "$out/racecheck.log"
  sed -n '/== swiglu: summary/,$p' "$out/bench-swiglu-all.log"
  grep -E "^==|relative|calibrated|failed" "$out/check.log"
  echo "== layer (nvfp4-moe bench)"; cat "$out/layer.log"
  echo "== layer, NVFP4 intermediate (nvfp4-moe bench --intermediate nvfp4)"; cat "$out/layer-nvfp4.log"
  echo "== PyTorch MoE baselines"; tail -16 "$out/torch_moe.log"
} | tee "$out/0-summary.txt"

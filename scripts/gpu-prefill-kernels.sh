#!/usr/bin/env bash
# Issue 22's starting measurements on the GPU machine, from the repository root (device tool, carry
# ["gpu-bundle", "gpu-cpp"]): the SS/RS wgmma probe (scripts/gpu-wgmma-probe.sh), then for each
# preset and routing the layer's kernels at T (default 8192) under Nsight Compute (kernel durations
# of the first three forwards of `nvfp4-moe bench`, set-up kernels excluded) against their floors
# (scripts/layer_kernels.py), then the bench rows of the three routings (balanced, uniform,
# skewed). ~6 minutes on an H100 with two routings (each ncu run 3-6 s, the probe and the bench
# rows the rest, 2026-12-06); a third routing adds one ncu run per preset.
#   bash scripts/gpu-prefill-kernels.sh [PRESETS] [T]
set -uo pipefail
cd "$(dirname "$0")/.."
presets=${1:-deepseek-v3,qwen3-30b-a3b,mixtral-8x7b}
t=${2:-8192}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out/kernels"
cli=gpu-bundle/nvfp4-moe
[ -e "$cli.gz" ] && gunzip -f "$cli.gz" && chmod +x "$cli"
[ -f gpu-cpp/cutlass.tgz ] && timeout 120 bash scripts/gpu-wgmma-probe.sh 2>&1 | tee "$out/wgmma-probe.txt"
# The forward's kernels (names as in cpp/src): three forwards' worth of launches.
kernels='regex:count_kernel|scan_kernel|scatter_kernel|route_small_kernel|route_fused_kernel|gather_kernel|gather_tokens_kernel|combine_kernel|grouped_gemm|softmax_topk|swiglu_bf16|quantize_grouped|dequantize_grouped'
for p in ${presets//,/ }; do
  for r in balanced uniform skewed; do
    timeout 240 ncu --csv --clock-control none --metrics gpu__time_duration.sum --kernel-name "$kernels" --launch-count 24 \
      "$cli" bench --preset "$p" --tokens "$t" --routing "$r" >"$out/kernels/$p.$t.$r.csv" 2>"$out/kernels/$p.$t.$r.err"
    echo "ncu $p T=$t $r: rc=$? $(grep -c gpu__time_duration "$out/kernels/$p.$t.$r.csv") kernels"
  done
done
python3 scripts/layer_kernels.py ${NVFP4MOE_BF16_TFLOPS:+--bf16-tflops $NVFP4MOE_BF16_TFLOPS} "$out"/kernels/*.csv
timeout 240 "$cli" bench --preset "$presets" --tokens "$t" --routing balanced,uniform,skewed 2>/dev/null

#!/usr/bin/env bash
# Issue 22's first measurement on the GPU machine (device tool, carry ["gpu-cpp"]; `bash
# scripts/gpu-cpp.sh pack` here first): builds scripts/wgmma-probe.cu with the machine's nvcc
# against the carried CUTLASS headers and runs it (SS against RS BF16 wgmma rates at the prefill
# tile's shape, with and without a stand-in conversion of the A fragment; under a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xzf gpu-cpp/cutlass.tgz -C "$work"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
# (ptxas's notes, C7513 serialization warnings among them, are printed: the probe expects none.)
"$nvcc" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I"$work/cutlass/include" -Icpp/src scripts/wgmma-probe.cu \
  -o "$work/wgmma-probe"
"$work/wgmma-probe"

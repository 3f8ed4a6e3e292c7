#!/usr/bin/env bash
# Builds every test binary, every bench binary, every example and the CLI here (no GPU needed), and
# gathers them with a runner into gpu-bundle/ (git-ignored). On the H200 (device tool, carry ["gpu-bundle"]):
#   bash gpu-bundle/run.sh                 # all GPU tests (--include-ignored), then all benches
#   bash gpu-bundle/run.sh quantize/8192   # tests, then only benches whose name contains the filter
#   NVFP4MOE_BENCHES=none bash gpu-bundle/run.sh   # tests only
#   bash gpu-bundle/all.sh                 # tests, sanitizer, every bench and the PyTorch baselines
# The runner prints a summary table last and writes logs + bench JSON under $OUT (or ./gpu-out).
set -euo pipefail
cd "$(dirname "$0")/.."
third_party/fetch.sh
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
bundle=gpu-bundle
rm -rf "$bundle" && mkdir -p "$bundle/tests" "$bundle/benches" "$bundle/examples"

list_exes() { python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    # Test harnesses only (profile.test); cargo also reports the plain CLI binary it builds.
    if m.get("reason") == "compiler-artifact" and m.get("executable") and (m["profile"]["test"] or m["target"]["kind"][0] in ("bench", "example")):
        print(m["target"]["name"], m["target"]["kind"][0], m["executable"])
'; }

# Every binary with the `nccl` feature (the expert-parallel runner's NCCL transport; NCCL itself is
# loaded at run time, so binaries run without it and only that transport reports it missing).
features=(--features nccl)
cargo build --release "${features[@]}" --bin nvfp4-moe
cp "$CARGO_TARGET_DIR/release/nvfp4-moe" "$bundle/"
cargo test --release "${features[@]}" --no-run --message-format=json 2>/dev/null | list_exes | while read -r name kind exe; do
  # (cargo test also builds the examples: they are bundled below, not as tests.)
  if [ "$kind" != example ]; then cp "$exe" "$bundle/tests/$kind-$name"; fi
done
cargo bench "${features[@]}" --no-run --message-format=json 2>/dev/null | list_exes | while read -r name kind exe; do
  if [ "$kind" = bench ]; then cp "$exe" "$bundle/benches/$name"; fi
done
# The examples (run.sh runs each once after the tests).
cargo build --release "${features[@]}" --examples --message-format=json 2>/dev/null | list_exes | while read -r name kind exe; do
  if [ "$kind" = example ]; then cp "$exe" "$bundle/examples/$name"; fi
done
# candle_moe (the `candle` feature): candle's CUDA backend links cuBLAS, cuBLASLt, cuRAND, NVRTC,
# the driver and the shared CUDA runtime dynamically, and the fetched toolchain has none of them.
# It links against stand-ins with the real SONAMEs (scripts/cuda-link-stubs.sh) and loads the real libraries on the H200, where run.sh points
# LD_LIBRARY_PATH at the pip-installed CUDA 13 libraries. candle's kernels need CUDA_COMPUTE_CAP.
# NVFP4MOE_BUNDLE_CANDLE=0 leaves it out (it is ~10 MB gzipped: candle's PTX for every kernel).
stubs=$CARGO_TARGET_DIR/cuda-link-stubs
candle_log=$CARGO_TARGET_DIR/candle_moe.build.log
candle_build() {
  PATH="$PWD/third_party/cuda/bin:$PATH" CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} LIBRARY_PATH=$stubs \
    cargo build --release --features candle --example candle_moe
}
if [ "${NVFP4MOE_BUNDLE_CANDLE:-1}" = 0 ]; then
  echo "gpu-bundle: NVFP4MOE_BUNDLE_CANDLE=0: candle_moe not bundled" >&2
else
  # The first build compiles everything (its link may fail: no stubs yet); the stubs come from
  # the compiled objects; the second build only links.
  candle_build >"$candle_log" 2>&1 || true
  if scripts/cuda-link-stubs.sh "$stubs" "$CARGO_TARGET_DIR/release" && candle_build >>"$candle_log" 2>&1; then
    cp "$CARGO_TARGET_DIR/release/examples/candle_moe" "$bundle/examples/"
  else
    echo "gpu-bundle: candle_moe did not build or link (see $candle_log): not bundled" >&2
  fi
fi
cp scripts/gpu-run.sh "$bundle/run.sh"
cp scripts/nccl-env.sh "$bundle/"
cp scripts/gpu-all.sh "$bundle/all.sh"
cp benches/torch_grouped_gemm.py benches/torch_moe_baseline.py "$bundle/"
strip "$bundle"/nvfp4-moe "$bundle"/tests/* "$bundle"/benches/* "$bundle"/examples/* 2>/dev/null || true
# What travels to the GPU machine is limited (64 MiB): binaries go gzipped (~3.4x smaller);
# run.sh and all.sh unpack them in place.
gzip -9 -f "$bundle"/nvfp4-moe "$bundle"/tests/* "$bundle"/benches/* "$bundle"/examples/*
cp tests/modelopt/*.py "$bundle/"
du -sh "$bundle"; ls -la "$bundle" "$bundle/tests" "$bundle/benches" "$bundle/examples"

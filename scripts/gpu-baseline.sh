#!/usr/bin/env bash
# A baseline build for same-call A/B timing on the GPU machine (issues 14 and 19: "the starting
# build and the new build in one GPU call, interleaved"): the GEMM bench, the CLI (its `bench`) and
# the host-cost example of git revision REV, built here in a worktree of their own (its own target
# dir; this checkout is not touched), stripped and gzipped into gpu-baseline/REV/ (git-ignored).
# Revisions older than examples/host_cost.rs get today's copy of it (it uses only public API).
#   bash scripts/gpu-baseline.sh d531f63          (here; ~6 min on 2 cores)
# There (carry ["gpu-baseline"]), e.g.:
#   gunzip -k gpu-baseline/d531f63/*.gz; gpu-baseline/d531f63/gemm --bench '/T1$'
#   gpu-baseline/d531f63/nvfp4-moe bench --preset qwen3-30b-a3b --tokens 1,16
#   gpu-baseline/d531f63/host_cost qwen3-30b-a3b 16
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/gpu-baseline.sh REV}
sha=$(git rev-parse --short "$rev^{commit}")
third_party/fetch.sh
root=$PWD
wt=$(mktemp -d)/nvfp4-moe-$sha
trap 'git -C "$root" worktree remove --force "$wt" >/dev/null 2>&1 || true' EXIT
git worktree add --detach -q "$wt" "$sha"
[ -e "$wt/examples/host_cost.rs" ] || cp examples/host_cost.rs "$wt/examples/"
grep -q 'name = "host_cost"' "$wt/Cargo.toml" || printf '\n[[example]]\nname = "host_cost"\nrequired-features = ["cuda"]\n' >>"$wt/Cargo.toml"
# The toolchain of this checkout (the worktree has no fetched third_party/).
export NVCC=$root/third_party/cuda/bin/nvcc CUTLASS_DIR=$root/third_party/cutlass
[ -x "$root/third_party/cmake/bin/cmake" ] && export CMAKE=$root/third_party/cmake/bin/cmake
export CARGO_TARGET_DIR=$root/target/baseline-$sha
(cd "$wt" && cargo build --release --bin nvfp4-moe --example host_cost && cargo bench --no-run --bench gemm)
out=gpu-baseline/$sha
rm -rf "$out" && mkdir -p "$out"
cp "$CARGO_TARGET_DIR/release/nvfp4-moe" "$CARGO_TARGET_DIR/release/examples/host_cost" "$out/"
gemm=$(ls -t "$CARGO_TARGET_DIR"/release/deps/gemm-* | grep -v '\.d$' | head -1)
cp "$gemm" "$out/gemm"
strip "$out"/* 2>/dev/null || true
gzip -9 -f "$out"/*
echo "$sha" >"$out/REVISION"
du -sh "$out"

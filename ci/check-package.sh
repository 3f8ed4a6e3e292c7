#!/usr/bin/env bash
# Packages the crate as a user would get it from crates.io and checks it: `cargo package` builds
# the packaged sources (with --no-default-features: no CUDA toolkit needed), the .crate is under
# 10 MiB, and its file list holds the sources and nothing fetched or built (no toolchain, no
# target/, no GPU bundle).
set -euo pipefail
cd "$(dirname "$0")/.."
flags=(--no-default-features)
# A dirty tree (a local run with uncommitted edits) is packaged as it is; CI's clean clone is not dirty.
[ -z "$(git status --porcelain 2>/dev/null)" ] || flags+=(--allow-dirty)

list=$(cargo package --list "${flags[@]}")
bad=$(grep -E '^(target/|gpu-bundle/|third_party/(cuda|cutlass|cmake|\.downloads|\.stage)(/|$)|third_party/\.stamp$)|\.(a|o|so|whl|crate)$' <<<"$list" || true)
if [ -n "$bad" ]; then
  echo "check-package: files that must not be packaged:" >&2
  echo "$bad" >&2
  exit 1
fi
for need in Cargo.toml build.rs src/lib.rs src/bin/nvfp4-moe/main.rs cpp/CMakeLists.txt \
  cpp/include/nvfp4moe/nvfp4moe.h cpp/include/nvfp4moe/types.h codegen/abi.rs third_party/fetch.sh third_party/requirements.txt \
  tests/golden/input.safetensors tests/fixtures/modelopt_nvfp4_v2.safetensors tests/modelopt/oracle.py \
  tests/fixtures/checkpoints/modelopt_w4a4/model.safetensors scripts/fixtures/make_ct_fixtures.py python/nvfp4_moe/layer.py README.md CHANGELOG.md LICENSE-MIT LICENSE-APACHE; do
  grep -qxF "$need" <<<"$list" || { echo "check-package: $need is missing from the package" >&2; exit 1; }
done

cargo package "${flags[@]}"
crate=$(ls -t target/package/nvfp4-moe-*.crate | head -1)
size=$(stat -c %s "$crate")
limit=$((10 << 20))
echo "check-package: $crate: $(wc -l <<<"$list") files, $size bytes (limit $limit)"
[ "$size" -lt "$limit" ] || { echo "check-package: the package is over 10 MiB" >&2; exit 1; }

#!/usr/bin/env bash
# Packs nvidia-modelopt 0.47.0 (the recipe-v2 oracle) and the pure-Python packages it imports that
# the H200 image lacks into .whl/site.tgz (git-ignored, ~4 MB), for the device tool's `carry`.
# On the H200, scripts/gpu-run.sh unpacks it and puts it on PYTHONPATH (torch is already there).
# Run here (needs pip and the package registry): bash scripts/modelopt-wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: $plat -d "$tmp/w" \
  nvidia-modelopt==0.47.0 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 \
  typing-inspection==0.4.2 omegaconf==2.3.0 pulp==3.3.0
python3 -m pip download -q --no-deps -d "$tmp/w" antlr4-python3-runtime==4.9.3
python3 -m pip install -q --no-deps --no-compile --target "$tmp/site" $plat --only-binary=:all: "$tmp"/w/*.whl
python3 -m pip install -q --no-deps --no-compile --target "$tmp/site2" "$tmp"/w/antlr4-python3-runtime-4.9.3.tar.gz
cp -r "$tmp"/site2/* "$tmp/site/"
# pulp is imported by ModelOpt's searcher but its bundled CBC solver binaries are never run here.
rm -rf "$tmp"/site/pulp/solverdir/cbc "$tmp"/site/pulp/tests
mkdir -p .whl
tar czf .whl/site.tgz -C "$tmp" site
du -sh .whl/site.tgz

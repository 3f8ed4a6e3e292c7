#!/usr/bin/env bash
# Runs ct_check.py on the H200 (torch and a GPU there, no internet): installs the carried
# compressed-tensors wheels with --no-deps into a private directory put first on PYTHONPATH (as
# scripts/fixtures/compressed_tensors.sh does), writes a small synthetic BF16 MoE model
# (make_synthetic.py: 2 layers of 8 experts, H 256, I 128, 3 shards), converts it with the CLI and
# compares compressed-tensors' decompression with the crate's. Outputs: $OUT/convert-ct/.
#
# Needs: the CLI ($NVFP4MOE_CLI or the carried gpu-bundle/nvfp4-moe(.gz)) and the wheels
# ($CT_WHEELS, default .whl/ct of the repository: prepare with
# bash scripts/fixtures/compressed_tensors-wheels.sh, or copy an existing .whl/ct).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${OUT:-$PWD/gpu-out}/convert-ct
mkdir -p "$out"
exec > >(tee "$out/run.log") 2>&1

cli=${NVFP4MOE_CLI:-}
if [ -z "$cli" ]; then
  for c in "$root/gpu-bundle/nvfp4-moe" "$root/gpu-bundle/nvfp4-moe.gz"; do
    if [ -e "$c" ]; then
      case "$c" in *.gz) gunzip -f "$c"; c=${c%.gz} ;; esac
      chmod +x "$c"; cli=$c; break
    fi
  done
fi
[ -n "$cli" ] && [ -x "$cli" ] || { echo "ct_check.sh: no nvfp4-moe CLI" >&2; exit 1; }
wheels=${CT_WHEELS:-$root/.whl/ct}
[ -d "$wheels/wheels" ] && wheels=$wheels/wheels
ls "$wheels"/compressed_tensors-*.whl >/dev/null 2>&1 || { echo "ct_check.sh: no wheels in $wheels" >&2; exit 1; }

work=$(mktemp -d /tmp/ct-check.XXXXXX)
trap 'rm -rf "$work"' EXIT
py=${PYTHON:-python3}
"$py" -m pip install -q --no-deps --no-index --no-compile --target "$work/site" --find-links "$wheels" \
  compressed-tensors loguru pydantic pydantic-core annotated-types typing-inspection typing-extensions psutil \
  || { echo "ct_check.sh: cannot install the carried wheels" >&2; exit 1; }
export PYTHONPATH=$work/site${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$py" -c 'import torch, compressed_tensors; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "compressed-tensors", compressed_tensors.__version__)'

"$py" "$here/make_synthetic.py" --out "$work/model" --layers 2 --experts 8 --hidden 256 --intermediate 128 \
  --vocab 512 --shard-gb 0.002 || exit 1
"$py" -P "$here/ct_check.py" --cli "$cli" --model "$work/model" --work "$work/run" --out "$out"

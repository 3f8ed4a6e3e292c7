#!/usr/bin/env bash
# The 128x256 tile's tail-split experiments, timed on the GPU machine (device tool) from the
# repository root, over a bundle built here (`NVFP4MOE_BUNDLE_CANDLE=0 bash scripts/gpu-bundle.sh`;
# carry its folder, $NVFP4MOE_BUNDLE, default gpu-bundle):
#   bash scripts/gpu-tail-ab.sh
# 1. Unless TESTS=none: the tail tests (tail_split, batch_invariant) under each setting but the
#    first; a setting whose tests fail is not timed.
# 2. `nvfp4-moe bench` at T = $TOKENS (default 8192) for $PRESETS (default deepseek-v3,
#    qwen3-30b-a3b) under the three routings, once per setting of $SETTINGS (environment
#    assignments, several joined by "+", "-" for none; default: the shipped split, the tails after
#    the head (NVFP4MOE_TAIL_OVERLAP=0), NVFP4MOE_TAIL_TILES=32,64 and =0; an assignment CLI=PATH
#    in a setting runs that nvfp4-moe binary instead, e.g. an older build's), $ROUNDS rounds
#    (default 2), each round's order the previous one's reversed; then a table of the layer's us
#    per setting, the rounds separated by "/".
# Output stays short (the device tool returns the last 12,000 characters); logs go to $OUT.
set -uo pipefail
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
b=${NVFP4MOE_BUNDLE:-gpu-bundle}
settings=(${SETTINGS:-- NVFP4MOE_TAIL_OVERLAP=0 NVFP4MOE_TAIL_TILES=32,64 NVFP4MOE_TAIL_TILES=0})
rounds=${ROUNDS:-2}
cli=$b/nvfp4-moe
t=$b/tests/test-gpu
for f in "$cli" "$t"; do
  [ -e "$f.gz" ] && gunzip -f "$f.gz"
  [ -e "$f" ] && chmod +x "$f"
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader || true
# run SETTING CMD...: CMD with SETTING's assignments in its environment (CLI=PATH not among them).
run() {
  local kv=(NVFP4MOE_TAIL_AB=shipped) a env_kv=()
  [ "$1" = - ] || IFS=+ read -ra kv <<<"$1"
  shift
  for a in "${kv[@]}"; do [[ $a == CLI=* ]] || env_kv+=("$a"); done
  env "${env_kv[@]}" "$@"
}
# cli_of SETTING: the nvfp4-moe binary it runs.
cli_of() {
  local kv a c=$cli
  [ "$1" = - ] || { IFS=+ read -ra kv <<<"$1"; for a in "${kv[@]}"; do [[ $a == CLI=* ]] && c=${a#CLI=}; done; }
  [ -e "$c.gz" ] && gunzip -f "$c.gz"
  chmod +x "$c" 2>/dev/null
  echo "$c"
}
timed=()
for s in "${settings[@]}"; do
  if [ "${TESTS:-}" != none ] && [ "$s" != - ] && [[ $s != *CLI=* ]] && [ -x "$t" ]; then
    log="$out/tail-ab-tests-${s//[=,+]/-}.log"
    run "$s" timeout --kill-after=15s 300 "$t" --include-ignored --test-threads=2 tail_split batch_invariant \
      >"$log" 2>&1
    rc=$?
    echo "tests [$s]: rc=$rc $(grep -E '^test result' "$log" | tail -1)"
    if [ $rc -ne 0 ]; then
      grep -E '^(test .* FAILED|thread .* panicked)' "$log" | head -5
      continue
    fi
  fi
  timed+=("$s")
done
rows="$out/tail-ab.txt"
: >"$rows"
[ ${#timed[@]} -gt 0 ] || { echo "tail-ab: every setting failed its tests"; exit 1; }
order=("${timed[@]}")
for ((r = 0; r < rounds; r++)); do
  for s in "${order[@]}"; do
    run "$s" timeout 200 "$(cli_of "$s")" bench --preset "${PRESETS:-deepseek-v3,qwen3-30b-a3b}" \
      --tokens "${TOKENS:-8192}" --routing "${ROUTINGS:-balanced,uniform,skewed}" 2>>"$out/tail-ab-bench.err" |
      awk -v s="$s" '$2 ~ /^[0-9]+$/ && NF >= 8 {print s, $1, $2, $3, $5}' >>"$rows"
  done
  for ((i = 0, j = ${#order[@]} - 1; i < j; i++, j--)); do tmp=${order[i]}; order[i]=${order[j]}; order[j]=$tmp; done
done
python3 - "$rows" "${timed[@]}" <<'PY'
import collections, sys
rows, settings = sys.argv[1], sys.argv[2:]
d, keys = collections.defaultdict(list), []
for line in open(rows):
    s, preset, tokens, routing, us = line.split()
    k = (preset, tokens, routing)
    if k not in keys:
        keys.append(k)
    d[(k, s)].append(us)
print("| preset | T | routing | " + " | ".join(settings) + " |")
print("|---|---|---|" + "---|" * len(settings))
for k in keys:
    print("| " + " | ".join(k) + " | " + " | ".join(" / ".join(d[(k, s)]) or "-" for s in settings) + " |")
PY

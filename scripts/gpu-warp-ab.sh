#!/usr/bin/env bash
# The warp kernel's A/B on the GPU machine (device tool, carry ["gpu-bundle"]), from the repository
# root, over a bundle built with its variants compiled in:
#   NVFP4MOE_WARP_VARIANTS=1 NVFP4MOE_BUNDLE_CANDLE=0 bash scripts/gpu-bundle.sh     (here)
#   bash scripts/gpu-warp-ab.sh                                                      (there)
# 1. The GPU tests ($TESTS; default: those that launch the warp kernel, warp swiglu layer_
#    faults::) under each variant of $VARIANTS but the first (NVFP4MOE_WARP_VARIANT; "shipped" is
#    the release kernel), then memcheck over $MEMCHECK_TESTS (default: warp swiglu) under each
#    (MEMCHECK=0 or MEMCHECK_TESTS=none: not; TESTS=none: no tests at all, for timing probes whose
#    results are wrong). $TEST_TIMEOUT bounds each variant's tests (default 300 s); a variant whose
#    tests time out is not benched.
# 2. benches/gemm at $BENCH (default '/T1$', T = 1; read flush), the variants interleaved, two
#    rounds ($ROUNDS), then a table: us per launch and variant, one column per variant, the rounds
#    separated by "/".
# 3. With NCU_CASES (criterion filters, e.g. "qwen3-30b-a3b/L2/T1$"): Nsight Compute's kernel
#    duration (--clock-control none, caches flushed; median of 5 launches) per case and variant of
#    $NCU_VARIANTS (default: all): the issue's measure for launches whose floor is under 5 us.
# $NVFP4MOE_BUNDLE: the bundle's folder (default gpu-bundle).
# $VARIANT_ENV: the variable that picks the variant (default NVFP4MOE_WARP_VARIANT; session 13 timed
# the wgmma tiles' variants of 504c7d8, since removed, with NVFP4MOE_GEMM_VARIANT).
# Output stays short (the device tool returns the last 12,000 characters); logs go to $OUT.
set -uo pipefail
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
variants=(${VARIANTS:-shipped d5 d4 x})
venv=${VARIANT_ENV:-NVFP4MOE_WARP_VARIANT}
bench=${BENCH:-/T1\$}
tests=(${TESTS:-warp swiglu layer_ faults::})
memcheck_tests=(${MEMCHECK_TESTS:-warp swiglu})
rounds=${ROUNDS:-2}
b=${NVFP4MOE_BUNDLE:-gpu-bundle}
t=$b/tests/test-gpu
g=$b/benches/gemm
for f in "$t" "$g"; do
  [ -e "$f.gz" ] && gunzip -f "$f.gz"
  chmod +x "$f"
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader || true
fail=0
hung=()
for v in "${variants[@]:1}"; do
  [ "${tests[*]}" = none ] && break
  log="$out/ab-tests-$v.log"
  env "$venv=$v" timeout --kill-after=15s "${TEST_TIMEOUT:-300}" "$t" --include-ignored --test-threads=2 "${tests[@]}" \
    --skip sweep:: >"$log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || fail=1
  echo "tests [$v]: rc=$rc $(grep -E '^test result' "$log" | tail -1)"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    # A variant that hangs would spend every bench run's timeout too: not benched.
    echo "tests [$v]: timed out ($(grep -E 'running for over' "$log" | head -2 | tr '\n' ' ')); $v is not benched"
    hung+=("$v")
    continue
  fi
  grep -E '^test .* FAILED' "$log" | head -5
  [ "${MEMCHECK:-1}" = 0 ] || [ "${memcheck_tests[*]}" = none ] && continue
  log="$out/ab-memcheck-$v.log"
  env "$venv=$v" timeout --kill-after=15s 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$t" \
    --include-ignored --test-threads=1 "${memcheck_tests[@]}" --skip sweep:: >"$log" 2>&1 || fail=1
  echo "memcheck [$v]: $(grep -E '^test result' "$log" | tail -1) | $(grep -E 'ERROR SUMMARY' "$log" | tail -1)"
done
export NVFP4MOE_BF16_TFLOPS=${NVFP4MOE_BF16_TFLOPS:-790}
rows="$out/ab-gemm.txt"
: >"$rows"
order=()
for v in "${variants[@]}"; do [[ " ${hung[*]:-} " == *" $v "* ]] || order+=("$v"); done
for ((r = 0; r < rounds; r++)); do
  for v in "${order[@]}"; do
    env "$venv=$v" timeout 200 "$g" --bench "$bench" 2>&1 | sed -n '/: summary/,$p' | grep -E '/T[0-9]+ ' |
      awk -v v="$v" '{print v, $1, $2, $3}' >>"$rows"
  done
  # The next round in reverse order, so that no variant always runs first.
  for ((i = 0, j = ${#order[@]} - 1; i < j; i++, j--)); do tmp=${order[i]}; order[i]=${order[j]}; order[j]=$tmp; done
done
HUNG="${hung[*]:-}" python3 - "$rows" "${variants[@]}" <<'PY'
import collections, os, sys
rows, vs = sys.argv[1], sys.argv[2:]
hung = set(os.environ["HUNG"].split())
d, order, tile = collections.defaultdict(list), [], {}
for line in open(rows):
    v, n, t, us = line.split()
    d[(n, v)].append(float(us))
    tile.setdefault(n, t)
    if n not in order:
        order.append(n)
print("launch".ljust(40) + "".join(v.rjust(19) for v in vs))
for n in order:
    print(f"{n} {tile[n]}".ljust(40) + "".join(("hung" if v in hung else "/".join(f"{x:.2f}" for x in d[(n, v)])).rjust(19) for v in vs))
PY
ncu_cases=(${NCU_CASES:-})
ncu_variants=()
for v in ${NCU_VARIANTS:-${variants[@]}}; do [[ " ${hung[*]:-} " == *" $v "* ]] || ncu_variants+=("$v"); done
if [ ${#ncu_cases[@]} -gt 0 ]; then
  echo "ncu kernel duration (us, median of 5; --clock-control none, --cache-control all)"
  for c in "${ncu_cases[@]}"; do
    line="$c"
    for v in "${ncu_variants[@]}"; do
      log="$out/ncu-$(echo "$c" | tr -c 'A-Za-z0-9-' _)-$v.csv"
      env "$venv=$v" timeout 150 ncu --clock-control none --cache-control all -k regex:grouped_gemm \
        -s 5 -c 5 --metrics gpu__time_duration.sum --csv "$g" --bench "$c" >"$log" 2>&1
      med=$(python3 -c '
import csv, statistics, sys
v = [float(r["Metric Value"].replace(",", "")) * {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(r["Metric Unit"], float("nan"))
     for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith("\""))
     if r.get("Metric Name") == "gpu__time_duration.sum"]
print(f"{statistics.median(v):.2f}" if v else "n/a")' "$log" 2>/dev/null)
      line="$line  $v=$med"
    done
    echo "$line"
  done
fi
exit $fail

#!/usr/bin/env bash
# compute-sanitizer memcheck over the whole GPU test suite of a bundle (scripts/gpu-bundle.sh), on
# the GPU machine, from the repository root (device tool, carry [".whl", "gpu-bundle"]):
#   bash scripts/gpu-memcheck.sh
# Every test binary that launches CUDA work, with --include-ignored and the runner's environment
# (the CLI path for the CLI tests, whose child processes are checked too: --target-processes all;
# the ModelOpt oracle). Prints each binary's test result and error summary; exit 1 if any failed.
set -uo pipefail
bundle=${NVFP4MOE_BUNDLE:-gpu-bundle}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
for f in "$bundle"/nvfp4-moe.gz "$bundle"/tests/*.gz; do
  [ -e "$f" ] && gunzip -f "$f" && chmod +x "${f%.gz}"
done
export NVFP4MOE_CLI=$PWD/$bundle/nvfp4-moe NVFP4MOE_MODELOPT_ORACLE=$PWD/$bundle/oracle.py
if [ -f .whl/site.tgz ] && [ ! -d /tmp/nvfp4moe-py/site ]; then
  mkdir -p /tmp/nvfp4moe-py && tar xzf .whl/site.tgz -C /tmp/nvfp4moe-py
fi
[ -d /tmp/nvfp4moe-py/site ] && export PYTHONPATH=/tmp/nvfp4moe-py/site${PYTHONPATH:+:$PYTHONPATH}
fail=0
# The binaries with GPU tests (the others make no CUDA call: the sanitizer reports "terminated
# before first instrumented API call" for them). Three modules of test-gpu have their own memcheck
# steps in scripts/gpu-sanitize.sh, so that each call fits the device's 10 minutes: the shape
# sweep (sweep::, memcheck-small and memcheck-medium), the expert shards (shard::, memcheck-shard,
# ~240 s on an H100) and the expert-parallel runner (expert_parallel::, memcheck-ep and
# memcheck-ep-nccl). The whole suite under memcheck is this script and those five steps.
# NVFP4MOE_MEMCHECK_ALL=1 runs test-gpu whole (sweep:: excepted; with NVFP4MOE_MEMCHECK_TIMEOUT
# raised past its 300 s default: it takes more than 10 minutes); NVFP4MOE_MEMCHECK_THREADS sets the
# test threads (default 1).
skips=(--skip sweep::)
[ "${NVFP4MOE_MEMCHECK_ALL:-0}" = 1 ] || skips+=(--skip shard:: --skip expert_parallel::)
for b in ${NVFP4MOE_MEMCHECK_BINARIES:-test-gpu test-cli}; do
  log="$out/memcheck-$b.log"
  timeout "${NVFP4MOE_MEMCHECK_TIMEOUT:-300}" compute-sanitizer --tool memcheck --target-processes all \
    --error-exitcode 9 "$bundle/tests/$b" --include-ignored --test-threads="${NVFP4MOE_MEMCHECK_THREADS:-1}" "${skips[@]}" >"$log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || fail=1
  printf '%-10s rc=%-3s %s | %s\n' "$b" "$rc" "$(grep -E '^test result' "$log" | tail -1)" \
    "$(grep -E 'ERROR SUMMARY' "$log" | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
done
exit $fail

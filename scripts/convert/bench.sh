#!/usr/bin/env bash
# Measures `nvfp4-moe convert` end to end on the H200 host (issue 18's targets): a synthetic BF16
# checkpoint of >= 8 GB (make_synthetic.py, default ~10.7 GB) read from the page cache and
# converted on the GPU and with --device cpu (all of the host's cores), written
#   - to memory-backed storage (/dev/shm, when it has room for the output), and
#   - to the host's disk (every file synced by the converter, so the time includes the sync),
# with the disk's own write speed measured beside it (dd, 4 GiB, fdatasync). Each run's --json
# result goes to $OUT/convert-bench/<device>-<dest>.json; a summary table is printed last.
#
# Targets: >= 2 GB/s of BF16 input with the GPU, >= 1 GB/s with the CPU path on 16 cores (memory-
# backed case, or failing that within 10% of the disk's write speed); peak RssAnon (printed by the
# converter) < 2 GB + 2 x the largest tensor.
#
# Needs the CLI: $NVFP4MOE_CLI, else gpu-bundle/nvfp4-moe(.gz) of the carried bundle (built here
# with scripts/gpu-bundle.sh). Knobs: CONVERT_DISK_DIR (default /var/tmp/nvfp4moe-convert, on the
# host's disk), CONVERT_SHM_DIR (default /dev/shm/nvfp4moe-convert), SYNTH_ARGS (extra flags for
# make_synthetic.py, e.g. "--layers 6"), CONVERT_DEVICES (default "cuda cpu").
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${OUT:-$PWD/gpu-out}/convert-bench
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
[ -n "$cli" ] && [ -x "$cli" ] || { echo "bench.sh: no nvfp4-moe CLI (set NVFP4MOE_CLI or carry gpu-bundle)" >&2; exit 1; }

disk=${CONVERT_DISK_DIR:-/var/tmp/nvfp4moe-convert}
shm=${CONVERT_SHM_DIR:-/dev/shm/nvfp4moe-convert}
devices=${CONVERT_DEVICES:-cuda cpu}
mkdir -p "$disk"
model=$disk/synthetic-bf16
trap 'rm -rf "$disk" "$shm"' EXIT

echo "== machine"; date -u; uname -r; nproc; free -g | head -2
lscpu 2>/dev/null | grep -E 'Model name|^CPU\(s\)' || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
df -hT "$disk" /dev/shm 2>/dev/null || true
"$cli" --version; "$cli" info || true

echo "== synthetic model"
# shellcheck disable=SC2086
python3 "$here/make_synthetic.py" --out "$model" ${SYNTH_ARGS:-} || exit 1
in_bytes=$(du -sb "$model" | cut -f1)
echo "input: $in_bytes bytes"
# From the page cache: read it all once (the generator just wrote it; this makes sure).
cat "$model"/*.safetensors > /dev/null

echo "== disk write speed (dd, 4 GiB, fdatasync)"
dd if=/dev/zero of="$disk/dd.test" bs=64M count=64 conv=fdatasync 2>&1 | tail -1 | tee "$out/dd.txt"
rm -f "$disk/dd.test"

# /dev/shm must hold the output (~0.3 x the input for these shapes) with room to spare.
shm_ok=0
mkdir -p "$shm" 2>/dev/null && {
  avail=$(df -B1 --output=avail "$shm" | tail -1)
  [ "$avail" -gt $((in_bytes / 2 + (2 << 30))) ] && shm_ok=1
}
echo "/dev/shm usable: $shm_ok"

rc=0
for dev in $devices; do
  for dest in shm disk; do
    [ "$dest" = shm ] && [ "$shm_ok" = 0 ] && continue
    base=$([ "$dest" = shm ] && echo "$shm" || echo "$disk")
    target=$base/out-$dev
    rm -rf "$target"
    echo "== convert --device $dev -> $dest ($target)"
    start=$(date +%s.%N)
    if "$cli" --json convert --input "$model" --output "$target" --device "$dev" > "$out/$dev-$dest.json"; then
      end=$(date +%s.%N)
      echo "wall $(awk "BEGIN{printf \"%.2f\", $end - $start}") s; output $(du -sh "$target" | cut -f1)"
    else
      echo "convert --device $dev -> $dest FAILED"; rc=1
    fi
    rm -rf "$target"
  done
done

python3 - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
dd = open(os.path.join(out, "dd.txt")).read().strip() if os.path.exists(os.path.join(out, "dd.txt")) else "?"
print("\n== summary (targets: cuda >= 2 GB/s, cpu >= 1 GB/s; peak RssAnon < 2 GB + 2 x largest tensor)")
print(f"disk write speed: {dd}")
print(f"{'run':<12} {'GB/s':>7} {'seconds':>8} {'in GB':>7} {'out GB':>7} {'peak RssAnon MB':>16} {'bound MB':>9}  verdict")
for f in sorted(glob.glob(os.path.join(out, "*-*.json"))):
    try:
        r = json.load(open(f))
    except Exception:
        continue
    run = os.path.basename(f)[:-5]
    rate, secs = r["gb_per_s"], r["seconds"]["total"]
    peak = r["peak_rss_anon_bytes"] or 0
    bound = 2e9 + 2 * r["bytes"]["largest_tensor"]
    target = 2.0 if run.startswith("cuda") else 1.0
    ok = rate >= target and peak < bound
    print(f"{run:<12} {rate:7.2f} {secs:8.2f} {r['bytes']['input']/1e9:7.2f} {r['bytes']['output']/1e9:7.2f} "
          f"{peak/1e6:16.1f} {bound/1e6:9.0f}  {'meets' if ok else 'MISSES'} ({r['device']})")
PY
exit $rc

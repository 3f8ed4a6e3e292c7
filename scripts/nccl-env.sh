# Sourced by gpu-run.sh (as the bundle's run.sh) and gpu-sanitize.sh: a libnccl.so on the loader's
# path for the bundle's `nccl` feature (cudarc dlopens `libnccl.so`): the system's when the loader
# cache has one (the GPU machine's /usr/lib/x86_64-linux-gnu, NCCL 2.28.3 on 2026-12-06), else a
# link to a pip-installed libnccl.so.2 (nvidia-nccl-cu*) in a temporary directory.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  nccl_lib=$(python3 -c '
import glob, os, site
dirs = site.getsitepackages() + [site.getusersitepackages()]
libs = sorted(f for d in dirs for f in glob.glob(os.path.join(d, "nvidia", "**", "libnccl.so.2"), recursive=True))
print(libs[0] if libs else "")' 2>/dev/null)
  if [ -n "$nccl_lib" ]; then
    nccl_dir=$(mktemp -d)
    ln -s "$nccl_lib" "$nccl_dir/libnccl.so"
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$nccl_dir"
  fi
fi

#!/usr/bin/env bash
# The operator's C++-runtime check (python/cmake/check_cxx_runtime.cmake) on two small shared
# libraries built by the system's C++ compiler: one linked against the shared libstdc++ (passes)
# and one with -static-libstdc++ (must be refused, naming the fix). CI runs it; no torch needed.
#   bash python/tests/check_cxx_runtime_test.sh [CMAKE]
set -euo pipefail
cmake=${1:-cmake}
cxx=${CXX:-c++}
here=$(cd "$(dirname "$0")/.." && pwd)
# A long path, as a build tree's: CMake wraps the message's lines, and the marker must survive it.
work=$(mktemp -d)/a-build-directory-whose-path-is-as-long-as-a-scikit-build-tree-on-a-real-machine
mkdir -p "$work"
trap 'rm -rf "$(dirname "$work")"' EXIT
cat >"$work/lib.cpp" <<'CPP'
#include <sstream>
#include <string>
std::string describe(long v) { std::ostringstream o; o << "got " << v; return o.str(); }
CPP
"$cxx" -shared -fPIC -O1 "$work/lib.cpp" -o "$work/shared.so"
"$cxx" -shared -fPIC -O1 -static-libstdc++ "$work/lib.cpp" -o "$work/static.so"
check() { "$cmake" -DLIB="$1" -DCXX="$cxx" -P "$here/cmake/check_cxx_runtime.cmake"; }
check "$work/shared.so" || {
  echo "check_cxx_runtime: refused the library $cxx linked without -static-libstdc++ (does $cxx link it statically?)" >&2
  exit 1
}
if check "$work/static.so" >"$work/static.log" 2>&1; then
  echo "check_cxx_runtime: accepted a library with a static libstdc++" >&2
  exit 1
fi
grep -q "NVFP4MOE_STATIC_LIBSTDCXX" "$work/static.log" || { cat "$work/static.log" >&2; exit 1; }
echo "check_cxx_runtime: shared libstdc++ accepted, static refused"

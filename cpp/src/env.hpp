// The core's environment switches (A/B timing, tools that do not handle a feature). Each call
// site reads its switch once per process and keeps it in a function-local static.
#pragma once

#include <cstdlib>
#include <cstring>

namespace nvfp4moe::env {

// Whether the variable `name` is set to exactly "0": the switches are on unless turned off.
inline bool switched_off(const char* name) noexcept {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") == 0;
}

// The variable `name` as a whole decimal integer clamped to [lo, hi]; `unset` when it is unset,
// empty or not such an integer.
inline long integer(const char* name, long unset, long lo, long hi) noexcept {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return unset;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0') return unset;
  return x < lo ? lo : x > hi ? hi : x;
}

}  // namespace nvfp4moe::env

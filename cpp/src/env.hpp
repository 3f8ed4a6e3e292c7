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

}  // namespace nvfp4moe::env

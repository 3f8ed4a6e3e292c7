// Internal: recording a failure's message for last_error_message(), and checking launches.
#pragma once

#include "nvfp4moe/nvfp4moe.h"

namespace nvfp4moe {

// Records a printf-style message for last_error_message() and returns `status`.
Status fail(Status status, const char* fmt, ...) noexcept;

// Checks cudaGetLastError() after a launch; on failure records "<what>: <CUDA error>".
Status check_launch(const char* what) noexcept;

}  // namespace nvfp4moe

// The permutation's and combine's shape limits (routing.cu), shared with their can_implement
// checks (can_implement.cpp) so that a plan refuses what the launch would.
#pragma once

#include <cstdint>

namespace nvfp4moe::routing {

// Rows are copied and combined in pieces of kVecsPerCta 16-byte vectors, one per thread: CTA
// (r, c) takes piece c of row r, so that a decode step's few rows still spread over many SMs
// (one CTA per row looped 7 times over a 7168-wide row, latency-bound at T = 1).
constexpr int kVecsPerCta = 128;
// The widest row: its pieces index gridDim.y (at most 65535).
constexpr int64_t kMaxHidden = int64_t(65535) * kVecsPerCta * 8;

// How many CTAs of the one-launch permutation (route_fused_kernel, 1024 threads) the current GPU
// holds at once: permute_and_gather takes it for up to that many 1024-pair chunks (0: no
// cooperative launch on this GPU). The first call per device queries it (cudaOccupancy...): made
// by moe_layer_initialize and permute_workspace_bytes, before any stream capture needs it.
int route_fused_capacity() noexcept;

}  // namespace nvfp4moe::routing

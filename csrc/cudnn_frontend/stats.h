// Telemetry of the cuDNN frontend path, read by openwam_sdpa.frontend_stats():
// how many graphs were built (a steady state builds none; sdpa_varlen's
// ragged graphs apart), how many could not be built, how many calls took the
// ATen fallback, how many backward calls ran with the padding mask, how many
// of those wrote its lengths per call (a steady state writes none), and how
// many ran on shifted scores on either engine (score_shift.h).
// Host counters only: reading them never synchronises. A CUDA graph replay
// runs no host code and counts nothing.
#pragma once

#include <atomic>
#include <cstdint>

namespace openwam::frontend {

struct Stats {
  std::atomic<int64_t> forward_graphs_built{0};
  std::atomic<int64_t> backward_graphs_built{0};
  std::atomic<int64_t> ragged_graphs_built{0};  // sdpa_varlen's, both passes
  std::atomic<int64_t> graph_build_failures{0};
  std::atomic<int64_t> graph_cache_evictions{0};
  std::atomic<int64_t> aten_fallback_calls{0};
  std::atomic<int64_t> padding_mask_backwards{0};
  // Padding-mask backwards whose full lengths were written for the call
  // alone, not read from the device's table (full_lengths.h says when).
  std::atomic<int64_t> lengths_written_per_call{0};
  // Calls whose backward runs on shifted scores, counted where the shift runs
  // (a key mask's in the forward: score_shift.h).
  std::atomic<int64_t> score_shift_backwards{0};
};

inline Stats& stats() {
  static Stats s;
  return s;
}

}  // namespace openwam::frontend

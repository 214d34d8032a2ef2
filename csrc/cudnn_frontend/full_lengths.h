// The lengths behind cuDNN's padding mask when it is used as the fix: every
// sequence as long as the tensor, so nothing is masked.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace openwam::frontend {

// int32 [B] arrays on query's device, valid for a graph enqueued on the
// current stream: `q` holds s_q in every entry, `kv` s_kv.
struct FullLengths {
  const int32_t* q = nullptr;
  const int32_t* kv = nullptr;
  // A per-call write's storage (empty when the lengths come from the
  // device's table, lengths_table.h): keep it until the graph is enqueued.
  at::Tensor per_call;
};

// From the device's table, written once per (B, s_q, s_kv); else (the table
// full, a new configuration inside a CUDA-graph capture, or its block still
// being written on another stream) written for this call alone, through
// PyTorch's caching allocator: inside torch.compile's CUDA-graph warm-up the
// allocator hands out the graph's private pool, where a tensor kept across
// calls would be an untracked allocation.
FullLengths full_lengths(const at::Tensor& query, int64_t s_q, int64_t s_kv);

}  // namespace openwam::frontend

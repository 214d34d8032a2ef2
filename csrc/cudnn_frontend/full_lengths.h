// The lengths behind cuDNN's padding mask when it is used as the fix: every
// sequence as long as the tensor, so nothing is masked.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace openwam::frontend {

// int32 [2, B'] on query's device (B' = B rounded up to 4, so that row 1
// starts 16-byte aligned): row 0 holds s_q, row 1 s_kv, written by one kernel
// on the current stream. Made per call through PyTorch's caching allocator:
// inside torch.compile's CUDA-graph warm-up the allocator hands out the
// graph's private pool, where a tensor kept across calls would be an
// untracked allocation (and, made inside a capture, would be filled only at
// replay).
at::Tensor full_lengths(const at::Tensor& query, int64_t s_q, int64_t s_kv);

}  // namespace openwam::frontend

// The per-call tensors behind a ragged graph, from cu_seqlens on the device:
// each packed tensor's element offsets and the padding mask's true lengths,
// written by one kernel on the current stream (no host synchronisation; made
// through the caching allocator, as full_lengths.h explains).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>

namespace openwam::frontend {

// The packed tensors a ragged graph binds, each with its own row stride.
enum RaggedTensor : int { kRowsQ, kRowsK, kRowsV, kRowsO, kRowsStats, kRowsGradQ, kRowsGradKv,
                          kRaggedTensors };

struct RaggedOffsets {
  at::Tensor offsets;  // int64 [kRaggedTensors, pitch]: row t holds cu * row_stride[t]
  at::Tensor lengths;  // int32 [2, pitch]: the query and key lengths
  void* offsets_of(RaggedTensor t) const;
  void* lengths_q() const;
  void* lengths_kv() const;
};

// cu_seqlens_q/k: int32 [batch + 1] on the device. Sequences batch..bucket-1
// are empty and start at the end. Rows are 16-byte aligned, as cuDNN reads them.
RaggedOffsets ragged_offsets(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                             int64_t batch, int64_t bucket,
                             const std::array<int64_t, kRaggedTensors>& row_strides);

// Zeroes the rows of `packed` ([total_q, H, E], contiguous, 2-byte elements)
// that belong to sequences with queries but no keys: cuDNN writes nothing
// there (measured on 9.19.0), and F.sdpa's answer for a query that sees no
// key is a zero output and a zero dQ. One launch; sequences with keys exit.
void zero_rows_without_keys(at::Tensor& packed, const at::Tensor& cu_seqlens_q,
                            const at::Tensor& cu_seqlens_k, int64_t batch);

}  // namespace openwam::frontend

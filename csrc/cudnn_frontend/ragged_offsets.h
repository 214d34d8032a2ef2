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

// cuDNN writes nothing for a sequence without keys (its output and dQ rows;
// measured on 9.19.0) and, by the same tiling, for one without queries (its
// dK and dV rows), where F.sdpa's answer is 0. These zero those rows of
// packed [total, H, E] tensors (contiguous, 2-byte elements) in one launch,
// none where cu_seqlens_q and cu_seqlens_k are one tensor (no side is then
// empty without the other); sequences with both sides exit at once.
void zero_rows_without_keys(at::Tensor& out, const at::Tensor& cu_seqlens_q,
                            const at::Tensor& cu_seqlens_k, int64_t batch);
void zero_unattended_grads(at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                           const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                           int64_t batch);

}  // namespace openwam::frontend

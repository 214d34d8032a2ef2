// openwam::sdpa_varlen's cuDNN engine: cuDNN's ragged layout through the
// frontend's graphs. ATen's own call of that layout is wrong (its backward
// reads the longest sequence from query.size(2), which for packed
// [total, heads, head_dim] inputs is head_dim: pytorch #186142); built here
// as cudnn-frontend's samples build it, the same cuDNN is right:
//   - q, k, v, the output and the gradients are packed [total, heads, E]
//     buffers (rows with unit stride along E) seen as [B, H, S, E] through
//     int64 per-sequence offsets;
//   - the padding mask carries each sequence's true lengths;
//   - the logsumexp is packed too, float32 [total_q, H, 1];
//   - the backward sizes its dQ accumulator by max_total_seq_len.
// B, S and the totals are bucketed (ragged_buckets.h): batches of varying
// sequence count and lengths reuse a few graphs. Causal masks are top-left
// per sequence, as F.sdpa's is_causal. A sequence with queries but no keys
// gets zero output and zero dQ, one with keys but no queries zero dK and dV,
// as F.sdpa gives. No host synchronisation.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace openwam::frontend {

struct RaggedForward {
  at::Tensor out;        // [total_q, H, Ev], contiguous
  at::Tensor logsumexp;  // float32 [total_q, H, 1]; empty when not training
  at::Tensor philox_seed, philox_offset;  // 0-dim int64 with dropout, else undefined
};

// cu_seqlens int32 [B + 1] on q's device; max_seqlen the longest sequence
// (an upper bound, as FlashAttention-2 takes it). `training`: write the
// logsumexp and build the backward graph now too. False, with the reason in
// `why_not`, when cuDNN cannot build a graph for this configuration.
bool ragged_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, bool is_causal,
                    std::optional<double> scale, bool training, RaggedForward& result,
                    std::string& why_not);

// The backward of ragged_forward(training=true); contiguous gradients.
bool ragged_backward(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                     const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
                     const at::Tensor& philox_seed, const at::Tensor& philox_offset,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                     int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p,
                     bool is_causal, std::optional<double> scale,
                     std::tuple<at::Tensor, at::Tensor, at::Tensor>& grads,
                     std::string& why_not);

}  // namespace openwam::frontend

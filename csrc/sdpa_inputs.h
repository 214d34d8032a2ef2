// The arguments of one openwam::sdpa call, validated once, and the facts the
// dispatch decision and the guards read off them.
#pragma once

#include <ATen/ATen.h>
#include <optional>

namespace openwam {

struct SdpaInputs {
  at::Tensor query;  // [..., L, E]
  at::Tensor key;    // [..., S, E]
  at::Tensor value;  // [..., S, Ev]
  std::optional<at::Tensor> attn_mask;  // broadcastable to [..., L, S]
  double dropout_p = 0.0;
  bool is_causal = false;
  std::optional<double> scale;
  bool enable_gqa = false;

  int64_t s_q() const { return query.size(-2); }
  int64_t s_kv() const { return key.size(-2); }
  int64_t head_dim() const { return query.size(-1); }
  // Will autograd record this call: grad mode on and q, k or v requires grad.
  // Decided before any autograd::Function runs (grad mode is off inside).
  bool differentiated() const;
};

// Raises a clear error (op, argument, expected, got) for any input F.sdpa
// would reject, and for the misuses listed in validate_inputs' body.
void validate_inputs(const SdpaInputs& in);

}  // namespace openwam

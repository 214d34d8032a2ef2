// The arguments of one openwam::sdpa call, exactly as F.sdpa takes them, and
// the sizes the decision and the guard table read off them.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/SymInt.h>

#include <optional>

namespace openwam {

struct SdpaCall {
  const at::Tensor& query;                  // [..., L, E]
  const at::Tensor& key;                    // [..., S, E]
  const at::Tensor& value;                  // [..., S, Ev]
  const std::optional<at::Tensor>& attn_mask;  // broadcastable to [..., L, S]
  double dropout_p;
  bool is_causal;
  std::optional<double> scale;
  bool enable_gqa;

  // Will autograd record this call: grad mode on and q, k or v requires grad.
  bool differentiated() const;
  // Differentiated, or with dropout: a call with dropout takes the plan and
  // the training forward whatever the grad mode, so that its dropout pattern
  // does not depend on it. Reentrant activation checkpointing runs the
  // forward under no_grad and recomputes it with grad, and the recompute must
  // draw what the first forward drew (the ATen fallback's pad_keys_forward
  // plan draws it over the padded keys).
  bool takes_training_forward() const { return differentiated() || dropout_p > 0.0; }
};

// The checks F.sdpa makes before its selector runs (validate_sdpa_input in
// ATen's attention.cpp): dtypes, devices, ranks, nesting, the mask's dtype. A
// call failing them must reach PyTorch untouched, to fail with its own error.
bool passes_pytorch_validation(const SdpaCall& call);

// Whether query, key or value has no elements.
bool any_input_empty(const SdpaCall& call);

// 4-D inputs: key and value of one head count, which equals the query's or,
// under enable_gqa, divides it.
bool heads_group(const SdpaCall& call);

// Whether the shapes are ones PyTorch's math backend takes: inputs of one
// rank, batch dims and head_dim (query's and key's) alike, heads that group
// (4-D; enable_gqa needs 3-D or more), and a mask that broadcasts to the
// scores [..., L, S].
bool math_takes_shapes(const SdpaCall& call);

// The op's checks beyond F.sdpa's, for calls on which stock reads out of
// bounds instead of raising (value shorter than key, a mask on another
// device); calls PyTorch rejects first are left to it. Raises c10::Error
// (RuntimeError) naming the op and the sizes or devices.
void check_call(const SdpaCall& call);

// The sizes of a call the cuDNN path can take (3-D counts as one head).
// Symbolic while torch.compile traces with dynamic shapes: a comparison then
// installs a guard on exactly what it compares (s_kv % 128 == 64, say), so a
// rule never pins a size it does not look at.
struct CallShape {
  c10::SymInt batch = 1;
  c10::SymInt heads = 1;
  c10::SymInt kv_heads = 1;
  c10::SymInt s_q = 1;
  c10::SymInt s_kv = 1;
  c10::SymInt head_dim = 8;
  c10::SymInt head_dim_v = 8;
  bool is_causal = false;
  bool fp16 = false;  // float16 (bfloat16 otherwise, on the cuDNN path)
  bool has_mask = false;
  // A bool mask: the cuDNN path turns it into a bias of 0 and -inf, which the
  // score shift can raise exactly (score_shift.h).
  bool bool_mask = false;
  double dropout_p = 0.0;
  // A call of openwam::sdpa_varlen on cuDNN's ragged layout (s_q, s_kv: the
  // longest sequences); openwam::sdpa's calls are never ragged.
  bool ragged = false;
};

// Precondition: query/key/value are 3-D or 4-D (the cuDNN path's inputs).
CallShape shape_of(const SdpaCall& call);

}  // namespace openwam

// The Autograd kernel of openwam::_sdpa_varlen: runs the leaf op below
// autograd and, when query, key or value need a gradient, records a node whose
// backward calls openwam::_sdpa_varlen_backward through the dispatcher (one
// op of the backward graph under torch.compile). As cudnn_path.cpp does for
// openwam::_cudnn_sdpa.
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <memory>

#include "autograd_node.h"
#include "varlen_ops.h"

namespace openwam {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

struct SdpaVarlenBackward final : public Node {
  SavedVariable query, key, value, out, logsumexp, rng_state, rng_offset, cu_seqlens_q,
      cu_seqlens_k;
  c10::SymInt max_seqlen_q = 0, max_seqlen_k = 0;
  double dropout_p = 0.0;
  bool is_causal = false;
  std::optional<double> scale;
  int64_t backend = 0;

  variable_list apply(variable_list&& grads) override {
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return variable_list(3);  // an undefined gradient means zero
    }
    const NodePtr self = Ownership::self(this);
    // Unpacked before the guard, as in CudnnSdpaBackward (cudnn_path.cpp):
    // non-reentrant checkpointing recomputes the forward at the first unpack.
    const at::Tensor q = query.unpack(), k = key.unpack(), v = value.unpack();
    const at::Tensor o = out.unpack(self), lse = logsumexp.unpack(self);
    const at::Tensor state = rng_state.unpack(self), offset = rng_offset.unpack(self);
    const at::Tensor cu_q = cu_seqlens_q.unpack(), cu_k = cu_seqlens_k.unpack();
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) {
      below_autograd.emplace();
    }
    auto [dq, dk, dv] = ops::sdpa_varlen_backward().call(
        grad_out, q, k, v, o, lse, state, offset, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
        dropout_p, is_causal, scale, backend);
    variable_list result(3);
    if (task_should_compute_output(0)) result[0] = std::move(dq);
    if (task_should_compute_output(1)) result[1] = std::move(dk);
    if (task_should_compute_output(2)) result[2] = std::move(dv);
    return result;
  }

  std::string name() const override { return "openwam::SdpaVarlenBackward"; }

  // Compiled autograd: as CudnnSdpaBackward (autograd_node.h says why).
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    args.collect(query, false);
    args.collect(key, false);
    args.collect(value, false);
    args.collect(out, true);
    args.collect(logsumexp, true);
    args.collect(rng_state, true);
    args.collect(rng_offset, true);
    args.collect(cu_seqlens_q, false);
    args.collect(cu_seqlens_k, false);
    args.collect(max_seqlen_q);
    args.collect(max_seqlen_k);
    args.collect(dropout_p);
    args.collect(is_causal);
    args.collect(scale);
    args.collect(backend);
  }

  variable_list apply_with_saved(const variable_list& grads,
                                 torch::dynamo::autograd::SwapSavedVariables& swap) override {
    return apply_with_swapped([&] { return apply(variable_list(grads)); }, swap, query, key,
                              value, out, logsumexp, rng_state, rng_offset, cu_seqlens_q,
                              cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  }

  void release_variables() override {
    for (SavedVariable* v : {&query, &key, &value, &out, &logsumexp, &rng_state, &rng_offset,
                             &cu_seqlens_q, &cu_seqlens_k}) {
      v->reset_data();
    }
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sdpa_varlen_autograd(
    c10::DispatchKeySet keys, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, double dropout_p, bool is_causal,
    std::optional<double> scale, int64_t backend, bool compute_log_sumexp) {
  // No tangent formula (as cudnn_path.cpp's leaf op): forward-mode AD raises.
  TORCH_CHECK_NOT_IMPLEMENTED(
      !(torch::autograd::isFwGradDefined(query) || torch::autograd::isFwGradDefined(key) ||
        torch::autograd::isFwGradDefined(value)),
      "Trying to use forward AD with openwam::_sdpa_varlen that does not support it because "
      "it has not been implemented yet.");
  const bool needs_grad = torch::autograd::compute_requires_grad(query, key, value);
  // A call recorded without grad and replayed with it (an exported program
  // after run_decompositions() bakes in the False its trace saw) still gets
  // the logsumexp its backward reads. Fake tensors pass here too, so the
  // Meta kernel sees the same flag.
  compute_log_sumexp = compute_log_sumexp || needs_grad;
  auto result = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return ops::sdpa_varlen_forward().redispatch(
        keys & c10::after_ADInplaceOrView_keyset, query, key, value, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale, backend,
        compute_log_sumexp);
  }();
  if (needs_grad) {
    NodePtr node_ptr = Ownership::make<SdpaVarlenBackward>();
    auto* node = static_cast<SdpaVarlenBackward*>(node_ptr.get());
    node->set_next_edges(torch::autograd::collect_next_edges(query, key, value));
    node->query = SavedVariable(query, false);
    node->key = SavedVariable(key, false);
    node->value = SavedVariable(value, false);
    node->cu_seqlens_q = SavedVariable(cu_seqlens_q, false);
    node->cu_seqlens_k = SavedVariable(cu_seqlens_k, false);
    node->max_seqlen_q = max_seqlen_q;
    node->max_seqlen_k = max_seqlen_k;
    node->dropout_p = dropout_p;
    node->is_causal = is_causal;
    node->scale = scale;
    node->backend = backend;
    const at::Tensor& out = std::get<0>(result);
    torch::autograd::set_history(out, node_ptr);
    node->out = SavedVariable(out, true);
    node->logsumexp = SavedVariable(std::get<1>(result), true);
    node->rng_state = SavedVariable(std::get<2>(result), true);
    node->rng_offset = SavedVariable(std::get<3>(result), true);
  }
  return result;
}

}  // namespace
}  // namespace openwam

TORCH_LIBRARY_IMPL(openwam, Autograd, m) {
  m.impl("_sdpa_varlen", &openwam::sdpa_varlen_autograd);
  // Not twice differentiable, and says so as cudnn_path.cpp's backward does.
  m.impl("_sdpa_varlen_backward", torch::autograd::autogradNotImplementedFallback());
}

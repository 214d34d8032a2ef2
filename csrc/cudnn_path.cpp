#include "cudnn_path.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <memory>
#include <type_traits>

#include "autograd_node.h"
#include "cudnn_attention.h"
#include "decision.h"
#include "ops.h"
#include "padding.h"
#include "plan.h"
#include "score_shift.h"

namespace openwam {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// The backward of openwam::_cudnn_sdpa: calls openwam::_cudnn_sdpa_backward
// through the dispatcher, so that torch.compile records it as one op of the
// backward graph.
struct CudnnSdpaBackward final : public Node {
  SavedVariable query, key, value, bias, out, logsumexp, philox_seed, philox_offset;
  bool has_bias = false;
  double dropout_p = 0.0;
  bool is_causal = false;
  std::optional<double> scale;
  int64_t plan = 0;

  variable_list apply(variable_list&& grads) override {
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return variable_list(3);  // an undefined gradient means zero
    }
    const NodePtr self = Ownership::self(this);
    // Unpacked before the guard below: under non-reentrant activation
    // checkpointing the first unpack recomputes the checkpointed forward,
    // which must run through autograd to save its tensors again (inside the
    // guard it saved none, and torch.utils.checkpoint raised).
    std::optional<at::Tensor> bias_opt;
    if (has_bias) {
      bias_opt = bias.unpack();
    }
    const at::Tensor q = query.unpack(), k = key.unpack(), v = value.unpack();
    const at::Tensor o = out.unpack(self), lse = logsumexp.unpack(self);
    const at::Tensor seed = philox_seed.unpack(self), offset = philox_offset.unpack(self);
    // A plain backward (no create_graph) records nothing, so the backward op
    // and the ATen calls inside it skip their autograd kernels (a microsecond
    // or two of host time). With create_graph the call keeps them: the
    // backward op's Autograd kernel (registered below) then marks the
    // gradients as not differentiable again.
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) {
      below_autograd.emplace();
    }
    auto [dq, dk, dv] = ops::cudnn_sdpa_backward().call(
        grad_out, q, k, v, bias_opt, o, lse, seed, offset, dropout_p, is_causal, scale, plan);
    variable_list result(3);
    if (task_should_compute_output(0)) result[0] = std::move(dq);
    if (task_should_compute_output(1)) result[1] = std::move(dk);
    if (task_should_compute_output(2)) result[2] = std::move(dv);
    return result;
  }

  std::string name() const override { return "openwam::CudnnSdpaBackward"; }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    args.collect(query, false);
    args.collect(key, false);
    args.collect(value, false);
    args.collect(bias, false);
    args.collect(out, true);
    args.collect(logsumexp, true);
    args.collect(philox_seed, true);
    args.collect(philox_offset, true);
    args.collect(has_bias);
    args.collect(dropout_p);
    args.collect(is_causal);
    args.collect(scale);
    args.collect(plan);
  }

  variable_list apply_with_saved(const variable_list& grads,
                                 torch::dynamo::autograd::SwapSavedVariables& swap) override {
    return apply_with_swapped([&] { return apply(variable_list(grads)); }, swap, query, key,
                              value, bias, out, logsumexp, philox_seed, philox_offset);
  }

  void release_variables() override {
    for (SavedVariable* v : {&query, &key, &value, &bias, &out, &logsumexp,
                             &philox_seed, &philox_offset}) {
      v->reset_data();
    }
  }
};

// The Autograd kernel of openwam::_cudnn_sdpa: runs the op below autograd and,
// when q, k or v need a gradient, records CudnnSdpaBackward for its output.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> cudnn_sdpa_autograd(
    c10::DispatchKeySet keys, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_bias, double dropout_p, bool is_causal,
    std::optional<double> scale, bool compute_log_sumexp, int64_t plan) {
  // No tangent formula: forward-mode AD (torch.func.jvp, forward_ad) raises
  // as PyTorch's generated kernels do for an op without one (its own cuDNN
  // attention among them), instead of leaving the output without a tangent.
  TORCH_CHECK_NOT_IMPLEMENTED(
      !(torch::autograd::isFwGradDefined(query) || torch::autograd::isFwGradDefined(key) ||
        torch::autograd::isFwGradDefined(value) || torch::autograd::isFwGradDefined(attn_bias)),
      "Trying to use forward AD with openwam::_cudnn_sdpa that does not support it because "
      "it has not been implemented yet.");
  const bool needs_grad = torch::autograd::compute_requires_grad(query, key, value);
  if (needs_grad && !compute_log_sumexp) {
    // A call recorded without gradients and run with them: an exported
    // program after run_decompositions() holds the inference forward and the
    // empty plan its no-grad trace chose (as sdpa_varlen's leaf op, whose
    // autograd kernel says the same). It takes the training forward and the
    // plan decide() gives a differentiated call of this shape.
    const SdpaCall call{query, key, value, attn_bias, dropout_p, is_causal, scale,
                        /*enable_gqa=*/query.sym_size(1) != key.sym_size(1)};
    const TrainingPlan t = training_plan(call, runtime_cudnn_version(), current_settings().pad);
    TORCH_CHECK(t.verdict.avoid == nullptr,
                "openwam::_cudnn_sdpa: this call was recorded without gradients (an exported "
                "program after run_decompositions() keeps what its trace chose), and guard "
                "rule ", t.verdict.avoid != nullptr ? t.verdict.avoid->name : "",
                " keeps its differentiated form off cuDNN; export from a call whose inputs "
                "require grad, or keep openwam::sdpa undecomposed");
    plan = t.plan.to_int();
    compute_log_sumexp = true;
  }
  TORCH_CHECK(!at::GradMode::is_enabled() || !attn_bias.has_value() ||
                  !attn_bias->requires_grad(),
              "openwam::_cudnn_sdpa: attn_bias must not require grad (the cuDNN "
              "path does not differentiate the mask)");
  auto result = [&] {
    // As ATen's generated autograd kernels do: a redispatch past autograd
    // (no second dispatch from the top), with the ATen calls inside below
    // autograd too.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return ops::cudnn_sdpa().redispatch(keys & c10::after_ADInplaceOrView_keyset, query,
                                        key, value, attn_bias, dropout_p, is_causal, scale,
                                        compute_log_sumexp, plan);
  }();
  if (needs_grad) {
    NodePtr node_ptr = Ownership::make<CudnnSdpaBackward>();
    auto* node = static_cast<CudnnSdpaBackward*>(node_ptr.get());
    node->set_next_edges(torch::autograd::collect_next_edges(query, key, value));
    node->query = SavedVariable(query, false);
    node->key = SavedVariable(key, false);
    node->value = SavedVariable(value, false);
    node->has_bias = attn_bias.has_value();
    node->plan = plan;
    if (shifts_in_forward(Plan::from_int(plan), attn_bias, key.sym_size(2), compute_log_sumexp)) {
      // The forward shifted the scores (score_shift.h): the backward takes
      // the raised bias with the shifted logsumexp, on stock's graph, and
      // keeps no reference to the bias itself.
      node->bias = SavedVariable(std::get<4>(result), false);
      Plan backward = Plan::from_int(plan);
      backward.shift_scores = false;
      node->plan = backward.to_int();
    } else if (node->has_bias) {
      node->bias = SavedVariable(*attn_bias, false);
    }
    node->dropout_p = dropout_p;
    node->is_causal = is_causal;
    node->scale = scale;
    const at::Tensor& out = std::get<0>(result);
    torch::autograd::set_history(out, node_ptr);
    node->out = SavedVariable(out, true);
    node->logsumexp = SavedVariable(std::get<1>(result), true);
    node->philox_seed = SavedVariable(std::get<2>(result), true);
    node->philox_offset = SavedVariable(std::get<3>(result), true);
  }
  return result;
}

}  // namespace

at::Tensor run_cudnn_path(const SdpaCall& call, const Decision& decision) {
  // cuDNN takes [B, H, S, E]; a 3-D [N, S, E] call gets a unit head axis
  // (a view, so autograd maps the gradients back).
  const bool three_d = call.query.dim() == 3;
  const at::Tensor q = three_d ? call.query.unsqueeze(1) : call.query;
  const at::Tensor k = three_d ? call.key.unsqueeze(1) : call.key;
  const at::Tensor v = three_d ? call.value.unsqueeze(1) : call.value;
  std::optional<at::Tensor> bias;
  if (call.attn_mask.has_value()) {
    const at::Tensor& mask = *call.attn_mask;
    const c10::SymInt s_kv = call.key.sym_size(-2);
    // A K/V shim backward reads the bias with its keys padded (on cuDNN
    // 9.19.0 an additive mask's: a bool mask's takes the score shift there).
    // Where the bias is a new tensor anyway (a bool mask, or one of another
    // dtype), it is
    // written padded here, once, instead of copied padded at the backward: in
    // a compiled Qwen2 step at 2x4032, left-padded, that copy was two thirds
    // of the shim's copied bytes (H200, cuDNN 9.19.0). A mask already in the
    // inputs' dtype is not copied: every layer would hold its own padded copy
    // from its forward to its backward.
    std::optional<c10::SymInt> padded;
    if (mask.scalar_type() != call.query.scalar_type() &&
        shim_takes_bias(decision.plan, true, s_kv, call.dropout_p)) {
      padded = padded_length(s_kv, kCudnnKeyTile);
    }
    bias = cudnn_bias(mask, call.query.scalar_type(), call.query.dim(), s_kv, padded);
  }
  at::Tensor out = std::get<0>(ops::cudnn_sdpa().call(
      q, k, v, bias, call.dropout_p, call.is_causal, call.scale,
      /*compute_log_sumexp=*/call.takes_training_forward(), decision.plan.to_int()));
  return three_d ? out.squeeze(1) : out;
}

}  // namespace openwam

TORCH_LIBRARY_IMPL(openwam, Autograd, m) {
  m.impl("_cudnn_sdpa", &openwam::cudnn_sdpa_autograd);
  // The backward has no derivative of its own. Under create_graph its
  // gradients get a node that raises "derivative for
  // openwam::_cudnn_sdpa_backward is not implemented" if differentiated
  // again, as PyTorch's fused SDPA backwards do. Without a kernel here,
  // PyTorch's fallback only warned, and a second derivative came out wrong
  // (the CPU reference's) or zero.
  m.impl("_cudnn_sdpa_backward", torch::autograd::autogradNotImplementedFallback());
}

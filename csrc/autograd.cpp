// openwam::sdpa's kernel and its autograd: the cuDNN path as a C++
// torch::autograd::Function whose backward applies the plan the guards chose.
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>

#include "cudnn_attention.h"
#include "dispatch.h"
#include "padding.h"
#include "pytorch_path.h"
#include "repair_dq.h"
#include "sdpa_inputs.h"
#include "settings.h"

namespace openwam {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Padded key/value and bias for a cuDNN call: the bias is additive in the
// query's dtype with -inf on the padded keys (and the causal mask folded in).
struct PaddedCudnnInputs {
  at::Tensor key;
  at::Tensor value;
  at::Tensor bias;
};

PaddedCudnnInputs pad_for_cudnn(const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const at::Tensor& bias,
                                bool is_causal) {
  std::optional<at::Tensor> mask;
  if (bias.defined()) {
    mask = bias;
  }
  PaddedKeys p = pad_keys_for_call(query, key, value, mask, is_causal);
  return {p.key, p.value, cudnn_bias(p.mask, query.scalar_type(), 4, p.key.size(2))};
}

// OPENWAM_SDPA_CHECK_FINITE=1 (debug only: the counts synchronise with the
// host). Raises naming the shapes, the plan and the smallest logsumexp.
void check_finite_gradients(const at::Tensor& dq, const at::Tensor& dk,
                            const at::Tensor& dv, const at::Tensor& query,
                            const at::Tensor& key, const at::Tensor& logsumexp,
                            Plan plan) {
  const int64_t bad_dq = (~at::isfinite(dq)).sum().item<int64_t>();
  const int64_t bad_dk = (~at::isfinite(dk)).sum().item<int64_t>();
  const int64_t bad_dv = (~at::isfinite(dv)).sum().item<int64_t>();
  if (bad_dq + bad_dk + bad_dv == 0) {
    return;
  }
  const double min_lse = logsumexp.min().item<double>();
  TORCH_CHECK(false,
              "openwam::sdpa: non-finite gradient (OPENWAM_SDPA_CHECK_FINITE=1): "
              "dQ ", bad_dq, ", dK ", bad_dk, ", dV ", bad_dv,
              " non-finite elements; query ", query.sizes(), ", key ",
              key.sizes(), ", plan ", to_string(plan),
              ", smallest logsumexp ", min_lse);
}

class CudnnSdpaFunction : public torch::autograd::Function<CudnnSdpaFunction> {
 public:
  // q, k, v: 4-D; bias: additive, query dtype, 4-D, or none. (An optional,
  // not an undefined Tensor: Function::apply records device and dtype of
  // every Tensor argument.)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& query,
                            const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& bias, double dropout_p,
                            bool is_causal, std::optional<double> scale,
                            int64_t plan_id, bool check_finite) {
    const auto plan = static_cast<Plan>(plan_id);
    at::Tensor k = key, v = value, b = bias.value_or(at::Tensor());
    bool causal = is_causal;
    if (plan == Plan::kPadForward) {
      // Dropout: the backward must see the key length the forward's dropout
      // pattern was drawn for, so both run on the padded keys.
      PaddedCudnnInputs p = pad_for_cudnn(query, key, value, b, is_causal);
      k = p.key, v = p.value, b = p.bias, causal = false;
    }
    CudnnForward f = cudnn_forward(query, k, v, b, /*compute_logsumexp=*/true,
                                   dropout_p, causal, scale);
    ctx->save_for_backward({query, k, v, b, f.out, f.logsumexp,
                            f.philox_seed, f.philox_offset});
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["is_causal"] = causal;
    ctx->saved_data["has_scale"] = scale.has_value();
    ctx->saved_data["scale"] = scale.value_or(0.0);
    ctx->saved_data["plan"] = plan_id;
    ctx->saved_data["check_finite"] = check_finite;
    ctx->saved_data["max_q"] = f.max_q;
    ctx->saved_data["s_kv"] = key.sym_size(2);
    return f.out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "openwam::sdpa: double backward (create_graph=True) is not "
                "supported on the cuDNN path; for it, set OPENWAM_SDPA_CUDNN=0 "
                "and select PyTorch's math backend with "
                "torch.nn.attention.sdpa_kernel(SDPBackend.MATH)");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& query = saved[0];
    at::Tensor key = saved[1], value = saved[2], bias = saved[3];
    CudnnForward f;
    f.out = saved[4];
    f.logsumexp = saved[5];
    f.philox_seed = saved[6];
    f.philox_offset = saved[7];
    f.max_q = ctx->saved_data["max_q"].toSymInt();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    bool causal = ctx->saved_data["is_causal"].toBool();
    std::optional<double> scale;
    if (ctx->saved_data["has_scale"].toBool()) {
      scale = ctx->saved_data["scale"].toDouble();
    }
    const auto plan = static_cast<Plan>(ctx->saved_data["plan"].toInt());
    const c10::SymInt s_kv = ctx->saved_data["s_kv"].toSymInt();
    const at::Tensor grad_out = grads[0];

    if (plan == Plan::kPadBackward) {
      PaddedCudnnInputs p = pad_for_cudnn(query, key, value, bias, causal);
      key = p.key, value = p.value, bias = p.bias, causal = false;
    }
    auto [dq, dk, dv] = cudnn_backward(grad_out, query, key, value, f, bias,
                                       dropout_p, causal, scale);
    if (plan == Plan::kRepairDq) {
      // F.sdpa's default scale: 1 / sqrt(head_dim).
      const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(query.size(-1))));
      repair_dq_(dq, grad_out, query, key, value, f.out, f.logsumexp, bias,
                 causal, s);
    }
    if (dk.sym_size(2) != s_kv) {
      dk = dk.narrow_symint(2, 0, s_kv);
      dv = dv.narrow_symint(2, 0, s_kv);
    }
    if (ctx->saved_data["check_finite"].toBool()) {
      check_finite_gradients(dq, dk, dv, query, key, f.logsumexp, plan);
    }
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor run_cudnn_sdpa(const SdpaInputs& in, const Decision& decision,
                          const Settings& settings) {
  // cuDNN takes [B, H, S, E]; a 3-D [N, S, E] call gets a unit head axis
  // (a view, so autograd maps the gradients back).
  const bool three_d = in.query.dim() == 3;
  const at::Tensor q = three_d ? in.query.unsqueeze(1) : in.query;
  const at::Tensor k = three_d ? in.key.unsqueeze(1) : in.key;
  const at::Tensor v = three_d ? in.value.unsqueeze(1) : in.value;
  std::optional<at::Tensor> bias;
  if (in.attn_mask.has_value()) {
    bias = cudnn_bias(*in.attn_mask, in.query.scalar_type(), in.query.dim(), in.s_kv());
  }

  at::Tensor out;
  if (!in.differentiated()) {
    // Nothing to differentiate: the defect is backward-only, so this is
    // exactly stock cuDNN's inference call.
    out = cudnn_forward(q, k, v, bias.value_or(at::Tensor()), /*compute_logsumexp=*/false,
                        in.dropout_p, in.is_causal, in.scale)
              .out;
  } else {
    out = CudnnSdpaFunction::apply(q, k, v, bias, in.dropout_p, in.is_causal,
                                   in.scale, static_cast<int64_t>(decision.plan),
                                   settings.check_finite);
  }
  return three_d ? out.squeeze(1) : out;
}

at::Tensor sdpa(const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& value,
                const std::optional<at::Tensor>& attn_mask, double dropout_p,
                bool is_causal, std::optional<double> scale, bool enable_gqa) {
  const SdpaInputs in{query, key, value, attn_mask, dropout_p, is_causal,
                      scale, enable_gqa};
  validate_inputs(in);
  const Settings settings = current_settings();
  const Decision decision = decide(in, settings);
  if (decision.rule != nullptr) {
    warn_once(*decision.rule);
  }
  return decision.use_cudnn ? run_cudnn_sdpa(in, decision, settings)
                            : run_pytorch_sdpa(in, decision);
}

}  // namespace
}  // namespace openwam

// The Autograd kernel sees requires_grad and grad mode, which decide the plan.
// Below autograd (inference mode, no autograd key) the same function runs and
// finds nothing to differentiate.
TORCH_LIBRARY_IMPL(openwam, Autograd, m) {
  m.impl("sdpa", &openwam::sdpa);
}
TORCH_LIBRARY_IMPL(openwam, CompositeExplicitAutograd, m) {
  m.impl("sdpa", &openwam::sdpa);
}

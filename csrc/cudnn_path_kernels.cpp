// The kernels of the cuDNN path's leaf ops, openwam::_cudnn_sdpa and
// openwam::_cudnn_sdpa_backward.
//   CUDA  the op's own cuDNN graphs (cudnn_frontend/), the plan's padding
//         mask inside; where a graph cannot be built for a call, ATen's cuDNN
//         attention with the plan's padded inputs instead.
//   CPU   the fp32 reference (reference_attention.h) with the padded inputs,
//         so that the fallback's padding is tested on the CPU too.
//   Meta  the outputs' shapes and layouts that torch.compile traces with.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "aligned_operand.h"
#include "cudnn_attention.h"
#include "leaf_inputs.h"
#include "padding.h"
#include "plan.h"
#include "reference_attention.h"
#include "row_copy.h"
#include "score_shift.h"
#include "settings.h"
#include "shim_slices.h"

#ifdef OPENWAM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif
#ifdef OPENWAM_WITH_CUDNN_FRONTEND
#include "cudnn_frontend/sdpa_engine.h"
#include "cudnn_frontend/stats.h"
#endif

namespace openwam {
namespace {

using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensors5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The attention the padded-input plans are carried out around.
struct Engine {
  CudnnForward (*forward)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& bias, bool compute_logsumexp,
                          double dropout_p, bool is_causal, std::optional<double> scale);
  Tensors3 (*backward)(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& out,
                       const at::Tensor& logsumexp, const at::Tensor& philox_seed,
                       const at::Tensor& philox_offset, const at::Tensor& bias,
                       double dropout_p, bool is_causal, std::optional<double> scale);
  bool cuda;  // cuDNN's kernels: float16 or bfloat16 inputs (leaf_inputs.h)
};

// K/V zero-padded to a multiple of the cuDNN key tile, with a bias that hides
// the padded keys by -inf (and folds in is_causal: a bias and is_causal
// cannot be combined). The padded keys add exactly 0 to out and logsumexp, so
// a backward on them may use the unpadded forward's out and logsumexp.
struct PaddedKeys {
  at::Tensor key, value, bias;
};

// The bias as the leaf ops take it: its last dim the key length (or 1), or,
// for a K/V shim backward, already grown to the key tile with -inf there
// (run_cudnn_path writes it so where it makes the bias anyway). The forward,
// and every backward but the shim's, read its first s_kv keys. A key axis of
// 1 (only a direct call of the leaf op passes one; cudnn_bias never does) is
// materialised: the engines describe the bias to cuDNN with a contiguous key
// axis (sdpa_engine.h), not the stride 0 of an expand.
at::Tensor bias_keys(const at::Tensor& bias, int64_t s_kv) {
  if (!bias.defined() || bias.size(-1) == s_kv) {
    return bias;
  }
  if (bias.size(-1) == 1) {
    std::vector<int64_t> sizes = bias.sizes().vec();
    sizes.back() = s_kv;
    return bias.expand(sizes).contiguous();
  }
  const int64_t padded = padded_length(s_kv, kCudnnKeyTile);
  TORCH_CHECK(bias.size(-1) == padded, "openwam::_cudnn_sdpa: attn_bias's last dim must be "
              "the key length (", s_kv, ") or, padded for the K/V shim, ", padded, "; got ",
              bias.size(-1));
  return bias.narrow(-1, 0, s_kv);
}

// The bias of pad_keys_for_cudnn alone: what hides the keys past `s_kv` of
// `s_kv_padded` from `query`'s rows, with `bias` and is_causal folded in. A
// bias that comes padded (bias_keys) is that already.
at::Tensor padded_keys_bias(const at::Tensor& query, const at::Tensor& bias, int64_t s_kv,
                            int64_t s_kv_padded, bool is_causal) {
  if (bias.defined() && s_kv_padded != s_kv && bias.size(-1) == s_kv_padded) {
    return bias;
  }
  std::optional<at::Tensor> mask;
  if (bias.defined()) {
    mask = bias;
  }
  at::Tensor padded_mask =
      pad_key_mask(mask, s_kv, s_kv_padded, query.device(), PadWrite::kLeafKernel);
  if (is_causal) {
    TORCH_INTERNAL_ASSERT(!bias.defined());
    const int64_t s_q = query.size(2);
    const auto index = query.options().dtype(at::kLong);
    // Top-left aligned, as F.sdpa's is_causal: key j is visible from query i
    // when j <= i (and j is a real key).
    const at::Tensor causal = at::arange(s_kv_padded, index).view({1, s_kv_padded}).le(
        at::arange(s_q, index).view({s_q, 1}));
    padded_mask = causal.logical_and(padded_mask);
  }
  return cudnn_bias(padded_mask, query.scalar_type(), 4, s_kv_padded);
}

PaddedKeys pad_keys_for_cudnn(const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& bias,
                              bool is_causal) {
  const int64_t s_kv = key.size(2), s_padded = padded_length(s_kv, kCudnnKeyTile);
  return {pad_dim(key, 2, s_padded, 0, PadWrite::kLeafKernel),
          pad_dim(value, 2, s_padded, 0, PadWrite::kLeafKernel),
          padded_keys_bias(query, bias, s_kv, s_padded, is_causal)};
}

// `t` with no elements (int64 on `device` where the engine gave none). A
// tensor the engine just made is resized in place (metadata only): this runs
// twice on every forward, and two allocations through the dispatcher cost
// about a microsecond of host time.
void make_empty(at::Tensor& t, const c10::Device& device) {
  if (!t.defined()) {
    t = at::empty({0}, at::TensorOptions().dtype(at::kLong).device(device));
  } else if (t.use_count() == 1 && !t.is_view() &&
             t.unsafeGetTensorImpl()->allow_tensor_metadata_change()) {
    t.unsafeGetTensorImpl()->set_sizes_contiguous({0});
  } else {
    t = at::empty({0}, t.options());
  }
}

// The part of `padded_grad` (a gradient of `input` grown along dim 2) that is
// `input`'s, laid out like `input`, which is what the Meta kernel promises.
at::Tensor like_input(const at::Tensor& input, const at::Tensor& padded_grad) {
  at::Tensor grad = at::empty_like(input);
  copy_along(grad, padded_grad, 2, 0);
  return grad;
}

// Key tiles each slice of a K/V shim backward keeps at least (shim_slices.h):
// four waves of the GPU's SMs, one 128-key tile per block of cuDNN's
// backward. The CPU reference has no waves to fill: it slices wherever
// memory says.
int64_t min_slice_key_tiles(const at::Tensor& query) {
#ifdef OPENWAM_WITH_CUDA
  if (query.is_cuda()) {
    return 4 * at::cuda::getDeviceProperties(query.device().index())->multiProcessorCount;
  }
#endif
  return 0;
}

// OPENWAM_SDPA_CHECK_FINITE=1 (debug only: the counts synchronise with the
// host). Raises naming the shapes, the plan and the smallest logsumexp.
void check_finite_gradients(const at::Tensor& dq, const at::Tensor& dk,
                            const at::Tensor& dv, const at::Tensor& query,
                            const at::Tensor& key, const at::Tensor& logsumexp,
                            const Plan& plan) {
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
              key.sizes(), ", plan ", plan.to_string(),
              ", smallest logsumexp ", min_lse);
}

// The raised bias output of a forward that does not shift: the bias's sizes
// with no keys (so that it has the bias's dims, which the DTensor rule
// places as the bias), [0] without a bias. Meta kernel and kernels alike.
at::Tensor no_raised_bias(const at::Tensor& query, const std::optional<at::Tensor>& bias) {
  if (!bias.has_value() || bias->dim() == 0) {
    return at::empty({0}, query.options());
  }
  std::vector<c10::SymInt> sizes(bias->sym_sizes().begin(), bias->sym_sizes().end());
  sizes.back() = 0;
  return at::empty_symint(sizes, bias->options());
}

// The forward's outputs as the op's schema gives them. Where the call shifts
// its scores in the forward (shifts_in_forward), its logsumexp is shifted in
// place and the raised copy of the caller's `attn_bias` (its keys s_kv, as
// the predicate asks) is the last output, laid out as the Meta kernel says:
// not that of an aligned copy the ATen fallback may have run on.
Tensors5 finish_forward(CudnnForward f, const at::Tensor& query, bool compute_log_sumexp,
                        double dropout_p, const Plan& plan, int64_t s_kv,
                        const std::optional<at::Tensor>& attn_bias) {
  if (!compute_log_sumexp) {
    f.logsumexp = at::empty({0}, query.options().dtype(at::kFloat));
  }
  at::Tensor raised;
  if (shifts_in_forward(plan, attn_bias, s_kv, compute_log_sumexp)) {
    // Both engines write a contiguous [B, H, L, 1] logsumexp (ATen's cuDNN
    // attention too, torch 2.11); another layout is copied, not asserted on.
    if (!f.logsumexp.is_contiguous()) {
      f.logsumexp = f.logsumexp.contiguous();
    }
    raised = shift_scores_in_forward(*attn_bias, f.logsumexp);
  } else {
    raised = no_raised_bias(query, attn_bias);
  }
  if (dropout_p == 0.0) {
    // Without dropout the philox state is unused (cuDNN leaves ATen's
    // uninitialised): emptied, the op's outputs are deterministic (opcheck
    // compares them).
    make_empty(f.philox_seed, query.device());
    make_empty(f.philox_offset, query.device());
  }
  return {f.out, f.logsumexp, f.philox_seed, f.philox_offset, raised};
}

// A backward's gradients, checked where OPENWAM_SDPA_CHECK_FINITE asks.
Tensors3 finish_backward(Tensors3 grads, const at::Tensor& query, const at::Tensor& key,
                         const at::Tensor& logsumexp, const Plan& plan) {
  if (current_settings().check_finite) {
    check_finite_gradients(std::get<0>(grads), std::get<1>(grads), std::get<2>(grads), query,
                           key, logsumexp, plan);
  }
  return grads;
}

// The K/V shim's backward (no dropout), slice by slice along batch and
// key/value heads: shim_slices.h says why and how many. Each slice pads its
// own K and V, and the part of the bias it reads where the slice before read
// another; its gradients are copied into tensors laid out like the inputs
// (copy_along: row_copy.h says why not copy_).
// One slice is the whole call.
Tensors3 sliced_shim_backward(const Engine& engine, const at::Tensor& grad_out,
                              const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& out,
                              const at::Tensor& logsumexp, const at::Tensor& philox_seed,
                              const at::Tensor& philox_offset, const at::Tensor& bias_in,
                              bool is_causal, std::optional<double> scale) {
  at::Tensor bias = bias_in;  // right-aligned to [B|1, H|1, L|1, S], so it slices
  while (bias.defined() && bias.dim() < 4) {
    bias = bias.unsqueeze(0);
  }
  const int64_t s_kv = key.size(2);
  const ShimShape shape{query.size(0),
                        query.size(1),
                        key.size(1),
                        query.size(2),
                        padded_length(s_kv, kCudnnKeyTile),
                        query.size(3),
                        value.size(3),
                        bias.defined(),
                        bias.defined() && bias.size(0) > 1,
                        bias.defined() && bias.size(1) > 1,
                        bias.defined() ? bias.size(2) : 0};
  const std::vector<ShimSlice> slices = shim_slices(shape, min_slice_key_tiles(query));
  const int64_t group = shape.heads / shape.kv_heads;
  at::Tensor dq, dk = at::empty_like(key), dv = at::empty_like(value);
  if (slices.size() > 1) {
    dq = at::empty_like(query);
  }
  // Slices that read the same part of the bias (all of them, for a bias
  // broadcast over batch and heads, or for is_causal's mask) share one
  // padded copy of it.
  at::Tensor padded_bias;
  ShimSlice padded_rows{-1, 0, -1, 0};
  for (const ShimSlice& slice : slices) {
    const auto kv_side = [&](const at::Tensor& t) {
      return t.narrow(0, slice.batch_begin, slice.batches)
          .narrow(1, slice.kv_head_begin, slice.kv_heads);
    };
    const auto q_side = [&](const at::Tensor& t) {
      at::Tensor s = t.size(0) > 1 ? t.narrow(0, slice.batch_begin, slice.batches) : t;
      return s.size(1) > 1 ? s.narrow(1, slice.kv_head_begin * group, slice.kv_heads * group)
                           : s;
    };
    const at::Tensor q = q_side(query);
    const ShimSlice rows = bias_rows(shape, slice);
    if (!(rows == padded_rows)) {
      padded_bias.reset();  // the previous slice's copy goes before the next is made
      padded_bias = padded_keys_bias(q, bias.defined() ? q_side(bias) : bias, s_kv,
                                     shape.s_kv_padded, is_causal);
      padded_rows = rows;
    }
    const auto padded = [&](const at::Tensor& t) {
      return pad_dim(kv_side(t), 2, shape.s_kv_padded, 0, PadWrite::kLeafKernel);
    };
    // The slice's rows of q, out and grad_out start on 16 bytes (head_dim is a
    // multiple of 8); its logsumexp, L floats a row, need not (B4 H18 at
    // L 4095: 8 bytes off), and both engines' graphs assume 16 (found in review).
    auto [dq_s, dk_s, dv_s] =
        engine.backward(q_side(grad_out), q, padded(key), padded(value), q_side(out),
                        aligned_operand(q_side(logsumexp)), philox_seed, philox_offset,
                        padded_bias, 0.0, false, scale);
    if (slices.size() == 1) {
      dq = dq_s;
    } else {
      copy_along(q_side(dq), dq_s, 2, 0);
    }
    copy_along(kv_side(dk), dk_s, 2, 0);
    copy_along(kv_side(dv), dv_s, 2, 0);
  }
  return {dq, dk, dv};
}

// The plan of a leaf-op call. One that pads the keys at the backward only is
// for calls without dropout: with dropout the forward draws its pattern over
// the padded keys too (pad_keys_forward), else the backward would replay it
// over another key length, silently. The guard table never makes it; a direct
// call of the leaf ops could.
// Dropout with a single query row is refused by both ops, their Meta kernels
// too: cuDNN's forward faulted on it (an illegal memory access: H100, cuDNN
// 9.19.0, frontend graph with the padding mask, batch 1), and openwam::sdpa
// hands such calls to PyTorch (decision: "dropout with s_q == 1"). Dropout
// first: a symbolic query length is not guarded without it.
void check_no_one_row_dropout(const char* op, double dropout_p, const at::Tensor& query) {
  TORCH_CHECK(!(dropout_p > 0.0 && query.sym_size(2) == 1), op,
              ": dropout with a single query row is not run on cuDNN (openwam::sdpa hands such "
              "calls to PyTorch), got dropout_p ", dropout_p);
}

Plan plan_of_call(const char* op, int64_t plan_bits, double dropout_p, const at::Tensor& query) {
  const Plan plan = Plan::from_int(plan_bits);
  TORCH_CHECK(!(plan.pad_keys_backward && dropout_p > 0.0), op,
              ": the plan pad_keys_backward is for calls without dropout (with dropout the "
              "keys are padded in the forward: pad_keys_forward), got dropout_p ", dropout_p);
  check_no_one_row_dropout(op, dropout_p, query);
  return plan;
}

// What the forward's plan and inputs must agree on, checked before it runs:
// its backward would refuse them (a single query row) or assert (a bias with
// is_causal, which decide() never sends: cudnn_rejects). Found by opcheck on
// direct calls of the leaf op (review).
void check_forward_plan(const char* op, const Plan& plan, const std::optional<at::Tensor>& bias,
                        bool is_causal, const at::Tensor& query) {
  TORCH_CHECK(!(bias.has_value() && is_causal), op,
              ": takes an attn_bias or is_causal, not both (fold the causal part into the bias)");
  TORCH_CHECK(!plan.pad_query_backward || query.sym_size(2) == 1, op,
              ": the plan pad_query_backward is for a single query row, got ",
              query.sym_size(2), " rows");
  TORCH_CHECK(!plan.shift_scores || bias.has_value(), op,
              ": the plan shift_scores is for calls with a bias (a bool mask's), got none");
}

// The engine's forward with the plan's padded inputs (checked by the caller).
template <const Engine& engine>
CudnnForward engine_forward(const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const std::optional<at::Tensor>& attn_bias,
                            double dropout_p, bool is_causal, std::optional<double> scale,
                            bool compute_log_sumexp, const Plan& plan) {
  if (engine.cuda && !(is_aligned(query) && is_aligned(key) && is_aligned(value) &&
                       is_aligned(attn_bias))) {
    // cuDNN takes 16-byte aligned operands (aligned_operand.h): the ATen
    // fallback as the frontend's engines.
    return engine_forward<engine>(aligned_operand(query), aligned_operand(key),
                                  aligned_operand(value), aligned_operand(attn_bias), dropout_p,
                                  is_causal, scale, compute_log_sumexp, plan);
  }
  at::Tensor k = key, v = value;
  at::Tensor bias = bias_keys(attn_bias.value_or(at::Tensor()), key.size(2));
  bool causal = is_causal;
  if (plan.pad_keys_forward) {
    // Dropout: the backward must see the key length the forward's dropout
    // pattern was drawn for, so both run on the padded keys.
    PaddedKeys p = pad_keys_for_cudnn(query, key, value, bias, is_causal);
    k = p.key, v = p.value, bias = p.bias, causal = false;
  }
  return engine.forward(query, k, v, bias, compute_log_sumexp, dropout_p, causal, scale);
}

// The kernels of the two ops for an engine (registered below per dispatch key).
template <const Engine& engine>
Tensors5 forward_with_plan(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value,
                           const std::optional<at::Tensor>& attn_bias, double dropout_p,
                           bool is_causal, std::optional<double> scale,
                           bool compute_log_sumexp, int64_t plan_bits) {
  check_leaf_inputs("openwam::_cudnn_sdpa", {query, key, value, attn_bias}, engine.cuda);
  const Plan plan = plan_of_call("openwam::_cudnn_sdpa", plan_bits, dropout_p, query);
  check_forward_plan("openwam::_cudnn_sdpa", plan, attn_bias, is_causal, query);
  return finish_forward(engine_forward<engine>(query, key, value, attn_bias, dropout_p, is_causal,
                                               scale, compute_log_sumexp, plan),
                        query, compute_log_sumexp, dropout_p, plan, key.size(2), attn_bias);
}

template <const Engine& engine>
Tensors3 backward_with_plan(const at::Tensor& grad_out, const at::Tensor& query,
                            const at::Tensor& key,
                            const at::Tensor& value,
                            const std::optional<at::Tensor>& attn_bias,
                            const at::Tensor& out, const at::Tensor& logsumexp,
                            const at::Tensor& philox_seed, const at::Tensor& philox_offset,
                            double dropout_p, bool is_causal, std::optional<double> scale,
                            int64_t plan_bits) {
  check_leaf_inputs("openwam::_cudnn_sdpa_backward",
                    {query, key, value, attn_bias, grad_out, out, logsumexp}, engine.cuda);
  if (engine.cuda && !(is_aligned(grad_out) && is_aligned(query) && is_aligned(key) &&
                       is_aligned(value) && is_aligned(attn_bias) && is_aligned(out) &&
                       is_aligned(logsumexp))) {
    // As in forward_with_plan; the gradients come back laid out like the
    // copies, which is how empty_like lays out the inputs' own.
    return backward_with_plan<engine>(aligned_operand(grad_out), aligned_operand(query),
                                      aligned_operand(key), aligned_operand(value),
                                      aligned_operand(attn_bias), aligned_operand(out),
                                      aligned_operand(logsumexp), philox_seed, philox_offset,
                                      dropout_p, is_causal, scale, plan_bits);
  }
  const Plan plan = plan_of_call("openwam::_cudnn_sdpa_backward", plan_bits, dropout_p, query);
  // An upstream gradient broadcast along head_dim (out.sum().backward()
  // gives an expanded one) is materialised: the padding reads rows of it.
  const at::Tensor go_dense = grad_out.stride(-1) == 1 ? grad_out : grad_out.contiguous();
  at::Tensor k = key, v = value;
  const at::Tensor given_bias = attn_bias.value_or(at::Tensor());  // maybe padded (bias_keys)
  at::Tensor bias = bias_keys(given_bias, key.size(2));
  bool causal = is_causal;
  TORCH_CHECK(!plan.pad_query_backward || query.size(2) == 1,
              "openwam::_cudnn_sdpa_backward: the plan pad_query_backward is for a "
              "single query row, got ", query.size(2), " rows");
  if (plan.pad_query_backward) {
    // Batch 1, one query row (no dropout: plan_of_call): exact in fp32 and
    // GEMV-sized, so no engine's backward runs (reference_attention.h says
    // why).
    return finish_backward(
        single_row_backward(go_dense, query, key, value, bias, is_causal, scale),
        query, key, logsumexp, plan);
  }
  if (plan.pad_keys_backward && dropout_p == 0.0) {
    return finish_backward(
        sliced_shim_backward(engine, go_dense, query, key, value, out, logsumexp, philox_seed,
                             philox_offset, given_bias, is_causal, scale),
        query, key, logsumexp, plan);
  }
  if (plan.pads_keys()) {
    PaddedKeys p = pad_keys_for_cudnn(query, key, value, given_bias, is_causal);
    k = p.key, v = p.value, bias = p.bias, causal = false;
  }
  // A bool mask's bias on the key tail: the scores shifted, a bias raised in
  // place restored when the backward returns (score_shift.h).
  const ScopedScoreShift shift(plan.shift_scores, bias, logsumexp);
  auto [dq, dk, dv] = engine.backward(go_dense, query, k, v, out, shift.logsumexp(), philox_seed,
                                      philox_offset, shift.bias(), dropout_p, causal, scale);
  shift.ran();
  if (plan.pads_keys()) {
    dk = like_input(key, dk);
    dv = like_input(value, dv);
  }
  return finish_backward({dq, dk, dv}, query, key, logsumexp, plan);
}

// ------------------------------------------------------------ CPU: reference

CudnnForward reference_engine_forward(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& bias,
                                      bool /*compute_logsumexp*/, double dropout_p,
                                      bool is_causal, std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0,
              "openwam::_cudnn_sdpa (CPU reference kernel): no dropout, got ", dropout_p);
  CudnnForward f;
  std::tie(f.out, f.logsumexp) = reference_forward(q, k, v, bias, is_causal, scale);
  // No dropout: no philox state (forward_with_plan empties it).
  f.philox_seed = at::empty({}, at::TensorOptions().dtype(at::kLong));
  f.philox_offset = at::empty({}, at::TensorOptions().dtype(at::kLong));
  return f;
}

Tensors3 reference_engine_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                   const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& out, const at::Tensor& logsumexp,
                                   const at::Tensor&, const at::Tensor&,
                                   const at::Tensor& bias, double dropout_p,
                                   bool is_causal, std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0,
              "openwam::_cudnn_sdpa_backward (CPU reference kernel): no dropout, got ",
              dropout_p);
  return reference_backward(grad_out, q, k, v, out, logsumexp, bias, is_causal, scale);
}

constexpr Engine kReferenceEngine{&reference_engine_forward, &reference_engine_backward, false};

// ------------------------------------------------------------ CUDA: cuDNN

#ifdef OPENWAM_WITH_CUDA
constexpr Engine kAtenEngine{&cudnn_forward, &cudnn_backward, true};

#ifdef OPENWAM_WITH_CUDNN_FRONTEND
// A call whose graph the frontend cannot build runs on ATen's cuDNN attention
// with the plan's padded inputs. Said once per reason (the configuration is
// in it), for the first few: a family of such shapes would warn every step.
void note_fallback(const std::string& why_not, const Plan& plan) {
  constexpr size_t kMaxWarned = 8;
  frontend::stats().aten_fallback_calls++;
  static std::mutex mutex;
  static std::set<std::string> said;
  size_t warned = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (said.size() >= kMaxWarned || !said.insert(why_not).second) {
      return;
    }
    warned = said.size();
  }
  Plan fallback = plan;
  fallback.padding_mask = false;
  TORCH_WARN("openwam_sdpa: the cuDNN frontend cannot build a graph for this call (", why_not,
             "); it runs on ATen's cuDNN attention with the fix '", fallback.to_string(),
             "'. openwam_sdpa.frontend_stats() lists such configurations",
             warned == kMaxWarned ? " (the last such warning of this process)." : ".");
}

// The frontend's backward on the K/V shim's padded inputs (no padding mask:
// the padded keys' bias holds -inf past the real ones).
Tensors3 frontend_shim_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                const at::Tensor& logsumexp, const at::Tensor& philox_seed,
                                const at::Tensor& philox_offset, const at::Tensor& bias,
                                double dropout_p, bool is_causal, std::optional<double> scale) {
  Tensors3 grads;
  std::string why_not;
  if (frontend::sdpa_backward(grad_out, q, k, v, out, logsumexp, philox_seed, philox_offset,
                              bias, dropout_p, is_causal, scale, /*padding_mask=*/false, grads,
                              why_not)) {
    return grads;
  }
  // The warning names what the fallback carries out: these inputs were
  // padded for the K/V shim.
  Plan padded;
  padded.pad_keys_backward = true;
  note_fallback(why_not, padded);
  return cudnn_backward(grad_out, q, k, v, out, logsumexp, philox_seed, philox_offset, bias,
                        dropout_p, is_causal, scale);
}

constexpr Engine kFrontendPaddedEngine{&cudnn_forward, &frontend_shim_backward, true};

Tensors5 frontend_forward(const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& value, const std::optional<at::Tensor>& attn_bias,
                          double dropout_p, bool is_causal, std::optional<double> scale,
                          bool compute_log_sumexp, int64_t plan_bits) {
  check_leaf_inputs("openwam::_cudnn_sdpa", {query, key, value, attn_bias}, true);
  const Plan plan = plan_of_call("openwam::_cudnn_sdpa", plan_bits, dropout_p, query);
  check_forward_plan("openwam::_cudnn_sdpa", plan, attn_bias, is_causal, query);
  if (!current_settings().frontend) {
    return forward_with_plan<kAtenEngine>(query, key, value, attn_bias, dropout_p, is_causal,
                                          scale, compute_log_sumexp, plan_bits);
  }
  CudnnForward f;
  std::string why_not;
  // A one-query-row plan's backward never runs the graph of this shape, nor
  // does one that takes the K/V shim (it runs on padded keys): nothing to
  // prepare (frontend_backward). Preparing it cost the shim's first call a
  // third graph build (1.5x stock's first call at 4096x4032, H200).
  const bool prepare_backward =
      !plan.pad_query_backward &&
      !shim_takes_bias(plan, attn_bias.has_value(), key.size(2), dropout_p);
  const at::Tensor bias = bias_keys(attn_bias.value_or(at::Tensor()), key.size(2));
  if (frontend::sdpa_forward(query, key, value, bias, compute_log_sumexp, dropout_p, is_causal,
                             scale, plan.padding_mask, prepare_backward, f, why_not)) {
    return finish_forward(std::move(f), query, compute_log_sumexp, dropout_p, plan, key.size(2),
                          attn_bias);
  }
  note_fallback(why_not, plan);
  return forward_with_plan<kAtenEngine>(query, key, value, attn_bias, dropout_p, is_causal,
                                        scale, compute_log_sumexp, plan_bits);
}

Tensors3 frontend_backward(const at::Tensor& grad_out, const at::Tensor& query,
                           const at::Tensor& key, const at::Tensor& value,
                           const std::optional<at::Tensor>& attn_bias, const at::Tensor& out,
                           const at::Tensor& logsumexp, const at::Tensor& philox_seed,
                           const at::Tensor& philox_offset, double dropout_p, bool is_causal,
                           std::optional<double> scale, int64_t plan_bits) {
  check_leaf_inputs("openwam::_cudnn_sdpa_backward",
                    {query, key, value, attn_bias, grad_out, out, logsumexp}, true);
  const Plan plan = plan_of_call("openwam::_cudnn_sdpa_backward", plan_bits, dropout_p, query);
  if (!current_settings().frontend) {
    return backward_with_plan<kAtenEngine>(grad_out, query, key, value, attn_bias, out,
                                           logsumexp, philox_seed, philox_offset, dropout_p,
                                           is_causal, scale, plan_bits);
  }
  const auto& ctx = at::globalContext();
  if (ctx.deterministicAlgorithms() && ctx.deterministicAlgorithmsWarnOnly()) {
    // cuDNN's backward accumulates dQ with atomics; ATen's cuDNN attention says
    // so in these words (a determinism check that refuses outright keeps the
    // call off cuDNN: cudnn_rejects()).
    TORCH_WARN_ONCE("cuDNN Attention defaults to a non-deterministic algorithm. ",
                    "To explicitly enable determinism call "
                    "torch.use_deterministic_algorithms(True, warn_only=False).");
  }
  if (shim_takes_bias(plan, attn_bias.has_value(), key.size(2), dropout_p)) {
    return backward_with_plan<kFrontendPaddedEngine>(grad_out, query, key, value, attn_bias,
                                                     out, logsumexp, philox_seed, philox_offset,
                                                     dropout_p, is_causal, scale, plan_bits);
  }
  if (plan.pad_query_backward) {
    // Batch 1, one query row (cudnn-frontend #1072): the padding mask alone
    // left non-finite gradients in 25 of 360 degenerate cells (H200, cuDNN
    // 9.19.0, tests/gpu/test_degenerate_gpu.py). The backward is computed in
    // fp32 (backward_with_plan); no engine's runs.
    return backward_with_plan<kFrontendPaddedEngine>(
        grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
        dropout_p, is_causal, scale, plan_bits);
  }
  Tensors3 grads;
  std::string why_not;
  bool ran = false;
  {
    const at::Tensor bias = bias_keys(attn_bias.value_or(at::Tensor()), key.size(2));
    // Restored (where raised in place) before the ATen fallback below, which
    // shifts it again.
    const ScopedScoreShift shift(plan.shift_scores, bias, logsumexp);
    ran = frontend::sdpa_backward(grad_out, query, key, value, out, shift.logsumexp(),
                                  philox_seed, philox_offset, shift.bias(), dropout_p, is_causal,
                                  scale, plan.padding_mask, grads, why_not);
    if (ran) {
      shift.ran();
    }
  }
  if (ran) {
    return finish_backward(std::move(grads), query, key, logsumexp, plan);
  }
  note_fallback(why_not, plan);
  return backward_with_plan<kAtenEngine>(grad_out, query, key, value, attn_bias, out,
                                         logsumexp, philox_seed, philox_offset, dropout_p,
                                         is_causal, scale, plan_bits);
}
#endif  // OPENWAM_WITH_CUDNN_FRONTEND
#endif  // OPENWAM_WITH_CUDA

// ------------------------------------------------------------ Meta

// What ATen's own meta kernels of the cuDNN ops say: output like the query,
// float32 logsumexp [B, H, L, 1], 0-dim int64 philox state on the meta
// device (empty without dropout: forward_with_plan), gradients like their
// inputs. The raised bias: the bias's sizes and strides where the forward
// shifts (shifts_in_forward), else no_raised_bias.
Tensors5 cudnn_sdpa_meta(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_bias, double dropout_p, bool,
                         std::optional<double>, bool compute_log_sumexp, int64_t plan_bits) {
  check_no_one_row_dropout("openwam::_cudnn_sdpa", dropout_p, query);
  const auto f32 = query.options().dtype(at::kFloat);
  at::Tensor lse = compute_log_sumexp
                       ? at::empty_symint({query.sym_size(0), query.sym_size(1),
                                           query.sym_size(2), 1},
                                          f32)
                       : at::empty({0}, f32);
  const auto philox = at::TensorOptions().dtype(at::kLong).device(at::kMeta);
  const std::vector<int64_t> philox_sizes =
      dropout_p == 0.0 ? std::vector<int64_t>{0} : std::vector<int64_t>{};
  const at::Tensor raised =
      shifts_in_forward(Plan::from_int(plan_bits), attn_bias, key.sym_size(2), compute_log_sumexp)
          ? at::empty_strided_symint(attn_bias->sym_sizes(), attn_bias->sym_strides(),
                                     attn_bias->options())
          : no_raised_bias(query, attn_bias);
  return {empty_like_cudnn_output(query, value.sym_size(-1)), lse,
          at::empty(philox_sizes, philox), at::empty(philox_sizes, philox), raised};
}

Tensors3 cudnn_sdpa_backward_meta(
    const at::Tensor&, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const std::optional<at::Tensor>&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, double dropout_p, bool,
    std::optional<double>, int64_t) {
  check_no_one_row_dropout("openwam::_cudnn_sdpa_backward", dropout_p, query);
  return {at::empty_like(query), at::empty_like(key), at::empty_like(value)};
}

}  // namespace
}  // namespace openwam

TORCH_LIBRARY_IMPL(openwam, CPU, m) {
  m.impl("_cudnn_sdpa", &openwam::forward_with_plan<openwam::kReferenceEngine>);
  m.impl("_cudnn_sdpa_backward", &openwam::backward_with_plan<openwam::kReferenceEngine>);
}
#if defined(OPENWAM_WITH_CUDNN_FRONTEND)
TORCH_LIBRARY_IMPL(openwam, CUDA, m) {
  m.impl("_cudnn_sdpa", &openwam::frontend_forward);
  m.impl("_cudnn_sdpa_backward", &openwam::frontend_backward);
}
#elif defined(OPENWAM_WITH_CUDA)
TORCH_LIBRARY_IMPL(openwam, CUDA, m) {
  m.impl("_cudnn_sdpa", &openwam::forward_with_plan<openwam::kAtenEngine>);
  m.impl("_cudnn_sdpa_backward", &openwam::backward_with_plan<openwam::kAtenEngine>);
}
#endif
TORCH_LIBRARY_IMPL(openwam, Meta, m) {
  m.impl("_cudnn_sdpa", &openwam::cudnn_sdpa_meta);
  m.impl("_cudnn_sdpa_backward", &openwam::cudnn_sdpa_backward_meta);
}

#include "sdpa_call.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>
#include <ATen/SDPBackend.h>
#include <c10/core/SymBool.h>

#include <vector>

#include "decision.h"

namespace openwam {

bool SdpaCall::differentiated() const {
  return at::GradMode::is_enabled() &&
         (query.requires_grad() || key.requires_grad() || value.requires_grad());
}

bool any_input_empty(const SdpaCall& c) {
  // sym_numel: numel() throws on the symbolic sizes of a dynamic-shape trace.
  return c.query.sym_numel() == 0 || c.key.sym_numel() == 0 || c.value.sym_numel() == 0;
}

bool passes_pytorch_validation(const SdpaCall& c) {
  const at::Tensor& q = c.query;
  if (q.scalar_type() != c.key.scalar_type() || q.scalar_type() != c.value.scalar_type()) {
    return false;
  }
  if (q.device() != c.key.device() || q.device() != c.value.device()) return false;
  if (q.dim() < 2 || c.key.dim() < 2 || c.value.dim() < 2) return false;
  if (q.is_nested() || c.key.is_nested() || c.value.is_nested()) return false;
  if (c.attn_mask.has_value()) {
    const at::ScalarType m = c.attn_mask->scalar_type();
    if (m != at::kBool && m != at::kFloat && m != q.scalar_type()) return false;
  }
  return true;
}

namespace {

// Whether the mask broadcasts to the scores [..., L, S]: the masks stock
// serves. Read only for a mask on another device and for empty calls, so
// that no size guard is installed on the common call.
bool broadcasts_to_scores(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k) {
  const int64_t n = mask.dim();
  if (n < 2 || n > q.dim()) return false;
  for (int64_t i = 1; i <= n; ++i) {
    const c10::SymInt& m = mask.sym_size(-i);
    const c10::SymInt& scores = i == 1 ? k.sym_size(-2) : q.sym_size(-i);
    if (m != 1 && m != scores) return false;
  }
  return true;
}

// Zeros of `like`'s dtype and the given sizes on `device`: contiguous, so that
// every kernel stock has takes them as it would the tensor they stand in for.
at::Tensor stand_in(const at::Tensor& like, c10::SymIntArrayRef sizes, c10::Device device) {
  return at::zeros_symint(sizes, like.options().device(device));
}

// Raises PyTorch's own error for the call with this `value` and `mask`, if
// PyTorch has one: the call's own where F.sdpa's math backend serves it, else
// stand-ins for what the op checks itself (a value of the key's length, a mask
// on the query's device). Its error comes first, type and words
// (found in review: the op's checks had replaced F.sdpa's errors for head
// counts, shapes and mask broadcasting, and an IndexError's type). On the
// error path only: one forward of stock's, without gradients.
void raise_pytorch_error_if_any(const SdpaCall& c, const at::Tensor& value,
                                const std::optional<at::Tensor>& mask) {
  at::NoGradGuard no_grad;
  (void)at::scaled_dot_product_attention(c.query, c.key, value, mask, c.dropout_p, c.is_causal,
                                         c.scale, c.enable_gqa);
}

// Whether F.sdpa runs the call on its math backend, whose ops check shapes
// and devices before they read: there the call itself is safe to try, and
// F.sdpa's error is the one it raises. Its fused kernels may read past a short
// value or a meta mask instead.
bool pytorch_takes_math(const SdpaCall& c) {
  return pytorch_choice(c) == static_cast<int64_t>(at::SDPBackend::math);
}

// A mask on a device other than the query's: stock's fused kernels, on the
// CPU and on CUDA, take a meta mask and return garbage without an error;
// where stock raises (a CPU mask with CUDA inputs), it raises this device
// check, naming its kernel. Masks stock rejects for their shape keep its error.
// Meta and empty calls compute nothing: PyTorch answers them (it returns an
// empty output, or raises its own device error).
void check_mask_device(const SdpaCall& c) {
  if (!c.attn_mask.has_value()) return;
  const at::Tensor& mask = *c.attn_mask;
  const at::Tensor& q = c.query;
  if (mask.device() == q.device() || q.is_meta()) return;
  if (!passes_pytorch_validation(c) || !broadcasts_to_scores(mask, q, c.key)) return;
  if (any_input_empty(c)) return;
  raise_pytorch_error_if_any(
      c, c.value, pytorch_takes_math(c) ? mask : stand_in(mask, mask.sym_sizes(), q.device()));
  // Worded as PyTorch's own device check (c10's common_device_check_failure).
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but got attn_mask is on ",
              mask.device(), ", different from other tensors on ", q.device(),
              " (when checking argument in method openwam::sdpa)");
}

}  // namespace

bool heads_group(const SdpaCall& c) {
  const c10::SymInt hq = c.query.sym_size(1), hk = c.key.sym_size(1);
  if (c.value.sym_size(1) != hk) return false;
  return hq == hk || (c.enable_gqa && hk != 0 && hq % hk == 0);
}

bool math_takes_shapes(const SdpaCall& c) {
  const at::Tensor& q = c.query;
  const at::Tensor& k = c.key;
  const at::Tensor& v = c.value;
  const int64_t n = q.dim();
  if (k.dim() != n || v.dim() != n || k.sym_size(-1) != q.sym_size(-1)) return false;
  // Grouped-query attention reads the heads at dim -3 (an IndexError below 3-D).
  if (c.enable_gqa && n < 3) return false;
  // The batch dims (all but heads, sequence and head_dim) of one size: the
  // math backend's matmuls would broadcast them, F.sdpa's output keeps q's.
  for (int64_t d = 0; d < n - 2; ++d) {
    if (n == 4 && d == 1) continue;
    if (k.sym_size(d) != q.sym_size(d) || v.sym_size(d) != q.sym_size(d)) return false;
  }
  if (n == 4 && !heads_group(c)) return false;
  return !c.attn_mask.has_value() || broadcasts_to_scores(*c.attn_mask, q, k);
}

void check_call(const SdpaCall& c) {
  check_mask_device(c);
  // Key and value of different lengths: PyTorch's math backend rejects them
  // (its bmm), but its fused CPU kernel (torch 2.13) takes the key length for
  // value's and reads past value's end, returning garbage.
  if (c.key.dim() < 2 || c.value.dim() < 2) return;  // PyTorch's rank error
  // Nested key/value have no size along their ragged dimension (reading it
  // raises); their lengths are PyTorch's to check.
  const auto ragged = [](const at::Tensor& t) {
    return t.is_nested() || t.layout() == c10::kJagged;
  };
  if (ragged(c.key) || ragged(c.value)) return;
  const c10::SymInt s_kv = c.key.sym_size(-2);
  const c10::SymInt s_v = c.value.sym_size(-2);
  const auto k = s_kv.maybe_as_int();
  const auto v = s_v.maybe_as_int();
  if (k.has_value() && v.has_value() && *k == *v) return;  // concrete and equal
  if (!passes_pytorch_validation(c)) return;  // PyTorch's own error comes first
  if (k.has_value() && v.has_value()) {
    std::vector<c10::SymInt> sizes(c.value.sym_sizes().begin(), c.value.sym_sizes().end());
    sizes[sizes.size() - 2] = s_kv;
    raise_pytorch_error_if_any(
        c, pytorch_takes_math(c) ? c.value : stand_in(c.value, sizes, c.value.device()),
        c.attn_mask);
  }
  // Symbolic under torch.compile: a runtime assert, not a guard.
  TORCH_SYM_CHECK(s_kv.sym_eq(s_v),
                  "openwam::sdpa: value must have the same sequence length as key (",
                  s_kv, "), got ", s_v);
}

CallShape shape_of(const SdpaCall& call) {
  CallShape s;
  const bool four_d = call.query.dim() == 4;
  s.batch = call.query.sym_size(0);
  s.heads = four_d ? call.query.sym_size(1) : c10::SymInt(1);
  s.kv_heads = four_d ? call.key.sym_size(1) : c10::SymInt(1);
  s.s_q = call.query.sym_size(-2);
  s.s_kv = call.key.sym_size(-2);
  s.head_dim = call.query.sym_size(-1);
  s.head_dim_v = call.value.sym_size(-1);
  s.is_causal = call.is_causal;
  s.fp16 = call.query.scalar_type() == at::kHalf;
  s.has_mask = call.attn_mask.has_value();
  s.bool_mask = s.has_mask && call.attn_mask->scalar_type() == at::kBool;
  s.dropout_p = call.dropout_p;
  return s;
}

}  // namespace openwam

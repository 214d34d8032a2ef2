#include <torch/autograd.h>

#include <cmath>
#include <limits>

#include "support.h"

namespace openwam_test {

Inputs bhsd(int64_t B, int64_t H, int64_t s_q, int64_t s_kv, int64_t D,
            at::TensorOptions options, bool requires_grad, int64_t kv_heads) {
  const int64_t hk = kv_heads == 0 ? H : kv_heads;
  Inputs in;
  in.query = at::randn({B, H, s_q, D}, options).requires_grad_(requires_grad);
  in.key = at::randn({B, hk, s_kv, D}, options).requires_grad_(requires_grad);
  in.value = at::randn({B, hk, s_kv, D}, options).requires_grad_(requires_grad);
  in.enable_gqa = hk != H;
  return in;
}

Inputs bshd(int64_t B, int64_t H, int64_t s_q, int64_t s_kv, int64_t D,
            at::TensorOptions options, bool requires_grad) {
  const auto view = [&](int64_t S) {
    return at::randn({B, S, H, D}, options).transpose(1, 2).requires_grad_(requires_grad);
  };
  Inputs in;
  in.query = view(s_q);
  in.key = view(s_kv);
  in.value = view(s_kv);
  return in;
}

void make_first_row_low(Inputs& in) {
  const bool q_grad = in.query.requires_grad();
  const bool k_grad = in.key.requires_grad();
  const int64_t D = in.query.size(-1);
  const double scale = in.scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));
  at::NoGradGuard no_grad;
  // Keys: component 0 = 4 (+/- 0.1), the rest small. Row 0 of the query:
  // -55 / (4 * scale) along component 0, so its scores are about -55.
  at::Tensor k = in.key.detach().clone();
  k.select(-1, 0).fill_(4.0).add_(at::randn_like(k.select(-1, 0)) * 0.1);
  k.narrow(-1, 1, D - 1).mul_(0.3);
  at::Tensor q = in.query.detach().clone();
  at::Tensor row = q.narrow(-2, 0, 1);
  row.mul_(0.1);
  row.select(-1, 0).fill_(-55.0 / (4.0 * scale));
  // Same layout as before: copy back into the tensors' own storage.
  in.key = in.key.detach().copy_(k).requires_grad_(k_grad);
  in.query = in.query.detach().copy_(q).requires_grad_(q_grad);
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  if (a.numel() == 0) {
    return 0.0;
  }
  const at::Tensor x = a.detach().to(at::kDouble), y = b.detach().to(at::kDouble);
  const at::Tensor d = at::where(x.eq(y), at::zeros({}, kF64), (x - y).abs());
  return d.isnan().any().item<bool>() ? std::numeric_limits<double>::infinity()
                                       : d.max().item<double>();
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor y = b.detach().to(at::kDouble);
  // Infinities (a hidden row's logsumexp) must match exactly, not set the scale.
  const double scale =
      y.numel() == 0 ? 0.0
                     : at::where(y.isfinite(), y.abs(), at::zeros({}, kF64)).max().item<double>();
  return max_abs_diff(a, b) / (scale + 1.0);
}

bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.scalar_type() == b.scalar_type();
}

Reference reference_attention(const at::Tensor& q_in, const at::Tensor& k_in,
                              const at::Tensor& v_in, const at::Tensor& bias,
                              bool is_causal, std::optional<double> scale,
                              const at::Tensor& grad_out) {
  at::AutoGradMode grad_on(true);
  const bool backward = grad_out.defined();
  const at::Tensor q = q_in.detach().to(at::kDouble).requires_grad_(backward);
  const at::Tensor k = k_in.detach().to(at::kDouble).requires_grad_(backward);
  const at::Tensor v = v_in.detach().to(at::kDouble).requires_grad_(backward);
  at::Tensor ke = k, ve = v;
  if (q.dim() == 4 && k.size(1) != q.size(1)) {
    ke = k.repeat_interleave(q.size(1) / k.size(1), 1);
    ve = v.repeat_interleave(q.size(1) / k.size(1), 1);
  }
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  at::Tensor scores = at::matmul(q, ke.transpose(-1, -2)) * s;
  if (bias.defined()) {
    scores = scores + bias.detach().to(at::kDouble);
  }
  if (is_causal) {
    const int64_t L = scores.size(-2), S = scores.size(-1);
    scores = scores.masked_fill(at::ones({L, S}, at::kBool).triu(1),
                                -std::numeric_limits<double>::infinity());
  }
  // A row that sees no key: softmax over zeros, multiplied by 0, so that no
  // NaN reaches the output or the gradients.
  const at::Tensor sees = scores.isneginf().logical_not().any(-1, /*keepdim=*/true);
  const at::Tensor safe = at::where(sees, scores, at::zeros({}, kF64));
  const at::Tensor probs = at::softmax(safe, -1) * sees.to(at::kDouble);

  Reference r;
  r.out = at::matmul(probs, ve);
  r.logsumexp = at::logsumexp(scores.detach(), -1);
  if (backward) {
    auto grads = torch::autograd::grad({r.out}, {q, k, v}, {grad_out.to(at::kDouble)});
    r.dq = grads[0];
    r.dk = grads[1];
    r.dv = grads[2];
  }
  r.out = r.out.detach();
  return r;
}

}  // namespace openwam_test

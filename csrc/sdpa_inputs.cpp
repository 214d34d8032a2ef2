#include "sdpa_inputs.h"

#include <ATen/core/grad_mode.h>

#include <cmath>

namespace openwam {
namespace {

constexpr const char* kOp = "openwam::sdpa";

void check_mask(const SdpaInputs& in) {
  const at::Tensor& q = in.query;
  const at::Tensor& m = *in.attn_mask;
  TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == q.scalar_type(),
              kOp, ": attn_mask must be bool or have query's dtype (",
              q.scalar_type(), "), got ", m.scalar_type());
  TORCH_CHECK(m.device() == q.device(), kOp,
              ": attn_mask must be on query's device (", q.device(), "), got ",
              m.device());
  TORCH_CHECK(!m.requires_grad(), kOp,
              ": attn_mask must not require grad (openwam::sdpa does not "
              "differentiate the mask), got a mask with requires_grad=True");
  TORCH_CHECK(m.dim() >= 2, kOp,
              ": attn_mask must have at least 2 dims [..., L, S], got ", m.dim(),
              "-D");
  TORCH_CHECK(m.dim() <= q.dim(), kOp, ": attn_mask must have at most ",
              q.dim(), " dims to broadcast to [..., L, S], got ", m.dim(), "-D");
  // Right-aligned broadcast against [batch..., heads, L, S].
  std::vector<int64_t> target = q.sizes().vec();
  target[target.size() - 1] = in.s_kv();
  for (int64_t i = 1; i <= m.dim(); ++i) {
    const int64_t got = m.size(-i);
    const int64_t want = target[target.size() - i];
    TORCH_CHECK(got == want || got == 1, kOp, ": attn_mask of shape ",
                m.sizes(), " does not broadcast to the attention shape ",
                at::IntArrayRef(target), " (dim ", -i, ": expected ", want,
                " or 1, got ", got, ")");
  }
}

}  // namespace

bool SdpaInputs::differentiated() const {
  return at::GradMode::is_enabled() &&
         (query.requires_grad() || key.requires_grad() || value.requires_grad());
}

void validate_inputs(const SdpaInputs& in) {
  const at::Tensor& q = in.query;
  const at::Tensor& k = in.key;
  const at::Tensor& v = in.value;
  TORCH_CHECK(q.dim() >= 2, kOp,
              ": query must have at least 2 dims [..., L, E], got ", q.dim(), "-D");
  TORCH_CHECK(k.dim() == q.dim(), kOp, ": key must have query's rank (",
              q.dim(), "-D), got ", k.dim(), "-D");
  TORCH_CHECK(v.dim() == q.dim(), kOp, ": value must have query's rank (",
              q.dim(), "-D), got ", v.dim(), "-D");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), kOp,
              ": query must be a floating point tensor, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), kOp,
              ": key must have query's dtype (", q.scalar_type(), "), got ",
              k.scalar_type());
  TORCH_CHECK(v.scalar_type() == q.scalar_type(), kOp,
              ": value must have query's dtype (", q.scalar_type(), "), got ",
              v.scalar_type());
  TORCH_CHECK(k.device() == q.device(), kOp, ": key must be on query's device (",
              q.device(), "), got ", k.device());
  TORCH_CHECK(v.device() == q.device(), kOp,
              ": value must be on query's device (", q.device(), "), got ",
              v.device());
  TORCH_CHECK(!q.is_nested() && !k.is_nested() && !v.is_nested(), kOp,
              ": nested tensors are not supported; pass dense tensors");

  TORCH_CHECK(k.size(-1) == q.size(-1), kOp,
              ": key must have the same head_dim as query (", q.size(-1),
              "), got ", k.size(-1));
  TORCH_CHECK(v.size(-2) == k.size(-2), kOp,
              ": value must have the same sequence length as key (", k.size(-2),
              "), got ", v.size(-2));
  // Leading (batch) dims must match; the head dim of a 4-D call may differ
  // for grouped-query attention.
  const int64_t rank = q.dim();
  for (int64_t d = 0; d < rank - 2; ++d) {
    const bool head_axis = rank == 4 && d == 1;
    if (head_axis) {
      continue;
    }
    TORCH_CHECK(k.size(d) == q.size(d), kOp, ": key must have query's size ",
                q.size(d), " in batch dim ", d, ", got ", k.size(d));
    TORCH_CHECK(v.size(d) == q.size(d), kOp, ": value must have query's size ",
                q.size(d), " in batch dim ", d, ", got ", v.size(d));
  }
  if (rank == 4) {
    const int64_t hq = q.size(1), hk = k.size(1), hv = v.size(1);
    TORCH_CHECK(hk == hv, kOp, ": value must have key's number of heads (", hk,
                "), got ", hv);
    if (in.enable_gqa) {
      TORCH_CHECK(hk > 0 && hq % hk == 0, kOp,
                  ": with enable_gqa=True, query's heads (", hq,
                  ") must be a multiple of key's heads, got ", hk);
    } else {
      TORCH_CHECK(hk == hq, kOp, ": key must have query's number of heads (",
                  hq, ") unless enable_gqa=True, got ", hk);
    }
  }

  TORCH_CHECK(std::isfinite(in.dropout_p) && in.dropout_p >= 0.0 &&
                  in.dropout_p < 1.0,
              kOp, ": dropout_p must be in [0, 1), got ", in.dropout_p);
  if (in.scale.has_value()) {
    TORCH_CHECK(std::isfinite(*in.scale) && *in.scale > 0.0, kOp,
                ": scale must be a positive finite number or None, got ",
                *in.scale);
  }
  if (in.attn_mask.has_value()) {
    TORCH_CHECK(!in.is_causal, kOp,
                ": attn_mask and is_causal=True cannot be combined (as in "
                "F.scaled_dot_product_attention); fold the causal mask into "
                "attn_mask");
    check_mask(in);
  }
}

}  // namespace openwam

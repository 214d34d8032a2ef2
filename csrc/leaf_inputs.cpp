#include "leaf_inputs.h"

#include <vector>

namespace openwam {
namespace {

void check_like_query(const char* op, const char* name, const at::Tensor& t,
                      const at::Tensor& query, at::ScalarType dtype) {
  if (!t.defined()) {
    return;
  }
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == query.device(), op, ": ", name, " must be on query's device (",
              query.device(), "), got ", t.device());
}

}  // namespace

void check_leaf_inputs(const char* op, const LeafInputs& in, bool half_only) {
  TORCH_CHECK(in.query.dim() == 4 && in.key.dim() == 4 && in.value.dim() == 4, op,
              ": query, key and value must be 4-D [B, H, S, E], got ", in.query.dim(), "-D, ",
              in.key.dim(), "-D and ", in.value.dim(), "-D");
  const at::Tensor &q = in.query, &k = in.key, &v = in.value;
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && v.size(1) == k.size(1) &&
                  k.size(1) > 0 && q.size(1) % k.size(1) == 0 && v.size(2) == k.size(2) &&
                  k.size(3) == q.size(3),
              op, ": query [B, H, L, E], key [B, H_kv, S, E] and value [B, H_kv, S, Ev] with "
              "H a multiple of H_kv, got ", q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  const at::ScalarType dtype = in.query.scalar_type();
  TORCH_CHECK(!half_only || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": the cuDNN kernels take float16 or bfloat16, got query of ", dtype);
  check_like_query(op, "key", in.key, in.query, dtype);
  check_like_query(op, "value", in.value, in.query, dtype);
  if (in.bias.has_value()) {
    check_like_query(op, "attn_bias (additive, in query's dtype)", *in.bias, in.query, dtype);
  }
  check_like_query(op, "grad_out", in.grad_out, in.query, dtype);
  check_like_query(op, "out", in.out, in.query, dtype);
  check_like_query(op, "logsumexp", in.logsumexp, in.query, at::kFloat);
  if (in.logsumexp.defined()) {
    // The backward's: what its forward gave. A forward with
    // compute_log_sumexp=False gives an empty logsumexp, which ATen's cuDNN
    // backward would have read as the statistics (found in review).
    const std::vector<int64_t> rows{q.size(0), q.size(1), q.size(2)};
    const auto with_last = [&](int64_t last) {
      std::vector<int64_t> sizes = rows;
      sizes.push_back(last);
      return sizes;
    };
    TORCH_INTERNAL_ASSERT(in.out.defined() && in.grad_out.defined());
    TORCH_CHECK(in.out.sizes() == with_last(v.size(3)) &&
                    in.grad_out.sizes() == with_last(v.size(3)),
                op, ": out and grad_out must be [B, H, L, Ev] ",
                at::IntArrayRef(with_last(v.size(3))), ", got ", in.out.sizes(), " and ",
                in.grad_out.sizes());
    TORCH_CHECK(in.logsumexp.sizes() == with_last(1), op,
                ": logsumexp must be its forward's float32 [B, H, L, 1] ",
                at::IntArrayRef(with_last(1)), " (a forward with compute_log_sumexp=False gives "
                "none), got ", in.logsumexp.sizes());
  }
}

}  // namespace openwam

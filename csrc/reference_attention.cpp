#include "reference_attention.h"

#include <limits>

#include "attention_scale.h"
#include "cudnn_attention.h"

namespace openwam {
namespace {

// Key/value heads repeated to the query's (grouped-query attention).
at::Tensor expand_heads(const at::Tensor& kv, int64_t heads) {
  const int64_t groups = heads / kv.size(1);
  return groups == 1 ? kv : kv.repeat_interleave(groups, 1);
}

// Summed back over each group of query heads sharing a key/value head.
at::Tensor reduce_heads(const at::Tensor& grad, int64_t kv_heads) {
  const int64_t groups = grad.size(1) / kv_heads;
  if (groups == 1) return grad;
  auto sizes = grad.sizes().vec();
  sizes[1] = kv_heads;
  sizes.insert(sizes.begin() + 2, groups);
  return grad.reshape(sizes).sum(2);
}

// The probabilities exp(s - lse) of every (row, key), 0 where hidden, in
// `dtype`; `lse` computed here when undefined.
struct Scores {
  at::Tensor probs, logsumexp, key, value;
};

Scores scores(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& bias, bool is_causal, double scale, at::Tensor lse,
              at::ScalarType dtype) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "openwam: the reference attention takes 4-D [B, H, S, E] inputs, got ",
              query.dim(), "-D");
  Scores r;
  r.key = expand_heads(key, query.size(1)).to(dtype);
  r.value = expand_heads(value, query.size(1)).to(dtype);
  at::Tensor s = at::matmul(query.to(dtype), r.key.transpose(-1, -2)) * scale;
  if (bias.defined()) {
    s = s + bias.to(dtype);
  }
  if (is_causal) {  // top-left aligned, as F.sdpa's is_causal
    const auto hidden = at::ones({s.size(-2), s.size(-1)}, s.options().dtype(at::kBool)).triu(1);
    s = s.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  }
  r.logsumexp = lse.defined() ? lse.to(dtype).reshape({s.size(0), s.size(1), s.size(2), 1})
                              : at::logsumexp(s, -1, /*keepdim=*/true);
  r.probs = at::where(r.logsumexp.isneginf(), at::zeros({}, s.options()),
                      at::exp(s - r.logsumexp));
  return r;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> reference_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& bias, bool is_causal, std::optional<double> scale) {
  const Scores r = scores(query, key, value, bias, is_causal,
                          softmax_scale(scale, query), at::Tensor(), at::kFloat);
  return {empty_like_cudnn_output(query, value.sym_size(-1)).copy_(at::matmul(r.probs, r.value)),
          r.logsumexp.contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> reference_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& bias, bool is_causal, std::optional<double> scale) {
  const double s = softmax_scale(scale, query);
  const Scores r = scores(query, key, value, bias, is_causal, s, logsumexp, at::kFloat);
  const at::Tensor go = grad_out.to(at::kFloat);
  const at::Tensor delta = (go * out.to(at::kFloat)).sum(-1, /*keepdim=*/true);
  const at::Tensor ds = r.probs * (at::matmul(go, r.value.transpose(-1, -2)) - delta);
  const at::Tensor dq = at::matmul(ds, r.key) * s;
  const at::Tensor dk = at::matmul(ds.transpose(-1, -2), query.to(at::kFloat)) * s;
  const at::Tensor dv = at::matmul(r.probs.transpose(-1, -2), go);
  return {at::empty_like(query).copy_(dq),
          at::empty_like(key).copy_(reduce_heads(dk, key.size(1))),
          at::empty_like(value).copy_(reduce_heads(dv, value.size(1)))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> single_row_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& bias, bool is_causal,
    std::optional<double> scale) {
  TORCH_INTERNAL_ASSERT(query.dim() == 4 && query.size(2) == 1,
                        "single_row_backward takes one query row");
  const int64_t batch = query.size(0), heads = query.size(1), kv_heads = key.size(1);
  const int64_t group = heads / kv_heads;
  const int64_t s_kv = key.size(2);
  const double s = softmax_scale(scale, query);
  // fp32 as IEEE fp32 whatever the user's allow_tf32 / fp32_precision: with
  // TF32, ds and P would be rounded to 10 mantissa bits in the products below,
  // an error the size of fp16's final rounding added to dQ, dK and dV.
  // Thread-local, so nothing outside this call sees it.
  const at::NoTF32Guard ieee_fp32;
  // Head h = kv_head * group + g: [B, H, 1, E] seen as [B, H_kv, group, E].
  const auto grouped = [&](const at::Tensor& t) {
    return t.to(at::kFloat).reshape({batch, kv_heads, group, t.size(-1)});
  };
  const at::Tensor q = grouped(query), go = grouped(grad_out);
  const at::Tensor k = key.to(at::kFloat), v = value.to(at::kFloat);
  at::Tensor scores = at::matmul(q, k.transpose(-1, -2)) * s;  // [B, H_kv, group, S]
  if (bias.defined()) {
    scores = scores + bias.to(at::kFloat).expand({batch, heads, 1, s_kv}).reshape(
                          {batch, kv_heads, group, s_kv});
  }
  if (is_causal && s_kv > 1) {  // top-left: the one row sees key 0 only
    scores = at::cat({scores.narrow(-1, 0, 1),
                      at::full_like(scores.narrow(-1, 1, s_kv - 1),
                                    -std::numeric_limits<double>::infinity())},
                     -1);
  }
  // P as a softmax of these scores (exp(s - max) / sum), not exp(s - lse)
  // with the forward's logsumexp: cuDNN computes its fp32 scores in another
  // order, and on an adversarial row (logits near -110, where an fp32 ulp is
  // 7.6e-6) a few ulps between the two put P's sum that far off 1. Where the
  // row sees one key (causal, one query) dQ and dK are 0 exactly, and that
  // offset was all of them: 235x stock's dQ error in the GPU fuzz (H100,
  // cuDNN 9.19.0, fp16, head_dim 64, 1,856 keys). A softmax sums to 1 within
  // fp32 rounding of 1, not of |lse|, and is 1 exactly on a single key.
  // A row that sees no key has zero gradients.
  const at::Tensor unseen = at::logsumexp(scores, -1, /*keepdim=*/true).isneginf();
  const at::Tensor probs =
      at::where(unseen, at::zeros({}, scores.options()), at::softmax(scores, -1));
  // delta = dO . O, taken as sum_j P_j dP_j: the same number, but from the
  // fp32 probabilities rather than the output rounded to the inputs' dtype.
  // That rounding cancels into dQ where one key component dominates: 2.45x
  // stock cuDNN's dQ error at head_dim 256 with keys sharing an offset
  // (H200, cuDNN 9.19.0, bf16; the GPU fuzz, seed 89004); this way dQ is
  // within its own rounding to bf16 (tests/test_cudnn_path_cpu.py).
  const at::Tensor dp = at::matmul(go, v.transpose(-1, -2));
  const at::Tensor delta = (probs * dp).sum(-1, /*keepdim=*/true);
  const at::Tensor ds = probs * (dp - delta);
  const at::Tensor dq = (at::matmul(ds, k) * s).reshape({batch, heads, 1, query.size(-1)});
  const at::Tensor dk = at::matmul(ds.transpose(-1, -2), q) * s;  // summed over the group
  const at::Tensor dv = at::matmul(probs.transpose(-1, -2), go);
  return {at::empty_like(query).copy_(dq), at::empty_like(key).copy_(dk),
          at::empty_like(value).copy_(dv)};
}

}  // namespace openwam

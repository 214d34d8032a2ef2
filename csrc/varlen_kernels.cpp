// The kernels of sdpa_varlen's leaf ops, openwam::_sdpa_varlen and
// openwam::_sdpa_varlen_backward, per engine (VarlenBackend):
//   CPU   the exact reference, one sequence at a time (reads cu_seqlens:
//         free on the CPU), so that CI tests the op, its autograd and compile;
//   CUDA  ATen's FlashAttention-2 varlen, or cuDNN's ragged layout on the
//         frontend's graphs (cudnn_frontend/ragged_engine.h);
//   Meta  the outputs' shapes per engine, for torch.compile.
// Every kernel returns contiguous outputs, which is what the Meta kernel says.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <string>

#include "aligned_operand.h"
#include "attention_scale.h"
#include "varlen.h"

#ifdef OPENWAM_WITH_CUDA
#include <ATen/ops/_flash_attention_backward.h>
#include <ATen/ops/_flash_attention_forward.h>
#endif
#ifdef OPENWAM_WITH_CUDNN_FRONTEND
#include "cudnn_frontend/ragged_engine.h"
#endif

namespace openwam {
namespace {

using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensors4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

VarlenBackend backend_of(int64_t bits, const char* op) {
  TORCH_CHECK(bits >= 0 && bits <= static_cast<int64_t>(VarlenBackend::kCudnnRagged), op,
              ": backend must name a leaf engine (0 reference, 1 flash_varlen, "
              "2 cudnn_ragged), got ", bits);
  return static_cast<VarlenBackend>(bits);
}

// Without dropout there is no rng state: empty int64 tensors, so that the
// outputs are deterministic (opcheck compares them) and the Meta kernel can
// say what they are.
at::Tensor no_rng(const at::Tensor& like) {
  return at::empty({0}, like.options().dtype(at::kLong));
}

// The logsumexp of a call that no backward will read (compute_log_sumexp
// false): empty, whatever the engine, so that the Meta kernel can say so.
at::Tensor no_logsumexp(const at::Tensor& like) {
  return at::empty({0}, like.options().dtype(at::kFloat));
}

Tensors4 without_logsumexp(Tensors4 r, const at::Tensor& query, bool compute_log_sumexp) {
  if (!compute_log_sumexp) {
    std::get<1>(r) = no_logsumexp(query);
  }
  return r;
}

// ------------------------------------------------------------ CPU: reference

at::ScalarType compute_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// One sequence: [s, heads, E] -> [heads, s, E] in the compute type, key/value
// heads repeated to the query's (grouped-query attention).
at::Tensor heads_first(const at::Tensor& t, int64_t heads, at::ScalarType type) {
  at::Tensor r = t.transpose(0, 1).to(type);
  const int64_t groups = heads / t.size(1);
  return groups == 1 ? r : r.repeat_interleave(groups, 0);
}

// Summed back over each group of query heads sharing a key/value head:
// [heads, s, E] -> [s, kv_heads, E].
at::Tensor reduce_heads(const at::Tensor& grad, int64_t kv_heads) {
  const int64_t groups = grad.size(0) / kv_heads;
  at::Tensor g = grad;
  if (groups != 1) {
    g = grad.reshape({kv_heads, groups, grad.size(1), grad.size(2)}).sum(1);
  }
  return g.transpose(0, 1);
}

struct Sequence {
  int64_t q0, lq, k0, lk;
};

std::vector<Sequence> sequences(const at::Tensor& cu_q, const at::Tensor& cu_k) {
  const at::Tensor q = cu_q.contiguous();
  const at::Tensor k = cu_k.contiguous();
  const int32_t* pq = q.data_ptr<int32_t>();
  const int32_t* pk = k.data_ptr<int32_t>();
  std::vector<Sequence> seqs;
  for (int64_t b = 0; b + 1 < q.numel(); ++b) {
    seqs.push_back({pq[b], pq[b + 1] - pq[b], pk[b], pk[b + 1] - pk[b]});
  }
  return seqs;
}

// Scores of one sequence with F.sdpa's top-left causal mask, its logsumexp
// ([heads, lq]) and probabilities (0 for a row that sees no key).
struct Scores {
  at::Tensor probs, logsumexp, key, value;
};

Scores sequence_scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       bool is_causal, double scale, const at::Tensor& lse) {
  Scores r;
  r.key = k;
  r.value = v;
  at::Tensor s = at::matmul(q, k.transpose(-1, -2));
  if (q.size(-1) > 0) {
    // head_dim 0: every score is an empty sum, 0, and the default scale
    // 1/sqrt(0) would make it NaN; F.sdpa's math backend scales the empty
    // query instead and attends uniformly. So does this.
    s = s * scale;
  }
  if (is_causal) {
    const auto hidden = at::ones({s.size(-2), s.size(-1)}, s.options().dtype(at::kBool)).triu(1);
    s = s.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  }
  r.logsumexp = lse.defined() ? lse.to(s.scalar_type()) : at::logsumexp(s, -1);
  const at::Tensor l = r.logsumexp.unsqueeze(-1);
  r.probs = at::where(l.isneginf(), at::zeros({}, s.options()), at::exp(s - l));
  return r;
}

Tensors4 reference_forward(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const at::Tensor& cu_q,
                           const at::Tensor& cu_k, c10::SymInt max_q, c10::SymInt max_k,
                           double dropout_p, bool is_causal, std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0,
              "openwam::sdpa_varlen: dropout is not supported on the CPU, got dropout_p=",
              dropout_p);
  check_varlen_lengths(cu_q, cu_k, query.size(0), key.size(0), max_q.guard_int(__FILE__, __LINE__),
                       max_k.guard_int(__FILE__, __LINE__));
  const at::ScalarType type = compute_type(query);
  const int64_t heads = query.size(1);
  const double s = softmax_scale(scale, query);
  at::Tensor out = at::zeros({query.size(0), heads, value.size(2)}, query.options());
  at::Tensor lse = at::empty({heads, query.size(0)}, query.options().dtype(type));
  for (const Sequence& q : sequences(cu_q, cu_k)) {
    if (q.lq == 0) continue;
    const Scores r = sequence_scores(
        heads_first(query.narrow(0, q.q0, q.lq), heads, type),
        heads_first(key.narrow(0, q.k0, q.lk), heads, type),
        heads_first(value.narrow(0, q.k0, q.lk), heads, type), is_causal, s, at::Tensor());
    out.narrow(0, q.q0, q.lq).copy_(at::matmul(r.probs, r.value).transpose(0, 1));
    lse.narrow(1, q.q0, q.lq).copy_(r.logsumexp);
  }
  return {out, lse, no_rng(query), no_rng(query)};
}

Tensors3 reference_backward(const at::Tensor& grad_out, const at::Tensor& query,
                            const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& /*out*/, const at::Tensor& logsumexp,
                            const at::Tensor&, const at::Tensor&, const at::Tensor& cu_q,
                            const at::Tensor& cu_k, c10::SymInt, c10::SymInt, double dropout_p,
                            bool is_causal, std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0,
              "openwam::sdpa_varlen: dropout is not supported on the CPU, got dropout_p=",
              dropout_p);
  const at::ScalarType type = compute_type(query);
  const int64_t heads = query.size(1);
  const int64_t kv_heads = key.size(1);
  const double s = softmax_scale(scale, query);
  at::Tensor dq = at::zeros_like(query, at::MemoryFormat::Contiguous);
  at::Tensor dk = at::zeros_like(key, at::MemoryFormat::Contiguous);
  at::Tensor dv = at::zeros_like(value, at::MemoryFormat::Contiguous);
  for (const Sequence& q : sequences(cu_q, cu_k)) {
    if (q.lq == 0 || q.lk == 0) continue;  // no keys: zero gradient
    const at::Tensor qs = heads_first(query.narrow(0, q.q0, q.lq), heads, type);
    const Scores r = sequence_scores(
        qs, heads_first(key.narrow(0, q.k0, q.lk), heads, type),
        heads_first(value.narrow(0, q.k0, q.lk), heads, type), is_causal, s,
        logsumexp.narrow(1, q.q0, q.lq));
    const at::Tensor go = grad_out.narrow(0, q.q0, q.lq).transpose(0, 1).to(type);
    // The output in the compute type, not the one rounded to bf16/fp16: a
    // rounded output put delta's rounding into dQ and dK (2x-5x F.sdpa's bf16
    // error at scale -1.5; found in review). F.sdpa's CPU kernels keep it too.
    const at::Tensor o = at::matmul(r.probs, r.value);
    const at::Tensor delta = (go * o).sum(-1, /*keepdim=*/true);
    const at::Tensor ds = r.probs * (at::matmul(go, r.value.transpose(-1, -2)) - delta);
    dq.narrow(0, q.q0, q.lq).copy_((at::matmul(ds, r.key) * s).transpose(0, 1));
    dk.narrow(0, q.k0, q.lk).copy_(reduce_heads(at::matmul(ds.transpose(-1, -2), qs) * s, kv_heads));
    dv.narrow(0, q.k0, q.lk).copy_(reduce_heads(at::matmul(r.probs.transpose(-1, -2), go), kv_heads));
  }
  return {dq, dk, dv};
}

Tensors4 cpu_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& cu_q, const at::Tensor& cu_k, c10::SymInt max_q,
                     c10::SymInt max_k, double dropout_p, bool is_causal,
                     std::optional<double> scale, int64_t backend, bool compute_log_sumexp) {
  const VarlenBackend b = backend_of(backend, "openwam::_sdpa_varlen");
  TORCH_CHECK(b == VarlenBackend::kReference, "openwam::_sdpa_varlen: the ", to_string(b),
              " engine runs on CUDA only; CPU inputs take the reference (backend 0)");
  return without_logsumexp(reference_forward(query, key, value, cu_q, cu_k, max_q, max_k,
                                             dropout_p, is_causal, scale),
                           query, compute_log_sumexp);
}

Tensors3 cpu_backward(const at::Tensor& grad_out, const at::Tensor& query,
                      const at::Tensor& key, const at::Tensor& value, const at::Tensor& out,
                      const at::Tensor& logsumexp, const at::Tensor& rng_state,
                      const at::Tensor& rng_offset, const at::Tensor& cu_q,
                      const at::Tensor& cu_k, c10::SymInt max_q, c10::SymInt max_k,
                      double dropout_p, bool is_causal, std::optional<double> scale,
                      int64_t backend) {
  const VarlenBackend b = backend_of(backend, "openwam::_sdpa_varlen_backward");
  TORCH_CHECK(b == VarlenBackend::kReference, "openwam::_sdpa_varlen_backward: the ",
              to_string(b), " engine runs on CUDA only; CPU inputs take the reference");
  return reference_backward(grad_out, query, key, value, out, logsumexp, rng_state,
                            rng_offset, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale);
}

// ------------------------------------------------------------ CUDA

#ifdef OPENWAM_WITH_CUDA
// The fused engines read rows with unit stride along head_dim, each from a
// 16-byte aligned start (FlashAttention-2 loads 16-byte vectors; cuDNN's
// frontend refuses other strides, and FlashAttention-2 then stands in;
// aligned_operand.h).
at::Tensor rows(const at::Tensor& t) {
  return t.stride(-1) == 1 ? aligned_rows(t) : t.contiguous();
}

#ifdef OPENWAM_WITH_CUDNN_FRONTEND
// Where cuDNN cannot build a ragged graph for a call (a version, a layout),
// FlashAttention-2 varlen runs it. Not with dropout (the engines' random
// states differ) nor where FlashAttention-2 would align a causal mask
// differently (a sequence's s_q != s_k): those raise. The backward checks
// again: a backward graph evicted from the cache and not rebuilt must not
// meet FlashAttention-2 there either.
void check_flash_stands_in(const at::Tensor& cu_q, const at::Tensor& cu_k, double dropout_p,
                           bool is_causal, const std::string& why_not, const char* graph) {
  TORCH_CHECK(dropout_p == 0.0 && (!is_causal || same_elements(cu_q, cu_k)),
              "openwam::sdpa_varlen: cuDNN could not build its ragged ", graph,
              " for this call (", why_not, "), and FlashAttention-2 varlen cannot stand in ",
              dropout_p > 0.0 ? "with dropout" : "for a causal mask with s_q != s_k",
              "; OPENWAM_SDPA_VARLEN=block_diagonal runs it without a fused engine");
}

// FlashAttention-2 varlen in the ragged engine's format: its logsumexp
// transposed into [total_q, H, 1] (what the Meta kernel promised).
Tensors4 flash_in_ragged_format(const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const at::Tensor& cu_q,
                                const at::Tensor& cu_k, int64_t mq, int64_t mk,
                                double dropout_p, bool is_causal, std::optional<double> scale,
                                const std::string& why_not) {
  check_flash_stands_in(cu_q, cu_k, dropout_p, is_causal, why_not, "graph");
  TORCH_WARN_ONCE("openwam::sdpa_varlen: cuDNN could not build its ragged graph (", why_not,
                  "); FlashAttention-2 varlen runs such calls");
  auto [out, lse, rng_state, rng_offset, debug] = at::_flash_attention_forward(
      rows(query), rows(key), rows(value), cu_q, cu_k, mq, mk, 0.0, is_causal,
      /*return_debug_mask=*/false, scale);
  return {out.contiguous(), lse.t().unsqueeze(-1).contiguous(), no_rng(query), no_rng(query)};
}
#endif

Tensors4 cuda_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const at::Tensor& cu_q_in, const at::Tensor& cu_k_in, c10::SymInt max_q,
                      c10::SymInt max_k, double dropout_p, bool is_causal,
                      std::optional<double> scale, int64_t backend, bool compute_log_sumexp) {
  const VarlenBackend b = backend_of(backend, "openwam::_sdpa_varlen");
  const at::Tensor cu_q = cu_q_in.contiguous();
  const at::Tensor cu_k = same_elements(cu_q_in, cu_k_in) ? cu_q : cu_k_in.contiguous();
  const int64_t mq = max_q.guard_int(__FILE__, __LINE__);
  const int64_t mk = max_k.guard_int(__FILE__, __LINE__);
  if (b == VarlenBackend::kFlash) {
    auto [out, lse, rng_state, rng_offset, debug] = at::_flash_attention_forward(
        rows(query), rows(key), rows(value), cu_q, cu_k, mq, mk, dropout_p, is_causal,
        /*return_debug_mask=*/false, scale);
    if (dropout_p == 0.0) {
      rng_state = no_rng(query);
      rng_offset = no_rng(query);
    }
    return without_logsumexp({out.contiguous(), lse.contiguous(), rng_state, rng_offset},
                             query, compute_log_sumexp);
  }
  TORCH_CHECK(b == VarlenBackend::kCudnnRagged, "openwam::_sdpa_varlen: the ", to_string(b),
              " engine runs on the CPU only");
#ifdef OPENWAM_WITH_CUDNN_FRONTEND
  frontend::RaggedForward f;
  std::string why_not;
  if (frontend::ragged_forward(rows(query), rows(key), rows(value), cu_q, cu_k, mq, mk,
                               dropout_p, is_causal, scale, compute_log_sumexp, f, why_not)) {
    if (dropout_p == 0.0) {
      f.philox_seed = no_rng(query);
      f.philox_offset = no_rng(query);
    }
    return without_logsumexp({f.out, f.logsumexp, f.philox_seed, f.philox_offset}, query,
                             compute_log_sumexp);
  }
  return without_logsumexp(flash_in_ragged_format(query, key, value, cu_q, cu_k, mq, mk,
                                                  dropout_p, is_causal, scale, why_not),
                           query, compute_log_sumexp);
#else
  TORCH_CHECK(false, "openwam::_sdpa_varlen: cuDNN's ragged layout needs a build with the "
              "cuDNN frontend");
#endif
}

Tensors3 cuda_backward(const at::Tensor& grad_out, const at::Tensor& query,
                       const at::Tensor& key, const at::Tensor& value, const at::Tensor& out,
                       const at::Tensor& logsumexp, const at::Tensor& rng_state,
                       const at::Tensor& rng_offset, const at::Tensor& cu_q_in,
                       const at::Tensor& cu_k_in, c10::SymInt max_q, c10::SymInt max_k,
                       double dropout_p, bool is_causal, std::optional<double> scale,
                       int64_t backend) {
  const VarlenBackend b = backend_of(backend, "openwam::_sdpa_varlen_backward");
  const at::Tensor cu_q = cu_q_in.contiguous();
  const at::Tensor cu_k = same_elements(cu_q_in, cu_k_in) ? cu_q : cu_k_in.contiguous();
  const int64_t mq = max_q.guard_int(__FILE__, __LINE__);
  const int64_t mk = max_k.guard_int(__FILE__, __LINE__);
  // out.sum().backward() hands an upstream gradient broadcast along head_dim.
  const at::Tensor go =
      aligned_operand(grad_out.is_contiguous() ? grad_out : grad_out.contiguous());
  if (b == VarlenBackend::kFlash) {
    auto [dq, dk, dv] = at::_flash_attention_backward(
        go, rows(query), rows(key), rows(value), out, logsumexp, cu_q, cu_k, mq, mk, dropout_p,
        is_causal, rng_state, rng_offset, scale);
    return {dq.contiguous(), dk.contiguous(), dv.contiguous()};
  }
  TORCH_CHECK(b == VarlenBackend::kCudnnRagged, "openwam::_sdpa_varlen_backward: the ",
              to_string(b), " engine runs on the CPU only");
#ifdef OPENWAM_WITH_CUDNN_FRONTEND
  Tensors3 grads;
  std::string why_not;
  if (frontend::ragged_backward(go, rows(query), rows(key), rows(value), out, logsumexp,
                                rng_state, rng_offset, cu_q, cu_k, mq, mk, dropout_p,
                                is_causal, scale, grads, why_not)) {
    return grads;
  }
  // The forward found no graph either and ran FlashAttention-2 (above).
  check_flash_stands_in(cu_q, cu_k, dropout_p, is_causal, why_not, "backward graph");
  auto [dq, dk, dv] = at::_flash_attention_backward(
      go, rows(query), rows(key), rows(value), out,
      logsumexp.squeeze(-1).t().contiguous(), cu_q, cu_k, mq, mk, dropout_p, is_causal,
      rng_state, rng_offset, scale);
  return {dq.contiguous(), dk.contiguous(), dv.contiguous()};
#else
  TORCH_CHECK(false, "openwam::_sdpa_varlen_backward: cuDNN's ragged layout needs a build "
              "with the cuDNN frontend");
#endif
}
#endif  // OPENWAM_WITH_CUDA

// ------------------------------------------------------------ Meta

// logsumexp per engine: the reference and FlashAttention-2 give
// [heads, total_q] (float64 for a float64 reference call), cuDNN's ragged
// layout [total_q, heads, 1]; every engine an empty float32 one without
// compute_log_sumexp. The rng state is empty without dropout; with
// dropout it is what the engine's own Meta kernel says (flash: uint64 [2]
// and []; cuDNN: int64 [] twice).
Tensors4 meta_forward(const at::Tensor& query, const at::Tensor&, const at::Tensor& value,
                      const at::Tensor&, const at::Tensor&, c10::SymInt, c10::SymInt,
                      double dropout_p, bool, std::optional<double>, int64_t backend,
                      bool compute_log_sumexp) {
  const VarlenBackend b = backend_of(backend, "openwam::_sdpa_varlen");
  const c10::SymInt total_q = query.sym_size(0);
  const c10::SymInt heads = query.sym_size(1);
  at::Tensor out = at::empty_symint({total_q, heads, value.sym_size(2)}, query.options());
  const auto f32 = query.options().dtype(
      b == VarlenBackend::kReference ? compute_type(query) : at::kFloat);
  at::Tensor lse = !compute_log_sumexp ? no_logsumexp(query)
                   : b == VarlenBackend::kCudnnRagged
                       ? at::empty_symint({total_q, heads, 1}, f32)
                       : at::empty_symint({heads, total_q}, f32);
  at::Tensor state, offset;
  if (dropout_p == 0.0) {
    state = no_rng(query);
    offset = no_rng(query);
  } else if (b == VarlenBackend::kFlash) {
    state = at::empty({2}, query.options().dtype(at::kUInt64));
    offset = at::empty({}, query.options().dtype(at::kUInt64));
  } else {
    state = at::empty({}, query.options().dtype(at::kLong));
    offset = at::empty({}, query.options().dtype(at::kLong));
  }
  return {out, lse, state, offset};
}

Tensors3 meta_backward(const at::Tensor&, const at::Tensor& query, const at::Tensor& key,
                       const at::Tensor& value, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, c10::SymInt, c10::SymInt, double, bool,
                       std::optional<double>, int64_t) {
  return {at::empty_symint(query.sym_sizes(), query.options()),
          at::empty_symint(key.sym_sizes(), key.options()),
          at::empty_symint(value.sym_sizes(), value.options())};
}

}  // namespace
}  // namespace openwam

TORCH_LIBRARY_IMPL(openwam, CPU, m) {
  m.impl("_sdpa_varlen", &openwam::cpu_forward);
  m.impl("_sdpa_varlen_backward", &openwam::cpu_backward);
}
#ifdef OPENWAM_WITH_CUDA
TORCH_LIBRARY_IMPL(openwam, CUDA, m) {
  m.impl("_sdpa_varlen", &openwam::cuda_forward);
  m.impl("_sdpa_varlen_backward", &openwam::cuda_backward);
}
#endif
TORCH_LIBRARY_IMPL(openwam, Meta, m) {
  m.impl("_sdpa_varlen", &openwam::meta_forward);
  m.impl("_sdpa_varlen_backward", &openwam::meta_backward);
}

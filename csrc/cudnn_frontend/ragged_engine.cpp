#include "ragged_engine.h"

#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <unordered_map>

#include "../aligned_operand.h"
#include "dropout_seed.h"
#include "graph_key.h"
#include "graph_runner.h"
#include "ragged_buckets.h"
#include "ragged_offsets.h"
#include "sdpa_graphs.h"

namespace openwam::frontend {
namespace {

// Rows of a packed [total, H, E] tensor, as the graph's [B, H, S, E] with the
// batch stride of S rows (cuDNN takes each sequence's start from the offsets).
// A size-1 dimension's stride is normalised so that equal layouts give equal
// keys.
Layout packed(const at::Tensor& t, int64_t batch, int64_t s) {
  TORCH_INTERNAL_ASSERT(t.dim() == 3 && t.stride(2) == 1, "ragged graphs take packed rows");
  const int64_t heads = t.size(1), e = t.size(2);
  const int64_t head_stride = heads == 1 ? e : t.stride(1);
  const int64_t row_stride = t.size(0) <= 1 ? heads * head_stride : t.stride(0);
  return {{batch, heads, s, e}, {s * row_stride, head_stride, row_stride, 1}};
}

int64_t row_stride(const Layout& l) { return l.strides[2]; }

// What the graphs assume of a call (varlen_backend.cpp admits only such calls;
// these checks hold the private leaf op, callable directly, to the same).
void check_call(const char* op, const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& value, const at::Tensor& cu_q, const at::Tensor& cu_k) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kHalf || dtype == at::kBFloat16) && key.scalar_type() == dtype &&
                  value.scalar_type() == dtype,
              op, ": cuDNN's ragged layout takes float16/bfloat16 query, key and value of one "
              "dtype, got ", query.scalar_type(), ", ", key.scalar_type(), " and ",
              value.scalar_type());
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 &&
                  value.size(2) == query.size(2) && key.size(2) == query.size(2) &&
                  key.size(0) == value.size(0) && key.size(1) == value.size(1) &&
                  key.size(1) > 0 && query.size(1) % key.size(1) == 0,
              op, ": cuDNN's ragged layout takes packed [total, heads, head_dim] tensors with "
              "one head_dim, key and value of one total, and query heads a multiple of "
              "key/value heads, got query ",
              query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  TORCH_CHECK(cu_q.scalar_type() == at::kInt && cu_k.scalar_type() == at::kInt &&
                  cu_q.dim() == 1 && cu_q.sizes() == cu_k.sizes() && cu_q.size(0) >= 1,
              op, ": cu_seqlens_q/k must be int32 [batch + 1] of one size");
  // A kernel reads them (ragged_offsets.cu).
  TORCH_CHECK(cu_q.device() == query.device() && cu_k.device() == query.device() &&
                  key.device() == query.device() && value.device() == query.device(),
              op, ": query, key, value and cu_seqlens_q/k must be on one device, got ",
              query.device(), ", ", key.device(), ", ", value.device(), ", ", cu_q.device(),
              " and ", cu_k.device());
}

RaggedDims dims_of(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cu_q,
                   int64_t max_q, int64_t max_k) {
  return call_dims(cu_q.size(0) - 1, max_q, max_k, query.size(0), key.size(0));
}

SdpaGraphKey forward_key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const RaggedDims& d, double dropout_p,
                         bool is_causal, bool training) {
  SdpaGraphKey key;
  key.device = q.device().index();
  key.bf16 = q.scalar_type() == at::kBFloat16;
  key.pass = training ? Pass::kTraining : Pass::kInference;
  key.q = packed(q, d.batch, d.s_q);
  key.k = packed(k, d.batch, d.s_kv);
  key.v = packed(v, d.batch, d.s_kv);
  key.o = packed(out, d.batch, d.s_q);
  key.is_causal = is_causal;
  key.dropout_p = dropout_p;
  key.ragged = true;
  return key;
}

// The backward of `fwd`, for grad_out laid out like the output, and query,
// key, value and their gradients all contiguous [total, H, E]. On cuDNN 9.19.0
// (H200) the ragged backward gave a wrong dQ (normalised error 1.0-1.35) when
// the query was a strided view (a slice of a packed qkv projection, or a
// head-major buffer) and dQ contiguous, though both carried their own offsets;
// its forward took the same views right. The backward runs on contiguous
// copies of such views (backward_operand).
SdpaGraphKey backward_key(const SdpaGraphKey& fwd, const at::Tensor& q, const at::Tensor& k,
                          const RaggedDims& d) {
  SdpaGraphKey key = fwd;
  key.pass = Pass::kBackward;
  key.grad_out = fwd.o;
  const auto contiguous = [&](const at::Tensor& t, int64_t s) {
    const int64_t heads = t.size(1), e = t.size(2);
    return Layout{{d.batch, heads, s, e}, {s * heads * e, e, heads * e, 1}};
  };
  key.q = key.dq = contiguous(q, d.s_q);
  key.k = key.v = key.dk = key.dv = contiguous(k, d.s_kv);  // one head_dim (check_call)
  key.max_total_q = d.total_q;
  key.max_total_kv = d.total_kv;
  return key;
}

// An operand of the forward graph, aligned. A head-major buffer ([H, total, E]
// seen as [total, H, E]) is copied into rows: its head stride is the total,
// which the graph holds, so each batch's total would build a graph of its own
// (no bucket covers it); a token-major one, a slice of a packed qkv projection
// included, is taken as it is.
at::Tensor forward_operand(const at::Tensor& t) {
  const bool head_major = t.size(0) > 1 && t.size(1) > 1 && t.stride(1) > t.stride(0);
  return aligned_operand(head_major ? t.contiguous() : t);
}

// An operand of the backward graph: contiguous (backward_key), and aligned.
at::Tensor backward_operand(const at::Tensor& t) {
  return aligned_operand(t.is_contiguous() ? t : t.contiguous());
}

RaggedOffsets offsets_for(const SdpaGraphKey& key, const at::Tensor& cu_q,
                          const at::Tensor& cu_k, int64_t batch) {
  std::array<int64_t, kRaggedTensors> strides{};
  strides[kRowsQ] = row_stride(key.q);
  strides[kRowsK] = row_stride(key.k);
  strides[kRowsV] = row_stride(key.v);
  strides[kRowsO] = row_stride(key.o);
  strides[kRowsStats] = key.q.sizes[1];  // [total_q, H, 1]
  strides[kRowsGradQ] = key.dq.present() ? row_stride(key.dq) : 0;
  strides[kRowsGradKv] = key.dk.present() ? row_stride(key.dk) : 0;
  return ragged_offsets(cu_q, cu_k, batch, key.q.sizes[0], strides);
}

void bind_offsets(std::unordered_map<int64_t, void*>& pack, const RaggedOffsets& r,
                  bool stats, bool gradients) {
  pack[kSeqLenQ] = r.lengths_q();
  pack[kSeqLenKv] = r.lengths_kv();
  pack[kRaggedQ] = r.offsets_of(kRowsQ);
  pack[kRaggedK] = r.offsets_of(kRowsK);
  pack[kRaggedV] = r.offsets_of(kRowsV);
  pack[kRaggedO] = r.offsets_of(kRowsO);
  if (stats) pack[kRaggedStats] = r.offsets_of(kRowsStats);
  if (gradients) {
    pack[kRaggedGradQ] = r.offsets_of(kRowsGradQ);
    pack[kRaggedGradKv] = r.offsets_of(kRowsGradKv);
  }
}

}  // namespace

bool ragged_forward(const at::Tensor& query_in, const at::Tensor& key_in,
                    const at::Tensor& value_in, const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q,
                    int64_t max_k, double dropout_p, bool is_causal,
                    std::optional<double> scale, bool training, RaggedForward& result,
                    std::string& why_not) {
  check_call("openwam::_sdpa_varlen", query_in, key_in, value_in, cu_q, cu_k);
  // cuDNN's handle, the workspace and the graph build follow the current
  // device: make it the inputs' (a model spread over GPUs calls from another).
  const c10::cuda::CUDAGuard device(query_in.device());
  const at::Tensor query = forward_operand(query_in), key = forward_operand(key_in),
                   value = forward_operand(value_in);
  const RaggedDims d = dims_of(query, key, cu_q, max_q, max_k);
  at::Tensor out = at::empty({query.size(0), query.size(1), value.size(2)}, query.options());
  const SdpaGraphKey fwd = forward_key(query, key, value, out, d, dropout_p, is_causal, training);
  const SdpaGraphKey bwd = backward_key(fwd, query, key, d);
  const auto graph = forward_graph(fwd, bwd, training, why_not);
  if (graph == nullptr) {
    return false;
  }
  float scale_by_value = scale_value(scale, query);
  std::unordered_map<int64_t, void*> pack =
      forward_pack(query, key, value, out, &scale_by_value);
  const RaggedOffsets offsets = offsets_for(fwd, cu_q, cu_k, cu_q.size(0) - 1);
  bind_offsets(pack, offsets, training, false);
  result = RaggedForward{};
  result.out = out;
  if (training) {
    result.logsumexp =
        at::empty({query.size(0), query.size(1), 1}, query.options().dtype(at::kFloat));
    pack[kStats] = result.logsumexp.data_ptr();
  }
  if (dropout_p > 0.0) {
    std::tie(result.philox_seed, result.philox_offset) = dropout_seed_offset(
        query.device(),
        static_cast<uint64_t>(d.batch * query.size(1) * d.s_q * d.s_kv));
    pack[kSeed] = result.philox_seed.data_ptr();
    pack[kOffset] = result.philox_offset.data_ptr();
  }
  run(*graph, pack, fwd);
  zero_rows_without_keys(result.out, cu_q, cu_k, cu_q.size(0) - 1);
  return true;
}

bool ragged_backward(const at::Tensor& grad_out, const at::Tensor& query_in,
                     const at::Tensor& key_in, const at::Tensor& value_in,
                     const at::Tensor& out_in, const at::Tensor& logsumexp_in,
                     const at::Tensor& philox_seed, const at::Tensor& philox_offset,
                     const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q,
                     int64_t max_k, double dropout_p, bool is_causal,
                     std::optional<double> scale,
                     std::tuple<at::Tensor, at::Tensor, at::Tensor>& grads,
                     std::string& why_not) {
  check_call("openwam::_sdpa_varlen_backward", query_in, key_in, value_in, cu_q, cu_k);
  TORCH_CHECK(out_in.is_contiguous() && out_in.sizes() == query_in.sizes() &&
                  logsumexp_in.scalar_type() == at::kFloat && logsumexp_in.is_contiguous() &&
                  logsumexp_in.numel() == query_in.size(0) * query_in.size(1),
              "openwam::_sdpa_varlen_backward: the ragged engine's backward takes its forward's "
              "contiguous output and float32 [total_q, heads, 1] logsumexp");
  const c10::cuda::CUDAGuard device(query_in.device());  // as in ragged_forward
  const at::Tensor query = backward_operand(query_in), key = backward_operand(key_in),
                   value = backward_operand(value_in), out = backward_operand(out_in),
                   logsumexp = backward_operand(logsumexp_in);
  const RaggedDims d = dims_of(query, key, cu_q, max_q, max_k);
  // cuDNN reads grad_out's rows through the output's offsets.
  const at::Tensor go = backward_operand(grad_out);
  const SdpaGraphKey fwd = forward_key(query, key, value, out, d, dropout_p, is_causal, true);
  const SdpaGraphKey bwd = backward_key(fwd, query, key, d);
  const auto graph = graph_for(bwd, why_not);
  if (graph == nullptr) {
    return false;
  }
  at::Tensor dq = at::empty(query.sizes(), query.options());
  at::Tensor dk = at::empty(key.sizes(), key.options());
  at::Tensor dv = at::empty(value.sizes(), value.options());
  float scale_by_value = scale_value(scale, query);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, query.data_ptr()},    {kK, key.data_ptr()},     {kV, value.data_ptr()},
      {kO, out.data_ptr()},      {kGradOut, go.data_ptr()}, {kStats, logsumexp.data_ptr()},
      {kGradQ, dq.data_ptr()},   {kGradK, dk.data_ptr()},  {kGradV, dv.data_ptr()},
      {kScale, &scale_by_value}};
  const RaggedOffsets offsets = offsets_for(bwd, cu_q, cu_k, cu_q.size(0) - 1);
  bind_offsets(pack, offsets, true, true);
  if (dropout_p > 0.0) {
    check_seed_offset("openwam::_sdpa_varlen_backward", philox_seed, philox_offset,
                      query.device());
    pack[kSeed] = philox_seed.data_ptr();
    pack[kOffset] = philox_offset.data_ptr();
  }
  run(*graph, pack, bwd);
  zero_unattended_grads(dq, dk, dv, cu_q, cu_k, cu_q.size(0) - 1);
  grads = {dq, dk, dv};
  return true;
}

}  // namespace openwam::frontend

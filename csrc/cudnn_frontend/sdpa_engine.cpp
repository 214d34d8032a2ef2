#include "sdpa_engine.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <unordered_map>

#include "../aligned_operand.h"
#include "dropout_seed.h"
#include "full_lengths.h"
#include "graph_key.h"
#include "graph_runner.h"
#include "sdpa_graphs.h"
#include "stats.h"
#include "tensor_layouts.h"

namespace openwam::frontend {
namespace {

// The padding mask's full lengths bound into `pack`; the result must outlive
// run() (a per-call write's storage).
FullLengths bind_full_lengths(std::unordered_map<int64_t, void*>& pack, const at::Tensor& query,
                              const at::Tensor& key) {
  FullLengths lengths = full_lengths(query, query.size(2), key.size(2));
  pack[kSeqLenQ] = const_cast<int32_t*>(lengths.q);
  pack[kSeqLenKv] = const_cast<int32_t*>(lengths.kv);
  return lengths;
}

at::Tensor empty_gradient(const at::Tensor& t) {
  const Layout l = gradient_layout(t);
  return at::empty_strided({l.sizes.begin(), l.sizes.end()}, {l.strides.begin(), l.strides.end()},
                           t.options());
}

// cuDNN reads the bias as [B, 1|H, L, S]: broadcast axes expanded with
// stride 0, as ATen passes it.
at::Tensor expanded_bias(const at::Tensor& bias, const at::Tensor& query, const at::Tensor& key) {
  if (!bias.defined()) {
    return bias;
  }
  return bias.expand({query.size(0), bias.size(1), query.size(2), key.size(2)});
}

SdpaGraphKey base_key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& bias, double dropout_p, bool is_causal) {
  SdpaGraphKey key;
  key.device = q.device().index();
  key.bf16 = q.scalar_type() == at::kBFloat16;
  key.q = layout_of(q);
  key.k = layout_of(k);
  key.v = layout_of(v);
  if (bias.defined()) {
    key.bias = layout_of(bias);
  }
  key.is_causal = is_causal;
  key.dropout_p = dropout_p;
  return key;
}

// The backward of the forward `fwd`, for a grad_out laid out like the output.
SdpaGraphKey backward_key(const SdpaGraphKey& fwd, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, bool padding_mask) {
  SdpaGraphKey bwd = fwd;
  bwd.pass = Pass::kBackward;
  bwd.padding_mask = padding_mask;
  bwd.grad_out = fwd.o;
  bwd.dq = gradient_layout(q);
  bwd.dk = gradient_layout(k);
  bwd.dv = gradient_layout(v);
  return bwd;
}

}  // namespace

bool sdpa_forward(const at::Tensor& query_in, const at::Tensor& key_in,
                  const at::Tensor& value_in, const at::Tensor& bias_in, bool training,
                  double dropout_p, bool is_causal,
                  std::optional<double> scale, bool padding_mask, bool prepare_backward,
                  CudnnForward& result, std::string& why_not) {
  // cuDNN's handle, the workspace and the graph build follow the current
  // device: make it the inputs' (a model spread over GPUs calls from another).
  const c10::cuda::CUDAGuard device(query_in.device());
  const at::Tensor query = aligned_operand(query_in), key = aligned_operand(key_in),
                   value = aligned_operand(value_in);
  const at::Tensor bias = expanded_bias(aligned_operand(bias_in), query, key);
  const at::Tensor out = empty_like_cudnn_output(query, value.sym_size(-1));
  SdpaGraphKey fwd = base_key(query, key, value, bias, dropout_p, is_causal);
  fwd.pass = training ? Pass::kTraining : Pass::kInference;
  fwd.o = layout_of(out);
  // With dropout the forward runs with the backward's padding mask too, so
  // that both passes draw the dropout pattern in one configuration: that
  // cuDNN's pattern does not depend on the padding mask is not measured.
  fwd.padding_mask = padding_mask && dropout_p > 0.0;
  // A training forward builds the backward graph now too, for a grad_out laid
  // out like the output (autograd's usual case): where either cannot be
  // built, both passes take ATen.
  const SdpaGraphKey bwd = backward_key(fwd, query, key, value, padding_mask);
  const std::shared_ptr<const BuiltGraph> graph =
      forward_graph(fwd, bwd, training && prepare_backward, why_not);
  if (graph == nullptr) {
    return false;
  }
  float scale_by_value = scale_value(scale, query);
  std::unordered_map<int64_t, void*> pack =
      forward_pack(query, key, value, out, &scale_by_value);
  if (bias.defined()) {
    pack[kBias] = bias.data_ptr();
  }
  result.out = out;
  if (training) {
    result.logsumexp = at::empty({query.size(0), query.size(1), query.size(2), 1},
                                 query.options().dtype(at::kFloat));
    pack[kStats] = result.logsumexp.data_ptr();
  }
  if (dropout_p > 0.0) {
    // One random value per score, as ATen's cuDNN attention draws them.
    std::tie(result.philox_seed, result.philox_offset) = dropout_seed_offset(
        query.device(), static_cast<uint64_t>(query.size(0) * query.size(1) *
                                              query.size(2) * key.size(2)));
    pack[kSeed] = result.philox_seed.data_ptr();
    pack[kOffset] = result.philox_offset.data_ptr();
  }
  FullLengths lengths;  // outlives run()
  if (fwd.padding_mask) {
    lengths = bind_full_lengths(pack, query, key);
  }
  run(*graph, pack, fwd);
  return true;
}

bool sdpa_backward(const at::Tensor& grad_out_in, const at::Tensor& query_in,
                   const at::Tensor& key_in, const at::Tensor& value_in, const at::Tensor& out_in,
                   const at::Tensor& logsumexp,
                   const at::Tensor& philox_seed, const at::Tensor& philox_offset,
                   const at::Tensor& bias_in, double dropout_p, bool is_causal,
                   std::optional<double> scale, bool padding_mask,
                   std::tuple<at::Tensor, at::Tensor, at::Tensor>& grads, std::string& why_not) {
  const c10::cuda::CUDAGuard device(query_in.device());  // as in sdpa_forward
  // Re-homed as the forward re-homed them (its graph key saw the copies).
  const at::Tensor query = aligned_operand(query_in), key = aligned_operand(key_in),
                   value = aligned_operand(value_in), out = aligned_operand(out_in);
  const at::Tensor bias = expanded_bias(aligned_operand(bias_in), query, key);
  // cuDNN reads rows of grad_out: one broadcast along head_dim (from
  // out.sum().backward()) or otherwise strided is copied into out's layout.
  at::Tensor grad_out = grad_out_in;
  if (grad_out.stride(-1) != 1 || !grad_out.is_non_overlapping_and_dense()) {
    grad_out = at::empty_strided(out.sizes(), out.strides(), out.options()).copy_(grad_out_in);
  }
  grad_out = aligned_operand(grad_out);
  SdpaGraphKey fwd = base_key(query, key, value, bias, dropout_p, is_causal);
  fwd.o = layout_of(out);
  const SdpaGraphKey prepared = backward_key(fwd, query, key, value, padding_mask);
  SdpaGraphKey bwd = prepared;
  bwd.grad_out = layout_of(grad_out);
  std::shared_ptr<const BuiltGraph> graph = graph_for(bwd, why_not);
  if (graph == nullptr && bwd != prepared) {
    // The graph the forward prepared takes grad_out in out's layout.
    grad_out = at::empty_strided(out.sizes(), out.strides(), out.options()).copy_(grad_out);
    bwd = prepared;
    graph = graph_for(bwd, why_not);
  }
  if (graph == nullptr) {
    return false;
  }
  // The statistics the forward wrote: float32 [B, H, L, 1], packed; aligned as
  // the other operands (a slice of them need not start on 16 bytes).
  const at::Tensor lse = aligned_operand(logsumexp);
  TORCH_INTERNAL_ASSERT(lse.dim() == 4 && lse.size(0) == query.size(0) &&
                        lse.size(1) == query.size(1) && lse.size(2) == query.size(2) &&
                        lse.is_contiguous() && lse.scalar_type() == at::kFloat);
  at::Tensor dq = empty_gradient(query), dk = empty_gradient(key), dv = empty_gradient(value);
  float scale_by_value = scale_value(scale, query);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, query.data_ptr()},      {kK, key.data_ptr()},         {kV, value.data_ptr()},
      {kO, out.data_ptr()},        {kGradOut, grad_out.data_ptr()},
      {kStats, lse.data_ptr()},    {kGradQ, dq.data_ptr()},      {kGradK, dk.data_ptr()},
      {kGradV, dv.data_ptr()},     {kScale, &scale_by_value}};
  if (bias.defined()) {
    pack[kBias] = bias.data_ptr();
  }
  if (dropout_p > 0.0) {
    check_seed_offset("openwam::_cudnn_sdpa_backward", philox_seed, philox_offset,
                      query.device());
    pack[kSeed] = philox_seed.data_ptr();
    pack[kOffset] = philox_offset.data_ptr();
  }
  FullLengths lengths;  // outlives run()
  if (padding_mask) {
    lengths = bind_full_lengths(pack, query, key);
    stats().padding_mask_backwards++;
  }
  run(*graph, pack, bwd);
  grads = {dq, dk, dv};
  return true;
}

}  // namespace openwam::frontend

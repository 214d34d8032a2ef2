// Padding-free (packed, variable-length) attention: openwam::sdpa_varlen.
//
// Inputs follow flash-attn's varlen convention: query [total_q, H, E], key and
// value [total_k, H_kv, E|Ev], cu_seqlens_q/k int32 [B + 1] (offsets of each
// sequence into total; cu[0] == 0, cu[B] == total), max_seqlen_q/k an upper
// bound of the longest sequence, known to the caller (no host sync here).
// Sequence b attends only to its own keys; is_causal is top-left aligned per
// sequence, as F.sdpa's is_causal: query row i sees keys 0..i of its sequence.
//
// Kernels: varlen.cpp (schemas, validation, routing), varlen_autograd.cpp
// (the leaf op's autograd node), varlen_kernels.cpp (CPU reference, CUDA
// engines, Meta), varlen_backend.cpp (which engine, shared with explain()).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/SymInt.h>

#include <optional>

namespace openwam {

// The engines of the leaf ops openwam::_sdpa_varlen / _sdpa_varlen_backward,
// carried in their schemas as an int; kBlockDiagonal is no leaf: the call
// runs openwam::sdpa over the packed batch with a block-diagonal mask.
enum class VarlenBackend : int64_t {
  kReference = 0,     // exact, per sequence, on the CPU (fp32, float64 for float64)
  kFlash = 1,         // ATen's bundled FlashAttention-2 varlen
  kCudnnRagged = 2,   // the op's own cuDNN graphs on the ragged layout (cudnn_frontend/)
  kBlockDiagonal = 3, // openwam::sdpa with a dense block-diagonal mask
};

const char* to_string(VarlenBackend backend);

// The arguments of one sdpa_varlen call.
struct VarlenCall {
  const at::Tensor& query;         // [total_q, H, E]
  const at::Tensor& key;           // [total_k, H_kv, E]
  const at::Tensor& value;         // [total_k, H_kv, Ev]
  const at::Tensor& cu_seqlens_q;  // int32 [B + 1]
  const at::Tensor& cu_seqlens_k;  // int32 [B + 1]
  c10::SymInt max_seqlen_q;
  c10::SymInt max_seqlen_k;
  bool is_causal;
  std::optional<double> scale;
  double dropout_p;
  bool enable_gqa;

  // Will autograd record this call: grad mode on and q, k or v requires grad.
  bool differentiated() const;
  // Differentiated, or with dropout: a call with dropout runs the training
  // graph whatever the grad mode (SdpaCall::takes_training_forward says why).
  bool takes_training_forward() const { return differentiated() || dropout_p > 0.0; }
  // Is every sequence's query length its key length, without reading the
  // lengths: cu_seqlens_q and cu_seqlens_k are one tensor (or views of the
  // same elements).
  bool same_lengths() const;
};

// Are `a` and `b` the same elements (one tensor, or equal views of one
// storage), known without reading them.
bool same_elements(const at::Tensor& a, const at::Tensor& b);

// The checks every call passes (dtypes, devices, ranks, head counts,
// cu_seqlens' dtype and shape); raise with the argument, what was expected
// and what arrived. Reads no tensor values: no host sync on CUDA.
void check_varlen_arguments(const VarlenCall& call);

// The checks that read cu_seqlens (monotone from 0, last value == total,
// max_seqlen an upper bound). Only for tensors on the CPU, where reading
// them costs no sync: the CPU kernels run them.
void check_varlen_lengths(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                          int64_t total_q, int64_t total_k, int64_t max_seqlen_q,
                          int64_t max_seqlen_k);

}  // namespace openwam

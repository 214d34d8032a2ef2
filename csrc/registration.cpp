// The op schemas of the `openwam` library. Kernels are registered next to
// their implementations:
//   sdpa                  sdpa_op.cpp (CompositeImplicitAutograd, Autocast)
//   _cudnn_sdpa           cudnn_path.cpp (Autograd), cudnn_path_kernels.cpp
//   _cudnn_sdpa_backward  (CUDA, CPU reference, Meta); cudnn_path.cpp (Autograd:
//                         not twice differentiable)
//   pad_keys              padding.cpp
//   _mask_bias            mask_bias.cpp (CPU, CUDA, Meta)
//   sdpa_varlen and its leaf ops: varlen.cpp (their schemas and kernels)
#include <torch/library.h>

TORCH_LIBRARY(openwam, m) {
  // Drop-in for torch.nn.functional.scaled_dot_product_attention.
  m.def(
      "sdpa(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
      "float dropout_p=0.0, bool is_causal=False, float? scale=None, "
      "bool enable_gqa=False) -> Tensor");
  // The guarded cuDNN path, as two leaf ops so that torch.compile keeps them
  // (and the fix inside the backward) whole. 4-D [B, H, S, E] inputs, key and
  // value may have fewer heads; attn_bias additive in query's dtype; `plan`
  // is a Plan (plan.h). Outputs as ATen's cuDNN attention gives them;
  // logsumexp is empty unless compute_log_sumexp. A forward that shifts the
  // scores for its backward (score_shift.h: shifts_in_forward) returns its
  // logsumexp shifted and the raised bias, which its backward takes as
  // attn_bias; otherwise raised_bias has no keys. Seeded (its dropout draws
  // from the CUDA generator), as ATen's attention ops are: a compiled
  // graph's activation checkpointing then recomputes it with the forward's
  // generator state (torch._functorch.partitioners.functionalize_rng_ops),
  // not a new dropout pattern the backward would differentiate silently.
  m.def(
      "_cudnn_sdpa(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, "
      "float dropout_p, bool is_causal, float? scale, bool compute_log_sumexp, "
      "int plan) -> (Tensor out, Tensor logsumexp, Tensor philox_seed, "
      "Tensor philox_offset, Tensor raised_bias)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "_cudnn_sdpa_backward(Tensor grad_out, Tensor query, Tensor key, "
      "Tensor value, Tensor? attn_bias, Tensor out, Tensor logsumexp, "
      "Tensor philox_seed, Tensor philox_offset, float dropout_p, "
      "bool is_causal, float? scale, int plan) -> (Tensor grad_query, "
      "Tensor grad_key, Tensor grad_value)");
  // The padding shim on its own: zero keys/values up to a multiple of
  // `multiple`, hidden by the returned mask (bool stays bool, additive stays
  // additive, none becomes a [1, S_padded] bool key-padding mask).
  m.def(
      "pad_keys(Tensor key, Tensor value, Tensor? attn_mask=None, "
      "int multiple=128) -> (Tensor, Tensor, Tensor)");
  // A bool mask as cuDNN's additive bias (mask_bias.h), its keys grown to
  // s_kv_padded with -inf there.
  m.def("_mask_bias(Tensor mask, ScalarType dtype, SymInt s_kv, SymInt s_kv_padded) -> Tensor");
}

// The op schemas of the `openwam` library. Kernels are registered next to
// their implementations: autograd.cpp (sdpa), padding.cpp (pad_keys),
// meta.cpp and cuda/repair_dq.cu (_repair_dq_).
#include <torch/library.h>

TORCH_LIBRARY(openwam, m) {
  // Drop-in for torch.nn.functional.scaled_dot_product_attention.
  m.def(
      "sdpa(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
      "float dropout_p=0.0, bool is_causal=False, float? scale=None, "
      "bool enable_gqa=False) -> Tensor");
  // The padding shim on its own: zero keys/values up to a multiple of
  // `multiple`, hidden by the returned mask (bool stays bool, additive stays
  // additive, none becomes a [1, S_padded] bool key-padding mask).
  m.def(
      "pad_keys(Tensor key, Tensor value, Tensor? attn_mask=None, "
      "int multiple=128) -> (Tensor, Tensor, Tensor)");
  // Internal: recompute in fp32 the dQ rows whose logsumexp lies below the
  // overflow threshold of the cuDNN key-tail defect (see repair_dq.h).
  m.def(
      "_repair_dq_(Tensor(a!) grad_query, Tensor grad_out, Tensor query, "
      "Tensor key, Tensor value, Tensor out, Tensor logsumexp, "
      "Tensor? attn_bias, bool is_causal, float scale) -> ()");
}

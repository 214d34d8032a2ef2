// Thin wrappers around ATen's direct cuDNN attention ops (torch 2.11-2.14
// schema). They take 4-D [B, H, S, E] tensors and an additive bias in the
// query's dtype (never bool or float32: silently wrong in torch 2.11).
#pragma once

#include <ATen/ATen.h>
#include <optional>
#include <tuple>

namespace openwam {

struct CudnnForward {
  at::Tensor out;
  at::Tensor logsumexp;  // [B, H, L, 1] float32; undefined unless asked for
  at::Tensor philox_seed;
  at::Tensor philox_offset;
  // Symbolic while torch.compile traces with dynamic shapes: a plain int
  // here would fail (or pin the sequence length) under opcheck's
  // aot_dispatch_dynamic.
  c10::SymInt max_q = 0;
  c10::SymInt max_k = 0;
};

// `bias` is undefined for "no bias".
CudnnForward cudnn_forward(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const at::Tensor& bias,
                           bool compute_logsumexp, double dropout_p,
                           bool is_causal, std::optional<double> scale);

// Gradients laid out like their inputs. The key length is key's own, so a
// padded key/value/bias may be passed with the forward of the unpadded call
// (the padded keys add exactly 0 to out and logsumexp).
std::tuple<at::Tensor, at::Tensor, at::Tensor> cudnn_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const CudnnForward& forward,
    const at::Tensor& bias, double dropout_p, bool is_causal,
    std::optional<double> scale);

// A mask as the user passed it (broadcastable to [..., L, S] of an input of
// rank `input_rank`, 3 or 4) as a cuDNN bias: additive, query dtype, 4-D,
// last dim materialised and contiguous; other broadcast axes kept.
at::Tensor cudnn_bias(const at::Tensor& mask, at::ScalarType dtype,
                      int64_t input_rank, int64_t s_kv);

}  // namespace openwam

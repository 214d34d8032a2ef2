// Exact attention in fp32 on the CPU with cuDNN's conventions: a -inf bias
// hides a key; a row that sees no key gets zero output, logsumexp -inf and
// zero gradient. The CPU kernels of the cuDNN path's leaf ops run it in
// place of cuDNN (cudnn_path_kernels.cpp), so that CPU tests can exercise
// what surrounds cuDNN: the plans, the ops' autograd, their Meta kernels
// under torch.compile, their sharding under DTensor. openwam::sdpa never
// routes a CPU call there. No dropout.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace openwam {

// out laid out like query; logsumexp [B, H, L, 1] float32.
std::tuple<at::Tensor, at::Tensor> reference_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& bias, bool is_causal, std::optional<double> scale);

// Gradients laid out like their inputs, from the forward's logsumexp.
std::tuple<at::Tensor, at::Tensor, at::Tensor> reference_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& bias, bool is_causal, std::optional<double> scale);

}  // namespace openwam

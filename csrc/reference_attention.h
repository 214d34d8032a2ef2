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

// The backward of a one-query-row call (the plan pad_query_backward: batch
// 1 on the GPU) in fp32 with ATen ops, on any device. cuDNN's own backward
// there is cudnn-frontend #1072 (non-finite dK/dV), and the frontend's
// padding mask with a grown query left dQ at up to 1.15x the worse of flash
// and efficient attention in fp16 (H200, cuDNN 9.19.0). The problem is
// GEMV-sized: the query heads sharing a key/value head become the rows of
// one product, so grouped-query attention copies nothing and dK/dV sum over
// the group in the product. The row's delta (dO . O) is sum_j P_j dP_j in
// fp32, not read from the output rounded to the inputs' dtype, so dQ lies
// within its own final rounding. Its products are IEEE fp32 even where the
// user allows TF32. Its softmax is recomputed from the scores, not taken
// from the forward's logsumexp (reference_attention.cpp says why). No
// dropout. query [B, H, 1, E]; key/value [B, H_kv, S, E|Ev]; bias
// broadcastable to [B, H, 1, S] or undefined.
std::tuple<at::Tensor, at::Tensor, at::Tensor> single_row_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& bias, bool is_causal,
    std::optional<double> scale);

}  // namespace openwam

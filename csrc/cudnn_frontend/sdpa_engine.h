// The op's cuDNN attention, on graphs it builds itself with the cuDNN
// frontend (sdpa_graphs.h) rather than through ATen's private wrappers, which
// hide cuDNN's padding mask, the fix at the source of both backward defects.
//
// Graphs are built once per configuration and run as graph_runner.h says.
// CUDA builds with the frontend's headers only (OPENWAM_WITH_CUDNN_FRONTEND).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../cudnn_attention.h"

namespace openwam::frontend {

// q, k, v 4-D [B, H, S, E] (key/value may have fewer heads); `bias` additive
// in q's dtype, 4-D [B|1, H|1, L|1, S] with a contiguous last dim (what
// cudnn_bias() gives), or undefined. `training`: write the logsumexp, and,
// when `prepare_backward`, build the backward graph now too, with the padding
// mask when `padding_mask`, so that forward and backward agree on the engine
// (a backward that will run on other shapes has nothing to prepare); with
// dropout the forward itself runs with the padding mask too. Inputs whose
// data pointers are not 16-byte aligned run on aligned copies
// (csrc/aligned_operand.h). Returns
// false, with the reason in `why_not`, when a graph cannot be built for this
// configuration: the caller runs ATen's cuDNN attention instead.
bool sdpa_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& bias, bool training, double dropout_p, bool is_causal,
                  std::optional<double> scale, bool padding_mask, bool prepare_backward,
                  CudnnForward& result, std::string& why_not);

// The backward of sdpa_forward(training=true). The gradients are laid out like
// their inputs (empty_like). Returns false, with the reason, when a graph
// cannot be built for this configuration.
bool sdpa_backward(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                   const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
                   const at::Tensor& philox_seed, const at::Tensor& philox_offset,
                   const at::Tensor& bias, double dropout_p, bool is_causal,
                   std::optional<double> scale, bool padding_mask,
                   std::tuple<at::Tensor, at::Tensor, at::Tensor>& grads, std::string& why_not);

}  // namespace openwam::frontend

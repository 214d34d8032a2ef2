// What the CUDA kernels of the leaf ops openwam::_cudnn_sdpa and
// openwam::_cudnn_sdpa_backward check of their inputs.
//
// openwam::sdpa hands them only calls its decision admitted (decision.h), so
// these checks matter for direct calls of the (private) leaf ops: a cuDNN
// graph is built for the query's dtype, and reads every tensor it is given
// as that dtype on the query's device. Without them a float32 query ran an
// fp16 graph on float32 memory (silently wrong), and a CPU key beside a CUDA
// query handed cuDNN a host pointer.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace openwam {

// The tensors of one leaf-op call; grad_out, out and logsumexp only in the
// backward's (undefined in the forward's).
struct LeafInputs {
  const at::Tensor& query;
  const at::Tensor& key;
  const at::Tensor& value;
  const std::optional<at::Tensor>& bias;
  at::Tensor grad_out = {}, out = {}, logsumexp = {};
};

// TORCH_CHECKs, naming `op`: q, k and v 4-D of consistent sizes (one batch,
// query heads a multiple of key/value heads, one key length, one head_dim for
// query and key); query float16 or bfloat16 where
// `half_only` (the CUDA kernels; the CPU reference takes any floating dtype);
// key, value, bias, grad_out and out in query's dtype; logsumexp float32;
// every tensor on query's device.
void check_leaf_inputs(const char* op, const LeafInputs& in, bool half_only);

}  // namespace openwam

// What this project knows about ATen's cuDNN attention (torch 2.11-2.15): the
// inputs its direct ops can take, the mask it needs, and thin wrappers around
// the forward and backward ops.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "sdpa_call.h"

namespace openwam {

// cuDNN's SDPA backward walks keys in tiles of this many rows; the key-tail
// defect lives in the last, partial tile (cudnn-frontend #160).
constexpr int64_t kCudnnKeyTile = 128;

// The runtime cuDNN version (e.g. 91900), 0 where none is loaded.
long runtime_cudnn_version();

// nullptr when cuDNN attention can run on query's device at all; else why not
// (not CUDA, no cuDNN, GPU older than sm80).
const char* cudnn_unavailable(const at::Tensor& query);

// nullptr when the cuDNN path (the op's own cuDNN graphs, or ATen's direct
// cuDNN ops where a graph cannot be built; neither makes the checks F.sdpa's
// selector makes) can take these inputs; else the first reason it cannot.
// Device and library are not checked here.
// Everything F.sdpa would reject is rejected here too, so such calls reach
// PyTorch's own implementation and its errors.
const char* cudnn_rejects(const SdpaCall& call);

// A mask as F.sdpa takes it, as cuDNN's bias: additive in `dtype`, -inf where
// a bool mask is False. Stock F.sdpa's cuDNN path uses -65504 instead, which
// lets a fully masked query row attend to every key, and gives that row a
// logsumexp near -65504, the trigger of the key-tail defect; with -inf the
// row gets zero output, logsumexp -inf and zero gradient (cuDNN 9.19.0).
// The result is right-aligned to 4-D [B|1, H|1, L|1, S] for an input of rank
// `input_rank` (3 or 4: a 3-D call gets a unit head axis), its last dim
// materialised and contiguous; other broadcast axes stay broadcast. A bool or
// float32 bias handed to the direct op is silently misread in torch 2.11.
// With `s_kv_padded`, the key axis is grown to it, -inf past s_kv: the bias of
// a K/V shim backward, written here once (cudnn_path.cpp says when).
at::Tensor cudnn_bias(const at::Tensor& mask, at::ScalarType dtype, int64_t input_rank,
                      const c10::SymInt& s_kv,
                      const std::optional<c10::SymInt>& s_kv_padded = std::nullopt);

// The output of cuDNN's forward for this query and value head_dim, laid out
// as ATen allocates it (like the query; dense in its stride order when the
// value's head_dim differs). The Meta and CPU kernels allocate through it.
at::Tensor empty_like_cudnn_output(const at::Tensor& query, const c10::SymInt& head_dim_v);

struct CudnnForward {
  at::Tensor out;
  at::Tensor logsumexp;  // [B, H, L, 1] float32; undefined unless asked for
  at::Tensor philox_seed;
  at::Tensor philox_offset;
};

// q, k, v 4-D [B, H, S, E]; `bias` additive in q's dtype, 4-D, or undefined.
CudnnForward cudnn_forward(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const at::Tensor& bias,
                           bool compute_logsumexp, double dropout_p,
                           bool is_causal, std::optional<double> scale);

// Gradients laid out as empty_like(input). The key length is key's own, so a
// padded key/value/bias may be passed with the out and logsumexp of the
// unpadded forward (padded keys add exactly 0 to both).
std::tuple<at::Tensor, at::Tensor, at::Tensor> cudnn_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& philox_seed, const at::Tensor& philox_offset,
    const at::Tensor& bias, double dropout_p, bool is_causal,
    std::optional<double> scale);

}  // namespace openwam

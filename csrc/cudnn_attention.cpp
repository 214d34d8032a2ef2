#include "cudnn_attention.h"

#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_backward.h>

#include "padding.h"

namespace openwam {

CudnnForward cudnn_forward(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const at::Tensor& bias,
                           bool compute_logsumexp, double dropout_p,
                           bool is_causal, std::optional<double> scale) {
  TORCH_INTERNAL_ASSERT(query.dim() == 4 && key.dim() == 4 && value.dim() == 4);
  std::optional<at::Tensor> bias_opt;
  if (bias.defined()) {
    TORCH_INTERNAL_ASSERT(bias.scalar_type() == query.scalar_type() && bias.dim() == 4);
    bias_opt = bias;
  }
  auto result = at::_scaled_dot_product_cudnn_attention(
      query, key, value, bias_opt, compute_logsumexp, dropout_p, is_causal,
      /*return_debug_mask=*/false, scale);
  CudnnForward f;
  f.out = std::get<0>(result);
  f.logsumexp = std::get<1>(result);
  f.max_q = std::get<4>(result);
  f.max_k = std::get<5>(result);
  f.philox_seed = std::get<6>(result);
  f.philox_offset = std::get<7>(result);
  return f;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cudnn_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const CudnnForward& forward,
    const at::Tensor& bias, double dropout_p, bool is_causal,
    std::optional<double> scale) {
  // The dense path takes no cumulative sequence lengths.
  return at::_scaled_dot_product_cudnn_attention_backward_symint(
      grad_out, query, key, value, forward.out, forward.logsumexp,
      forward.philox_seed, forward.philox_offset, bias, at::Tensor(),
      at::Tensor(), forward.max_q, key.sym_size(2), dropout_p, is_causal, scale);
}

at::Tensor cudnn_bias(const at::Tensor& mask, at::ScalarType dtype,
                      int64_t input_rank, int64_t s_kv) {
  at::Tensor bias = additive_bias(mask, dtype);
  // Right-align to the input's rank, then give a 3-D call its head axis.
  while (bias.dim() < input_rank) {
    bias = bias.unsqueeze(0);
  }
  if (input_rank == 3) {
    bias = bias.unsqueeze(1);
  }
  if (bias.size(-1) != s_kv || bias.stride(-1) != 1) {
    std::vector<int64_t> sizes = bias.sizes().vec();
    sizes.back() = s_kv;
    bias = bias.expand(sizes).contiguous();
  }
  return bias;
}

}  // namespace openwam

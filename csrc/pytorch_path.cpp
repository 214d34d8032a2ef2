#include "pytorch_path.h"

#include <ATen/Context.h>
#include <ATen/ops/_scaled_dot_product_attention_math.h>
#include <ATen/ops/scaled_dot_product_attention.h>

#include <mutex>

#include "padding.h"

namespace openwam {
namespace {

// Keeps PyTorch's selector off cuDNN for one call. PyTorch's backend switches
// are process-global (torch.nn.attention.sdpa_kernel flips the same flags), so
// the flip is serialised by a mutex and undone on exit; other threads may see
// cuDNN disabled for the duration of one launch, which costs them speed,
// never correctness. If cuDNN was the only enabled backend, math stands in.
class CudnnExcluded {
 public:
  CudnnExcluded() : lock_(mutex()) {
    auto& ctx = at::globalContext();
    cudnn_ = ctx.userEnabledCuDNNSDP();
    math_ = ctx.userEnabledMathSDP();
    ctx.setSDPUseCuDNN(false);
    if (!ctx.userEnabledFlashSDP() && !ctx.userEnabledMemEfficientSDP()) {
      ctx.setSDPUseMath(true);
    }
  }
  ~CudnnExcluded() {
    auto& ctx = at::globalContext();
    ctx.setSDPUseMath(math_);
    ctx.setSDPUseCuDNN(cudnn_);
  }
  CudnnExcluded(const CudnnExcluded&) = delete;
  CudnnExcluded& operator=(const CudnnExcluded&) = delete;

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  std::lock_guard<std::mutex> lock_;
  bool cudnn_ = false;
  bool math_ = false;
};

at::Tensor call_sdpa(const SdpaInputs& in, const at::Tensor& key,
                     const at::Tensor& value,
                     const std::optional<at::Tensor>& mask, bool is_causal) {
  return at::scaled_dot_product_attention(in.query, key, value, mask,
                                          in.dropout_p, is_causal, in.scale,
                                          in.enable_gqa);
}

at::Tensor call_selected(const SdpaInputs& in, const Decision& decision) {
  if (decision.plan == Plan::kPadInputs) {
    PaddedKeys p = pad_keys_for_call(in.query, in.key, in.value, in.attn_mask,
                                     in.is_causal);
    return call_sdpa(in, p.key, p.value, p.mask, /*is_causal=*/false);
  }
  return call_sdpa(in, in.key, in.value, in.attn_mask, in.is_causal);
}

}  // namespace

at::Tensor run_pytorch_sdpa(const SdpaInputs& in, const Decision& decision) {
  if (decision.empty_input) {
    return std::get<0>(at::_scaled_dot_product_attention_math(
        in.query, in.key, in.value, in.attn_mask, in.dropout_p, in.is_causal,
        /*dropout_mask=*/std::nullopt, in.scale, in.enable_gqa));
  }
  if (decision.exclude_cudnn) {
    CudnnExcluded guard;
    return call_selected(in, decision);
  }
  return call_selected(in, decision);
}

}  // namespace openwam

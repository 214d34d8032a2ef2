#include "pytorch_path.h"

#include <ATen/Context.h>
#include <ATen/ops/_scaled_dot_product_attention_math.h>
#include <ATen/ops/scaled_dot_product_attention.h>

#include <mutex>

namespace openwam {
namespace {

// Keeps PyTorch's selector off cuDNN for one call. PyTorch's backend switches
// are process-global (torch.nn.attention.sdpa_kernel flips the same flags), so
// the flip is serialised by a mutex between the op's own calls and undone on
// exit. Another thread's F.sdpa call in that window sees cuDNN switched off:
// it runs on another backend, or, where cuDNN was the only one it allowed,
// gets PyTorch's "No available kernel" error. A thread that sets the cuDNN
// switch in the window (entering or leaving sdpa_kernel) has that change
// undone on exit. PyTorch's own sdpa_kernel contexts in two threads race the
// same way: the switches are not per thread.
class CudnnSwitchedOff {
 public:
  CudnnSwitchedOff() : lock_(mutex()) {
    auto& ctx = at::globalContext();
    was_enabled_ = ctx.userEnabledCuDNNSDP();
    ctx.setSDPUseCuDNN(false);
  }
  ~CudnnSwitchedOff() { at::globalContext().setSDPUseCuDNN(was_enabled_); }
  CudnnSwitchedOff(const CudnnSwitchedOff&) = delete;
  CudnnSwitchedOff& operator=(const CudnnSwitchedOff&) = delete;

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  std::lock_guard<std::mutex> lock_;
  bool was_enabled_ = false;
};

at::Tensor call_pytorch(const SdpaCall& c) {
  return at::scaled_dot_product_attention(c.query, c.key, c.value, c.attn_mask,
                                          c.dropout_p, c.is_causal, c.scale,
                                          c.enable_gqa);
}

}  // namespace

at::Tensor run_pytorch_path(const SdpaCall& call, const Decision& decision) {
  switch (decision.route) {
    case Route::kMath:
      return std::get<0>(at::_scaled_dot_product_attention_math(
          call.query, call.key, call.value, call.attn_mask, call.dropout_p,
          call.is_causal, /*dropout_mask=*/std::nullopt, call.scale, call.enable_gqa));
    case Route::kPyTorchWithoutCudnn: {
      CudnnSwitchedOff no_cudnn;
      return call_pytorch(call);
    }
    case Route::kPyTorch:
      return call_pytorch(call);
    case Route::kCudnn:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "run_pytorch_path: the decision routes to cuDNN");
}

}  // namespace openwam

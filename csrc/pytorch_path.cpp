#include "pytorch_path.h"

#include <ATen/Context.h>
#include <ATen/ops/_scaled_dot_product_attention_math.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/where.h>

#include <limits>
#include <mutex>
#include <utility>

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
// same way: the switches are not per thread. Recursive: a tensor subclass
// whose __torch_dispatch__ calls the patched F.sdpa from inside the call
// re-enters on the same thread (a plain mutex hung there; found in review);
// the inner guard restores the outer's "off", the outer the user's setting.
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
  static std::recursive_mutex& mutex() {
    static std::recursive_mutex m;
    return m;
  }
  std::lock_guard<std::recursive_mutex> lock_;
  bool was_enabled_ = false;
};

// The mask as PyTorch's entry hands it to its math backend: a bool mask
// becomes 0 / -inf in the query's dtype (convert_boolean_attn_mask,
// aten/src/ATen/native/transformers/attention.cpp). The math kernel adds the
// mask to the scores as it is: a bool mask passed straight in added 1 where
// it was true and hid nothing (silently wrong under torch.func.vmap on CUDA).
std::optional<at::Tensor> math_mask(const SdpaCall& c) {
  if (!c.attn_mask.has_value() || c.attn_mask->scalar_type() != at::kBool) {
    return c.attn_mask;
  }
  const at::Tensor& mask = *c.attn_mask;
  return at::where(mask.logical_not(), -std::numeric_limits<double>::infinity(),
                   at::scalar_tensor(0.0, mask.options().dtype(c.query.scalar_type())));
}

// The math route's mask and is_causal. PyTorch's fused CPU kernel takes a mask
// with is_causal and applies both (top-left); its math backend refuses the
// pair. The route's CPU calls (empty inputs before torch 2.13, decision.cpp)
// that the fused kernel would serve get is_causal folded into the mask, so
// that they run where F.sdpa runs them (an empty batch with a mask and
// is_causal had raised; found in review). At head_dim 0, which F.sdpa itself
// sends to the math backend, and on CUDA, where every kernel refuses the
// pair, the math backend's error stands.
std::pair<std::optional<at::Tensor>, bool> math_mask_and_causal(const SdpaCall& c) {
  std::optional<at::Tensor> mask = math_mask(c);
  if (!(c.is_causal && mask.has_value() && c.query.device().is_cpu() &&
        c.query.sym_size(-1) != 0)) {
    return {mask, c.is_causal};
  }
  const at::Tensor future =
      at::ones_symint({c.query.sym_size(-2), c.key.sym_size(-2)},
                      c.query.options().dtype(at::kBool))
          .triu(1);
  return {mask->masked_fill(future, -std::numeric_limits<double>::infinity()), false};
}

at::Tensor call_pytorch(const SdpaCall& c) {
  return at::scaled_dot_product_attention(c.query, c.key, c.value, c.attn_mask,
                                          c.dropout_p, c.is_causal, c.scale,
                                          c.enable_gqa);
}

}  // namespace

at::Tensor run_pytorch_path(const SdpaCall& call, const Decision& decision) {
  switch (decision.route) {
    case Route::kMath: {
      const auto [mask, is_causal] = math_mask_and_causal(call);
      return std::get<0>(at::_scaled_dot_product_attention_math(
          call.query, call.key, call.value, mask, call.dropout_p, is_causal,
          /*dropout_mask=*/std::nullopt, call.scale, call.enable_gqa));
    }
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

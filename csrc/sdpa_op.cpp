// openwam::sdpa's entry point: the op's own argument checks (sdpa_call.h),
// the decision (decision.h), then the guarded cuDNN path or PyTorch's own.
// Registered as CompositeImplicitAutograd: the kernel runs above autograd, so
// it sees requires_grad and grad mode, and under torch.compile it is traced
// through (not into a graph node): what lands in the graph is the path it
// chose, openwam::_cudnn_sdpa or PyTorch's attention ops, never the choice.
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "cudnn_path.h"
#include "decision.h"
#include "guards.h"
#include "ops.h"
#include "pytorch_path.h"
#include "sdpa_call.h"
#include "settings.h"

namespace openwam {
namespace {

at::Tensor sdpa(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                const std::optional<at::Tensor>& attn_mask, double dropout_p,
                bool is_causal, std::optional<double> scale, bool enable_gqa) {
  const SdpaCall call{query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  check_call(call);
  const Decision decision = decide(call, current_settings());
  if (decision.rule != nullptr) {
    warn_once(*decision.rule);
  }
  return decision.route == Route::kCudnn ? run_cudnn_path(call, decision)
                                         : run_pytorch_path(call, decision);
}

// Autocast: F.sdpa is on autocast's lower-precision list (ATen's
// autocast_mode.cpp, CUDA and CPU), which casts every floating-point
// argument, a float mask included, to the autocast dtype. The same here.
template <c10::DeviceType device_type>
at::Tensor sdpa_autocast(const at::Tensor& query, const at::Tensor& key,
                         const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double dropout_p,
                         bool is_causal, std::optional<double> scale, bool enable_gqa) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  const at::ScalarType to =
      at::autocast::get_lower_precision_fp_from_device_type(device_type);
  return ops::sdpa().call(at::autocast::cached_cast(to, query, device_type),
                          at::autocast::cached_cast(to, key, device_type),
                          at::autocast::cached_cast(to, value, device_type),
                          at::autocast::cached_cast(to, attn_mask, device_type),
                          dropout_p, is_causal, scale, enable_gqa);
}

}  // namespace
}  // namespace openwam

TORCH_LIBRARY_IMPL(openwam, CompositeImplicitAutograd, m) {
  m.impl("sdpa", &openwam::sdpa);
}
// Under torch.func.vmap the composite kernel runs too (as functorch does for
// ATen's composite ops), and decide() hands the batched call to F.sdpa's own
// batching; without this the vmap fallback loops per sample, and warns.
TORCH_LIBRARY_IMPL(openwam, FuncTorchBatchedDecomposition, m) {
  m.impl("sdpa", &openwam::sdpa);
}
TORCH_LIBRARY_IMPL(openwam, AutocastCUDA, m) {
  m.impl("sdpa", &openwam::sdpa_autocast<c10::DeviceType::CUDA>);
}
TORCH_LIBRARY_IMPL(openwam, AutocastCPU, m) {
  m.impl("sdpa", &openwam::sdpa_autocast<c10::DeviceType::CPU>);
}

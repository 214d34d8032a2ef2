// Typed handles of the openwam ops, for C++ callers that go through the
// dispatcher (so that autograd, autocast and torch.compile see the call).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

namespace openwam::ops {

using SdpaSchema = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, double, bool,
                              std::optional<double>, bool);

using CudnnSdpaSchema = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, double, bool, std::optional<double>, bool,
    int64_t);

using CudnnSdpaBackwardSchema = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, double, bool, std::optional<double>,
    int64_t);

template <typename Schema>
c10::TypedOperatorHandle<Schema> lookup(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Schema>();
}

// Each handle is looked up once per process.
inline const c10::TypedOperatorHandle<SdpaSchema>& sdpa() {
  static const auto op = lookup<SdpaSchema>("openwam::sdpa");
  return op;
}
inline const c10::TypedOperatorHandle<CudnnSdpaSchema>& cudnn_sdpa() {
  static const auto op = lookup<CudnnSdpaSchema>("openwam::_cudnn_sdpa");
  return op;
}
inline const c10::TypedOperatorHandle<CudnnSdpaBackwardSchema>& cudnn_sdpa_backward() {
  static const auto op = lookup<CudnnSdpaBackwardSchema>("openwam::_cudnn_sdpa_backward");
  return op;
}

}  // namespace openwam::ops

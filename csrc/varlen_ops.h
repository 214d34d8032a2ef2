// Typed handles of openwam::sdpa_varlen and its leaf ops, for C++ callers
// that go through the dispatcher (autograd, autocast and torch.compile see
// the call). The schemas are in varlen.cpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

#include "ops.h"

namespace openwam::ops {

using SdpaVarlenSchema = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const at::Tensor&, c10::SymInt,
                                    c10::SymInt, bool, std::optional<double>, double, bool);

using SdpaVarlenForwardSchema = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, c10::SymInt, c10::SymInt, double, bool, std::optional<double>,
    int64_t, bool);

using SdpaVarlenBackwardSchema = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, c10::SymInt, c10::SymInt, double, bool,
    std::optional<double>, int64_t);

inline const c10::TypedOperatorHandle<SdpaVarlenSchema>& sdpa_varlen() {
  static const auto op = lookup<SdpaVarlenSchema>("openwam::sdpa_varlen");
  return op;
}
inline const c10::TypedOperatorHandle<SdpaVarlenForwardSchema>& sdpa_varlen_forward() {
  static const auto op = lookup<SdpaVarlenForwardSchema>("openwam::_sdpa_varlen");
  return op;
}
inline const c10::TypedOperatorHandle<SdpaVarlenBackwardSchema>& sdpa_varlen_backward() {
  static const auto op = lookup<SdpaVarlenBackwardSchema>("openwam::_sdpa_varlen_backward");
  return op;
}

}  // namespace openwam::ops

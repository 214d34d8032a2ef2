// F.sdpa's softmax scale: the caller's, or 1/sqrt(E) of the query's head dim
// (its last dim, in the padded [B, H, S, E] and the packed [T, H, E] layouts
// alike). One definition, so that the CPU reference, the varlen kernels and
// the cuDNN graphs cannot default differently.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

namespace openwam {

inline double softmax_scale(std::optional<double> scale, const at::Tensor& query) {
  return scale.value_or(1.0 / std::sqrt(static_cast<double>(query.size(-1))));
}

}  // namespace openwam

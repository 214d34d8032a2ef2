// The layouts (graph_key.h's Layout) of the tensors a dense graph binds: an
// input's as it is, and the gradient allocated for it. Header-only and plain
// ATen, so that the CPU tests hold the gradient's layout to at::empty_like's,
// which the leaf ops' Meta kernel promises (torch.compile's inductor asserts
// it on the backward op's outputs).
#pragma once

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>

#include <vector>

#include "graph_key.h"

namespace openwam::frontend {

// A dimension of size 1 can have any stride; cuDNN reads its stride anyway,
// and a stride of 0 (an expanded size-1 dim) is normalised as ATen does, so
// that equal layouts give equal keys.
inline Layout layout_from(at::IntArrayRef sizes, at::IntArrayRef strides) {
  TORCH_INTERNAL_ASSERT(sizes.size() == 4 && strides.size() == 4,
                        "cuDNN SDPA graphs take 4-D tensors");
  Layout l;
  for (int i = 3; i >= 0; --i) {
    l.sizes[i] = sizes[i];
    l.strides[i] = strides[i];
    if (l.sizes[i] == 1) {
      l.strides[i] = i == 3 ? 1 : l.strides[i + 1] * l.sizes[i + 1];
    }
  }
  return l;
}

inline Layout layout_of(const at::Tensor& t) { return layout_from(t.sizes(), t.strides()); }

// The strides at::empty_like gives a gradient: the input's where they are
// dense and non-overlapping, else dense in the input's order of strides
// (at::infer_dense_strides, as empty_like preserves it). A q/k/v sliced from
// one packed projection ([B, S, 3, H, E] seen as [B, H, S, E]) gets a BSHD
// gradient, not a contiguous BHSD one the Meta kernel would not promise.
inline Layout gradient_layout(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) {
    return layout_of(t);
  }
  const std::vector<int64_t> strides = at::infer_dense_strides(t.sizes(), t.strides());
  return layout_from(t.sizes(), strides);
}

}  // namespace openwam::frontend

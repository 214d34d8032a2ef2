// The dense cuDNN engine's layouts (csrc/cudnn_frontend/tensor_layouts.h): a
// gradient is allocated as at::empty_like allocates it, which the leaf ops'
// Meta kernel promises; size-1 dims are normalised for the graph key.
#include <ATen/ATen.h>

#include "cudnn_frontend/tensor_layouts.h"
#include "support.h"

using openwam::frontend::gradient_layout;
using openwam::frontend::Layout;
using openwam::frontend::layout_of;

namespace {

const auto kBf16 = at::TensorOptions().dtype(at::kBFloat16);

}  // namespace

TEST_CASE("gradient_layout is at::empty_like's, for every layout a model hands in",
          "[tensor_layouts]") {
  const int64_t B = 2, S = 5, H = 4, E = 8;
  const at::Tensor qkv = at::empty({B, S, 3, H, E}, kBf16);
  const std::vector<std::pair<const char*, at::Tensor>> inputs = {
      {"contiguous BHSD", at::empty({B, H, S, E}, kBf16)},
      {"BSHD transposed", at::empty({B, S, H, E}, kBf16).transpose(1, 2)},
      {"a slice of a packed qkv projection", qkv.select(2, 0).transpose(1, 2)},
      {"head-major", at::empty({H, B, S, E}, kBf16).permute({1, 0, 2, 3})},
      {"heads expanded (stride 0)", at::empty({B, 1, S, E}, kBf16).expand({B, H, S, E})},
      {"rows of a wider buffer", at::empty({B, H, S, 2 * E}, kBf16).narrow(-1, 0, E)},
      {"one query row", at::empty({B, H, 1, E}, kBf16)},
      {"batch 1, BSHD", at::empty({1, S, H, E}, kBf16).transpose(1, 2)},
  };
  for (const auto& [name, t] : inputs) {
    CAPTURE(name);
    CHECK(gradient_layout(t) == layout_of(at::empty_like(t)));
    if (t.is_non_overlapping_and_dense()) {
      CHECK(gradient_layout(t) == layout_of(t));
    }
  }
  // The packed slice's gradient is dense BSHD, not the contiguous BHSD that
  // the engine allocated before (and that the Meta kernel did not promise).
  const Layout packed = gradient_layout(qkv.select(2, 0).transpose(1, 2));
  CHECK(packed.strides == std::array<int64_t, 4>{S * H * E, E, H * E, 1});
}

TEST_CASE("layout_of normalises the strides of size-1 dims", "[tensor_layouts]") {
  const at::Tensor row = at::empty({2, 4, 1, 8}, kBf16);
  const at::Tensor zero_stride_row = row.as_strided({2, 4, 1, 8}, {32, 8, 0, 1});
  CHECK(layout_of(zero_stride_row) == layout_of(row));
  const at::Tensor strided_row = at::empty({2, 4, 3, 8}, kBf16).narrow(2, 1, 1);
  CHECK(layout_of(strided_row).strides == std::array<int64_t, 4>{96, 24, 8, 1});
}

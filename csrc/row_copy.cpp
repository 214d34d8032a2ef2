#include "row_copy.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

namespace openwam {

std::vector<int64_t> copy_order(at::IntArrayRef sizes, at::IntArrayRef strides, int64_t dim) {
  std::vector<int64_t> order;
  for (int64_t d = 0; d < static_cast<int64_t>(sizes.size()); ++d) {
    if (sizes[d] > 1 || d == dim) {
      order.push_back(d);
    }
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  return order;
}

std::optional<RowLayout> row_layout(at::IntArrayRef sizes, at::IntArrayRef strides, int64_t dim,
                                    const std::vector<int64_t>& order) {
  const auto at_dim = std::find(order.begin(), order.end(), dim);
  TORCH_INTERNAL_ASSERT(at_dim != order.end());
  const int64_t pos = at_dim - order.begin();
  int64_t inner = 1;
  for (int64_t i = static_cast<int64_t>(order.size()) - 1; i > pos; --i) {
    if (strides[order[i]] != inner) {
      return std::nullopt;
    }
    inner *= sizes[order[i]];
  }
  if (sizes[dim] > 1 && strides[dim] != inner) {
    return std::nullopt;
  }
  const int64_t row = sizes[dim] * inner;
  RowLayout l{1, row, row, inner};
  if (pos > 0) {
    l.pitch = strides[order[pos - 1]];
    if (l.pitch < row) {
      return std::nullopt;
    }
    for (int64_t i = pos - 1; i >= 0; --i) {
      if (i < pos - 1 && strides[order[i]] != strides[order[i + 1]] * sizes[order[i + 1]]) {
        return std::nullopt;
      }
      l.rows *= sizes[order[i]];
    }
  }
  return l;
}

namespace {

#ifdef OPENWAM_WITH_CUDA
// `fill` in dtype's bits, repeated to 32 bits; nullopt for a dtype the
// kernel does not take.
std::optional<uint32_t> fill_word(at::ScalarType dtype, const c10::Scalar& fill) {
  switch (dtype) {
    case at::kBFloat16: {
      const uint32_t h = c10::BFloat16(fill.to<float>()).x;
      return h | (h << 16);
    }
    case at::kHalf: {
      const uint32_t h = c10::Half(fill.to<float>()).x;
      return h | (h << 16);
    }
    case at::kFloat: {
      const float f = fill.to<float>();
      uint32_t w;
      std::memcpy(&w, &f, sizeof(w));
      return w;
    }
    default:
      return std::nullopt;
  }
}

// copy_along on the kernel; false where it does not take the copy.
bool copy_rows_on_device(const at::Tensor& dst, const at::Tensor& src, int64_t dim, int64_t n,
                         const c10::Scalar& fill) {
  if (!dst.is_cuda() || src.device() != dst.device()) {
    return false;
  }
  const std::optional<uint32_t> word = fill_word(dst.scalar_type(), fill);
  if (!word) {
    return false;
  }
  const std::vector<int64_t> order = copy_order(dst.sizes(), dst.strides(), dim);
  const std::optional<RowLayout> d = row_layout(dst.sizes(), dst.strides(), dim, order);
  const std::optional<RowLayout> s = row_layout(src.sizes(), src.strides(), dim, order);
  if (!d || !s) {
    return false;
  }
  TORCH_INTERNAL_ASSERT(d->rows == s->rows && d->inner == s->inner);
  const int64_t esize = dst.element_size();
  const int64_t copy_bytes = n * d->inner * esize, row_bytes = d->row * esize;
  const int64_t src_pitch = s->pitch * esize, dst_pitch = d->pitch * esize;
  const auto aligned = [](int64_t v) { return v % 16 == 0; };
  const auto src_addr = reinterpret_cast<uintptr_t>(src.const_data_ptr());
  const auto dst_addr = reinterpret_cast<uintptr_t>(dst.data_ptr());
  if (!aligned(copy_bytes) || !aligned(row_bytes) || !aligned(src_pitch) ||
      !aligned(dst_pitch) || src_addr % 16 != 0 || dst_addr % 16 != 0) {
    return false;
  }
  launch_copy_rows(dst, src.const_data_ptr(), src_pitch, dst.data_ptr(), dst_pitch, copy_bytes,
                   row_bytes, d->rows, *word);
  return true;
}
#endif

}  // namespace

bool copy_along(const at::Tensor& dst, const at::Tensor& src, int64_t dim,
                const c10::Scalar& fill) {
  dim = c10::maybe_wrap_dim(dim, dst.dim());
  // Checks, not asserts: the tests reach this through openwam_sdpa._C.
  TORCH_CHECK(src.dim() == dst.dim() && src.scalar_type() == dst.scalar_type(),
              "copy_along: src and dst must agree in rank and dtype");
  for (int64_t d = 0; d < dst.dim(); ++d) {
    TORCH_CHECK(d == dim || src.size(d) == dst.size(d),
                "copy_along: src and dst may differ in dim ", dim, " only");
  }
  const int64_t n = std::min(dst.size(dim), src.size(dim));
  if (dst.numel() == 0) {
    return false;
  }
#ifdef OPENWAM_WITH_CUDA
  if (copy_rows_on_device(dst, src, dim, n, fill)) {
    return true;
  }
#endif
  dst.narrow(dim, 0, n).copy_(src.narrow(dim, 0, n));
  if (dst.size(dim) > n) {
    dst.narrow(dim, n, dst.size(dim) - n).fill_(fill);
  }
  return false;
}

}  // namespace openwam

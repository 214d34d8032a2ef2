// Operands as the fused attention kernels assume them: their data pointer
// 16-byte aligned. cuDNN's engines assume it (the frontend's default
// alignment; frontend 1.32 refuses to execute otherwise, INVALID_VARIANT_PACK),
// and FlashAttention-2 loads its rows in 16-byte vectors. A view at an odd
// element offset (x[..., 4:68] of bf16 rows) is not; a fresh block of the
// caching allocator always is.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace openwam {

inline bool is_aligned(const at::Tensor& t) {
  return !t.defined() || reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

inline bool is_aligned(const std::optional<at::Tensor>& t) {
  return !t.has_value() || is_aligned(*t);
}

// `t`, or a copy of it where its data pointer is not 16-byte aligned, dense in
// `t`'s order of strides (as at::empty_like lays it out). Undefined tensors
// are returned as they are. Callers take layouts from what this returns.
inline at::Tensor aligned_operand(const at::Tensor& t) {
  if (is_aligned(t)) {
    return t;
  }
  return at::empty_like(t, at::MemoryFormat::Preserve).copy_(t);
}

inline std::optional<at::Tensor> aligned_operand(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(aligned_operand(*t)) : t;
}

// Whether every row of `t` (along its last dim) starts on a 16-byte boundary
// when `t` itself does: every stride but the last dim's a whole number of
// 16-byte vectors (size-1 dims aside). x[..., :64] of bf16 rows 68 wide is
// not, its rows 136 bytes apart: an aligned start is not enough for
// FlashAttention-2 varlen, which loads every row in 16-byte vectors.
inline bool rows_aligned(const at::Tensor& t) {
  const int64_t per_vector = std::max<int64_t>(1, 16 / static_cast<int64_t>(t.element_size()));
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) % per_vector != 0) {
      return false;
    }
  }
  return true;
}

// `t`, or a copy of it (as aligned_operand copies) where its start or the
// start of any row is not 16-byte aligned. A dense copy of rows whose length
// is a multiple of 16 bytes has every row aligned.
inline at::Tensor aligned_rows(const at::Tensor& t) {
  if (is_aligned(t) && rows_aligned(t)) {
    return t;
  }
  return at::empty_like(t, at::MemoryFormat::Preserve).copy_(t);
}

}  // namespace openwam

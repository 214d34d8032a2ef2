// Operands as the fused attention kernels assume them: their data pointer
// 16-byte aligned. cuDNN's engines assume it (the frontend's default
// alignment; frontend 1.32 refuses to execute otherwise, INVALID_VARIANT_PACK),
// and FlashAttention-2 loads its rows in 16-byte vectors. A view at an odd
// element offset (x[..., 4:68] of bf16 rows) is not; a fresh block of the
// caching allocator always is.
#pragma once

#include <ATen/ATen.h>

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

}  // namespace openwam

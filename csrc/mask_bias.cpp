#include "mask_bias.h"

#include <torch/library.h>

#include <limits>
#include <vector>

namespace openwam {
namespace {

std::vector<c10::SymInt> bias_sizes(const at::Tensor& mask, const c10::SymInt& s_kv_padded) {
  std::vector<c10::SymInt> sizes(mask.sym_sizes().begin(), mask.sym_sizes().end());
  sizes.back() = s_kv_padded;
  return sizes;
}

void check_mask(const at::Tensor& mask, at::ScalarType dtype, const c10::SymInt& s_kv,
                const c10::SymInt& s_kv_padded) {
  TORCH_CHECK(mask.scalar_type() == at::kBool, "openwam::_mask_bias: mask must be bool, got ",
              mask.scalar_type());
  TORCH_CHECK(mask.dim() >= 1, "openwam::_mask_bias: mask must have at least 1 dim");
  TORCH_CHECK(mask.sym_size(-1) == s_kv || mask.sym_size(-1) == 1,
              "openwam::_mask_bias: mask's last dim must be s_kv (", s_kv, ") or 1, got ",
              mask.sym_size(-1));
  TORCH_CHECK(s_kv_padded >= s_kv, "openwam::_mask_bias: s_kv_padded (", s_kv_padded,
              ") must be at least s_kv (", s_kv, ")");
  TORCH_CHECK(at::isFloatingType(dtype),
              "openwam::_mask_bias: dtype must be a floating-point type, got ", dtype);
}

// Every device: a -inf fill, then 0 where the mask is true.
at::Tensor mask_bias_aten(const at::Tensor& mask, at::ScalarType dtype, c10::SymInt s_kv,
                          c10::SymInt s_kv_padded) {
  check_mask(mask, dtype, s_kv, s_kv_padded);
  at::Tensor bias = at::full_symint(bias_sizes(mask, s_kv_padded),
                                    -std::numeric_limits<double>::infinity(),
                                    mask.options().dtype(dtype));
  bias.narrow_symint(-1, 0, s_kv).masked_fill_(mask, 0);
  return bias;
}

at::Tensor mask_bias_meta(const at::Tensor& mask, at::ScalarType dtype, c10::SymInt s_kv,
                          c10::SymInt s_kv_padded) {
  check_mask(mask, dtype, s_kv, s_kv_padded);
  return at::empty_symint(bias_sizes(mask, s_kv_padded), mask.options().dtype(dtype));
}

#ifdef OPENWAM_WITH_CUDA
at::Tensor mask_bias_cuda(const at::Tensor& mask, at::ScalarType dtype, c10::SymInt s_kv_in,
                          c10::SymInt s_kv_padded_in) {
  check_mask(mask, dtype, s_kv_in, s_kv_padded_in);
  const int64_t s_kv = s_kv_in.expect_int(), s_kv_padded = s_kv_padded_in.expect_int();
  const int64_t esize = c10::elementSize(dtype);
  const bool kernel_dtype = dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
  if (!kernel_dtype || mask.dim() > 4 || (s_kv_padded * esize) % 16 != 0) {
    return mask_bias_aten(mask, dtype, s_kv_in, s_kv_padded_in);
  }
  at::Tensor bias =
      at::empty_symint(bias_sizes(mask, s_kv_padded_in), mask.options().dtype(dtype));
  MaskRows rows{};
  const int64_t lead = mask.dim() - 1;
  for (int64_t i = 0; i < 3; ++i) {
    // Right-aligned: the mask's leading dims fill the last `lead` slots.
    const int64_t d = i - (3 - lead);
    rows.sizes[i] = d >= 0 ? mask.size(d) : 1;
    rows.strides[i] = d >= 0 && mask.size(d) > 1 ? mask.stride(d) : 0;
  }
  rows.key_stride = mask.size(-1) > 1 ? mask.stride(-1) : 0;
  launch_mask_bias(bias, mask.const_data_ptr<bool>(), rows, s_kv);
  return bias;
}
#endif

}  // namespace

at::Tensor mask_bias(const at::Tensor& mask, at::ScalarType dtype, const c10::SymInt& s_kv,
                     const c10::SymInt& s_kv_padded) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("openwam::_mask_bias", "")
                             .typed<at::Tensor(const at::Tensor&, at::ScalarType,
                                               c10::SymInt, c10::SymInt)>();
  return op.call(mask, dtype, s_kv, s_kv_padded);
}

}  // namespace openwam

TORCH_LIBRARY_IMPL(openwam, CPU, m) {
  m.impl("_mask_bias", &openwam::mask_bias_aten);
}
TORCH_LIBRARY_IMPL(openwam, Meta, m) {
  m.impl("_mask_bias", &openwam::mask_bias_meta);
}
#ifdef OPENWAM_WITH_CUDA
TORCH_LIBRARY_IMPL(openwam, CUDA, m) {
  m.impl("_mask_bias", &openwam::mask_bias_cuda);
}
#endif

#include "padding.h"

#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "cudnn_attention.h"
#include "row_copy.h"

namespace openwam {

int64_t padded_length(int64_t length, int64_t multiple) {
  TORCH_CHECK(multiple > 0,
              "openwam::pad_keys: multiple must be a positive integer, got ",
              multiple);
  TORCH_CHECK(length >= 0, "openwam::pad_keys: length must be >= 0, got ",
              length);
  TORCH_CHECK(length <= std::numeric_limits<int64_t>::max() - (multiple - 1),
              "openwam::pad_keys: multiple must leave the padded length within int64, got ",
              multiple, " for ", length, " keys");
  return (length + multiple - 1) / multiple * multiple;
}

c10::SymInt padded_length(const c10::SymInt& length, int64_t multiple) {
  TORCH_INTERNAL_ASSERT(multiple > 0);
  return (length + multiple - 1) / multiple * multiple;
}

bool shim_takes_bias(const Plan& plan, bool has_bias, const c10::SymInt& s_kv,
                     double dropout_p) {
  if (!has_bias || !plan.pad_keys_backward || dropout_p > 0.0) {
    return false;
  }
  return ((padded_length(s_kv, kCudnnKeyTile) - s_kv) * 32)
      .sym_le(s_kv)
      .guard_bool(__FILE__, __LINE__);
}

at::Tensor pad_dim(const at::Tensor& t, int64_t dim, int64_t new_length,
                   const c10::Scalar& fill, PadWrite how) {
  dim = c10::maybe_wrap_dim(dim, t.dim());
  const int64_t old_length = t.size(dim);
  TORCH_INTERNAL_ASSERT(new_length >= old_length);
  if (new_length == old_length) {
    return t;
  }

  // Broadcast axes (stride 0, size > 1) are stored once and expanded again.
  at::Tensor stored = t;
  std::vector<int64_t> alloc_sizes = t.sizes().vec();
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d != dim && t.stride(d) == 0 && t.size(d) > 1) {
      stored = stored.narrow(d, 0, 1);
      alloc_sizes[d] = 1;
    }
  }
  alloc_sizes[dim] = new_length;

  // Allocate in the stride order of `t` (outermost = largest stride), so the
  // padded tensor has the same physical layout as the input. A `t` broadcast
  // along `dim` itself has no layout there to keep: it is allocated in
  // logical order, which keeps the last dim contiguous (cuDNN needs that).
  std::vector<int64_t> order(t.dim());
  std::iota(order.begin(), order.end(), 0);
  if (t.stride(dim) != 0) {
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return stored.stride(a) > stored.stride(b);
    });
  }
  std::vector<int64_t> permuted_sizes(t.dim());
  for (int64_t i = 0; i < t.dim(); ++i) {
    permuted_sizes[i] = alloc_sizes[order[i]];
  }
  std::vector<int64_t> inverse(t.dim());
  for (int64_t i = 0; i < t.dim(); ++i) {
    inverse[order[i]] = i;
  }
  at::Tensor buffer =
      at::empty(permuted_sizes, t.options()).permute(inverse);

  if (how == PadWrite::kLeafKernel) {
    copy_along(buffer, stored, dim, fill);
  } else {
    buffer.narrow(dim, 0, old_length).copy_(stored);
    buffer.narrow(dim, old_length, new_length - old_length).fill_(fill);
  }

  std::vector<int64_t> out_sizes = t.sizes().vec();
  out_sizes[dim] = new_length;
  return buffer.expand(out_sizes);
}

at::Tensor pad_key_mask(const std::optional<at::Tensor>& attn_mask, int64_t s_kv,
                        int64_t s_kv_padded, const c10::Device& device, PadWrite how) {
  TORCH_INTERNAL_ASSERT(s_kv_padded >= s_kv);
  if (!attn_mask.has_value()) {
    // A new key-padding mask that broadcasts over everything but the keys.
    return at::arange(s_kv_padded, at::TensorOptions().dtype(at::kLong).device(device))
        .lt(s_kv)
        .view({1, s_kv_padded});
  }
  const at::Tensor& m = *attn_mask;
  TORCH_CHECK(m.scalar_type() == at::kBool || at::isFloatingType(m.scalar_type()),
              "openwam::pad_keys: attn_mask must be bool or floating point, "
              "got ", m.scalar_type());
  TORCH_CHECK(m.dim() >= 1,
              "openwam::pad_keys: attn_mask must have at least 1 dim, got 0-D");
  TORCH_CHECK(m.size(-1) == s_kv || m.size(-1) == 1,
              "openwam::pad_keys: attn_mask's last dim must be the key length (", s_kv,
              ") or 1, got ", m.size(-1));
  // A mask broadcast along the key axis is materialised along it only.
  at::Tensor full = m;
  if (m.size(-1) != s_kv) {
    std::vector<int64_t> sizes = m.sizes().vec();
    sizes.back() = s_kv;
    full = m.expand(sizes);
  }
  const c10::Scalar hidden = m.scalar_type() == at::kBool
                                 ? c10::Scalar(false)
                                 : c10::Scalar(-std::numeric_limits<double>::infinity());
  return pad_dim(full, -1, s_kv_padded, hidden, how);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pad_keys(
    const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, int64_t multiple) {
  TORCH_CHECK(multiple > 0,
              "openwam::pad_keys: multiple must be a positive integer, got ",
              multiple);
  TORCH_CHECK(key.dim() >= 2,
              "openwam::pad_keys: key must have at least 2 dims [..., S, E], "
              "got ", key.dim(), "-D");
  TORCH_CHECK(value.dim() >= 2,
              "openwam::pad_keys: value must have at least 2 dims [..., S, Ev], "
              "got ", value.dim(), "-D");
  TORCH_CHECK(value.dim() == key.dim(),
              "openwam::pad_keys: value must have key's rank (", key.dim(),
              "-D), got ", value.dim(), "-D");
  const int64_t s_kv = key.size(-2);
  TORCH_CHECK(value.size(-2) == s_kv,
              "openwam::pad_keys: value must have the same sequence length as "
              "key (", s_kv, "), got ", value.size(-2));
  const int64_t target = padded_length(s_kv, multiple);
  at::Tensor k = pad_dim(key, -2, target, 0);
  at::Tensor v = pad_dim(value, -2, target, 0);
  return {k, v, pad_key_mask(attn_mask, s_kv, target, key.device())};
}

}  // namespace openwam

// Composite: autograd flows through copy_ and narrow, so pad_keys is
// differentiable in key/value (and an additive mask) on every device.
TORCH_LIBRARY_IMPL(openwam, CompositeImplicitAutograd, m) {
  m.impl("pad_keys", &openwam::pad_keys);
}

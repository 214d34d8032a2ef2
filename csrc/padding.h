// The padding shim: zero keys/values up to a multiple of the cuDNN key tile,
// hidden by the mask, so that the padded call computes exactly what the
// unpadded call computes.
//
// Why: cuDNN's SDPA backward on sm90 (cuDNN < 9.26, cudnn-frontend #160) scores
// the out-of-range key rows of the last 128-row tile as 0 instead of -inf; for
// a query row with logsumexp < -88.7 that overflows to inf and inf * 0 writes
// NaN into dQ. With s_kv a multiple of 128 there is no out-of-range row.
#pragma once

#include <ATen/ATen.h>
#include <optional>
#include <tuple>

namespace openwam {

// How pad_dim writes its buffer. kAutograd: copy_ and fill_, differentiable
// and traceable (pad_keys is a composite op). kLeafKernel: copy_along
// (row_copy.h), for the leaf ops' kernels, which see real tensors outside
// autograd.
enum class PadWrite { kAutograd, kLeafKernel };

// Smallest multiple of `multiple` that is >= `length`.
int64_t padded_length(int64_t length, int64_t multiple);

// `t` grown along `dim` to `new_length`, the new entries set to `fill`.
// The physical layout is kept: the buffer has the stride order of `t` (a BSHD
// buffer viewed as BHSD stays BSHD) and stride-0 (broadcast) axes other than
// `dim` stay broadcast. The original entries are copied into the buffer,
// only the tail is filled. Returns `t` itself when nothing grows.
at::Tensor pad_dim(const at::Tensor& t, int64_t dim, int64_t new_length,
                   const c10::Scalar& fill, PadWrite how = PadWrite::kAutograd);

// The mask of the shim's padded keys: `attn_mask` (broadcastable to
// [..., L, S], bool or additive) grown along the key axis from `s_kv` to
// `s_kv_padded`, False (bool) or -inf (additive) there, and materialised
// along that axis only where it broadcast along it; with no mask, a new bool
// key-padding mask [1, s_kv_padded] on `device`.
at::Tensor pad_key_mask(const std::optional<at::Tensor>& attn_mask, int64_t s_kv,
                        int64_t s_kv_padded, const c10::Device& device,
                        PadWrite how = PadWrite::kAutograd);

// The shim. key/value: [..., S, E]; attn_mask broadcastable to
// [..., L, S] (bool or additive) or absent. Returns (key, value, mask) with S
// grown to padded_length(S, multiple): keys and values zero in the tail, the
// mask as pad_key_mask gives it.
std::tuple<at::Tensor, at::Tensor, at::Tensor> pad_keys(
    const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, int64_t multiple);

}  // namespace openwam

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

#include "plan.h"

namespace openwam {

// How pad_dim writes its buffer. kAutograd: copy_ and fill_, differentiable
// and traceable (pad_keys is a composite op). kLeafKernel: copy_along
// (row_copy.h), for the leaf ops' kernels, which see real tensors outside
// autograd.
enum class PadWrite { kAutograd, kLeafKernel };

// Smallest multiple of `multiple` that is >= `length`.
int64_t padded_length(int64_t length, int64_t multiple);
c10::SymInt padded_length(const c10::SymInt& length, int64_t multiple);

// Whether a differentiated call's backward takes the K/V shim on the op's own
// cuDNN graphs (the ATen fallback takes it for every pad_keys_backward plan).
// On cuDNN 9.19.0 only an additive mask's call can: a bool mask's takes the
// score shift there (plan shift_scores, score_shift.h), at stock's cost.
//
// With a bias, cuDNN's padding-mask backward is the slow corner: 1.10x-1.23x
// stock's fwd+bwd at 360x64 to 4096x4032 (H200, cuDNN 9.19.0, bf16, head_dim
// 128), whatever the key length. Padding K/V and the bias to the next multiple
// of 128 instead costs what the extra keys cost: 1.06x at 4096x4032 (1.6% more
// keys), 1.21x against 1.20x at 1024x1088 (5.9%), 1.27x-1.42x from 704 keys
// down. So the shim takes the key-tail fix where it adds at most 1/32 of the
// keys. Not with dropout: the forward ran on the unpadded keys, and the
// backward must see the key length its dropout pattern was drawn for.
// (A symbolic s_kv is guarded on.)
bool shim_takes_bias(const Plan& plan, bool has_bias, const c10::SymInt& s_kv,
                     double dropout_p);

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

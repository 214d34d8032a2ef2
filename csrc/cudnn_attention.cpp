#include "cudnn_attention.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_backward.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "mask_bias.h"

#ifdef OPENWAM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace openwam {
namespace {

#ifndef OPENWAM_WITH_CUDA
constexpr const char* kBuiltWithoutCuda =
    "openwam_sdpa was built without CUDA (no CUDA toolkit at build time, or "
    "OPENWAM_SDPA_NO_CUDA=1)";
#endif

bool sm80_or_newer(const at::Tensor& t) {
#ifdef OPENWAM_WITH_CUDA
  return at::cuda::getDeviceProperties(t.device().index())->major >= 8;
#else
  (void)t;
  return false;
#endif
}

bool plain_dense(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && !t.is_nested();
}

// The mask right-aligned against [batch..., L, S] of the query.
bool broadcasts_to_attention(const at::Tensor& mask, const at::Tensor& query,
                             const c10::SymInt& s_kv) {
  // At least [L, S]: PyTorch's selector raises on a 1-D mask (IndexError),
  // which OPENWAM_SDPA_CUDNN=1 does not ask.
  if (mask.dim() < 2 || mask.dim() > query.dim()) {
    return false;
  }
  for (int64_t i = 1; i <= mask.dim(); ++i) {
    const c10::SymInt got = mask.sym_size(-i);
    const c10::SymInt want = i == 1 ? s_kv : query.sym_size(-i);
    if (got != want && got != 1) {
      return false;
    }
  }
  return true;
}

}  // namespace

long runtime_cudnn_version() {
  // The loaded library does not change within a process.
  static const long version = [] {
    const auto& hooks = at::detail::getCUDAHooks();
    return hooks.hasCUDA() && hooks.hasCuDNN() ? hooks.versionRuntimeCuDNN() : 0L;
  }();
  return version;
}

const char* cudnn_unavailable(const at::Tensor& query) {
  if (!query.is_cuda()) return "inputs are not on a CUDA device";
#ifndef OPENWAM_WITH_CUDA
  // A CUDA torch on a GPU, but no CUDA toolkit when the extension was built:
  // setup.py warns, and pip's -q hides it. Every CUDA call then runs stock
  // F.sdpa, defects included, so the first one says why (found in review).
  // Without a GPU (explain() of a fake CUDA call on a CPU machine) there is
  // nothing to reinstall for.
  if (at::detail::getCUDAHooks().hasCUDA()) {
    TORCH_WARN_ONCE(kBuiltWithoutCuda, ": CUDA calls run stock F.sdpa, without the fix. "
                    "With nvcc on PATH (or CUDA_HOME set): pip install --no-build-isolation "
                    "--force-reinstall --no-deps . in the openwam_sdpa checkout.");
    return kBuiltWithoutCuda;
  }
#endif
  if (runtime_cudnn_version() == 0) return "cuDNN is not available";
  if (!sm80_or_newer(query)) return "GPU older than sm80";
  return nullptr;
}

const char* cudnn_rejects(const SdpaCall& call) {
  const at::Tensor& q = call.query;
  const at::Tensor& k = call.key;
  const at::Tensor& v = call.value;
  if (!plain_dense(q) || !plain_dense(k) || !plain_dense(v)) {
    return "an input is not a dense strided tensor";
  }
  if (q.dim() != 3 && q.dim() != 4) return "inputs are not 3-D or 4-D";
  if (k.dim() != q.dim() || v.dim() != q.dim()) return "inputs differ in rank";
  if (q.scalar_type() != at::kHalf && q.scalar_type() != at::kBFloat16) {
    return "dtype is not float16/bfloat16";
  }
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type()) {
    return "inputs differ in dtype";
  }
  if (k.device() != q.device() || v.device() != q.device()) return "inputs differ in device";
  if (q.sym_numel() == 0 || k.sym_numel() == 0 || v.sym_numel() == 0) {
    return "an input is empty";
  }
  if (k.sym_size(0) != q.sym_size(0) || v.sym_size(0) != q.sym_size(0)) {
    return "inputs differ in batch size";
  }
  if (q.dim() == 4 && !heads_group(call)) {
    return v.sym_size(1) != k.sym_size(1)
               ? "key and value differ in heads"
               : "query heads differ from key heads without grouped-query attention";
  }
  const c10::SymInt d = q.sym_size(-1), dv = v.sym_size(-1);
  if (k.sym_size(-1) != d) return "key's head_dim differs from query's";
  if (d % 8 != 0 || d > 256 || dv % 8 != 0 || dv > 256) {
    return "head_dim is not a multiple of 8 up to 256";
  }
  if (k.sym_size(-2) != v.sym_size(-2)) return "key and value differ in length";
  if (k.sym_size(-2) <= 1) return "s_kv <= 1";
  if (q.sym_stride(-1) != 1 || k.sym_stride(-1) != 1 || v.sym_stride(-1) != 1) {
    return "last dim of query/key/value is not contiguous";
  }
  if (!(call.dropout_p >= 0.0 && call.dropout_p < 1.0)) return "dropout_p outside [0, 1)";
  if (call.dropout_p > 0.0) {
    if (q.sym_size(-2) == 1) return "dropout with s_q == 1";
    const double sixteenths = call.dropout_p * 16.0;
    if (sixteenths != std::round(sixteenths)) return "dropout_p is not a multiple of 1/16";
  }
  if (call.scale.has_value() && !std::isfinite(*call.scale)) return "scale is not finite";
  if (call.attn_mask.has_value()) {
    const at::Tensor& m = *call.attn_mask;
    if (call.is_causal) return "attn_mask with is_causal=True";
    if (!plain_dense(m)) return "attn_mask is not a dense strided tensor";
    if (m.requires_grad()) return "attn_mask requires grad";
    if (m.device() != q.device()) return "attn_mask is on another device";
    if (m.scalar_type() != at::kBool && m.scalar_type() != q.scalar_type() &&
        m.scalar_type() != at::kFloat) {
      return "attn_mask dtype is not bool, float32 or query's";
    }
    if (!broadcasts_to_attention(m, q, k.sym_size(-2))) {
      return "attn_mask does not broadcast to [..., L, S]";
    }
  }
  const auto& ctx = at::globalContext();
  if (ctx.deterministicAlgorithms() && !ctx.deterministicAlgorithmsWarnOnly()) {
    return "torch.use_deterministic_algorithms(True) is set";
  }
  return nullptr;
}

at::Tensor cudnn_bias(const at::Tensor& mask, at::ScalarType dtype, int64_t input_rank,
                      const c10::SymInt& s_kv, const std::optional<c10::SymInt>& s_kv_padded) {
  at::Tensor bias;
  const at::Tensor m = mask.dim() == 0 ? mask.unsqueeze(0) : mask;
  if (m.scalar_type() == at::kBool) {
    // In one pass (mask_bias.h), the keys grown where asked.
    bias = mask_bias(m, dtype, s_kv, s_kv_padded.value_or(s_kv));
  } else if (s_kv_padded.has_value()) {
    // The keys grown to s_kv_padded, -inf there; the mask copied into the
    // first s_kv (a mask broadcast along the keys broadcasts into them).
    std::vector<c10::SymInt> sizes(m.sym_sizes().begin(), m.sym_sizes().end());
    sizes.back() = *s_kv_padded;
    bias = at::full_symint(sizes, -std::numeric_limits<double>::infinity(),
                           m.options().dtype(dtype));
    bias.narrow_symint(-1, 0, s_kv).copy_(m);
  } else {
    bias = mask.scalar_type() == dtype ? mask : mask.to(dtype);
  }
  // Right-align to the input's rank, then give a 3-D call its head axis.
  while (bias.dim() < input_rank) {
    bias = bias.unsqueeze(0);
  }
  if (input_rank == 3) {
    bias = bias.unsqueeze(1);
  }
  if (!s_kv_padded.has_value() && (bias.sym_size(-1) != s_kv || bias.sym_stride(-1) != 1)) {
    std::vector<c10::SymInt> sizes(bias.sym_sizes().begin(), bias.sym_sizes().end());
    sizes.back() = s_kv;
    bias = bias.expand_symint(sizes).contiguous();
  }
  return bias;
}

at::Tensor empty_like_cudnn_output(const at::Tensor& query, const c10::SymInt& head_dim_v) {
  if (head_dim_v == query.sym_size(-1)) {
    return at::empty_like(query);
  }
  // ATen's alloc_with_matching_layout: dense, in the query's stride order.
  std::vector<int64_t> order(query.dim());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return query.sym_stride(a) > query.sym_stride(b);
  });
  std::vector<c10::SymInt> sizes(query.sym_sizes().begin(), query.sym_sizes().end());
  sizes.back() = head_dim_v;
  std::vector<c10::SymInt> strides(sizes.size());
  c10::SymInt stride = 1;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    strides[*it] = stride;
    stride = stride * sizes[*it];
  }
  return at::empty_strided_symint(sizes, strides, query.options());
}

CudnnForward cudnn_forward(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const at::Tensor& bias,
                           bool compute_logsumexp, double dropout_p,
                           bool is_causal, std::optional<double> scale) {
  TORCH_INTERNAL_ASSERT(query.dim() == 4 && key.dim() == 4 && value.dim() == 4);
  std::optional<at::Tensor> bias_opt;
  if (bias.defined()) {
    TORCH_INTERNAL_ASSERT(bias.scalar_type() == query.scalar_type() && bias.dim() == 4);
    bias_opt = bias;
  }
  auto result = at::_scaled_dot_product_cudnn_attention(
      query, key, value, bias_opt, compute_logsumexp, dropout_p, is_causal,
      /*return_debug_mask=*/false, scale);
  CudnnForward f;
  f.out = std::move(std::get<0>(result));
  f.logsumexp = std::move(std::get<1>(result));
  f.philox_seed = std::move(std::get<6>(result));
  f.philox_offset = std::move(std::get<7>(result));
  return f;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cudnn_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& philox_seed, const at::Tensor& philox_offset,
    const at::Tensor& bias, double dropout_p, bool is_causal,
    std::optional<double> scale) {
  // The dense path takes no cumulative sequence lengths; max_q and max_k are
  // the padded lengths of the dense inputs.
  return at::_scaled_dot_product_cudnn_attention_backward_symint(
      grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset,
      bias, at::Tensor(), at::Tensor(), query.sym_size(2), key.sym_size(2),
      dropout_p, is_causal, scale);
}

}  // namespace openwam

#include "dispatch.h"

#include "padding.h"

#include <ATen/Context.h>
#include <ATen/ops/_fused_sdp_choice.h>

#include <cmath>

#ifdef OPENWAM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace openwam {
namespace {

const char* backend_name(int64_t choice) {
  switch (static_cast<at::SDPBackend>(choice)) {
    case at::SDPBackend::math: return "math";
    case at::SDPBackend::flash_attention: return "flash_attention";
    case at::SDPBackend::efficient_attention: return "efficient_attention";
    case at::SDPBackend::cudnn_attention: return "cudnn_attention";
    case at::SDPBackend::overrideable: return "overrideable";
    default: return "error";
  }
}

bool fail(std::string* why_not, const char* reason) {
  if (why_not != nullptr) {
    *why_not = reason;
  }
  return false;
}

bool cuda_arch_supported(const at::Tensor& t) {
#ifdef OPENWAM_WITH_CUDA
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(t.device().index());
  return prop->major >= 8;
#else
  (void)t;
  return false;
#endif
}

bool any_input_empty(const SdpaInputs& in) {
  // sym_numel: numel() throws on the symbolic sizes of a dynamic-shape trace.
  return in.query.sym_numel() == 0 || in.key.sym_numel() == 0 ||
         in.value.sym_numel() == 0;
}

}  // namespace

bool cudnn_can_serve(const SdpaInputs& in, std::string* why_not) {
  const at::Tensor& q = in.query;
  const at::Tensor& k = in.key;
  const at::Tensor& v = in.value;
  if (!q.is_cuda()) return fail(why_not, "inputs are not on a CUDA device");
  if (runtime_cudnn_version() == 0) return fail(why_not, "cuDNN is not available");
  if (!cuda_arch_supported(q)) return fail(why_not, "GPU older than sm80");
  if (q.scalar_type() != at::kHalf && q.scalar_type() != at::kBFloat16) {
    return fail(why_not, "dtype is not float16/bfloat16");
  }
  if (q.dim() != 3 && q.dim() != 4) return fail(why_not, "inputs are not 3-D or 4-D");
  if (any_input_empty(in)) return fail(why_not, "an input is empty");
  const int64_t d = in.head_dim();
  if (d % 8 != 0 || d > 256) return fail(why_not, "head_dim is not a multiple of 8 up to 256");
  if (v.size(-1) != d) return fail(why_not, "value head_dim differs from query's");
  if (q.stride(-1) != 1 || k.stride(-1) != 1 || v.stride(-1) != 1) {
    return fail(why_not, "last dim of query/key/value is not contiguous");
  }
  if (in.s_kv() <= 1) return fail(why_not, "s_kv <= 1");
  if (in.dropout_p > 0.0) {
    if (in.s_q() == 1) return fail(why_not, "dropout with s_q == 1");
    const double sixteenths = in.dropout_p * 16.0;
    if (sixteenths != std::round(sixteenths)) {
      return fail(why_not, "dropout_p is not a multiple of 1/16");
    }
  }
  if (at::globalContext().deterministicAlgorithms()) {
    return fail(why_not, "torch.use_deterministic_algorithms(True) is set");
  }
  return true;
}

Decision decide(const SdpaInputs& in, const Settings& settings) {
  Decision out;
  if (any_input_empty(in)) {
    out.empty_input = true;
    out.pytorch_choice = "not asked (an input is empty)";
    out.reason = "an input is empty: PyTorch's math backend";
    return out;
  }
  std::string why_not;
  const bool servable = cudnn_can_serve(in, &why_not);
  const long version = servable ? runtime_cudnn_version() : 0;
  // PyTorch's own choice costs a pass through its selector on the host; a
  // call that prefers cuDNN and can have it does not need it.
  const bool need_choice = !(settings.cudnn == CudnnPreference::kPrefer && servable);
  const int64_t choice =
      need_choice ? at::_fused_sdp_choice(in.query, in.key, in.value, in.attn_mask,
                                          in.dropout_p, in.is_causal, in.scale,
                                          in.enable_gqa)
                  : static_cast<int64_t>(at::SDPBackend::cudnn_attention);
  out.pytorch_choice = need_choice ? backend_name(choice) : "not asked (cuDNN preferred)";
  const bool pytorch_picks_cudnn =
      choice == static_cast<int64_t>(at::SDPBackend::cudnn_attention);

  switch (settings.cudnn) {
    case CudnnPreference::kNever:
      out.use_cudnn = false;
      out.reason = "OPENWAM_SDPA_CUDNN=0";
      break;
    case CudnnPreference::kPrefer:
      out.use_cudnn = servable;
      out.reason = servable ? "OPENWAM_SDPA_CUDNN=1 and cuDNN can serve"
                            : "cuDNN cannot serve: " + why_not;
      break;
    case CudnnPreference::kFollowPyTorch:
      out.use_cudnn = pytorch_picks_cudnn && servable;
      out.reason = !pytorch_picks_cudnn
                       ? "PyTorch picks " + out.pytorch_choice
                       : (servable ? "PyTorch picks cuDNN"
                                   : "PyTorch picks cuDNN but the direct op cannot serve: " + why_not);
      break;
  }
  if (out.use_cudnn) {
    if (const GuardRule* avoid = rule_avoiding_cudnn(in, version)) {
      out.use_cudnn = false;
      out.rule = avoid;
      out.reason = std::string("guard rule ") + avoid->name;
    }
  }
  out.exclude_cudnn = !out.use_cudnn && pytorch_picks_cudnn;

  if (out.use_cudnn) {
    out.plan = in.differentiated()
                   ? plan_for_cudnn(in, settings, version, &out.rule)
                   : Plan::kNone;
  } else if (settings.pad == PadMode::kAlways && in.differentiated() &&
             in.s_kv() % kCudnnKeyTile != 0) {
    out.plan = Plan::kPadInputs;
  }
  return out;
}

}  // namespace openwam

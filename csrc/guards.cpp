#include "guards.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>

#include <mutex>

#include "padding.h"

namespace openwam {
namespace {

// cuDNN encodes 9.x.y as 90000 + 100 * x + y.
constexpr long kCudnn9_19_0 = 91900;
constexpr long kCudnn9_25_1 = 92501;
constexpr long kCudnn9_26_0 = 92600;
constexpr long kCudnn9_27_0 = 92700;

enum RuleId { kKeyTailMeasured, kKeyTailConservative, kSq1DkDvNan, kPlanSegfault, kNumRules };

const std::vector<GuardRule>& rules() {
  static const std::vector<GuardRule> table = {
      // Measured by this project on an H200 (torch 2.11.0+cu130, cuDNN 9.19.0,
      // 2026-11-30): s_kv = 256 + r for r = 1..127 and s_kv in 1..127, 1025..1151,
      // head_dim 64 and 128: only r == 64 gives NaN dQ; is_causal never did.
      {"key_tail_nan_dq_9.19", "9.19.0",
       "backward NaN in dQ rows with logsumexp < -88.7 when s_kv % 128 == 64 "
       "(head_dim 64/128; other head_dims: any s_kv % 128 != 0)",
       "repair the dQ rows with very negative logsumexp (pad when dropout > 0)",
       "cudnn-frontend #160, PR #628; pytorch #196678; sweep in "
       "notes/probe_2026-11-30_h200.json"},
      // The same defect on other versions before its fix: torch 2.7.1 with
      // cuDNN 9.7.1 failed for every s_kv % 128 != 0 (DESIGN.md section 1).
      {"key_tail_nan_dq", "< 9.26.0 (other than 9.19.0)",
       "backward NaN in dQ rows with logsumexp < -88.7 when s_kv % 128 != 0",
       "repair the dQ rows with very negative logsumexp (pad when dropout > 0)",
       "cudnn-frontend #160, PR #628 (fixed in cuDNN 9.26); pytorch #196678"},
      {"sq1_dkdv_nan", "9.25.1 - 9.26.x",
       "backward NaN in all of dK/dV for s_q == 1, s_kv == 128 and very "
       "negative logsumexp",
       "run the call on PyTorch's next backend (not cuDNN)",
       "cudnn-frontend #1072"},
      {"bhsq1_plan_segfault", "9.25.1 - 9.26.x",
       "segfault building the backward plan for B == H == s_q == 1",
       "run the call on PyTorch's next backend (not cuDNN)",
       "cudnn-frontend #1071"},
  };
  return table;
}

bool in_range(long v, long lo, long hi_exclusive) {
  return v >= lo && v < hi_exclusive;
}

// The (version, head_dim) pairs the H200 sweep measured; the rest of the
// key-tail rule is conservative.
bool key_tail_measured(long cudnn_version, int64_t head_dim) {
  return cudnn_version == kCudnn9_19_0 && (head_dim == 64 || head_dim == 128);
}

}  // namespace

const char* to_string(Plan plan) {
  switch (plan) {
    case Plan::kNone: return "none";
    case Plan::kRepairDq: return "repair_dq";
    case Plan::kPadBackward: return "pad_backward";
    case Plan::kPadForward: return "pad_forward";
    case Plan::kPadInputs: return "pad_inputs";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown Plan");
}

const std::vector<GuardRule>& guard_rules() { return rules(); }

long runtime_cudnn_version() {
  // Every call reads it (dispatch and guards); the loaded library does not
  // change within a process.
  static const long version = [] {
    const auto& hooks = at::detail::getCUDAHooks();
    return hooks.hasCUDA() && hooks.hasCuDNN() ? hooks.versionRuntimeCuDNN() : 0L;
  }();
  return version;
}

bool key_tail_defect(long cudnn_version, int64_t s_kv, int64_t head_dim,
                     bool is_causal) {
  const int64_t remainder = s_kv % kCudnnKeyTile;
  if (remainder == 0 || cudnn_version >= kCudnn9_26_0) {
    return false;
  }
  if (key_tail_measured(cudnn_version, head_dim)) {
    return remainder == 64 && !is_causal;
  }
  return true;
}

const GuardRule* rule_avoiding_cudnn(const SdpaInputs& in, long cudnn_version) {
  if (!in.differentiated() || !in_range(cudnn_version, kCudnn9_25_1, kCudnn9_27_0)) {
    return nullptr;
  }
  const at::Tensor& q = in.query;
  const int64_t batch = q.size(0);
  const int64_t heads = q.dim() == 4 ? q.size(1) : 1;
  if (batch == 1 && heads == 1 && in.s_q() == 1) {
    return &rules()[kPlanSegfault];
  }
  if (in.s_q() == 1 && in.s_kv() == 128) {
    return &rules()[kSq1DkDvNan];
  }
  return nullptr;
}

bool repair_supported(const SdpaInputs& in) {
#ifdef OPENWAM_WITH_CUDA
  return in.dropout_p == 0.0 && in.head_dim() <= 256 &&
         in.value.size(-1) == in.head_dim();
#else
  (void)in;
  return false;
#endif
}

Plan plan_for_cudnn(const SdpaInputs& in, const Settings& settings,
                    long cudnn_version, const GuardRule** rule) {
  *rule = nullptr;
  const bool aligned = in.s_kv() % kCudnnKeyTile == 0;
  if (settings.pad == PadMode::kNever || aligned) {
    return Plan::kNone;
  }
  if (settings.pad == PadMode::kAlways) {
    return in.dropout_p > 0.0 ? Plan::kPadForward : Plan::kPadBackward;
  }
  if (!key_tail_defect(cudnn_version, in.s_kv(), in.head_dim(), in.is_causal)) {
    return Plan::kNone;
  }
  *rule = &rules()[key_tail_measured(cudnn_version, in.head_dim())
                       ? kKeyTailMeasured
                       : kKeyTailConservative];
  if (in.dropout_p > 0.0) {
    return Plan::kPadForward;
  }
  return repair_supported(in) ? Plan::kRepairDq : Plan::kPadBackward;
}

void warn_once(const GuardRule& rule) {
  static std::once_flag flags[kNumRules];
  const auto index = static_cast<size_t>(&rule - rules().data());
  TORCH_INTERNAL_ASSERT(index < kNumRules);
  std::call_once(flags[index], [&] {
    TORCH_WARN("openwam_sdpa: guard rule '", rule.name, "' fired (cuDNN ",
               rule.versions, ": ", rule.defect, "; ", rule.source,
               "). Action: ", rule.action,
               ". This warning is shown once per process.");
  });
}

}  // namespace openwam

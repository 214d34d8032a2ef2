#include "varlen_backend.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cudnn_attention.h"
#include "settings.h"

#ifdef OPENWAM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace openwam {
namespace {

constexpr int kUnset = -1;
std::atomic<int> g_preference{kUnset};

VarlenPreference parse_preference() {
  const char* raw = std::getenv("OPENWAM_SDPA_VARLEN");
  const char* value = raw == nullptr ? "" : raw;
  if (std::strcmp(value, "") == 0 || std::strcmp(value, "auto") == 0) {
    return VarlenPreference::kAuto;
  }
  if (std::strcmp(value, "flash") == 0) return VarlenPreference::kFlash;
  if (std::strcmp(value, "cudnn") == 0) return VarlenPreference::kCudnn;
  if (std::strcmp(value, "block_diagonal") == 0) return VarlenPreference::kBlockDiagonal;
  TORCH_CHECK(false,
              "openwam::sdpa_varlen: environment variable OPENWAM_SDPA_VARLEN must be "
              "'auto', 'flash', 'cudnn' or 'block_diagonal', got '", value, "'");
}

bool half_precision(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

// Sizes both fused engines take: head_dim a multiple of 8 up to 256, one
// head_dim for query and value (ATen's flash varlen pads nothing itself).
const char* fused_rejects(const VarlenCall& call) {
  if (!half_precision(call.query)) return "dtype is not float16/bfloat16";
  const c10::SymInt& e = call.query.sym_size(-1);
  if (call.value.sym_size(-1) != e) return "value's head_dim differs from query's";
  if (e > 256) return "head_dim is over 256";
  if (e % 8 != 0) return "head_dim is not a multiple of 8";
  return nullptr;
}

VarlenDecision decided(VarlenBackend backend, const char* reason) {
  VarlenDecision d;
  d.backend = backend;
  d.reason = reason;
  return d;
}

// The first guard row that fires for this ragged call only because it is
// ragged (the dense rows answer for openwam::sdpa's calls).
const GuardRule* ragged_rule(const VarlenCall& call, long version) {
  CallShape shape;
  shape.batch = call.cu_seqlens_q.sym_size(0) - 1;
  shape.heads = call.query.sym_size(1);
  shape.kv_heads = call.key.sym_size(1);
  shape.s_q = call.max_seqlen_q;
  shape.s_kv = call.max_seqlen_k;
  shape.head_dim = call.query.sym_size(-1);
  shape.head_dim_v = call.value.sym_size(-1);
  shape.is_causal = call.is_causal;
  shape.fp16 = call.query.scalar_type() == at::kHalf;
  shape.dropout_p = call.dropout_p;
  CallShape dense = shape;
  shape.ragged = true;
  for (const GuardRule& rule : guard_rules()) {
    if (rule.covers(shape, version) && !rule.hits(dense, version)) {
      return &rule;
    }
  }
  return nullptr;
}

}  // namespace

const char* to_string(VarlenBackend backend) {
  switch (backend) {
    case VarlenBackend::kReference: return "reference";
    case VarlenBackend::kFlash: return "flash_varlen";
    case VarlenBackend::kCudnnRagged: return "cudnn_ragged";
    case VarlenBackend::kBlockDiagonal: return "block_diagonal";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown VarlenBackend");
}

const char* to_string(VarlenPreference p) {
  switch (p) {
    case VarlenPreference::kAuto: return "auto";
    case VarlenPreference::kFlash: return "flash";
    case VarlenPreference::kCudnn: return "cudnn";
    case VarlenPreference::kBlockDiagonal: return "block_diagonal";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown VarlenPreference");
}

VarlenPreference varlen_preference() {
  const int cached = g_preference.load(std::memory_order_relaxed);
  return cached == kUnset ? reload_varlen_preference() : static_cast<VarlenPreference>(cached);
}

VarlenPreference reload_varlen_preference() {
  g_preference.store(kUnset, std::memory_order_relaxed);
  const VarlenPreference p = parse_preference();  // raises: the cache stays unset
  g_preference.store(static_cast<int>(p), std::memory_order_relaxed);
  return p;
}

const char* flash_varlen_rejects(const VarlenCall& call) {
  if (const char* why = fused_rejects(call)) return why;
  // FlashAttention-2 aligns a causal mask bottom-right when a sequence's
  // s_q != s_k, F.sdpa top-left: the two agree only on square sequences, and
  // the lengths cannot be read here without a host sync.
  if (call.is_causal && !call.same_lengths()) {
    return "is_causal with cu_seqlens_q and cu_seqlens_k not one tensor (FlashAttention-2 "
           "would align the mask bottom-right where a sequence's s_q != s_k)";
  }
  if (at::globalContext().deterministicAlgorithms() && call.dropout_p > 0.0) {
    return "deterministic algorithms with dropout";
  }
  return nullptr;
}

const char* cudnn_ragged_rejects(const VarlenCall& call) {
  if (const char* why = fused_rejects(call)) return why;
  if (call.query.sym_size(-1) % 16 != 0) {
    // cudnn-frontend 1.32 drops the backward's max_total_seq_len there ("a known
    // functional issue"): its workspace would grow to the bucketed padded batch.
    return "head_dim is not a multiple of 16 (cuDNN's ragged backward would size its "
           "workspace as the padded batch)";
  }
  if (at::globalContext().deterministicAlgorithms()) {
    return "deterministic algorithms requested (cuDNN's backward is not deterministic)";
  }
  return nullptr;
}

VarlenDecision decide_varlen(const VarlenCall& call, VarlenPreference preference,
                             const VarlenStack& stack) {
  if (preference == VarlenPreference::kBlockDiagonal) {
    return decided(VarlenBackend::kBlockDiagonal, "OPENWAM_SDPA_VARLEN=block_diagonal");
  }
  if (!stack.cuda) {
    return decided(VarlenBackend::kReference, "CPU: the exact per-sequence reference");
  }
  if (call.query.sym_numel() == 0 || call.key.sym_numel() == 0) {
    return decided(VarlenBackend::kBlockDiagonal, "an input is empty");
  }
  const char* flash_no =
      stack.flash_available ? flash_varlen_rejects(call) : "FlashAttention-2 is not available "
                                                            "(GPU older than sm80 or not built)";
  if (flash_no == nullptr && stack.flash_backward_limits_head_dim && call.differentiated()) {
    const auto head_dim = call.query.sym_size(-1);
    if ((head_dim > 192 && head_dim <= 224) || (head_dim > 224 && call.dropout_p > 0.0)) {
      // Its forward would run, and its backward raise.
      flash_no = "FlashAttention-2's backward on this GPU refuses head_dim in (192, 224], and "
                 "above 224 with dropout";
    }
  }
  const char* cudnn_no =
      stack.cudnn_unavailable != nullptr ? stack.cudnn_unavailable : cudnn_ragged_rejects(call);
  VarlenDecision d;
  if (preference == VarlenPreference::kCudnn && cudnn_no == nullptr) {
    // The setting overrides every row of the ragged layout: they keep it off
    // where it is unmeasured or rounds adversarial rows coarser than stock,
    // never where it crashes or gives NaN (such a row would have to hold).
    d = decided(VarlenBackend::kCudnnRagged, "OPENWAM_SDPA_VARLEN=cudnn");
    d.rule = ragged_rule(call, stack.cudnn_version);
    d.rule_overridden = d.rule != nullptr;
    return d;
  }
  if (preference == VarlenPreference::kAuto && cudnn_no == nullptr) {
    const GuardRule* rule = ragged_rule(call, stack.cudnn_version);
    if (rule == nullptr) {
      return decided(VarlenBackend::kCudnnRagged,
                     "cuDNN's ragged layout on the frontend's graphs, measured right on this "
                     "cuDNN");
    }
    if (rule->rounding_only && flash_no != nullptr) {
      d = decided(VarlenBackend::kCudnnRagged,
                  "a guard row about rounding keeps cuDNN's ragged layout off, but "
                  "FlashAttention-2 cannot serve: the ragged layout rather than the "
                  "block-diagonal fallback (memory total_q x total_k)");
      d.rule = rule;
      return d;
    }
    d = decided(flash_no == nullptr ? VarlenBackend::kFlash : VarlenBackend::kBlockDiagonal,
                flash_no == nullptr
                    ? "a guard row keeps cuDNN's ragged layout off: FlashAttention-2 varlen"
                    : "a guard row keeps cuDNN's ragged layout off, and FlashAttention-2 "
                      "cannot serve: openwam::sdpa with a block-diagonal mask");
    d.rule = rule;
    return d;
  }
  if (flash_no == nullptr) {
    return decided(VarlenBackend::kFlash, preference == VarlenPreference::kFlash
                                              ? "OPENWAM_SDPA_VARLEN=flash"
                                              : "cuDNN's ragged layout cannot take the call; "
                                                "FlashAttention-2 varlen can");
  }
  return decided(VarlenBackend::kBlockDiagonal,
                 "no fused varlen engine can serve: openwam::sdpa with a block-diagonal mask");
}

VarlenDecision decide_varlen(const VarlenCall& call) {
  VarlenStack stack;
  stack.cuda = call.query.is_cuda();
  if (stack.cuda) {
#ifdef OPENWAM_WITH_CUDA
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(call.query.device().index());
    stack.flash_available = props->major >= 8;
    stack.flash_backward_limits_head_dim = (props->major == 8 && (props->minor == 6 ||
                                                                  props->minor == 9)) ||
                                           (props->major == 12 && props->minor <= 1);
#endif
    stack.cudnn_version = runtime_cudnn_version();
    stack.cudnn_unavailable = cudnn_unavailable(call.query);
#ifdef OPENWAM_WITH_CUDA
    if (stack.cudnn_unavailable == nullptr &&
        at::cuda::getDeviceProperties(call.query.device().index())->major != 9) {
      // Measured on Hopper only. On sm8x/sm12x cudnn-frontend 1.32 drops the
      // backward's max_total_seq_len (its workspace grows to the padded batch).
      stack.cudnn_unavailable = "cuDNN's ragged layout is measured on Hopper (sm90) only";
    }
#endif
#ifndef OPENWAM_WITH_CUDNN_FRONTEND
    if (stack.cudnn_unavailable == nullptr) {
      stack.cudnn_unavailable = "this build has no cuDNN frontend (the ragged engine's graphs)";
    }
#endif
    if (stack.cudnn_unavailable == nullptr && !current_settings().frontend) {
      // ATen's own ragged call is wrong (pytorch #186142): no fallback there.
      stack.cudnn_unavailable = "OPENWAM_SDPA_FRONTEND=0 (the ragged engine runs on the "
                                "frontend's graphs only)";
    }
  }
  return decide_varlen(call, varlen_preference(), stack);
}

}  // namespace openwam

// Which engine runs an sdpa_varlen call: one function, called by the op and
// by explain_varlen(), from the setting OPENWAM_SDPA_VARLEN, the inputs and
// the stack. It reads no tensor values; the ragged guard rows compare the
// longest lengths and the batch (guards.cpp: max_seqlen_q == 1, max_seqlen_k
// % 128 == 64, batch == 1), so under torch.compile a batch crossing one of
// those bounds recompiles once, and the others reuse the engine recorded.
#pragma once

#include "guards.h"
#include "varlen.h"

namespace openwam {

// OPENWAM_SDPA_VARLEN: auto (default) = cuDNN's ragged layout on the
// frontend's graphs wherever it can take the call and no guard row keeps it
// off (on a cuDNN this project measured), else FlashAttention-2 varlen;
// flash = never cuDNN; cudnn = cuDNN's ragged layout wherever it can take the
// inputs, overriding the ragged layout's guard rows (for measuring them);
// block_diagonal = openwam::sdpa over the packed
// batch with a block-diagonal mask, on every device (what transformers'
// "sdpa" does with packed batches; for comparing, and for testing the
// fallback on the CPU). Whatever neither fused engine takes runs on the
// block-diagonal fallback (CUDA) or the reference (CPU).
enum class VarlenPreference { kAuto, kFlash, kCudnn, kBlockDiagonal };

const char* to_string(VarlenPreference p);

// Cached like settings.h's: parsed once, re-read by reload_varlen_settings().
VarlenPreference varlen_preference();
VarlenPreference reload_varlen_preference();

// What the decision reads beyond the call, passed in so that a test can pose
// any stack.
struct VarlenStack {
  bool cuda = false;                  // query on a CUDA device
  bool flash_available = false;       // ATen's flash kernels run here (sm80+, built)
  // sm86, sm89, sm120, sm121: FlashAttention-2's backward refuses head_dim in
  // (192, 224], and above 224 with dropout (PyTorch's own dispatcher keeps
  // such training calls off flash: check_requires_grad_and_head_dim_gt192_*).
  bool flash_backward_limits_head_dim = false;
  long cudnn_version = 0;             // runtime cuDNN; 0: none
  const char* cudnn_unavailable = nullptr;  // why cuDNN cannot run here
};

struct VarlenDecision {
  VarlenBackend backend = VarlenBackend::kReference;
  const GuardRule* rule = nullptr;  // the guard row that kept cuDNN off, or overridden
  bool rule_overridden = false;     // OPENWAM_SDPA_VARLEN=cudnn ran it anyway
  const char* reason = "";
};

// nullptr when FlashAttention-2 varlen computes exactly this call; else why not.
const char* flash_varlen_rejects(const VarlenCall& call);
// nullptr when cuDNN's ragged layout can take this call; else why not.
const char* cudnn_ragged_rejects(const VarlenCall& call);

VarlenDecision decide_varlen(const VarlenCall& call, VarlenPreference preference,
                             const VarlenStack& stack);
// This process's stack.
VarlenDecision decide_varlen(const VarlenCall& call);

}  // namespace openwam

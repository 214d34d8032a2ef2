// sdpa_varlen's engine choice (csrc/varlen_backend.h): decide_varlen(call,
// preference, stack) with a posed stack, on CPU tensors standing in for CUDA
// ones (the decision reads only metadata). Every preference, the guard row of
// the ragged layout, and FlashAttention-2's limits.
#include <ATen/ATen.h>

#include <string>

#include "guards.h"
#include "varlen_backend.h"
#include "support.h"

using openwam::VarlenBackend;
using openwam::VarlenCall;
using openwam::VarlenDecision;
using openwam::VarlenPreference;
using openwam::VarlenStack;

namespace {

constexpr long k9_19_0 = openwam::cudnn_version(9, 19, 0);

struct Packed {
  at::Tensor q, k, v, cu_q, cu_k;
  bool is_causal = true;
  double dropout_p = 0.0;

  Packed(at::ScalarType dtype = at::kBFloat16, int64_t head_dim = 128, int64_t head_dim_v = -1,
         bool one_cu = true) {
    const auto opts = at::TensorOptions().dtype(dtype);
    q = at::zeros({10, 4, head_dim}, opts);
    k = at::zeros({10, 2, head_dim}, opts);
    v = at::zeros({10, 2, head_dim_v < 0 ? head_dim : head_dim_v}, opts);
    cu_q = at::tensor({0, 4, 10}, at::TensorOptions().dtype(at::kInt));
    cu_k = one_cu ? cu_q : cu_q.clone();
  }

  VarlenDecision decide(VarlenPreference preference, const VarlenStack& stack) const {
    const VarlenCall call{q, k, v, cu_q, cu_k, 6, 6, is_causal, std::nullopt, dropout_p, true};
    return openwam::decide_varlen(call, preference, stack);
  }
};

VarlenStack cuda_stack(bool flash = true, const char* cudnn_unavailable = nullptr,
                       long cudnn_version = k9_19_0) {
  VarlenStack s;
  s.cuda = true;
  s.flash_available = flash;
  s.cudnn_version = cudnn_version;
  s.cudnn_unavailable = cudnn_unavailable;
  return s;
}

std::string rule_name(const VarlenDecision& d) { return d.rule == nullptr ? "" : d.rule->name; }

}  // namespace

TEST_CASE("varlen: the CPU takes the reference, except block_diagonal", "[varlen]") {
  const Packed p;
  VarlenStack cpu;
  for (auto pref : {VarlenPreference::kAuto, VarlenPreference::kFlash, VarlenPreference::kCudnn}) {
    CHECK(p.decide(pref, cpu).backend == VarlenBackend::kReference);
  }
  CHECK(p.decide(VarlenPreference::kBlockDiagonal, cpu).backend == VarlenBackend::kBlockDiagonal);
}

TEST_CASE("varlen: FlashAttention-2 by default on CUDA, within its limits", "[varlen]") {
  CHECK(Packed().decide(VarlenPreference::kAuto, cuda_stack()).backend == VarlenBackend::kFlash);
  CHECK(Packed(at::kHalf, 256).decide(VarlenPreference::kAuto, cuda_stack()).backend ==
        VarlenBackend::kFlash);
  // Beyond them: the block-diagonal fallback (cuDNN's ragged layout is
  // guarded off by ragged_wrong_9.19, measured, whose name the decision carries).
  for (const Packed& p : {Packed(at::kFloat), Packed(at::kBFloat16, 264),
                          Packed(at::kBFloat16, 100), Packed(at::kBFloat16, 128, 64)}) {
    const VarlenDecision d = p.decide(VarlenPreference::kAuto, cuda_stack());
    CHECK(d.backend == VarlenBackend::kBlockDiagonal);
  }
  const VarlenDecision d = Packed(at::kBFloat16, 128, 128, /*one_cu=*/false)
                               .decide(VarlenPreference::kAuto, cuda_stack());
  CHECK(d.backend == VarlenBackend::kBlockDiagonal);
  CHECK(rule_name(d) == "ragged_wrong_9.19");
  CHECK_FALSE(d.rule_overridden);
  Packed not_causal(at::kBFloat16, 128, 128, /*one_cu=*/false);
  not_causal.is_causal = false;
  CHECK(not_causal.decide(VarlenPreference::kAuto, cuda_stack()).backend == VarlenBackend::kFlash);
  CHECK(Packed().decide(VarlenPreference::kAuto, cuda_stack(/*flash=*/false)).backend ==
        VarlenBackend::kBlockDiagonal);
}

TEST_CASE("varlen: OPENWAM_SDPA_VARLEN=cudnn overrides the unmeasured ragged row only",
          "[varlen]") {
  const VarlenStack unmeasured = cuda_stack(true, nullptr, openwam::cudnn_version(9, 20, 0));
  const VarlenDecision d = Packed().decide(VarlenPreference::kCudnn, unmeasured);
  CHECK(d.backend == VarlenBackend::kCudnnRagged);
  CHECK(rule_name(d) == "ragged_wrong");
  CHECK(d.rule_overridden);
  // On 9.19.0 the row is measured (wrong dQ, a hang): the setting cannot
  // send a call there.
  const VarlenDecision held = Packed().decide(VarlenPreference::kCudnn, cuda_stack());
  CHECK(held.backend == VarlenBackend::kFlash);
  CHECK(rule_name(held) == "ragged_wrong_9.19");
  CHECK_FALSE(held.rule_overridden);
  // Without cuDNN, or for inputs it cannot take: FlashAttention-2 or the fallback.
  CHECK(Packed(at::kFloat).decide(VarlenPreference::kCudnn, unmeasured).backend ==
        VarlenBackend::kBlockDiagonal);
  CHECK(Packed().decide(VarlenPreference::kCudnn, cuda_stack(true, "cuDNN is not available"))
            .backend == VarlenBackend::kFlash);
}

TEST_CASE("varlen: flash never picks cuDNN, and an empty input takes the fallback", "[varlen]") {
  const VarlenDecision d =
      Packed(at::kBFloat16, 128, 128, false).decide(VarlenPreference::kFlash, cuda_stack());
  CHECK(d.backend == VarlenBackend::kBlockDiagonal);
  CHECK(d.rule == nullptr);
  Packed empty;
  empty.q = empty.q.narrow(0, 0, 0);
  CHECK(empty.decide(VarlenPreference::kAuto, cuda_stack()).backend ==
        VarlenBackend::kBlockDiagonal);
}

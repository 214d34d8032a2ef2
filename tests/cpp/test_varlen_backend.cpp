// sdpa_varlen's engine choice (csrc/varlen_backend.h): decide_varlen(call,
// preference, stack) with a posed stack, on CPU tensors standing in for CUDA
// ones (the decision reads only metadata). Every preference, the guard row of
// the ragged layout, and the fused engines' limits.
#include <ATen/ATen.h>

#include <string>

#include "guards.h"
#include "varlen_backend.h"
#include "support.h"

using openwam::GuardRule;
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

TEST_CASE("varlen: cuDNN's ragged layout by default on a measured cuDNN", "[varlen]") {
  for (const Packed& p : {Packed(), Packed(at::kHalf, 256), Packed(at::kBFloat16, 64),
                          Packed(at::kBFloat16, 128, 128, /*one_cu=*/false)}) {
    const VarlenDecision d = p.decide(VarlenPreference::kAuto, cuda_stack());
    CHECK(d.backend == VarlenBackend::kCudnnRagged);
    CHECK(d.rule == nullptr);
  }
  // Without FlashAttention-2 too: the engines do not depend on each other.
  CHECK(Packed().decide(VarlenPreference::kAuto, cuda_stack(/*flash=*/false)).backend ==
        VarlenBackend::kCudnnRagged);
  // Beyond what both fused engines take: the block-diagonal fallback.
  for (const Packed& p : {Packed(at::kFloat), Packed(at::kBFloat16, 264),
                          Packed(at::kBFloat16, 100), Packed(at::kBFloat16, 128, 64)}) {
    CHECK(p.decide(VarlenPreference::kAuto, cuda_stack()).backend ==
          VarlenBackend::kBlockDiagonal);
  }
}

TEST_CASE("varlen: head_dim off a multiple of 16 keeps the ragged layout off", "[varlen]") {
  // cudnn-frontend 1.32 drops the backward's max_total_seq_len there: the
  // workspace would grow to the padded batch. FlashAttention-2 takes it.
  for (int64_t e : {72, 104, 200}) {
    const Packed p(at::kBFloat16, e);
    const VarlenDecision d = p.decide(VarlenPreference::kAuto, cuda_stack());
    CHECK(d.backend == VarlenBackend::kFlash);
    const VarlenCall call{p.q, p.k, p.v, p.cu_q, p.cu_k, 6, 6, true, std::nullopt, 0.0, true};
    CHECK(std::string(openwam::cudnn_ragged_rejects(call)).find("multiple of 16") !=
          std::string::npos);
    // Not even when asked for: the setting overrides guard rows, not limits.
    CHECK(p.decide(VarlenPreference::kCudnn, cuda_stack()).backend == VarlenBackend::kFlash);
  }
  // 80 is a multiple of 16: within the engine's limits, where asked for (by
  // default a guard row keeps head_dims other than 64/128/256 off: below).
  CHECK(Packed(at::kBFloat16, 80).decide(VarlenPreference::kCudnn, cuda_stack()).backend ==
        VarlenBackend::kCudnnRagged);
}

TEST_CASE("varlen: on 9.19.0 the ragged layout keeps to head_dim 64, 128 and 256", "[varlen]") {
  // The varlen fuzz found an adversarial row's dQ 5.4x stock's at head_dim
  // 192 (guards.cpp, ragged_adversarial_dq_9.19); the head_dims it never drew
  // are kept off with it.
  for (int64_t e : {32, 80, 96, 160, 192}) {
    CAPTURE(e);
    const Packed p(at::kBFloat16, e);
    const VarlenDecision d = p.decide(VarlenPreference::kAuto, cuda_stack());
    CHECK(d.backend == VarlenBackend::kFlash);
    CHECK(rule_name(d) == "ragged_adversarial_dq_9.19");
    CHECK_FALSE(d.rule_overridden);
    // Where FlashAttention-2 cannot serve, the row is about rounding: the
    // ragged layout rather than the fallback's total_q x total_k memory.
    const VarlenDecision no_flash = p.decide(VarlenPreference::kAuto, cuda_stack(false));
    CHECK(no_flash.backend == VarlenBackend::kCudnnRagged);
    CHECK(rule_name(no_flash) == "ragged_adversarial_dq_9.19");
    CHECK_FALSE(no_flash.rule_overridden);
    Packed distinct_cu(at::kBFloat16, e, -1, /*one_cu=*/false);  // causal: FA2 would align
    CHECK(distinct_cu.decide(VarlenPreference::kAuto, cuda_stack()).backend ==
          VarlenBackend::kCudnnRagged);
    // OPENWAM_SDPA_VARLEN=cudnn overrides the row.
    const VarlenDecision asked = p.decide(VarlenPreference::kCudnn, cuda_stack());
    CHECK(asked.backend == VarlenBackend::kCudnnRagged);
    CHECK(asked.rule_overridden);
  }
  for (int64_t e : {64, 128, 256}) {
    CAPTURE(e);
    const VarlenDecision d = Packed(at::kHalf, e).decide(VarlenPreference::kAuto, cuda_stack());
    CHECK(d.backend == VarlenBackend::kCudnnRagged);
    CHECK(d.rule == nullptr);
  }
  // Degenerate packs take the same row: one sequence of one query, and an
  // empty sequence among others.
  const auto opts = at::TensorOptions().dtype(at::kBFloat16);
  const auto cu_opts = at::TensorOptions().dtype(at::kInt);
  for (const auto& cu : {at::tensor({0, 1}, cu_opts), at::tensor({0, 0, 1}, cu_opts)}) {
    const at::Tensor q = at::zeros({1, 2, 192}, opts), kv = at::zeros({1, 1, 192}, opts);
    const VarlenCall one{q, kv, kv, cu, cu, 1, 1, true, std::nullopt, 0.0, true};
    const VarlenDecision d = openwam::decide_varlen(one, VarlenPreference::kAuto, cuda_stack());
    CHECK(d.backend == VarlenBackend::kFlash);
    CHECK(rule_name(d) == "ragged_adversarial_dq_9.19");
  }
  // A row that is not about rounding holds: on an unmeasured cuDNN a call
  // FlashAttention-2 cannot take goes to the fallback.
  const VarlenStack unmeasured = cuda_stack(false, nullptr, openwam::cudnn_version(9, 20, 0));
  CHECK(Packed(at::kBFloat16, 192).decide(VarlenPreference::kAuto, unmeasured).backend ==
        VarlenBackend::kBlockDiagonal);
  for (const GuardRule& r : openwam::guard_rules()) {
    CAPTURE(r.name);
    CHECK(r.rounding_only == (std::string(r.name) == "ragged_adversarial_dq_9.19"));
  }
}

TEST_CASE("varlen: an unmeasured cuDNN takes FlashAttention-2, within its limits", "[varlen]") {
  const VarlenStack unmeasured = cuda_stack(true, nullptr, openwam::cudnn_version(9, 20, 0));
  const VarlenDecision d = Packed().decide(VarlenPreference::kAuto, unmeasured);
  CHECK(d.backend == VarlenBackend::kFlash);
  CHECK(rule_name(d) == "ragged_unmeasured");
  CHECK_FALSE(d.rule_overridden);
  // A cuDNN newer than the table knows is unmeasured too.
  for (long newer : {openwam::cudnn_version(9, 27, 0), openwam::cudnn_version(10, 0, 0)}) {
    CAPTURE(newer);
    const VarlenDecision later = Packed().decide(VarlenPreference::kAuto,
                                                 cuda_stack(true, nullptr, newer));
    CHECK(later.backend == VarlenBackend::kFlash);
    CHECK(rule_name(later) == "ragged_unmeasured");
  }
  // A causal call whose cu_seqlens_q and cu_seqlens_k differ: FlashAttention-2
  // would align the mask bottom-right, so the block-diagonal fallback.
  const VarlenDecision uneven = Packed(at::kBFloat16, 128, 128, /*one_cu=*/false)
                                    .decide(VarlenPreference::kAuto, unmeasured);
  CHECK(uneven.backend == VarlenBackend::kBlockDiagonal);
  CHECK(rule_name(uneven) == "ragged_unmeasured");
  Packed not_causal(at::kBFloat16, 128, 128, /*one_cu=*/false);
  not_causal.is_causal = false;
  CHECK(not_causal.decide(VarlenPreference::kAuto, unmeasured).backend == VarlenBackend::kFlash);
  // cuDNN unavailable (no frontend in the build, OPENWAM_SDPA_FRONTEND=0, no cuDNN).
  CHECK(Packed().decide(VarlenPreference::kAuto, cuda_stack(true, "no frontend")).backend ==
        VarlenBackend::kFlash);
  CHECK(Packed().decide(VarlenPreference::kAuto, cuda_stack(false, "no frontend")).backend ==
        VarlenBackend::kBlockDiagonal);
}

TEST_CASE("varlen: FlashAttention-2 does not train head_dim 193-224 where its backward refuses",
          "[varlen]") {
  VarlenStack sm89 = cuda_stack(true, "cuDNN's ragged layout is measured on Hopper (sm90) only");
  sm89.flash_backward_limits_head_dim = true;
  const auto backend = [&](int64_t head_dim, bool grad, double dropout,
                           const VarlenStack& stack) {
    Packed p(at::kBFloat16, head_dim);
    p.is_causal = false;
    p.dropout_p = dropout;
    p.q.requires_grad_(grad);
    return p.decide(VarlenPreference::kAuto, stack).backend;
  };
  CHECK(backend(224, true, 0.0, sm89) == VarlenBackend::kBlockDiagonal);
  CHECK(backend(200, true, 0.0, sm89) == VarlenBackend::kBlockDiagonal);
  CHECK(backend(256, true, 0.1, sm89) == VarlenBackend::kBlockDiagonal);
  // What its backward takes, or no backward at all: FlashAttention-2.
  CHECK(backend(192, true, 0.0, sm89) == VarlenBackend::kFlash);
  CHECK(backend(256, true, 0.0, sm89) == VarlenBackend::kFlash);
  CHECK(backend(224, false, 0.0, sm89) == VarlenBackend::kFlash);
  {
    at::AutoGradMode no_grad(false);
    CHECK(backend(224, true, 0.0, sm89) == VarlenBackend::kFlash);
  }
  // sm80 and sm90 train every head_dim up to 256.
  VarlenStack sm80 = sm89;
  sm80.flash_backward_limits_head_dim = false;
  CHECK(backend(224, true, 0.0, sm80) == VarlenBackend::kFlash);
  CHECK(backend(256, true, 0.1, sm80) == VarlenBackend::kFlash);
}

TEST_CASE("varlen: OPENWAM_SDPA_VARLEN=cudnn overrides the unmeasured ragged row", "[varlen]") {
  const VarlenStack unmeasured = cuda_stack(true, nullptr, openwam::cudnn_version(9, 20, 0));
  const VarlenDecision d = Packed().decide(VarlenPreference::kCudnn, unmeasured);
  CHECK(d.backend == VarlenBackend::kCudnnRagged);
  CHECK(rule_name(d) == "ragged_unmeasured");
  CHECK(d.rule_overridden);
  const VarlenDecision measured = Packed().decide(VarlenPreference::kCudnn, cuda_stack());
  CHECK(measured.backend == VarlenBackend::kCudnnRagged);
  CHECK(measured.rule == nullptr);
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

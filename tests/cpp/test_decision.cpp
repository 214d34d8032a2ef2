// The decision (csrc/decision.h): decide(call, settings, stack) with a posed
// stack, on bf16 CPU tensors (cudnn_rejects reads only the inputs; the
// device is the stack's cudnn_unavailable). Every route, every setting, the
// guard rules' routes and plans, and when PyTorch's selector is asked.
#include <ATen/ATen.h>
#include <ATen/SDPBackend.h>
#include <ATen/core/grad_mode.h>
#include <ATen/functorch/BatchedTensorImpl.h>

#include <string>

#include <torch/version.h>

#include "decision.h"
#include "guards.h"
#include "support.h"

using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;
using openwam::CudnnPreference;
using openwam::Decision;
using openwam::PadMode;
using openwam::Route;
using openwam::Settings;
using openwam_test::bhsd;
using openwam_test::Inputs;

namespace {

constexpr long k9_19_0 = openwam::cudnn_version(9, 19, 0);
constexpr long k9_25_1 = openwam::cudnn_version(9, 25, 1);
constexpr long k9_26_0 = openwam::cudnn_version(9, 26, 0);
constexpr long kTooNew = openwam::kNewestKnownCudnn + 1;

int64_t backend(at::SDPBackend b) { return static_cast<int64_t>(b); }

// A stack posed for decide(); counts how often PyTorch's selector is asked.
struct PosedStack {
  long cudnn_version = k9_19_0;
  bool cuda_device = true;
  const char* cudnn_unavailable = nullptr;
  bool cudnn_sdp_enabled = true;
  bool math_sdp_enabled = true;
  bool other_sdp_enabled = true;
  int64_t choice = backend(at::SDPBackend::cudnn_attention);
  bool serves_without_cudnn = true;  // another enabled backend takes the call
  int calls = 0;
  int serves_calls = 0;

  Decision decide(const Inputs& in, const Settings& settings) {
    const auto selector = [this]() -> int64_t {
      ++calls;
      return choice;
    };
    const auto serves = [this]() -> bool {
      ++serves_calls;
      return serves_without_cudnn;
    };
    openwam::Stack stack;
    stack.cudnn_version = cudnn_version;
    stack.cuda_device = cuda_device;
    stack.cudnn_unavailable = cudnn_unavailable;
    stack.cudnn_sdp_enabled = cudnn_sdp_enabled;
    stack.math_sdp_enabled = math_sdp_enabled;
    stack.other_sdp_enabled = other_sdp_enabled;
    stack.pytorch_choice = selector;
    stack.serves_without_cudnn = serves;
    return openwam::decide(in.call(), settings, stack);
  }
};

Settings settings(CudnnPreference cudnn, PadMode pad = PadMode::kAuto) {
  Settings s;
  s.cudnn = cudnn;
  s.pad = pad;
  return s;
}

const Settings kFollow = settings(CudnnPreference::kFollowPyTorch);
const Settings kPrefer = settings(CudnnPreference::kPrefer);
const Settings kNever = settings(CudnnPreference::kNever);

std::string rule_of(const Decision& d) {
  return d.rule == nullptr ? std::string("<none>") : std::string(d.rule->name);
}

// A differentiated call that 9.19.0 hits with the key-tail defect.
Inputs key_tail_call() { return bhsd(2, 4, 8, 320, 64); }

// `in` with a bool key mask [B, 1, 1, S] that keeps every key.
Inputs masked(Inputs in) {
  in.attn_mask = at::ones({in.query.size(0), 1, 1, in.key.size(-2)}, at::kBool);
  return in;
}

}  // namespace

TEST_CASE("decide: route names", "[decision]") {
  CHECK(std::string(openwam::to_string(Route::kCudnn)) == "cudnn");
  CHECK(std::string(openwam::to_string(Route::kPyTorch)) == "pytorch");
  CHECK(std::string(openwam::to_string(Route::kPyTorchWithoutCudnn)) ==
        "pytorch_without_cudnn");
  CHECK(std::string(openwam::to_string(Route::kMath)) == "math");
}

TEST_CASE("decide: following PyTorch, it picks cuDNN: the guarded cuDNN path",
          "[decision]") {
  const Inputs in = key_tail_call();
  PosedStack stack;
  const Decision d = stack.decide(in, kFollow);
  CHECK(d.route == Route::kCudnn);
  CHECK(stack.calls == 1);
  CHECK(std::string(d.pytorch_choice) == "cudnn_attention");
  CHECK(std::string(d.reason) == "PyTorch picks cuDNN");
  CHECK(d.plan.to_string() == "padding_mask+pad_keys_backward");
  CHECK(rule_of(d) == "key_tail_nan_dq_9.19");
}

TEST_CASE("decide: following PyTorch, it picks another backend: PyTorch untouched",
          "[decision]") {
  const Inputs in = key_tail_call();
  struct Case {
    at::SDPBackend backend;
    const char* name;
  };
  for (const Case c : {Case{at::SDPBackend::math, "math"},
                       Case{at::SDPBackend::flash_attention, "flash_attention"},
                       Case{at::SDPBackend::efficient_attention, "efficient_attention"},
                       Case{at::SDPBackend::overrideable, "overrideable"},
                       Case{at::SDPBackend::error, "error"}}) {
    CAPTURE(c.name);
    PosedStack stack;
    stack.choice = backend(c.backend);
    const Decision d = stack.decide(in, kFollow);
    CHECK(d.route == Route::kPyTorch);
    CHECK(stack.calls == 1);
    CHECK(std::string(d.pytorch_choice) == c.name);
    CHECK(std::string(d.reason) == "PyTorch picks another backend");
    CHECK(d.plan.none());
    CHECK(d.rule == nullptr);
  }
}

TEST_CASE("decide: OPENWAM_SDPA_CUDNN=1 takes cuDNN without asking PyTorch",
          "[decision]") {
  const Inputs in = key_tail_call();
  for (const int64_t choice : {backend(at::SDPBackend::flash_attention),
                               backend(at::SDPBackend::cudnn_attention)}) {
    CAPTURE(choice);
    PosedStack stack;
    stack.choice = choice;
    const Decision d = stack.decide(in, kPrefer);
    CHECK(d.route == Route::kCudnn);
    CHECK(stack.calls == 0);
    CHECK_THAT(std::string(d.pytorch_choice), StartsWith("not asked"));
    CHECK(std::string(d.reason) == "OPENWAM_SDPA_CUDNN=1 and cuDNN can serve");
    CHECK(d.plan.to_string() == "padding_mask+pad_keys_backward");
    CHECK(rule_of(d) == "key_tail_nan_dq_9.19");
  }
}

TEST_CASE("decide: OPENWAM_SDPA_CUDNN=1 honours cuDNN SDPA switched off", "[decision]") {
  const Inputs in = key_tail_call();
  PosedStack stack;
  stack.cudnn_sdp_enabled = false;
  const Decision d = stack.decide(in, kPrefer);
  CHECK(d.route == Route::kPyTorch);
  CHECK(stack.calls == 0);
  CHECK_THAT(std::string(d.reason), Contains("switched off"));
  CHECK(d.plan.none());
  CHECK(d.rule == nullptr);
}

TEST_CASE("decide: OPENWAM_SDPA_CUDNN=0 never takes cuDNN and never asks", "[decision]") {
  for (const Inputs& in : {key_tail_call(), bhsd(2, 4, 8, 320, 12)}) {
    PosedStack stack;
    const Decision d = stack.decide(in, kNever);
    CHECK(d.route == Route::kPyTorchWithoutCudnn);
    CHECK(stack.calls == 0);
    CHECK(std::string(d.reason) == "OPENWAM_SDPA_CUDNN=0");
    CHECK(d.plan.none());
    CHECK(d.rule == nullptr);
  }
}

TEST_CASE("decide: cuDNN unavailable on the device: PyTorch, not asked", "[decision]") {
  const Inputs in = key_tail_call();
  for (const Settings& s : {kFollow, kPrefer}) {
    PosedStack stack;
    stack.cudnn_unavailable = "inputs are not on a CUDA device";
    const Decision d = stack.decide(in, s);
    CHECK(d.route == Route::kPyTorch);
    CHECK(stack.calls == 0);
    CHECK(std::string(d.reason) == "inputs are not on a CUDA device");
    CHECK(std::string(d.pytorch_choice) == "not asked");
    CHECK(d.plan.none());
  }
}

TEST_CASE("decide: inputs batched by torch.func.vmap: math on CUDA, else PyTorch, not asked",
          "[decision]") {
  // A BatchedTensorImpl, as torch.func.vmap hands the op its inputs.
  Inputs in = key_tail_call();
  in.value = at::functorch::makeBatched(in.value, 0, /*level=*/1);
  for (const Settings& s : {kFollow, kPrefer, kNever}) {
    PosedStack stack;
    Decision d = stack.decide(in, s);
    CHECK(d.route == Route::kMath);  // stock's fused CUDA backwards are wrong under vmap
    CHECK_THAT(d.reason, Contains("torch.func.vmap"));
    stack.math_sdp_enabled = false;  // the user switched math off: cuDNN off instead
    d = stack.decide(in, s);
    CHECK(d.route == Route::kPyTorchWithoutCudnn);
    CHECK_THAT(d.reason, Contains("torch.func.vmap"));
    stack.other_sdp_enabled = false;  // cuDNN the only backend: the user's to have
    CHECK(stack.decide(in, s).route == Route::kPyTorch);
    stack.other_sdp_enabled = true;
    stack.math_sdp_enabled = true;
    Inputs int_mask = in;  // a mask PyTorch rejects: its route, and its error
    int_mask.attn_mask = at::ones({8, 320}, at::kInt);
    CHECK(stack.decide(int_mask, s).route == Route::kPyTorchWithoutCudnn);
    in.dropout_p = 0.1;  // dropout keeps PyTorch's own randomness under vmap
    CHECK(stack.decide(in, s).route == Route::kPyTorchWithoutCudnn);
    in.dropout_p = 0.0;
    stack.cuda_device = false;  // CPU: PyTorch's own batching, untouched
    stack.cudnn_unavailable = "inputs are not on a CUDA device";
    CHECK(stack.decide(in, s).route == Route::kPyTorch);
    CHECK(stack.calls == 0);
  }
}

// From torch 2.13 PyTorch answers every empty call itself (decision.cpp):
// the route the math backend takes before it.
constexpr Route kEmptyCpuRoute =
    TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
        ? Route::kPyTorch
        : Route::kMath;

TEST_CASE("decide: empty CPU inputs, PyTorch's math backend before torch 2.13 and PyTorch "
          "from it, whatever the settings",
          "[decision]") {
  // torch 2.11's fused CPU kernel dies of SIGFPE on zero heads (pytorch
  // #174939); an empty call has nothing for a fused kernel to do. Where the
  // math backend is switched off (sdpa_kernel), PyTorch answers the call.
  const std::vector<std::vector<int64_t>> q_kv_shapes[] = {
      {{0, 2, 3, 8}, {0, 2, 5, 8}},  // empty batch
      {{1, 0, 3, 8}, {1, 0, 5, 8}},  // zero heads
      {{1, 2, 0, 8}, {1, 2, 5, 8}},  // zero-length query
      {{1, 2, 3, 8}, {1, 2, 0, 8}},  // zero-length keys
      {{1, 2, 3, 0}, {1, 2, 5, 0}},  // zero head_dim
  };
  for (const auto& shapes : q_kv_shapes) {
    for (const Settings& s : {kFollow, kPrefer, kNever,
                              settings(CudnnPreference::kFollowPyTorch, PadMode::kAlways)}) {
      CAPTURE(shapes[0], shapes[1], openwam::to_string(s.cudnn), openwam::to_string(s.pad));
      Inputs in;
      in.query = at::randn(shapes[0], openwam_test::kBF16).requires_grad_(true);
      in.key = at::randn(shapes[1], openwam_test::kBF16).requires_grad_(true);
      in.value = at::randn(shapes[1], openwam_test::kBF16).requires_grad_(true);
      PosedStack stack;
      const Decision d = stack.decide(in, s);
      CHECK(d.route == kEmptyCpuRoute);
      CHECK(stack.calls == 0);
      CHECK_THAT(std::string(d.reason), Contains("empty"));
      CHECK(d.plan.none());
      PosedStack no_math;
      no_math.math_sdp_enabled = false;
      CHECK(no_math.decide(in, s).route == Route::kPyTorch);
    }
  }
  // Grouped-query attention over zero key/value heads: the math backend's
  // head grouping divides by their count (SIGFPE), PyTorch's fused CPU kernel
  // answers (torch 2.13). Without it, zero heads everywhere are the math
  // backend's; query heads over none are not a shape it takes (F.sdpa's).
  for (const std::vector<int64_t>& q_shape :
       {std::vector<int64_t>{1, 0, 3, 8}, std::vector<int64_t>{1, 2, 3, 8}}) {
    Inputs gqa;
    gqa.query = at::randn(q_shape, openwam_test::kBF16);
    gqa.key = at::randn({1, 0, 5, 8}, openwam_test::kBF16);
    gqa.value = at::randn({1, 0, 5, 8}, openwam_test::kBF16);
    PosedStack stack;
    CHECK(stack.decide(gqa, kFollow).route ==
          (q_shape[1] == 0 ? kEmptyCpuRoute : Route::kPyTorch));
    gqa.enable_gqa = true;
    CHECK(stack.decide(gqa, kFollow).route == Route::kPyTorch);
  }
  // Shapes the math backend refuses, which PyTorch's fused CPU kernel answers
  // for an empty call (torch 2.13): PyTorch's, zero heads or not. Its fused
  // kernel takes only shapes the math backend takes, so torch 2.11's SIGFPE
  // there is not met (found in review).
  {
    Inputs bad_mask = bhsd(0, 2, 3, 5, 8);
    bad_mask.attn_mask = at::zeros({7, 9});
    Inputs more_heads = bhsd(0, 2, 3, 5, 8);
    more_heads.query = at::randn({0, 4, 3, 8}, openwam_test::kBF16);
    Inputs ungrouped = more_heads;
    ungrouped.query = at::randn({0, 3, 3, 8}, openwam_test::kBF16);
    ungrouped.enable_gqa = true;
    for (const Inputs& in : {bad_mask, more_heads, ungrouped}) {
      CAPTURE(in.query.sizes(), in.key.sizes());
      PosedStack stack;
      CHECK(stack.decide(in, kFollow).route == Route::kPyTorch);
    }
    more_heads.enable_gqa = true;  // 4 query heads over 2: math takes them
    PosedStack stack;
    CHECK(stack.decide(more_heads, kFollow).route == kEmptyCpuRoute);
    Inputs no_query_heads = more_heads;  // batch 1 against 0: not the math backend's
    no_query_heads.query = at::randn({1, 0, 3, 8}, openwam_test::kBF16);
    no_query_heads.enable_gqa = false;
    CHECK(stack.decide(no_query_heads, kFollow).route == Route::kPyTorch);
    Inputs zero_heads_bad_mask = bad_mask;  // zero heads, a mask that does not broadcast
    zero_heads_bad_mask.query = at::randn({0, 0, 3, 8}, openwam_test::kBF16);
    zero_heads_bad_mask.key = zero_heads_bad_mask.value = at::randn({0, 0, 5, 8},
                                                                   openwam_test::kBF16);
    CHECK(stack.decide(zero_heads_bad_mask, kFollow).route == Route::kPyTorch);
  }
  // Empty and invalid: PyTorch itself, to raise its own error.
  Inputs bad;
  bad.query = at::randn({0, 2, 3, 8}, openwam_test::kBF16);
  bad.key = at::randn({0, 2, 5, 8}, openwam_test::kF16);
  bad.value = at::randn({0, 2, 5, 8}, openwam_test::kBF16);
  PosedStack stack;
  const Decision d = stack.decide(bad, kFollow);
  CHECK(d.route == Route::kPyTorch);
  CHECK(stack.calls == 0);
  CHECK_THAT(std::string(d.reason), Contains("empty"));
}

TEST_CASE("decide: inputs the cuDNN path rejects, cuDNN the only backend allowed",
          "[decision]") {
  // sdpa_kernel(CUDNN_ATTENTION): the call is PyTorch's as it is, as F.sdpa
  // would run it (switching cuDNN off would leave no backend and raise).
  const Inputs in = bhsd(2, 4, 8, 320, 12);
  PosedStack stack;
  stack.other_sdp_enabled = false;
  const Decision d = stack.decide(in, kFollow);
  CHECK(d.route == Route::kPyTorch);
}

TEST_CASE("decide: inputs the cuDNN path rejects, math off, no other backend takes them",
          "[decision]") {
  // sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION]) with inputs flash
  // refuses: switching cuDNN off would raise "No available kernel" where
  // F.sdpa runs on cuDNN. The call is PyTorch's as it is.
  const Inputs in = bhsd(2, 4, 8, 320, 12);
  PosedStack stack;
  stack.math_sdp_enabled = false;
  stack.serves_without_cudnn = false;
  CHECK(stack.decide(in, kFollow).route == Route::kPyTorch);
  CHECK(stack.serves_calls == 1);
  stack.serves_without_cudnn = true;  // flash takes them: cuDNN off
  CHECK(stack.decide(in, kFollow).route == Route::kPyTorchWithoutCudnn);
  // Math on serves whatever passes PyTorch's checks: not asked.
  PosedStack with_math;
  with_math.serves_without_cudnn = false;
  CHECK(with_math.decide(in, kFollow).route == Route::kPyTorchWithoutCudnn);
  CHECK(with_math.serves_calls == 0);
  // Under vmap stock cuDNN's gradients are wrong: cuDNN goes off, and where
  // nothing else takes the call PyTorch raises "No available kernel".
  Inputs batched = key_tail_call();
  batched.value = at::functorch::makeBatched(batched.value, 0, /*level=*/1);
  batched.dropout_p = 0.1;
  stack.serves_without_cudnn = false;
  CHECK(stack.decide(batched, kFollow).route == Route::kPyTorchWithoutCudnn);
}

TEST_CASE("decide: a guard rule against a crash keeps cuDNN off even with no other backend",
          "[decision]") {
  // bhsq1_backward_plan_segfault: PyTorch's "No available kernel" error
  // rather than a segfault, where cuDNN is the only backend left.
  PosedStack stack;
  stack.cudnn_version = k9_26_0;
  stack.math_sdp_enabled = false;
  stack.serves_without_cudnn = false;
  const Decision d = stack.decide(bhsd(1, 1, 1, 300, 64), kFollow);
  CHECK(d.route == Route::kPyTorchWithoutCudnn);
  CHECK(rule_of(d) == "bhsq1_backward_plan_segfault");
}

TEST_CASE("decide: inputs the cuDNN path rejects", "[decision]") {
  // head_dim 12 is not a multiple of 8: the path cannot take it.
  const Inputs in = bhsd(2, 4, 8, 320, 12);
  SECTION("differentiated, PyTorch picks cuDNN: PyTorch without cuDNN") {
    for (const Settings& s : {kFollow, kPrefer}) {
      PosedStack stack;
      const Decision d = stack.decide(in, s);
      CHECK(d.route == Route::kPyTorchWithoutCudnn);
      CHECK(stack.calls == 1);
      CHECK(std::string(d.pytorch_choice) == "cudnn_attention");
      CHECK_THAT(std::string(d.reason), Contains("cannot take these inputs"));
      CHECK(d.plan.none());
      CHECK(d.rule == nullptr);
    }
  }
  SECTION("differentiated, PyTorch picks another backend: PyTorch untouched") {
    PosedStack stack;
    stack.choice = backend(at::SDPBackend::math);
    const Decision d = stack.decide(in, kFollow);
    CHECK(d.route == Route::kPyTorch);
    CHECK(stack.calls == 1);
    CHECK(std::string(d.pytorch_choice) == "math");
    CHECK(std::string(d.reason) == "head_dim is not a multiple of 8 up to 256");
  }
  SECTION("not differentiated: PyTorch untouched, not asked") {
    // cuDNN's forward has no known defect.
    const Inputs no_grad = bhsd(2, 4, 8, 320, 12, openwam_test::kBF16, false);
    PosedStack stack;
    Decision d = stack.decide(no_grad, kFollow);
    CHECK(d.route == Route::kPyTorch);
    CHECK(stack.calls == 0);
    CHECK(std::string(d.pytorch_choice) == "not asked");
    CHECK(std::string(d.reason) == "head_dim is not a multiple of 8 up to 256");
    at::AutoGradMode grad_off(false);
    d = stack.decide(in, kFollow);
    CHECK(d.route == Route::kPyTorch);
    CHECK(stack.calls == 0);
  }
  SECTION("not differentiated, with dropout: PyTorch without cuDNN, as when differentiated") {
    // Reentrant checkpointing runs the forward under no_grad, then again with
    // grad: one backend must draw both dropout patterns.
    Inputs no_grad = bhsd(2, 4, 8, 320, 64, openwam_test::kBF16, false);
    no_grad.dropout_p = 0.3;  // not a multiple of 1/16: the cuDNN path refuses it
    PosedStack stack;
    const Decision d = stack.decide(no_grad, kFollow);
    CHECK(d.route == Route::kPyTorchWithoutCudnn);
    CHECK(stack.calls == 1);
    CHECK_THAT(std::string(d.reason), Contains("cannot take these inputs"));
  }
  SECTION("inputs PyTorch rejects reach PyTorch untouched, not asked") {
    Inputs bad = bhsd(2, 4, 8, 320, 64);
    bad.key = bad.key.detach().to(at::kHalf).requires_grad_(true);
    PosedStack stack;
    const Decision d = stack.decide(bad, kFollow);
    CHECK(d.route == Route::kPyTorch);
    CHECK(stack.calls == 0);
    CHECK(std::string(d.reason) == "inputs differ in dtype");

    Inputs bad_mask = bhsd(2, 4, 8, 320, 64);
    bad_mask.attn_mask = at::zeros({8, 320}, at::kInt);
    const Decision dm = stack.decide(bad_mask, kFollow);
    CHECK(dm.route == Route::kPyTorch);
    CHECK(stack.calls == 0);
  }
}

TEST_CASE("decide: not differentiated: stock cuDNN, no plan", "[decision]") {
  // Batch 1, one query row, s_kv % 128 == 64 on 9.19.0: every backward rule
  // would fire if the call were differentiated.
  const Inputs no_grad = bhsd(1, 1, 1, 320, 64, openwam_test::kBF16, false);
  const Inputs grad = bhsd(1, 1, 1, 320, 64);
  for (const Settings& s : {kFollow, kPrefer,
                            settings(CudnnPreference::kFollowPyTorch, PadMode::kAlways)}) {
    for (long version : {k9_19_0, k9_25_1}) {
      CAPTURE(openwam::to_string(s.cudnn), openwam::to_string(s.pad), version);
      PosedStack stack;
      stack.cudnn_version = version;
      Decision d = stack.decide(no_grad, s);
      CHECK(d.route == Route::kCudnn);
      CHECK(d.plan.none());
      CHECK(d.rule == nullptr);
      {
        at::AutoGradMode grad_off(false);
        d = stack.decide(grad, s);
        CHECK(d.route == Route::kCudnn);
        CHECK(d.plan.none());
        CHECK(d.rule == nullptr);
      }
      {
        c10::InferenceMode inference;
        d = stack.decide(grad, s);
        CHECK(d.route == Route::kCudnn);
        CHECK(d.plan.none());
      }
    }
  }
}

TEST_CASE("decide: not differentiated, with dropout: the plan a differentiated call takes",
          "[decision]") {
  // Reentrant activation checkpointing runs the forward under no_grad and
  // recomputes it with grad: both must draw the same dropout pattern, so the
  // forward's plan (pad_keys_forward on the ATen fallback) cannot depend on
  // the grad mode.
  Inputs no_grad = bhsd(2, 4, 8, 320, 64, openwam_test::kBF16, false);
  Inputs grad = bhsd(2, 4, 8, 320, 64);
  no_grad.dropout_p = grad.dropout_p = 0.25;
  PosedStack stack;
  const Decision trained = stack.decide(grad, kFollow);
  CHECK(trained.plan.to_string() == "padding_mask+pad_keys_forward");
  Decision d = stack.decide(no_grad, kFollow);
  CHECK(d.route == Route::kCudnn);
  CHECK(d.plan == trained.plan);
  CHECK(rule_of(d) == rule_of(trained));
  {
    at::AutoGradMode grad_off(false);
    d = stack.decide(grad, kFollow);
    CHECK(d.route == Route::kCudnn);
    CHECK(d.plan == trained.plan);
  }
  // Without dropout the same call takes no plan (the case above).
  no_grad.dropout_p = 0.0;
  CHECK(stack.decide(no_grad, kFollow).plan.none());
}

TEST_CASE("decide: a differentiated call needs only one input requiring grad",
          "[decision]") {
  Inputs in = bhsd(2, 4, 8, 320, 64, openwam_test::kBF16, false);
  in.value.requires_grad_(true);
  PosedStack stack;
  CHECK(stack.decide(in, kFollow).plan.to_string() == "padding_mask+pad_keys_backward");
}

TEST_CASE("decide: a guard rule keeps the call off cuDNN, in every pad mode",
          "[decision]") {
  // cuDNN 9.25.1+ segfaults building the backward plan for batch = heads =
  // s_q = 1 (cudnn-frontend #1071).
  Inputs three_d;  // 3-D [N, L, E] counts as one head
  three_d.query = at::randn({1, 1, 64}, openwam_test::kBF16).requires_grad_(true);
  three_d.key = at::randn({1, 300, 64}, openwam_test::kBF16).requires_grad_(true);
  three_d.value = at::randn({1, 300, 64}, openwam_test::kBF16).requires_grad_(true);
  for (const Inputs& in : {bhsd(1, 1, 1, 300, 64), bhsd(1, 1, 1, 256, 64), three_d}) {
    for (PadMode pad : {PadMode::kAuto, PadMode::kAlways, PadMode::kNever}) {
      for (CudnnPreference pref :
           {CudnnPreference::kFollowPyTorch, CudnnPreference::kPrefer}) {
        for (long version : {k9_25_1, k9_26_0, openwam::kNewestKnownCudnn}) {
          CAPTURE(in.query.sizes(), in.key.sizes(), openwam::to_string(pad),
                  openwam::to_string(pref), version);
          PosedStack stack;
          stack.cudnn_version = version;
          const Decision d = stack.decide(in, settings(pref, pad));
          CHECK(d.route == Route::kPyTorchWithoutCudnn);
          CHECK(rule_of(d) == "bhsq1_backward_plan_segfault");
          CHECK(std::string(d.reason) == "a guard rule keeps this call off cuDNN");
          CHECK(d.plan.none());
        }
      }
    }
  }
  // Before 9.25.1, or with two heads, the same call stays on cuDNN.
  PosedStack old_stack;
  CHECK(old_stack.decide(bhsd(1, 1, 1, 300, 64), kFollow).route == Route::kCudnn);
  PosedStack new_stack;
  new_stack.cudnn_version = k9_25_1;
  CHECK(new_stack.decide(bhsd(1, 2, 1, 300, 64), kFollow).route == Route::kCudnn);
}

TEST_CASE("decide: OPENWAM_SDPA_PAD=auto takes the guard table's plan", "[decision]") {
  struct Case {
    Inputs in;
    long version;
    const char* plan;
    const char* rule;
  };
  Inputs dropout = bhsd(2, 4, 8, 320, 64);
  dropout.dropout_p = 0.25;
  Inputs causal = bhsd(2, 4, 8, 320, 64);
  causal.is_causal = true;
  const Case cases[] = {
      {bhsd(2, 4, 8, 320, 64), k9_19_0, "padding_mask+pad_keys_backward",
       "key_tail_nan_dq_9.19"},
      {dropout, k9_19_0, "padding_mask+pad_keys_forward", "key_tail_nan_dq_9.19"},
      {causal, k9_19_0, "none", "<none>"},                     // measured clean
      {bhsd(2, 4, 8, 300, 64), k9_19_0, "none", "<none>"},     // r != 64
      {bhsd(2, 4, 8, 300, 96), k9_19_0, "padding_mask+pad_keys_backward", "key_tail_nan_dq"},
      {masked(bhsd(2, 4, 8, 320, 64)), k9_19_0, "shift_scores", "key_tail_nan_dq_9.19"},
      {masked(dropout), k9_19_0, "shift_scores", "key_tail_nan_dq_9.19"},
      {bhsd(2, 4, 8, 300, 64), k9_25_1, "padding_mask+pad_keys_backward", "key_tail_nan_dq"},
      {bhsd(2, 4, 8, 300, 64), k9_26_0, "none", "<none>"},     // fixed
      {bhsd(1, 4, 1, 256, 64), k9_19_0, "padding_mask+pad_query_backward",
       "sq1_nan_dk_dv_9.19"},
      {bhsd(1, 4, 1, 320, 64), k9_19_0, "padding_mask+pad_keys_backward+pad_query_backward",
       "key_tail_nan_dq_9.19"},
      {bhsd(1, 4, 1, 300, 64), k9_26_0, "padding_mask+pad_query_backward", "sq1_nan_dk_dv"},
      // Newer than the table knows: no fix known for one query row, so it stays.
      {bhsd(1, 4, 1, 300, 64), kTooNew, "padding_mask+pad_query_backward", "sq1_nan_dk_dv"},
      {bhsd(2, 4, 8, 320, 64), kTooNew, "none", "<none>"},  // the key tail: fixed in 9.26
      {bhsd(2, 8, 8, 320, 64, openwam_test::kBF16, true, 2), k9_19_0,
       "padding_mask+pad_keys_backward", "key_tail_nan_dq_9.19"},  // GQA
  };
  for (const Case& c : cases) {
    CAPTURE(c.in.query.sizes(), c.in.key.sizes(), c.in.dropout_p, c.in.is_causal,
            c.version);
    for (const Settings& s : {kFollow, kPrefer}) {
      PosedStack stack;
      stack.cudnn_version = c.version;
      const Decision d = stack.decide(c.in, s);
      CHECK(d.route == Route::kCudnn);
      CHECK(d.plan.to_string() == c.plan);
      CHECK(rule_of(d) == c.rule);
    }
  }
}

TEST_CASE("decide: OPENWAM_SDPA_PAD=always: the padding mask on every backward, the "
          "fallback's padded keys on every unaligned key length",
          "[decision]") {
  const Settings always = settings(CudnnPreference::kFollowPyTorch, PadMode::kAlways);
  Inputs dropout = bhsd(2, 4, 8, 300, 64);
  dropout.dropout_p = 0.25;
  struct Case {
    Inputs in;
    long version;
    const char* plan;
    const char* rule;
  };
  const Case cases[] = {
      // Unaffected versions and shapes take the fix too, with no rule to warn.
      {bhsd(2, 4, 8, 300, 64), k9_19_0, "padding_mask+pad_keys_backward", "<none>"},
      {bhsd(2, 4, 8, 300, 64), kTooNew, "padding_mask+pad_keys_backward", "<none>"},
      {dropout, k9_26_0, "padding_mask+pad_keys_forward", "<none>"},
      // A key-tail row's plan is the same; the rule still warns.
      {bhsd(2, 4, 8, 320, 64), k9_19_0, "padding_mask+pad_keys_backward",
       "key_tail_nan_dq_9.19"},
      // A multiple of 128: the padding mask, no keys for the fallback to pad.
      {bhsd(2, 4, 8, 256, 64), k9_19_0, "padding_mask", "<none>"},
      {bhsd(2, 4, 8, 256, 64), kTooNew, "padding_mask", "<none>"},
      // The single-row fix is kept.
      {bhsd(1, 4, 1, 256, 64), k9_19_0, "padding_mask+pad_query_backward",
       "sq1_nan_dk_dv_9.19"},
      {bhsd(1, 4, 1, 300, 64), k9_19_0, "padding_mask+pad_keys_backward+pad_query_backward",
       "sq1_nan_dk_dv_9.19"},
      // A bool mask: the score shift, key tail or not.
      {masked(bhsd(2, 4, 8, 320, 64)), k9_19_0, "shift_scores", "key_tail_nan_dq_9.19"},
      {masked(bhsd(2, 4, 8, 256, 64)), k9_19_0, "shift_scores", "<none>"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.in.query.sizes(), c.in.key.sizes(), c.in.dropout_p, c.version);
    PosedStack stack;
    stack.cudnn_version = c.version;
    const Decision d = stack.decide(c.in, always);
    CHECK(d.route == Route::kCudnn);
    CHECK(d.plan.to_string() == c.plan);
    CHECK(rule_of(d) == c.rule);
  }
}

TEST_CASE("decide: OPENWAM_SDPA_PAD=never: no fix, no rule", "[decision]") {
  const Settings never = settings(CudnnPreference::kFollowPyTorch, PadMode::kNever);
  Inputs dropout = bhsd(2, 4, 8, 320, 64);
  dropout.dropout_p = 0.25;
  for (const Inputs& in : {bhsd(2, 4, 8, 320, 64), dropout, bhsd(1, 4, 1, 320, 64)}) {
    CAPTURE(in.query.sizes(), in.dropout_p);
    PosedStack stack;
    const Decision d = stack.decide(in, never);
    CHECK(d.route == Route::kCudnn);
    CHECK(d.plan.none());
    CHECK(d.rule == nullptr);
  }
}

TEST_CASE("decide: the selector is asked at most once, only where needed",
          "[decision]") {
  struct Case {
    const char* what;
    Settings settings;
    Inputs in;
    const char* unavailable;
    int calls;
  };
  const Case cases[] = {
      {"follow, valid", kFollow, key_tail_call(), nullptr, 1},
      {"follow, rejected, differentiated", kFollow, bhsd(2, 4, 8, 320, 12), nullptr, 1},
      {"follow, rejected, no grad", kFollow,
       bhsd(2, 4, 8, 320, 12, openwam_test::kBF16, false), nullptr, 0},
      {"follow, unavailable", kFollow, key_tail_call(), "no cuDNN", 0},
      {"prefer, valid", kPrefer, key_tail_call(), nullptr, 0},
      {"prefer, rejected, differentiated", kPrefer, bhsd(2, 4, 8, 320, 12), nullptr, 1},
      {"prefer, unavailable", kPrefer, key_tail_call(), "no cuDNN", 0},
      {"never", kNever, key_tail_call(), nullptr, 0},
      {"never, rejected", kNever, bhsd(2, 4, 8, 320, 12), nullptr, 0},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    PosedStack stack;
    stack.cudnn_unavailable = c.unavailable;
    stack.decide(c.in, c.settings);
    CHECK(stack.calls == c.calls);
  }
}

TEST_CASE("decide: every decision gives a reason", "[decision]") {
  const Inputs inputs[] = {key_tail_call(), bhsd(2, 4, 8, 320, 12),
                           bhsd(1, 1, 1, 300, 64),
                           bhsd(2, 4, 8, 320, 64, openwam_test::kBF16, false)};
  for (const Inputs& in : inputs) {
    for (const Settings& s : {kFollow, kPrefer, kNever}) {
      for (long version : {k9_19_0, k9_25_1, kTooNew}) {
        for (int64_t choice : {backend(at::SDPBackend::cudnn_attention),
                               backend(at::SDPBackend::flash_attention)}) {
          PosedStack stack;
          stack.cudnn_version = version;
          stack.choice = choice;
          const Decision d = stack.decide(in, s);
          CAPTURE(in.query.sizes(), openwam::to_string(s.cudnn), version, choice,
                  openwam::to_string(d.route));
          REQUIRE(d.reason != nullptr);
          CHECK(std::string(d.reason).size() > 0);
          REQUIRE(d.pytorch_choice != nullptr);
          CHECK(std::string(d.pytorch_choice).size() > 0);
          // A plan only on the cuDNN path; a rule only with a plan or an
          // avoided call.
          if (d.route != Route::kCudnn) {
            CHECK(d.plan.none());
          }
          if (d.rule != nullptr) {
            CHECK((!d.plan.none() || d.route == Route::kPyTorchWithoutCudnn));
          }
        }
      }
    }
  }
}

TEST_CASE("decide with this process's stack: CPU inputs never take cuDNN",
          "[decision]") {
  const Inputs in = key_tail_call();
  at::AutoGradMode grad_on(true);
  REQUIRE(in.call().differentiated());
  for (auto pref : {CudnnPreference::kFollowPyTorch, CudnnPreference::kPrefer}) {
    for (auto pad : {PadMode::kAuto, PadMode::kAlways, PadMode::kNever}) {
      CAPTURE(openwam::to_string(pref), openwam::to_string(pad));
      const Decision d = openwam::decide(in.call(), settings(pref, pad));
      CHECK(d.route == Route::kPyTorch);
      CHECK(std::string(d.reason) == "inputs are not on a CUDA device");
      CHECK(std::string(d.pytorch_choice) == "not asked");
      CHECK(d.plan.none());
      CHECK(d.rule == nullptr);
    }
  }
  // No cuDNN to switch off on the CPU (the switch is process-wide, its flip
  // serialised): PyTorch as it is.
  CHECK(openwam::decide(in.call(), kNever).route == Route::kPyTorch);
  CHECK(std::string(openwam::decide(in.call(), kNever).reason) == "OPENWAM_SDPA_CUDNN=0");
}

#include "decision.h"

#include <ATen/Context.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <ATen/SDPBackend.h>
#ifdef OPENWAM_WITH_CUDA
#include <ATen/native/transformers/cuda/sdp_utils.h>
#endif
#include <torch/version.h>

#include "cudnn_attention.h"

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

constexpr int64_t kCudnnChoice = static_cast<int64_t>(at::SDPBackend::cudnn_attention);

Decision routed(Route route, const char* reason) {
  Decision d;
  d.route = route;
  d.reason = reason;
  return d;
}

// The plan for a differentiated cuDNN call under the OPENWAM_SDPA_PAD mode.
Plan plan_for(const GuardVerdict& verdict, const CallShape& shape, long cudnn_version,
              PadMode pad) {
  switch (pad) {
    case PadMode::kNever:
      return Plan{};
    case PadMode::kAlways: {
      // Every differentiated backward takes the fix, whether or not a rule
      // marks the call affected.
      Plan p = verdict.plan;
      if (score_shift_measured(shape, cudnn_version)) {
        p.shift_scores = true;
        return p;
      }
      p.padding_mask = true;
      if (shape.s_kv % kCudnnKeyTile != 0 && !p.pads_keys()) {
        (shape.dropout_p > 0.0 ? p.pad_keys_forward : p.pad_keys_backward) = true;
      }
      return p;
    }
    case PadMode::kAuto:
      return verdict.plan;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown PadMode");
}

// Whether PyTorch has a backend for the call with cuDNN switched off. Math
// serves whatever passes PyTorch's checks; with math switched off
// (sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION])) only flash's and
// efficient attention's checks know: a mask or dropout can leave cuDNN the
// one backend that takes the call, and switching it off would raise "No
// available kernel" where F.sdpa runs (found in review).
bool others_serve(const Stack& stack) {
  return stack.math_sdp_enabled || stack.serves_without_cudnn();
}

// Inputs batched by torch.func.vmap (functorch's BatchedTensorImpl).
bool batched(const SdpaCall& c) {
  const c10::DispatchKeySet keys({c10::DispatchKey::FuncTorchBatched,
                                  c10::DispatchKey::BatchedNestedTensor});
  const auto is = [&keys](const at::Tensor& t) { return t.key_set().has_any(keys); };
  return is(c.query) || is(c.key) || is(c.value) || (c.attn_mask && is(*c.attn_mask));
}

}  // namespace

TrainingPlan training_plan(const SdpaCall& call, long cudnn_version, PadMode pad) {
  const CallShape shape = shape_of(call);
  TrainingPlan t;
  t.verdict = check_guards(shape, cudnn_version);
  t.plan = plan_for(t.verdict, shape, cudnn_version, pad);
  return t;
}

const char* to_string(Route route) {
  switch (route) {
    case Route::kCudnn: return "cudnn";
    case Route::kPyTorch: return "pytorch";
    case Route::kPyTorchWithoutCudnn: return "pytorch_without_cudnn";
    case Route::kMath: return "math";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown Route");
}

Decision decide(const SdpaCall& call, const Settings& settings, const Stack& stack) {
  if (batched(call)) {
    // The cuDNN path's ops have no batching rule (vmap would loop per sample,
    // and warn); F.sdpa batches itself, and requires_grad does not show
    // through the batching. On CUDA, torch 2.11's fused backwards under vmap
    // are wrong: cuDNN's dQ/dK/dV (normalized error 1.0, NaN in dV when
    // causal) and efficient attention's causal backward raises ("LSE is not
    // correctly aligned"); measured on the H200. PyTorch's math backend
    // decomposes into batched matmuls and is right. Dropout keeps PyTorch's
    // own route (its randomness rules under vmap are the user's contract).
    // Inputs PyTorch rejects keep its route, and its error.
    if (stack.cuda_device && stack.math_sdp_enabled && call.dropout_p == 0.0 &&
        passes_pytorch_validation(call)) {
      return routed(Route::kMath,
                    "inputs batched by torch.func.vmap on CUDA: PyTorch's math backend "
                    "(stock's fused backwards are wrong under vmap)");
    }
    // Not others_serve(): where no other backend takes a batched call,
    // PyTorch's "No available kernel" beats stock cuDNN's wrong gradients.
    const bool cudnn_off = stack.cuda_device && stack.cudnn_unavailable == nullptr &&
                           stack.cudnn_sdp_enabled && stack.other_sdp_enabled;
    return cudnn_off ? routed(Route::kPyTorchWithoutCudnn,
                              "inputs batched by torch.func.vmap; cuDNN switched off")
                     : routed(Route::kPyTorch, "inputs batched by torch.func.vmap");
  }
  if (any_input_empty(call)) {
    // From torch 2.13, F.sdpa answers every empty call itself, rightly (a
    // head_dim-0 row is the mean of the values its mask shows), and its
    // answers differ between releases (a mask with is_causal: an empty
    // output on 2.13's CPU build, "Explicit attn_mask should not be set" on
    // 2.14 and 2.15): PyTorch's to answer (found in review: the math route
    // returned where 2.14 raises, raised where 2.13 returns, and built an
    // L x S causal mask for an empty batch).
    constexpr bool pytorch_answers_empty_calls =
        TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13);
    if (pytorch_answers_empty_calls) {
      return routed(Route::kPyTorch, "an input is empty");
    }
    // Before it, torch 2.11's fused CPU kernel dies of SIGFPE on zero heads
    // (measured on the H200 machine; pytorch #174939) and 2.12's returns
    // zeros at head_dim 0: empty CPU calls go to the math
    // backend where it is allowed and takes their shapes. Those the math
    // backend refuses are PyTorch's to answer: its fused CPU kernel takes only
    // shapes the math backend takes too (equal batch and head_dims, heads that
    // group, a mask that broadcasts), so F.sdpa runs them on the math backend
    // on torch 2.11 and answers them on 2.13 and later (review: 233 of 270
    // empty-call mismatches against F.sdpa came from sending them to the math
    // backend anyway). Nor grouped-query attention over zero key heads: the
    // math backend's head grouping divides by their count. Everything else
    // empty is PyTorch's to answer (its fused CUDA kernels refuse empty
    // sequences).
    const bool gqa_without_kv_heads =
        call.enable_gqa && call.key.dim() >= 3 && call.key.sym_size(-3) == 0;
    const bool math_serves = call.query.device().is_cpu() && stack.math_sdp_enabled &&
                             !gqa_without_kv_heads && passes_pytorch_validation(call) &&
                             math_takes_shapes(call);
    return math_serves
               ? routed(Route::kMath, "an empty CPU input: PyTorch's math backend")
               : routed(Route::kPyTorch, "an input is empty");
  }
  if (settings.cudnn == CudnnPreference::kNever) {
    // Off CUDA there is no cuDNN to switch off: flipping the process-wide
    // switch (under its mutex) would serialise threaded CPU calls for nothing.
    return routed(stack.cuda_device ? Route::kPyTorchWithoutCudnn : Route::kPyTorch,
                  "OPENWAM_SDPA_CUDNN=0");
  }

  const char* why_not =
      stack.cudnn_unavailable != nullptr ? stack.cudnn_unavailable : cudnn_rejects(call);
  if (why_not != nullptr) {
    Decision d = routed(Route::kPyTorch, why_not);
    // Inputs PyTorch would still send to stock cuDNN (and its defects) go
    // elsewhere when they will be differentiated and another backend is
    // allowed; where cuDNN is the only one that takes them (sdpa_kernel),
    // the call is the user's to have, as F.sdpa would run it. A call with
    // dropout goes elsewhere whatever the grad mode: reentrant
    // checkpointing's two forwards must run on one backend to draw one
    // dropout pattern.
    if (stack.cudnn_unavailable == nullptr && call.takes_training_forward() &&
        stack.other_sdp_enabled && passes_pytorch_validation(call)) {
      const int64_t choice = stack.pytorch_choice();
      d.pytorch_choice = backend_name(choice);
      if (choice == kCudnnChoice && others_serve(stack)) {
        d.route = Route::kPyTorchWithoutCudnn;
        d.reason = "PyTorch picks cuDNN, but the guarded cuDNN path cannot take "
                   "these inputs; cuDNN is switched off for this call";
      }
    }
    return d;
  }

  Decision d;
  if (settings.cudnn == CudnnPreference::kPrefer) {
    d.pytorch_choice = "not asked (OPENWAM_SDPA_CUDNN=1)";
    if (!stack.cudnn_sdp_enabled) {
      return routed(Route::kPyTorch, "cuDNN SDPA is switched off (sdpa_kernel or "
                                     "torch.backends.cuda.enable_cudnn_sdp)");
    }
    d.reason = "OPENWAM_SDPA_CUDNN=1 and cuDNN can serve";
  } else {
    const int64_t choice = stack.pytorch_choice();
    d.pytorch_choice = backend_name(choice);
    if (choice != kCudnnChoice) {
      d.reason = "PyTorch picks another backend";
      return d;  // Route::kPyTorch
    }
    d.reason = "PyTorch picks cuDNN";
  }

  d.route = Route::kCudnn;
  if (!call.takes_training_forward()) {
    return d;  // the defects are backward-only: stock cuDNN's forward
  }
  const TrainingPlan t = training_plan(call, stack.cudnn_version, settings.pad);
  if (t.verdict.avoid != nullptr) {
    d.route = Route::kPyTorchWithoutCudnn;
    d.rule = t.verdict.avoid;
    d.reason = "a guard rule keeps this call off cuDNN";
    return d;
  }
  d.plan = t.plan;
  d.rule = d.plan.none() ? nullptr : t.verdict.first_hit;
  return d;
}

// PyTorch's selector reads only the tensors' metadata. Called with the
// Python keys excluded, it runs on fake tensors too without being seen by
// torch.compile's tracers: the choice is made here, not recorded in a graph
// (ATen's own scaled_dot_product_attention calls the selector's stub directly
// for the same reason; the stub is not exported to extensions). With
// functorch's keys excluded too, it reads a torch.func wrapper's metadata as
// the stub does: the op itself has no batching rule and raises under
// vmap(grad(f)).
namespace {
c10::DispatchKeySet untraced_keys() {
  return c10::DispatchKeySet(
      {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
       c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
       c10::DispatchKey::FuncTorchDynamicLayerBackMode, c10::DispatchKey::FuncTorchGradWrapper,
       c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchVmapMode});
}
}  // namespace

int64_t pytorch_choice(const SdpaCall& call) {
  const c10::impl::ExcludeDispatchKeyGuard untraced(untraced_keys());
  return at::_fused_sdp_choice(call.query, call.key, call.value, call.attn_mask, call.dropout_p,
                               call.is_causal, call.scale, call.enable_gqa);
}

bool pytorch_serves_without_cudnn(const SdpaCall& call) {
#ifdef OPENWAM_WITH_CUDA
  // The checks PyTorch's CUDA selector makes of flash and efficient
  // attention, each with its switch, asked without touching the switches
  // (the process-wide cuDNN switch flipped here would fail other threads'
  // calls meanwhile). They read only metadata: a 3-D call gets the batch
  // dim that torch 2.14's selector gives it, unseen by tracers (as in
  // pytorch_choice: the unsqueeze is no op of the call).
  const c10::impl::ExcludeDispatchKeyGuard untraced(untraced_keys());
  const auto batched = [](const at::Tensor& t) { return t.dim() == 3 ? t.unsqueeze(0) : t; };
  sdp::sdp_params params;
  params.query = batched(call.query);
  params.key = batched(call.key);
  params.value = batched(call.value);
  params.attn_mask = call.attn_mask;
  params.dropout = call.dropout_p;
  params.is_causal = call.is_causal;
  params.enable_gqa = call.enable_gqa;
  return sdp::can_use_flash_attention(params, /*debug=*/false) ||
         sdp::can_use_mem_efficient_attention(params, /*debug=*/false);
#else
  // No cuDNN in a CPU build: the question never comes up (decide() asks it
  // only of calls cuDNN could run).
  (void)call;
  return true;
#endif
}

Decision decide(const SdpaCall& call, const Settings& settings) {
  Stack stack;
  stack.cudnn_version = runtime_cudnn_version();
  stack.cuda_device = call.query.is_cuda();
  stack.cudnn_unavailable = cudnn_unavailable(call.query);
  const auto& ctx = at::globalContext();
  stack.cudnn_sdp_enabled = ctx.userEnabledCuDNNSDP();
  stack.math_sdp_enabled = ctx.userEnabledMathSDP();
  stack.other_sdp_enabled =
      ctx.userEnabledFlashSDP() || ctx.userEnabledMemEfficientSDP() || stack.math_sdp_enabled;
  const auto choice = [&call] { return pytorch_choice(call); };
  const auto serves = [&call] { return pytorch_serves_without_cudnn(call); };
  stack.pytorch_choice = choice;
  stack.serves_without_cudnn = serves;
  return decide(call, settings, stack);
}

}  // namespace openwam

// The decision, in one place, from the settings to the backend to the plan:
// does this call run on the guarded cuDNN path, and with which fix, or on
// PyTorch's own implementation? The op and explain() both call decide().
//
// It runs in C++ before any op is dispatched, also while torch.compile
// traces: nothing of it (PyTorch's selector included) is recorded in a graph,
// only the ops it chose.
#pragma once

#include <c10/util/FunctionRef.h>

#include <cstdint>

#include "guards.h"
#include "plan.h"
#include "sdpa_call.h"
#include "settings.h"

namespace openwam {

enum class Route {
  kCudnn,                // the guarded cuDNN path (cudnn_path.h)
  kPyTorch,              // at::scaled_dot_product_attention, untouched
  kPyTorchWithoutCudnn,  // the same with cuDNN switched off for the call
  kMath,                 // PyTorch's math backend: empty inputs, vmap on CUDA
};

const char* to_string(Route route);

struct Decision {
  Route route = Route::kPyTorch;
  Plan plan;  // the cuDNN path's fix (differentiated calls, and calls with dropout)
  const GuardRule* rule = nullptr;    // the guard rule that set the plan or the route
  const char* pytorch_choice = "not asked";  // PyTorch's own backend, by name
  const char* reason = "";            // why, in words
};

// What decide() reads beyond the call and the settings: facts of the process
// and the device, passed in so that a test can pose any stack.
struct Stack {
  long cudnn_version = 0;                  // runtime cuDNN, e.g. 91900; 0: none
  bool cuda_device = false;                // the inputs are on a CUDA device
  const char* cudnn_unavailable = nullptr; // why cuDNN cannot run here, or nullptr
  // PyTorch's backend switches (torch.backends.cuda.enable_*_sdp, sdpa_kernel).
  bool cudnn_sdp_enabled = true;
  bool math_sdp_enabled = true;
  bool other_sdp_enabled = true;           // flash, efficient or math
  // The backend PyTorch's own selector picks (an at::SDPBackend value). Asked
  // only where the decision needs it: it costs a pass through the selector.
  c10::function_ref<int64_t()> pytorch_choice;
  // Whether flash or efficient attention takes the call, by PyTorch's own
  // checks (their switches included). Asked only where math is switched off.
  c10::function_ref<bool()> serves_without_cudnn;
};

// The stack of this process for this call: the runtime cuDNN, the device,
// PyTorch's switches and its selector (the op at::_fused_sdp_choice, called
// with the Python dispatch keys excluded so that tracers do not record it;
// decision.cpp says why).
Decision decide(const SdpaCall& call, const Settings& settings);

Decision decide(const SdpaCall& call, const Settings& settings, const Stack& stack);

// The process's answers to Stack's two questions about PyTorch's backends.
int64_t pytorch_choice(const SdpaCall& call);
bool pytorch_serves_without_cudnn(const SdpaCall& call);

// What the guard table gives a differentiated cuDNN call of this shape on
// `cudnn_version`: its verdict (`avoid`: keep it off cuDNN) and the plan under
// the OPENWAM_SDPA_PAD mode. decide()'s answer on the cuDNN path, and the leaf
// op's for a call recorded without gradients (cudnn_path.cpp).
struct TrainingPlan {
  GuardVerdict verdict;
  Plan plan;
};
TrainingPlan training_plan(const SdpaCall& call, long cudnn_version, PadMode pad);

}  // namespace openwam

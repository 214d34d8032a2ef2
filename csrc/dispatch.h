// The dispatch decision: does this call run on cuDNN (through the shim) or on
// PyTorch's own selection? One place, so `explain()` and the op agree.
#pragma once

#include <string>

#include "guards.h"
#include "sdpa_inputs.h"
#include "settings.h"

namespace openwam {

struct Decision {
  bool use_cudnn = false;
  // The backend PyTorch itself would pick (at::_fused_sdp_choice), as a name.
  std::string pytorch_choice;
  // The fallback must keep PyTorch off cuDNN: either PyTorch would pick it but
  // we may not (OPENWAM_SDPA_CUDNN=0, a guard rule, or inputs our cuDNN call
  // cannot take), since stock cuDNN carries the defect.
  bool exclude_cudnn = false;
  // An input is empty: PyTorch's math backend computes the (empty or zero)
  // result. The fused CPU kernel of torch 2.11 dies of SIGFPE on zero heads
  // (measured on the H200 machine, 2026-11-30; pytorch #174939), and no fused
  // kernel has work to do.
  bool empty_input = false;
  Plan plan = Plan::kNone;
  const GuardRule* rule = nullptr;  // the guard rule that fired, if any
  std::string reason;               // why, in words
};

// Whether cuDNN can take these inputs through ATen's direct op, which skips
// every check F.sdpa's selector makes (DESIGN.md section 3). `why_not` gets
// the first reason it cannot.
bool cudnn_can_serve(const SdpaInputs& in, std::string* why_not);

Decision decide(const SdpaInputs& in, const Settings& settings);

}  // namespace openwam

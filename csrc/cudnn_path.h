// The guarded cuDNN path of openwam::sdpa (the counterpart of
// pytorch_path.h): the call's prologue (3-D inputs, the mask as cuDNN's
// bias), then the leaf op openwam::_cudnn_sdpa, whose autograd node calls
// openwam::_cudnn_sdpa_backward, where the plan's fix runs.
#pragma once

#include <ATen/ATen.h>

#include "decision.h"
#include "sdpa_call.h"

namespace openwam {

at::Tensor run_cudnn_path(const SdpaCall& call, const Decision& decision);

}  // namespace openwam

// Calls that do not run on the guarded cuDNN path go to PyTorch's own
// at::scaled_dot_product_attention (its selection, its kernels, its autograd,
// its errors), with cuDNN switched off where the decision says so.
#pragma once

#include <ATen/ATen.h>

#include "decision.h"
#include "sdpa_call.h"

namespace openwam {

at::Tensor run_pytorch_path(const SdpaCall& call, const Decision& decision);

}  // namespace openwam

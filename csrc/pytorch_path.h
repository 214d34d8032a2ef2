// Calls that do not run on cuDNN through the shim go to PyTorch's own
// at::scaled_dot_product_attention (its own backend choice and autograd).
#pragma once

#include <ATen/ATen.h>

#include "dispatch.h"
#include "sdpa_inputs.h"

namespace openwam {

at::Tensor run_pytorch_sdpa(const SdpaInputs& in, const Decision& decision);

}  // namespace openwam

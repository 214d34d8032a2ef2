// Dropout's seed and offset for a cuDNN graph, drawn from PyTorch's CUDA
// generator as ATen's cuDNN attention draws them, and written on the device
// so that a CUDA graph replay advances them (the generator's capture-safe
// philox state).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace openwam::frontend {

// Two 0-dim int64 tensors on `device` (seed, offset), the generator advanced
// by `increment` random values.
std::pair<at::Tensor, at::Tensor> dropout_seed_offset(const c10::Device& device,
                                                      uint64_t increment);

}  // namespace openwam::frontend

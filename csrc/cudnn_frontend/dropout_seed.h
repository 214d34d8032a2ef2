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

// A backward's check of the seed and offset it binds for its kernel: the
// forward's, one int64 each on `device`. Only a direct call of a private
// backward op passes others (host tensors would reach the kernel).
inline void check_seed_offset(const char* op, const at::Tensor& seed, const at::Tensor& offset,
                              const c10::Device& device) {
  for (const at::Tensor* t : {&seed, &offset}) {
    TORCH_CHECK(t->device() == device && t->scalar_type() == at::kLong && t->numel() == 1, op,
                ": the dropout seed and offset must be the forward's (one int64 each on ",
                device, "), got ", t->scalar_type(), " of ", t->numel(), " elements on ",
                t->device());
  }
}

}  // namespace openwam::frontend

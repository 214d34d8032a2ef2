#include "dropout_seed.h"

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <c10/cuda/CUDAException.h>

#include <mutex>

namespace openwam::frontend {
namespace {

// Under capture the state holds device pointers that each replay advances;
// at::cuda::philox::unpack reads whichever form it holds.
__global__ void write_seed_offset(at::PhiloxCudaState state, int64_t* seed, int64_t* offset) {
  const auto seed_offset = at::cuda::philox::unpack(state);
  *seed = static_cast<int64_t>(std::get<0>(seed_offset));
  *offset = static_cast<int64_t>(std::get<1>(seed_offset));
}

}  // namespace

std::pair<at::Tensor, at::Tensor> dropout_seed_offset(const c10::Device& device,
                                                      uint64_t increment) {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(device.index()));
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(increment);
  }
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor seed = at::empty({}, options);
  at::Tensor offset = at::empty({}, options);
  write_seed_offset<<<1, 1, 0, at::cuda::getCurrentCUDAStream(device.index())>>>(
      state, seed.data_ptr<int64_t>(), offset.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {seed, offset};
}

}  // namespace openwam::frontend

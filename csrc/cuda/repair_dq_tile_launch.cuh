// Launching the tile kernel (repair_dq_tile.cuh) of one element type. Each
// type's kernels compile in their own file (repair_dq_tile_bf16.cu,
// repair_dq_tile_fp16.cu) so that the two build in parallel.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <mutex>

#include "repair_dq_layout.cuh"
#include "repair_dq_tile.cuh"

namespace openwam {
namespace repair {

// Defined in repair_dq_tile_bf16.cu and repair_dq_tile_fp16.cu.
void launch_tiles_bf16(const TileParams& p, int device, cudaStream_t stream);
void launch_tiles_fp16(const TileParams& p, int device, cudaStream_t stream);

// How the kernel runs on a device, without and with a bias (which adds a
// tile to each stage): pipeline depth and blocks per SM. Found once per
// device.
struct TileConfig {
  int stages = 0;
  int blocks_per_sm = 0;
};

template <class Elt, int kWidth>
TileConfig tile_config(int device, bool has_bias) {
  constexpr int kMaxDevices = 64;
  static std::array<std::array<TileConfig, 2>, kMaxDevices> configs{};
  static std::array<std::once_flag, kMaxDevices> once;
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "openwam::repair_dq_rows: device index ",
              device, " out of range");
  std::call_once(once[device], [device] {
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(device);
    const auto kernel = repair_tile_kernel<Elt, kWidth>;
    std::array<TileConfig, 2>& c = configs[device];
    int max_smem = 0;
    for (int with_bias = 0; with_bias < 2; ++with_bias) {
      c[with_bias].stages = tile_stages(
          kWidth, with_bias == 1, kTileBlocksPerSm<kWidth>,
          static_cast<int>(props->sharedMemPerMultiprocessor),
          static_cast<int>(props->reservedSharedMemPerBlock));
      max_smem = std::max(max_smem, TileSmem{kWidth, with_bias == 1, c[with_bias].stages}.total());
    }
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        max_smem));
    for (int with_bias = 0; with_bias < 2; ++with_bias) {
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &c[with_bias].blocks_per_sm, kernel, kTileThreads,
          TileSmem{kWidth, with_bias == 1, c[with_bias].stages}.total()));
    }
  });
  return configs[device][has_bias ? 1 : 0];
}

template <class Elt, int kWidth>
void launch_tiles_width(TileParams p, int device, cudaStream_t stream) {
  const bool has_bias = p.bias != nullptr;
  const TileConfig config = tile_config<Elt, kWidth>(device, has_bias);
  TORCH_CHECK(config.blocks_per_sm > 0, "openwam::repair_dq_rows: the tile kernel (head_dim width ",
              kWidth, ") does not fit on this GPU's multiprocessors");
  p.stages = config.stages;
  const int64_t slots = static_cast<int64_t>(config.blocks_per_sm) *
                        at::cuda::getDeviceProperties(device)->multiProcessorCount;
  const int64_t grid = tile_grid_size(p.n_items, p.tiles_per_head, slots);
  repair_tile_kernel<Elt, kWidth><<<static_cast<unsigned>(grid), kTileThreads,
                                    TileSmem{kWidth, has_bias, p.stages}.total(), stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class Elt>
void launch_tiles(const TileParams& p, int device, cudaStream_t stream) {
  switch (head_dim_width(p.head_dim)) {
    case 64: return launch_tiles_width<Elt, 64>(p, device, stream);
    case 128: return launch_tiles_width<Elt, 128>(p, device, stream);
    case 256: return launch_tiles_width<Elt, 256>(p, device, stream);
    default:
      TORCH_INTERNAL_ASSERT(false, "openwam::repair_dq_rows: head_dim ", p.head_dim,
                            " over 256");
  }
}

}  // namespace repair
}  // namespace openwam

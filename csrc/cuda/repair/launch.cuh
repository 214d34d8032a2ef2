// The repair kernel and its launch, for one element type. Each type's
// kernels compile in their own file (kernel_bf16.cu, kernel_fp16.cu) so
// that the two build in parallel.
//
// One launch, no workspace: each block finds the rows of its own tiles
// (scan.cuh) and recomputes them (tile.cuh). A kernel
// launch costs the host about 4 us inside a backward, most of the 5 us a
// call may add (the host-time budget): with a scan kernel and a tile kernel the repair
// added 8.6 us to a backward, 1.0 us without their launches (H200 host,
// torch 2.11, paired rounds). A grid-wide barrier between a
// scan phase and a tile phase would need every block resident at once (a
// cooperative launch), which stalls the repair behind whatever else holds
// the GPU's multiprocessors, such as the NCCL kernels of data-parallel
// training that overlap the backward; a cluster needs only its two blocks
// at once.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <bitset>
#include <mutex>

#include "layout.cuh"
#include "scan.cuh"
#include "run.cuh"

namespace openwam {
namespace repair {

// Defined in kernel_bf16.cu and kernel_fp16.cu.
void launch_repair_bf16(const ScanParams& scan, const TileParams& tiles, int device,
                        cudaStream_t stream, bool behind_backward);
void launch_repair_fp16(const ScanParams& scan, const TileParams& tiles, int device,
                        cudaStream_t stream, bool behind_backward);

// Wide tiles on wgmma where the kernel is built for sm_90a and Q and dO stay
// in registers (head_dim width 64 or 128); mma.sync elsewhere.
template <int kWidth>
constexpr bool kTileWgmma = OPENWAM_REPAIR_WGMMA && TileShape<kWidth>::kQInRegs;

// kCluster: launched in clusters of kClusterBlocks (launch_cluster). A
// kernel of its own, so that blocks on their own runs keep the code they
// had without clusters.
template <class Elt, int kWidth, bool kCluster>
__global__ void __launch_bounds__(kTileThreads, kTileBlocksPerSm<kWidth>)
    repair_kernel(const ScanParams scan, const TileParams tiles) {
  repair_tiles<Elt, kWidth, kTileWgmma<kWidth>, kCluster>(scan, tiles);
}

// How the kernel runs on a device, without and with a bias (which adds a
// tile to each stage): pipeline depth, blocks per SM, clusters of
// kClusterBlocks resident at once (0: the device or the kernel's build has no
// clusters) and the kernels' driver handles (without and with clusters).
// Found once per device.
struct TileConfig {
  int stages = 0;
  int blocks_per_sm = 0;
  int max_clusters = 0;
  CUfunction function = nullptr;
  CUfunction cluster_function = nullptr;
  bool programmatic = false;  // sm_90 code on sm_90: may start as the grid ahead ends (PDL)
};

// The driver's cuLaunchKernelEx, found through the runtime (no link to
// libcuda). Launching the kernel's driver handle directly skips the
// runtime's lookup of the kernel: 0.5-0.8 us less host time per backward
// than cudaLaunchKernelEx (H200 host, paired rounds).
using LaunchKernelEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
inline LaunchKernelEx launch_kernel_ex() {
  static const LaunchKernelEx fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuLaunchKernelEx", &f, 12000,
                                                    cudaEnableDefault, &found));
#else  // the versioned lookup came with CUDA 12.5
    C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuLaunchKernelEx", &f, cudaEnableDefault, &found));
#endif
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && f != nullptr,
                "openwam::repair_dq_rows: the CUDA driver has no cuLaunchKernelEx");
    return reinterpret_cast<LaunchKernelEx>(f);
  }();
  return fn;
}

constexpr int kMaxDevices = 64;

// The driver API launches in the thread's current context, which a thread
// whose first CUDA call is the repair does not have: the runtime binds a
// device's primary context lazily, on a thread's first runtime call that
// needs it, and CUDAGuard skips cudaSetDevice when the device is already the
// thread's current one (device 0 on a fresh thread). So each thread binds it
// once per device (from CUDA 12, cudaSetDevice makes the primary context
// current at once). Afterwards the current context follows the current
// device: CUDAGuard's cudaSetDevice binds it on every switch.
inline void bind_primary_context(int device) {
  thread_local std::bitset<kMaxDevices> bound;
  if (!bound.test(device)) {
    C10_CUDA_CHECK(cudaSetDevice(device));
    bound.set(device);
  }
}

template <class Elt, int kWidth>
TileConfig tile_config(int device, bool has_bias) {
  static std::array<std::array<TileConfig, 2>, kMaxDevices> configs{};
  static std::array<std::once_flag, kMaxDevices> once;
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "openwam::repair_dq_rows: device index ",
              device, " out of range");
  std::call_once(once[device], [device] {
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(device);
    const auto kernel = repair_kernel<Elt, kWidth, false>;
    const auto cluster_kernel = repair_kernel<Elt, kWidth, true>;
    std::array<TileConfig, 2>& c = configs[device];
    int max_smem = 0;
    for (int with_bias = 0; with_bias < 2; ++with_bias) {
      c[with_bias].stages = tile_stages(
          kWidth, with_bias == 1, kTileBlocksPerSm<kWidth>,
          static_cast<int>(props->sharedMemPerMultiprocessor),
          static_cast<int>(props->reservedSharedMemPerBlock));
      max_smem = std::max(max_smem, TileSmem{kWidth, with_bias == 1, c[with_bias].stages}.total());
    }
    CUfunction f[2] = {nullptr, nullptr};
    for (int k = 0; k < 2; ++k) {
      const auto kern = k == 0 ? kernel : cluster_kernel;
      C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          max_smem));
      C10_CUDA_CHECK(cudaGetFuncBySymbol(&f[k], reinterpret_cast<const void*>(kern)));
    }
    c[0].function = c[1].function = f[0];
    c[0].cluster_function = c[1].cluster_function = f[1];
    // Clusters need sm_90 and a kernel built for it (not sm_80 code run on a
    // newer GPU: its cluster instructions compile to a trap; nor sm_80 PTX
    // compiled for it at load time, whose binary version is the GPU's). A
    // programmatic launch needs the same: its griddepcontrol.wait is only
    // in sm_90 code.
    cudaFuncAttributes attrs{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attrs, cluster_kernel));
    const bool sm90_code =
        props->major >= 9 && attrs.binaryVersion >= 90 && attrs.ptxVersion >= 90;
    c[0].programmatic = c[1].programmatic = sm90_code;
    for (int with_bias = 0; with_bias < 2; ++with_bias) {
      const int smem = TileSmem{kWidth, with_bias == 1, c[with_bias].stages}.total();
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c[with_bias].blocks_per_sm,
                                                                   kernel, kTileThreads, smem));
      if (!sm90_code) continue;
      cudaLaunchAttribute cluster_dim{};
      cluster_dim.id = cudaLaunchAttributeClusterDimension;
      cluster_dim.val.clusterDim.x = kClusterBlocks;
      cluster_dim.val.clusterDim.y = cluster_dim.val.clusterDim.z = 1;
      cudaLaunchConfig_t probe{};
      probe.gridDim = dim3(kClusterBlocks);
      probe.blockDim = dim3(kTileThreads);
      probe.dynamicSmemBytes = static_cast<size_t>(smem);
      probe.attrs = &cluster_dim;
      probe.numAttrs = 1;
      // A device or driver that cannot answer gets the kernel without
      // clusters (max_clusters 0), not an error in the user's backward.
      if (cudaOccupancyMaxActiveClusters(&c[with_bias].max_clusters, cluster_kernel, &probe) !=
          cudaSuccess) {
        (void)cudaGetLastError();  // clear it, so that no later check reports it
        c[with_bias].max_clusters = 0;
      }
    }
  });
  return configs[device][has_bias ? 1 : 0];
}

// behind_backward: the launch follows cuDNN's backward on `stream`
// (repair_dq_rows). On sm_90 the kernel is then its programmatic dependent:
// it starts as the backward's last kernel (the conversion of dQ to 16 bits)
// retires its blocks, without the gap between two plain launches, and
// waits for it only before writing dQ (wait_for_grid_ahead). 1-3 us less
// per backward, with or without affected rows (H200, cuDNN 9.19).
template <class Elt, int kWidth>
void launch_repair_width(const ScanParams& scan, TileParams tiles, int device,
                         cudaStream_t stream, bool behind_backward) {
  const bool has_bias = tiles.bias != nullptr;
  const TileConfig config = tile_config<Elt, kWidth>(device, has_bias);
  TORCH_CHECK(config.blocks_per_sm > 0, "openwam::repair_dq_rows: the repair kernel (head_dim width ",
              kWidth, ") does not fit on this GPU's multiprocessors");
  tiles.stages = config.stages;
  const int cluster =
      kLaunchClusters ? launch_cluster(tiles.s_kv, tiles.tiles_per_head, config.max_clusters) : 1;
  const int64_t slots =
      cluster > 1 ? config.max_clusters
                  : static_cast<int64_t>(config.blocks_per_sm) *
                        at::cuda::getDeviceProperties(device)->multiProcessorCount;
  CUlaunchConfig launch{};
  launch.gridDimX = static_cast<unsigned>(tile_grid_size(tiles.n_items, slots) * cluster);
  launch.gridDimY = launch.gridDimZ = 1;
  launch.blockDimX = kTileThreads;
  launch.blockDimY = launch.blockDimZ = 1;
  launch.sharedMemBytes = static_cast<unsigned>(TileSmem{kWidth, has_bias, tiles.stages}.total());
  launch.hStream = stream;
  CUlaunchAttribute attrs[2]{};
  unsigned n_attrs = 0;
  if (cluster > 1) {
    CUlaunchAttribute& cluster_dim = attrs[n_attrs++];
    cluster_dim.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    cluster_dim.value.clusterDim.x = static_cast<unsigned>(cluster);
    cluster_dim.value.clusterDim.y = cluster_dim.value.clusterDim.z = 1;
  }
  if (behind_backward && config.programmatic) {
    CUlaunchAttribute& serial = attrs[n_attrs++];
    serial.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    serial.value.programmaticStreamSerializationAllowed = 1;
  }
  launch.attrs = n_attrs > 0 ? attrs : nullptr;
  launch.numAttrs = n_attrs;
  void* args[] = {const_cast<ScanParams*>(&scan), &tiles};
  bind_primary_context(device);
  const CUresult status = launch_kernel_ex()(
      &launch, cluster > 1 ? config.cluster_function : config.function, args, nullptr);
  TORCH_CHECK(status == CUDA_SUCCESS, "openwam::repair_dq_rows: launching the repair kernel failed ",
              "(CUresult ", static_cast<int>(status), ")");
}

template <class Elt>
void launch_repair(const ScanParams& scan, const TileParams& tiles, int device,
                   cudaStream_t stream, bool behind_backward) {
  switch (head_dim_width(tiles.head_dim)) {
    case 64: return launch_repair_width<Elt, 64>(scan, tiles, device, stream, behind_backward);
    case 128: return launch_repair_width<Elt, 128>(scan, tiles, device, stream, behind_backward);
    case 256: return launch_repair_width<Elt, 256>(scan, tiles, device, stream, behind_backward);
    default:
      TORCH_INTERNAL_ASSERT(false, "openwam::repair_dq_rows: head_dim ", tiles.head_dim,
                            " over 256");
  }
}

}  // namespace repair
}  // namespace openwam

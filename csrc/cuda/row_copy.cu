// copy_along's kernel (row_copy.h says why).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "row_copy.h"

namespace openwam {
namespace {

// One 16-byte vector a thread, grid-stride over rows x row_vecs.
__global__ void copy_rows(const uint4* src, int64_t src_pitch, uint4* dst, int64_t dst_pitch,
                          int64_t copy_vecs, int64_t row_vecs, int64_t total, uint4 fill) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / row_vecs, c = i - r * row_vecs;
    dst[r * dst_pitch + c] = c < copy_vecs ? src[r * src_pitch + c] : fill;
  }
}

}  // namespace

void launch_copy_rows(const at::Tensor& dst, const void* src, int64_t src_pitch,
                      void* dst_data, int64_t dst_pitch, int64_t copy_bytes, int64_t row_bytes,
                      int64_t rows, uint32_t fill_word) {
  constexpr int64_t kVec = sizeof(uint4);
  const int64_t row_vecs = row_bytes / kVec, total = rows * row_vecs;
  if (total == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(dst.device());
  constexpr int kThreads = 256;
  // Enough blocks to keep every SM's memory pipeline full, then grid-stride.
  const int64_t sm = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min((total + kThreads - 1) / kThreads, sm * 16);
  copy_rows<<<static_cast<unsigned>(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint4*>(src), src_pitch / kVec, static_cast<uint4*>(dst_data),
      dst_pitch / kVec, copy_bytes / kVec, row_vecs, total,
      make_uint4(fill_word, fill_word, fill_word, fill_word));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace openwam

// openwam::_mask_bias's CUDA kernel (mask_bias.h says why).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "mask_bias.h"

namespace openwam {
namespace {

constexpr int kThreads = 256;

// Word: the dtype's bits (uint16_t for half and bfloat16, uint32_t for
// float); each thread writes 16-byte vectors of kPer words. A block holds
// kThreads / threads_per_row rows (short rows share a block, long ones
// take all of it), grid-stride over groups of rows: the index arithmetic
// (int64 divisions) runs once a row, not once a vector.
// kAligned: the mask's keys are contiguous and every row starts on a kPer-byte
// boundary, so a vector's kPer mask bytes come in one load (the tail vector
// that crosses s_kv excepted). Otherwise byte by byte, through the strides.
template <typename Word, bool kAligned>
__global__ void mask_bias_kernel(const bool* mask, MaskRows rows, uint4* bias, int64_t s_kv,
                                 int64_t row_vecs, int64_t n_rows, int threads_per_row,
                                 Word neg_inf) {
  constexpr int kPer = sizeof(uint4) / sizeof(Word);
  using Load = std::conditional_t<kPer == 8, uint2, uint32_t>;
  static_assert(sizeof(Load) == kPer, "one mask byte a word");
  const int rows_per_block = kThreads / threads_per_row;
  const int lane = threadIdx.x % threads_per_row;
  for (int64_t r = int64_t{blockIdx.x} * rows_per_block + threadIdx.x / threads_per_row;
       r < n_rows; r += int64_t{gridDim.x} * rows_per_block) {
    const int64_t i2 = r % rows.sizes[2], r1 = r / rows.sizes[2];
    const int64_t i1 = r1 % rows.sizes[1], i0 = r1 / rows.sizes[1];
    const bool* row = mask + i0 * rows.strides[0] + i1 * rows.strides[1] + i2 * rows.strides[2];
    uint4* out_row = bias + r * row_vecs;
    for (int64_t v = lane; v < row_vecs; v += threads_per_row) {
      const int64_t first = v * kPer;
      union {
        uint4 vec;
        Word words[kPer];
      } out;
      if (kAligned && first + kPer <= s_kv) {
        union {
          Load load;
          unsigned char bytes[kPer];
        } in;
        in.load = *reinterpret_cast<const Load*>(row + first);
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          out.words[j] = in.bytes[j] ? Word{0} : neg_inf;
        }
      } else {
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const int64_t key = first + j;
          out.words[j] = key < s_kv && row[key * rows.key_stride] ? Word{0} : neg_inf;
        }
      }
      out_row[v] = out.vec;
    }
  }
}

template <typename Word>
void launch(const bool* mask, const MaskRows& rows, uint4* out, int64_t s_kv, int64_t row_vecs,
            int64_t n_rows, bool aligned, Word neg_inf, cudaStream_t stream) {
  // Threads a row: the row's vectors, rounded up to a power of two, at most a block.
  int threads_per_row = 1;
  while (threads_per_row < kThreads && threads_per_row < row_vecs) {
    threads_per_row *= 2;
  }
  const int64_t rows_per_block = kThreads / threads_per_row;
  const int64_t sm = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto blocks = static_cast<unsigned>(
      std::min((n_rows + rows_per_block - 1) / rows_per_block, sm * 32));
  if (aligned) {
    mask_bias_kernel<Word, true><<<blocks, kThreads, 0, stream>>>(
        mask, rows, out, s_kv, row_vecs, n_rows, threads_per_row, neg_inf);
  } else {
    mask_bias_kernel<Word, false><<<blocks, kThreads, 0, stream>>>(
        mask, rows, out, s_kv, row_vecs, n_rows, threads_per_row, neg_inf);
  }
}

}  // namespace

bool mask_rows_aligned(const bool* mask, const MaskRows& rows, int64_t bytes) {
  if (rows.key_stride != 1 || reinterpret_cast<std::uintptr_t>(mask) % bytes != 0) {
    return false;
  }
  return std::all_of(std::begin(rows.strides), std::end(rows.strides),
                     [&](int64_t s) { return s % bytes == 0; });
}

void launch_mask_bias(const at::Tensor& bias, const bool* mask, const MaskRows& rows,
                      int64_t s_kv) {
  const int64_t row_vecs = bias.size(-1) * bias.element_size() / int64_t{sizeof(uint4)};
  // A bias without keys has no rows to write (and numel / 0 would be SIGFPE:
  // a direct call with s_kv_padded 0; found in review).
  if (row_vecs == 0 || bias.numel() == 0) {
    return;
  }
  const int64_t n_rows = bias.numel() / bias.size(-1);
  const c10::cuda::CUDAGuard guard(bias.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  auto* out = static_cast<uint4*>(bias.data_ptr());
  // One mask byte a word of the bias: a vector reads 16 / element_size bytes.
  const bool aligned = mask_rows_aligned(mask, rows, int64_t{sizeof(uint4)} / bias.element_size());
  switch (bias.scalar_type()) {
    case at::kBFloat16:
      launch<uint16_t>(mask, rows, out, s_kv, row_vecs, n_rows, aligned, 0xFF80, stream);
      break;
    case at::kHalf:
      launch<uint16_t>(mask, rows, out, s_kv, row_vecs, n_rows, aligned, 0xFC00, stream);
      break;
    case at::kFloat:
      launch<uint32_t>(mask, rows, out, s_kv, row_vecs, n_rows, aligned, 0xFF800000u, stream);
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "mask_bias: unexpected dtype ", bias.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace openwam

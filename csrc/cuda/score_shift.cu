// The score shift's CUDA kernel (score_shift.h says why).
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "score_shift.h"

namespace openwam {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpEntries = 256;  // more logsumexp entries a row: a block each
// Logsumexp entries a thread holds in registers between the row's minimum and
// its shifted write, where the row's entries are one contiguous run: all of a
// warp's rows; a key mask's 24 heads x 360 queries in 9 a thread of a
// 1024-thread block.
template <int kGroup>
constexpr int kCached = kGroup == 32 ? kWarpEntries / 32 : 16;

// Bias row (gb, gh, gl)'s finite entries moved by `delta` from `src` into
// `dst` (the same row in place, where rows with delta 0 are not written), its
// keys shared by `step` lanes (the shift raises, the restore lowers).
template <typename T>
__device__ void move_row(const T* src, T* dst, const ShiftRows& r, int64_t gb, int64_t gh,
                         int64_t gl, float delta, int lane, int step) {
  if (delta == 0.0f && src == dst) {
    return;
  }
  const int64_t first = r.bias_offset(gb, gh, gl);
  for (int64_t j = lane; j < r.keys; j += step) {
    const T v = src[first + j * r.key_stride];
    const float x = static_cast<float>(v);
    dst[first + j * r.key_stride] = isfinite(x) ? static_cast<T>(x + delta) : v;
  }
}

// kGroup threads per bias row: a warp where few logsumexp entries read a row
// (a [B, 1, L, S] mask: one per head), a whole block of kGroup threads where
// many do (a key mask [B, 1, 1, S]: heads x rows), so that neither leaves the
// GPU idle. The row's smallest finite logsumexp, its c (kept in `shifts` for
// the restore where not null), the shifted logsumexp, then the row's finite
// entries raised by c into `bias_out` (`bias` itself in place, where ordinary
// rows, c == 0, are not written). A row whose entries are one contiguous run
// of at most kGroup * kCached is read once, into registers, all loads in
// flight together.
template <typename T, int kGroup>
__global__ void __launch_bounds__(kGroup < kThreads ? kThreads : kGroup)
    score_shift_kernel(const T* bias, T* bias_out, const float* lse, float* lse_out,
                       float* shifts, ShiftRows r, ShiftLimits limits) {
  constexpr int kBlock = kGroup < kThreads ? kThreads : kGroup;
  constexpr int kPerBlock = kBlock / kGroup;
  __shared__ float warp_min[kBlock / 32];
  const int64_t groups = r.groups(), entries = r.entries();
  constexpr int kHeld = kCached<kGroup>;
  const bool cached = r.contiguous && entries <= int64_t{kGroup} * kHeld;
  const int lane = threadIdx.x % kGroup;
  float held[kHeld];
  // Block-uniform trip count: every thread reaches the __syncthreads below.
  for (int64_t base = int64_t{blockIdx.x} * kPerBlock; base < groups;
       base += int64_t{gridDim.x} * kPerBlock) {
    const int64_t g = base + threadIdx.x / kGroup;
    const bool live = g < groups;
    int64_t gb = 0, gh = 0, gl = 0;
    if (live) {
      r.row_of(g, gb, gh, gl);
    }
    float m = INFINITY;
    if (live && cached) {
      const float* run = lse + g * entries;
#pragma unroll
      for (int i = 0; i < kHeld; ++i) {
        const int64_t e = lane + int64_t{i} * kGroup;
        held[i] = e < entries ? run[e] : INFINITY;
      }
#pragma unroll
      for (int i = 0; i < kHeld; ++i) {
        if (isfinite(held[i])) {
          m = fminf(m, held[i]);
        }
      }
    } else if (live) {
      for (int64_t e = lane; e < entries; e += kGroup) {
        const float x = lse[r.lse_index(gb, gh, gl, e)];
        if (isfinite(x)) {
          m = fminf(m, x);
        }
      }
    }
    for (int off = (kGroup < 32 ? kGroup : 32) / 2; off > 0; off /= 2) {
      m = fminf(m, __shfl_xor_sync(0xffffffffu, m, off));
    }
    if constexpr (kGroup > 32) {
      if (threadIdx.x % 32 == 0) {
        warp_min[threadIdx.x / 32] = m;
      }
      __syncthreads();
#pragma unroll
      for (int w = 0; w < kGroup / 32; ++w) {
        m = fminf(m, warp_min[w]);
      }
      __syncthreads();  // warp_min is rewritten by the next row
    }
    if (!live) {
      continue;
    }
    const float c = shift_of(m, limits);
    if (lane == 0 && shifts != nullptr) {
      shifts[g] = c;
    }
    if (cached) {
      float* run = lse_out + g * entries;
#pragma unroll
      for (int i = 0; i < kHeld; ++i) {
        const int64_t e = lane + int64_t{i} * kGroup;
        if (e < entries) {
          run[e] = shifted_lse(held[i], c);
        }
      }
    } else {
      for (int64_t e = lane; e < entries; e += kGroup) {
        const int64_t i = r.lse_index(gb, gh, gl, e);
        lse_out[i] = shifted_lse(lse[i], c);
      }
    }
    move_row(bias, bias_out, r, gb, gh, gl, c, lane, kGroup);
  }
}

// The restore: a warp per bias row, c read back from the shift's `shifts`;
// rows it did not raise are not read.
template <typename T>
__global__ void score_unshift_kernel(T* bias, const float* shifts, ShiftRows r) {
  const int64_t groups = r.groups();
  const int lane = threadIdx.x % 32;
  for (int64_t g = (int64_t{blockIdx.x} * kThreads + threadIdx.x) / 32; g < groups;
       g += int64_t{gridDim.x} * (kThreads / 32)) {
    const float c = shifts[g];
    if (c == 0.0f) {
      continue;
    }
    int64_t gb, gh, gl;
    r.row_of(g, gb, gh, gl);
    move_row(bias, bias, r, gb, gh, gl, -c, lane, 32);
  }
}

int blocks_for(int64_t groups, int64_t per_block) {
  return static_cast<int>(std::min<int64_t>((groups + per_block - 1) / per_block, 65535));
}

}  // namespace

void launch_score_shift(const at::Tensor& bias, const at::Tensor& bias_out,
                        const at::Tensor& logsumexp, float* lse_out, float* shifts,
                        const ShiftRows& rows) {
  const c10::cuda::CUDAGuard device(bias.device());
  const int64_t groups = rows.groups();
  const ShiftLimits limits = shift_limits(bias.scalar_type());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool wide = rows.entries() > kWarpEntries;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bias.scalar_type(), "score_shift", [&] {
    scalar_t* out = bias_out.data_ptr<scalar_t>();
    if (lse_out == nullptr) {
      score_unshift_kernel<scalar_t><<<blocks_for(groups, kThreads / 32), kThreads, 0, stream>>>(
          out, shifts, rows);
    } else if (wide) {
      score_shift_kernel<scalar_t, 1024><<<blocks_for(groups, 1), 1024, 0, stream>>>(
          bias.const_data_ptr<scalar_t>(), out, logsumexp.const_data_ptr<float>(), lse_out,
          shifts, rows, limits);
    } else {
      score_shift_kernel<scalar_t, 32><<<blocks_for(groups, kThreads / 32), kThreads, 0, stream>>>(
          bias.const_data_ptr<scalar_t>(), out, logsumexp.const_data_ptr<float>(), lse_out,
          shifts, rows, limits);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace openwam

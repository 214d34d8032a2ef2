// openwam::_mask_bias: a bool attention mask as cuDNN's additive bias, in one
// pass, optionally with its keys grown for the K/V shim.
//
// Why an op: ATen writes the bias in two kernels (a -inf fill, then
// masked_fill_), and into a buffer with padded keys the second one runs on
// its strided, non-vectorised loop: 100 us a layer for a [2, 1, 4032, 4096]
// bf16 bias (H200, torch 2.11.0), against 76 us for stock's own conversion
// (at::where). The CUDA kernel reads the mask once and writes the bias in
// 16-byte vectors. An op with a Meta kernel, so that torch.compile keeps it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace openwam {

// The bias of bool `mask` (last dim s_kv, or 1 to broadcast along the keys):
// the mask's sizes with the last one s_kv_padded (>= s_kv), in floating-point
// `dtype` (the kernel's: float, half, bfloat16; ATen's for the others), contiguous; 0 where the mask is true, -inf where
// it is false and at every key from s_kv on.
at::Tensor mask_bias(const at::Tensor& mask, at::ScalarType dtype, const c10::SymInt& s_kv,
                     const c10::SymInt& s_kv_padded);

#ifdef OPENWAM_WITH_CUDA
// The CUDA kernel (csrc/cuda/mask_bias.cu): `bias` contiguous, its rows of
// s_kv_padded elements a multiple of 16 bytes; the mask's rows found through
// its leading sizes and strides (at most three dims, broadcast ones stride 0),
// its keys `key_stride` apart (0: broadcast along the keys).
struct MaskRows {
  int64_t sizes[3], strides[3];
  int64_t key_stride;
};
void launch_mask_bias(const at::Tensor& bias, const bool* mask, const MaskRows& rows,
                      int64_t s_kv);
// Whether the kernel may load a vector's mask bytes at once: keys contiguous,
// and the mask's start and row strides multiples of `bytes` (its loads' size).
bool mask_rows_aligned(const bool* mask, const MaskRows& rows, int64_t bytes);
#endif

}  // namespace openwam

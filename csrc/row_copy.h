// A copy between two tensors that differ in one dim's length: the K/V shim's
// padded copies of K, V and the bias (grown to a multiple of 128 keys) and
// the copies of dK and dV back out of the padded gradients
// (cudnn_path_kernels.cpp).
//
// Why a kernel: ATen copies into or out of a narrowed tensor with its
// strided, non-vectorised loop, two bytes an element in bf16. At the 400m
// training step's attention (B2 H8 D128, 4032 keys, a [B, 1, L, S] mask;
// H200, torch 2.11.0, cuDNN 9.19.0) the shim's five such copies took 165 us
// of each backward, as much as 10% of stock's fwd+bwd (the op's fwd+bwd was
// 1.102x stock's; with this kernel, 1.044x). Both sides of each copy are rows
// with a constant pitch, so one kernel moves them in 16-byte vectors and
// fills the padded tail in the same pass.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace openwam {

// A tensor seen as `rows` rows `pitch` elements apart, each `row` elements
// long: `inner` elements for each index of the copy's dim, which is
// outermost in the row.
struct RowLayout {
  int64_t rows, row, pitch, inner;
};

// The dims of size > 1 and `dim`, outermost (largest stride) first: the order
// in which both sides of a copy must be rows for the kernel to take it.
std::vector<int64_t> copy_order(at::IntArrayRef sizes, at::IntArrayRef strides, int64_t dim);

// The rows of a tensor (sizes, strides) in `order`: the dims after `dim`
// dense (the last of stride 1), `dim`'s stride their size, and the dims
// before it collapsing into one with a constant pitch no shorter than a row.
// nullopt where they are not.
std::optional<RowLayout> row_layout(at::IntArrayRef sizes, at::IntArrayRef strides, int64_t dim,
                                    const std::vector<int64_t>& order);

// dst's first n entries along `dim` := src's, where n is the shorter of the
// two lengths there, and dst's entries past n := `fill`. The two agree in
// every other dim and in dtype. For the leaf ops' kernels (real tensors, no
// autograd): on CUDA, rows of 16-byte vectors when both sides are rows
// (row_layout) and aligned to 16 bytes; ATen's copy_ and fill_ otherwise.
// Returns whether the kernel took the copy (the GPU tests check which path ran).
bool copy_along(const at::Tensor& dst, const at::Tensor& src, int64_t dim,
                const c10::Scalar& fill);

#ifdef OPENWAM_WITH_CUDA
// The kernel of copy_along, in bytes: each of `rows` rows of dst (dst_pitch
// apart) gets `copy_bytes` from src's row (src_pitch apart), then `fill_word`
// repeated up to `row_bytes`. Every argument a multiple of 16 bytes; on
// dst's device and its current stream. (csrc/cuda/row_copy.cu)
void launch_copy_rows(const at::Tensor& dst, const void* src, int64_t src_pitch,
                      void* dst_data, int64_t dst_pitch, int64_t copy_bytes, int64_t row_bytes,
                      int64_t rows, uint32_t fill_word);
#endif

}  // namespace openwam

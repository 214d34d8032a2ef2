#include "shim_slices.h"

#include <c10/util/Exception.h>

#include "cudnn_attention.h"

namespace openwam {
namespace {

// A slice size: `batches` batch elements x `kv_heads` key/value heads.
struct SliceSize {
  int64_t batches, kv_heads;
};

// The slice sizes that divide the call evenly, largest first: every divisor
// of the batch with all heads, then one batch element with every divisor of
// the key/value heads. With one query row, no slice of one batch element
// where the call has several: a slice is a cuDNN call of its own, and one
// of batch 1 with one query row is the trigger of cudnn-frontend #1072 (NaN
// in all of dK and dV; guard row sq1_nan_dk_dv) that the whole call, at
// batch 2 or more, does not hit. (A call of batch 1 with one query row takes
// the one-row plan before the shim, decision.cpp.)
std::vector<SliceSize> even_sizes(const ShimShape& s) {
  const int64_t min_batches = s.s_q == 1 && s.batch > 1 ? 2 : 1;
  std::vector<SliceSize> sizes;
  for (int64_t b = s.batch; b >= min_batches; --b) {
    if (s.batch % b == 0) sizes.push_back({b, s.kv_heads});
  }
  for (int64_t h = s.kv_heads - 1; h >= 1 && min_batches == 1; --h) {
    if (s.kv_heads % h == 0) sizes.push_back({1, h});
  }
  return sizes;
}

}  // namespace

int64_t shim_slice_elements(const ShimShape& s, int64_t batches, int64_t kv_heads) {
  const int64_t heads = kv_heads * (s.heads / s.kv_heads);
  const int64_t kv = batches * kv_heads * s.s_kv_padded * (s.head_dim + s.head_dim_v);
  const int64_t queries = batches * heads * s.s_q * s.head_dim;
  const int64_t bias = s.has_bias ? (s.bias_per_batch ? batches : 1) *
                                        (s.bias_per_head ? heads : 1) * s.bias_queries *
                                        s.s_kv_padded
                                  : 0;
  // Padded K and V and their gradients; dQ; the bias; the float32 workspace.
  return 2 * kv + queries + bias + 2 * queries;
}

int64_t stock_workspace_elements(const ShimShape& s) {
  return 2 * s.batch * s.heads * s.s_q * s.head_dim;
}

std::vector<ShimSlice> shim_slices(const ShimShape& s, int64_t min_key_tiles) {
  TORCH_INTERNAL_ASSERT(s.batch > 0 && s.kv_heads > 0 && s.heads % s.kv_heads == 0 &&
                        s.s_kv_padded % kCudnnKeyTile == 0);
  const int64_t group = s.heads / s.kv_heads;
  const int64_t key_tiles = s.s_kv_padded / kCudnnKeyTile;
  SliceSize chosen{s.batch, s.kv_heads};
  for (const SliceSize& size : even_sizes(s)) {
    if (size.batches * size.kv_heads * group * key_tiles < min_key_tiles) break;
    chosen = size;
    if (shim_slice_elements(s, size.batches, size.kv_heads) <= stock_workspace_elements(s)) break;
  }
  std::vector<ShimSlice> slices;
  for (int64_t b = 0; b < s.batch; b += chosen.batches) {
    for (int64_t h = 0; h < s.kv_heads; h += chosen.kv_heads) {
      slices.push_back({b, chosen.batches, h, chosen.kv_heads});
    }
  }
  return slices;
}

ShimSlice bias_rows(const ShimShape& s, const ShimSlice& slice) {
  return {s.bias_per_batch ? slice.batch_begin : 0, s.bias_per_batch ? slice.batches : 1,
          s.bias_per_head ? slice.kv_head_begin : 0, s.bias_per_head ? slice.kv_heads : 1};
}

}  // namespace openwam

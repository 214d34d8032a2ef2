// How the K/V shim's backward is split into calls, so that its padded copies
// cost no more memory than stock's backward where the call is large enough
// to split.
//
// Why: the shim (padding.h) runs the backward on K, V and the bias copied with
// the keys grown to a multiple of 128, and gets dK and dV with the padded rows
// (dropped by a copy). As one call over the whole batch those copies were
// +195 MiB over stock's peak at B4 H24 D128 4096x4032 with a key mask (H200,
// cuDNN 9.19.0). cuDNN's sm90 backward keeps dQ in float32 in its workspace
// (192 MiB of stock's 576 MiB there), and a call over a slice of the batch
// needs that workspace for its slice only. So the backward runs slice by
// slice, in the fewest slices for which one slice's copies and workspace fit
// in stock's workspace, as long as each slice keeps enough key tiles to fill
// the GPU.
#pragma once

#include <cstdint>
#include <vector>

namespace openwam {

// The sizes of a shimmed backward: head dims in elements, s_kv_padded a
// multiple of the key tile. The bias as cuDNN reads it, [B|1, H|1, L|1, S]:
// which of its first three dims are not broadcast, and its query length.
struct ShimShape {
  int64_t batch, heads, kv_heads, s_q, s_kv_padded, head_dim, head_dim_v;
  bool has_bias, bias_per_batch, bias_per_head;
  int64_t bias_queries;
};

// One call's slice: batch [batch_begin, +batches), key/value heads
// [kv_head_begin, +kv_heads) and the query heads that attend to them.
struct ShimSlice {
  int64_t batch_begin, batches, kv_head_begin, kv_heads;
  bool operator==(const ShimSlice& o) const {
    return batch_begin == o.batch_begin && batches == o.batches &&
           kv_head_begin == o.kv_head_begin && kv_heads == o.kv_heads;
  }
};

// Elements (of the inputs' dtype) one slice of `batches` x `kv_heads` holds
// while its backward runs: padded K and V, their padded gradients, its dQ,
// its padded bias, and cuDNN's float32 dQ workspace (counted twice).
int64_t shim_slice_elements(const ShimShape& s, int64_t batches, int64_t kv_heads);

// The workspace of stock's backward over the whole call, in the same units.
int64_t stock_workspace_elements(const ShimShape& s);

// Equal slices covering the call (one graph serves them all): the fewest
// whose elements fit in stock_workspace_elements, among those that keep at
// least `min_key_tiles` (batch x query heads x key tiles of 128) each; where
// none fits, the smallest that keeps them; a call with fewer tiles is one
// slice. Batch slices first, then one batch element split along its
// key/value heads; with one query row, slices of two batch elements or more
// only (one would be the call cudnn-frontend #1072 fails on).
std::vector<ShimSlice> shim_slices(const ShimShape& s, int64_t min_key_tiles);

// The part of the bias [B|1, H|1, L|1, S] that `slice` reads, as a slice of
// the bias's own batch and key/value-head axes: an axis the bias broadcasts
// along is read whole (begin 0, length 1). Slices that read the same part
// share one padded copy of the bias.
ShimSlice bias_rows(const ShimShape& s, const ShimSlice& slice);

}  // namespace openwam

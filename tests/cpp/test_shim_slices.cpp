// How the K/V shim's backward is sliced (csrc/shim_slices.h): equal slices
// that cover the call once, the fewest whose copies and workspace fit in
// stock's workspace, never below the key tiles that fill the GPU. Plain
// arithmetic: built in CPU builds.
#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>

#include "shim_slices.h"

using openwam::bias_rows;
using openwam::shim_slice_elements;
using openwam::shim_slices;
using openwam::ShimShape;
using openwam::ShimSlice;
using openwam::stock_workspace_elements;

namespace {

constexpr int64_t kH200Tiles = 4 * 132;  // four waves of the H200's SMs

// A key mask [B, 1, 1, S] (bench_sdpa.py's "keys").
ShimShape key_mask(int64_t b, int64_t h, int64_t hkv, int64_t s_q, int64_t s_kv_padded,
                   int64_t d) {
  return {b, h, hkv, s_q, s_kv_padded, d, d, true, b > 1, false, 1};
}

// Every (batch, query head) is covered by exactly one slice, and the slices
// are the same size.
void check_cover(const ShimShape& s, const std::vector<ShimSlice>& slices) {
  std::vector<int> seen(s.batch * s.kv_heads, 0);
  for (const ShimSlice& slice : slices) {
    CHECK(slice.batches == slices[0].batches);
    CHECK(slice.kv_heads == slices[0].kv_heads);
    for (int64_t b = slice.batch_begin; b < slice.batch_begin + slice.batches; ++b) {
      for (int64_t h = slice.kv_head_begin; h < slice.kv_head_begin + slice.kv_heads; ++h) {
        REQUIRE(b < s.batch);
        REQUIRE(h < s.kv_heads);
        seen[b * s.kv_heads + h]++;
      }
    }
  }
  for (int n : seen) CHECK(n == 1);
}

}  // namespace

TEST_CASE("shim slices: one batch element each where the copies were +195 MiB",
          "[shim]") {
  // B4 H24 D128 4096x4032 with a key mask: the shape of the +195 MiB.
  const ShimShape s = key_mask(4, 24, 24, 4096, 4096, 128);
  const std::vector<ShimSlice> slices = shim_slices(s, kH200Tiles);
  REQUIRE(slices.size() == 4);
  CHECK(slices[2] == ShimSlice{2, 1, 0, 24});
  check_cover(s, slices);
  CHECK(shim_slice_elements(s, 1, 24) <= stock_workspace_elements(s));
  // Two batch elements a slice would not fit.
  CHECK(shim_slice_elements(s, 2, 24) > stock_workspace_elements(s));
}

TEST_CASE("shim slices: a whole call never fits", "[shim]") {
  // Its copies come on top of a workspace as large as stock's.
  for (const ShimShape& s : {key_mask(4, 24, 24, 4096, 4096, 128),
                             key_mask(1, 8, 1, 64, 128, 64),
                             ShimShape{2, 16, 16, 4032, 4096, 64, 64, true, true, false, 4032}}) {
    CHECK(shim_slice_elements(s, s.batch, s.kv_heads) > stock_workspace_elements(s));
  }
}

TEST_CASE("shim slices: a slice keeps the key tiles that fill the GPU", "[shim]") {
  // A left-padded 2x4032 batch of a 16-head model (the training benchmark's
  // 400m step): 1,024 key tiles in all, 512 a batch element. Half a call
  // would leave the H200 under four waves: one slice.
  const ShimShape hf{2, 16, 16, 4032, 4096, 64, 64, true, true, false, 4032};
  CHECK(shim_slices(hf, kH200Tiles).size() == 1);
  // Calls smaller than the floor stay whole.
  CHECK(shim_slices(key_mask(32, 24, 24, 360, 128, 128), 100000).size() == 1);
}

TEST_CASE("shim slices: where nothing fits, the smallest slice that keeps the tiles",
          "[shim]") {
  // 32 queries over 4,032 keys: the padded K/V copies outweigh the query
  // side's workspace at every size.
  const ShimShape s = key_mask(4, 24, 24, 32, 4096, 128);
  CHECK(shim_slice_elements(s, 1, 1) > stock_workspace_elements(s));
  CHECK(shim_slices(s, 0).size() == 4 * 24);
  // 768 key tiles a slice at least: one batch element with all its heads.
  const std::vector<ShimSlice> floor = shim_slices(s, 768);
  check_cover(s, floor);
  REQUIRE(floor.size() == 4);
  CHECK(floor[0] == ShimSlice{0, 1, 0, 24});
}

TEST_CASE("shim slices: grouped heads split along key/value heads, groups whole",
          "[shim]") {
  // One batch element, 32 query heads over 8 key/value heads.
  const ShimShape s = key_mask(1, 32, 8, 8192, 8192, 128);
  const std::vector<ShimSlice> slices = shim_slices(s, 0);
  check_cover(s, slices);
  REQUIRE(slices.size() > 1);
  CHECK(slices[0].batches == 1);
  CHECK(8 % slices[0].kv_heads == 0);
  CHECK(shim_slice_elements(s, 1, slices[0].kv_heads) <= stock_workspace_elements(s));
  // The next larger even slice would not fit.
  CHECK(shim_slice_elements(s, 1, 2 * slices[0].kv_heads) > stock_workspace_elements(s));
}

TEST_CASE("shim slices: a batch that does not divide evenly takes a divisor", "[shim]") {
  // Six batch elements where one a slice fits and more than one does not...
  const ShimShape s = key_mask(6, 24, 24, 4096, 4096, 128);
  const std::vector<ShimSlice> slices = shim_slices(s, kH200Tiles);
  check_cover(s, slices);
  CHECK(slices.size() == 6);
  // ...and a batch of 9 with room for four a slice takes three, a divisor.
  const ShimShape wide{9, 8, 8, 4096, 1024, 128, 128, false, false, false, 0};
  CHECK(shim_slice_elements(wide, 4, 8) <= stock_workspace_elements(wide));
  CHECK(shim_slice_elements(wide, 5, 8) > stock_workspace_elements(wide));
  const std::vector<ShimSlice> nine = shim_slices(wide, 0);
  check_cover(wide, nine);
  CHECK(nine.size() == 3);
}

TEST_CASE("shim slices: slices that read the same part of the bias share it", "[shim]") {
  // A [L, S] mask broadcast over batch and heads: one part, read by all.
  const ShimShape broadcast{4, 24, 24, 4096, 4096, 128, 128, true, false, false, 4096};
  const std::vector<ShimSlice> slices = shim_slices(broadcast, kH200Tiles);
  REQUIRE(slices.size() == 4);
  for (const ShimSlice& slice : slices) {
    CHECK(bias_rows(broadcast, slice) == ShimSlice{0, 1, 0, 1});
  }
  // A key mask per batch element over heads split into slices: the slices
  // of one element share its row, the next element reads another.
  const ShimShape keys = key_mask(2, 32, 8, 8192, 8192, 128);
  const std::vector<ShimSlice> split = shim_slices(keys, 0);
  REQUIRE(split.size() > 2);
  REQUIRE(split[0].batches == 1);
  CHECK(bias_rows(keys, split[0]) == bias_rows(keys, split[1]));
  CHECK(bias_rows(keys, split[0]) == ShimSlice{0, 1, 0, 1});
  CHECK(bias_rows(keys, split.back()) == ShimSlice{1, 1, 0, 1});
  // A bias per (batch, head) is its own part in every slice.
  const ShimShape full{2, 32, 8, 8192, 8192, 128, 128, true, true, true, 8192};
  const std::vector<ShimSlice> own = shim_slices(full, 0);
  REQUIRE(own.size() > 1);
  CHECK(!(bias_rows(full, own[0]) == bias_rows(full, own[1])));
}

TEST_CASE("shim slices: one query row keeps two batch elements or more a slice",
          "[shim]") {
  // B4 H24 1x4032 with a key mask (found in review): by size alone a slice
  // of one batch element, a cuDNN call of batch 1 with one query row, which
  // is cudnn-frontend #1072's trigger (NaN in all of dK and dV) where the
  // call itself, batch 4, is clean.
  const ShimShape one_row = key_mask(4, 24, 24, 1, 4096, 128);
  const std::vector<ShimSlice> slices = shim_slices(one_row, kH200Tiles);
  check_cover(one_row, slices);
  for (const ShimSlice& slice : slices) {
    CHECK(slice.batches >= 2);
    CHECK(slice.kv_heads == 24);
  }
  // The same call with two query rows may go down to one batch element.
  const ShimShape two_rows = key_mask(4, 24, 24, 2, 4096, 128);
  CHECK(shim_slices(two_rows, kH200Tiles)[0].batches == 1);
  // A prime batch has no divisor but itself above 1: one slice, whole.
  const ShimShape prime = key_mask(5, 24, 24, 1, 4096, 128);
  const std::vector<ShimSlice> whole = shim_slices(prime, kH200Tiles);
  REQUIRE(whole.size() == 1);
  CHECK(whole[0] == ShimSlice{0, 5, 0, 24});
}

// copy_along (csrc/row_copy.h): which layouts are rows for its kernel
// (copy_order, row_layout), and the copy itself on the CPU, where it runs on
// ATen's copy_ and fill_. The kernel is compared with ATen on the GPU
// (tests/gpu/test_row_copy_gpu.py).
#include <ATen/ATen.h>

#include <limits>
#include <optional>
#include <vector>

#include "row_copy.h"
#include "support.h"

using openwam_test::kF64;

namespace {

std::optional<openwam::RowLayout> rows_of(const at::Tensor& t, int64_t dim,
                                          const at::Tensor& order_of) {
  return openwam::row_layout(t.sizes(), t.strides(), dim,
                             openwam::copy_order(order_of.sizes(), order_of.strides(), dim));
}

std::optional<openwam::RowLayout> rows_of(const at::Tensor& t, int64_t dim) {
  return rows_of(t, dim, t);
}

}  // namespace

TEST_CASE("copy_order puts the largest stride first and drops size-1 dims", "[row_copy]") {
  at::Tensor bshd = at::empty({2, 5, 3, 4}, kF64).transpose(1, 2);  // [B, H, S, D] of BSHD
  CHECK(openwam::copy_order(bshd.sizes(), bshd.strides(), 2) == std::vector<int64_t>{0, 2, 1, 3});
  at::Tensor bias = at::empty({2, 1, 7, 9}, kF64);
  CHECK(openwam::copy_order(bias.sizes(), bias.strides(), 3) == std::vector<int64_t>{0, 2, 3});
  // The copy's own dim is kept even at size 1.
  at::Tensor one = at::empty({3, 1, 4}, kF64);
  CHECK(openwam::copy_order(one.sizes(), one.strides(), 1) == std::vector<int64_t>{0, 1, 2});
}

TEST_CASE("row_layout: contiguous BHSD along the keys is one row per (b, h)", "[row_copy]") {
  const auto l = rows_of(at::empty({2, 3, 5, 4}, kF64), 2);
  REQUIRE(l.has_value());
  CHECK(l->rows == 6);
  CHECK(l->row == 20);
  CHECK(l->pitch == 20);
  CHECK(l->inner == 4);
}

TEST_CASE("row_layout: BSHD viewed as BHSD is one row per batch element", "[row_copy]") {
  const auto l = rows_of(at::empty({2, 5, 3, 4}, kF64).transpose(1, 2), 2);
  REQUIRE(l.has_value());
  CHECK(l->rows == 2);
  CHECK(l->row == 60);
  CHECK(l->pitch == 60);
  CHECK(l->inner == 12);
}

TEST_CASE("row_layout: a padded buffer narrowed to its keys has the buffer's pitch",
          "[row_copy]") {
  at::Tensor buffer = at::empty({2, 3, 8, 4}, kF64);
  const auto l = rows_of(buffer.narrow(2, 0, 5), 2);
  REQUIRE(l.has_value());
  CHECK(l->rows == 6);
  CHECK(l->row == 20);
  CHECK(l->pitch == 32);
}

TEST_CASE("row_layout: a bias along its last dim is one row per query", "[row_copy]") {
  const auto l = rows_of(at::empty({2, 1, 7, 9}, kF64), 3);
  REQUIRE(l.has_value());
  CHECK(l->rows == 14);
  CHECK(l->row == 9);
  CHECK(l->inner == 1);
}

TEST_CASE("row_layout: a slice of the batch keeps its rows, of the heads keeps a pitch",
          "[row_copy]") {
  at::Tensor bhsd = at::empty({4, 6, 5, 4}, kF64);
  const auto batch = rows_of(bhsd.narrow(0, 1, 2), 2);
  REQUIRE(batch.has_value());
  CHECK(batch->rows == 12);
  CHECK(batch->pitch == 20);
  // Heads 2..3 of one batch element: two rows, 20 apart.
  const auto heads = rows_of(bhsd.narrow(0, 1, 1).narrow(1, 2, 2), 2);
  REQUIRE(heads.has_value());
  CHECK(heads->rows == 2);
  // Heads 2..3 of every batch element: the batch and head dims no longer
  // collapse into one pitch.
  CHECK_FALSE(rows_of(bhsd.narrow(1, 2, 2), 2).has_value());
}

TEST_CASE("row_layout: the copy's dim innermost in memory gives rows of it alone",
          "[row_copy]") {
  // [3, 5, 4] with dim 1 of stride 1: 12 rows of 5, 5 apart.
  const auto l = rows_of(at::empty({3, 4, 5}, kF64).transpose(1, 2), 1);
  REQUIRE(l.has_value());
  CHECK(l->rows == 12);
  CHECK(l->row == 5);
  CHECK(l->pitch == 5);
  CHECK(l->inner == 1);
}

TEST_CASE("row_layout: layouts that are not rows", "[row_copy]") {
  // Heads sliced out of BSHD: the keys' stride is not the inner block's size.
  at::Tensor bshd = at::empty({2, 5, 6, 4}, kF64).transpose(1, 2);
  CHECK_FALSE(rows_of(bshd.narrow(1, 0, 3), 2).has_value());
  // Broadcast along the copy's dim or inside it.
  CHECK_FALSE(rows_of(at::empty({2, 1, 4}, kF64).expand({2, 5, 4}), 1).has_value());
  CHECK_FALSE(rows_of(at::empty({2, 5, 1}, kF64).expand({2, 5, 4}), 1).has_value());
  // Every other element: no dim of stride 1.
  CHECK_FALSE(rows_of(at::empty({3, 4, 10}, kF64).slice(2, 0, 10, 2), 1).has_value());
  // The other side of a copy in an order its strides do not follow.
  at::Tensor bhsd = at::empty({2, 3, 5, 4}, kF64);
  CHECK_FALSE(rows_of(bhsd, 2, at::empty({2, 5, 3, 4}, kF64).transpose(1, 2)).has_value());
}

TEST_CASE("copy_along pads and cuts along a dim (CPU: ATen's copy_ and fill_)", "[row_copy]") {
  at::Tensor src = at::randn({2, 5, 3, 4}, kF64).transpose(1, 2);  // BSHD as BHSD
  at::Tensor padded = at::empty({2, 3, 8, 4}, kF64);
  openwam::copy_along(padded, src, 2, -std::numeric_limits<double>::infinity());
  CHECK(at::equal(padded.narrow(2, 0, 5), src));
  CHECK(padded.narrow(2, 5, 3).isneginf().all().item<bool>());
  at::Tensor back = at::empty_like(src);
  openwam::copy_along(back, padded, 2, 0);
  CHECK(at::equal(back, src));
}

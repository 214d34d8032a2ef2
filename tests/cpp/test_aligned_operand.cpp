// Operands as the fused kernels assume them (csrc/aligned_operand.h): a
// 16-byte aligned start, and for the varlen engines every row's start too.
// CPU tensors stand in: the rule reads pointers and strides only.
#include <ATen/ATen.h>

#include "aligned_operand.h"
#include "support.h"

using openwam::aligned_operand;
using openwam::aligned_rows;
using openwam::is_aligned;
using openwam::rows_aligned;

namespace {

const auto kBf16 = at::TensorOptions().dtype(at::kBFloat16);

}  // namespace

TEST_CASE("aligned_operand copies only a misaligned start, densely in the input's order",
          "[aligned_operand]") {
  const at::Tensor wide = at::randn({5, 4, 72}).to(at::kBFloat16);
  const at::Tensor at_start = wide.narrow(-1, 0, 64);  // rows 144 bytes apart
  CHECK(is_aligned(at_start));
  CHECK(aligned_operand(at_start).data_ptr() == at_start.data_ptr());

  const at::Tensor offset = wide.narrow(-1, 4, 64);  // 8 bytes in
  REQUIRE_FALSE(is_aligned(offset));
  const at::Tensor copy = aligned_operand(offset);
  CHECK(is_aligned(copy));
  CHECK(copy.is_contiguous());
  CHECK(at::equal(copy, offset));

  // A head-major view stays head-major in its copy (at::empty_like's rule).
  const at::Tensor head_major = at::randn({4, 6, 72}).to(at::kBFloat16).narrow(-1, 4, 64)
                                    .transpose(0, 1);
  const at::Tensor hm_copy = aligned_operand(head_major);
  CHECK(hm_copy.stride(0) < hm_copy.stride(1));
  CHECK(at::equal(hm_copy, head_major));
  CHECK_FALSE(aligned_operand(at::Tensor()).defined());
}

TEST_CASE("aligned_rows also copies rows that lie a non-multiple of 16 bytes apart",
          "[aligned_operand]") {
  // x[..., :64] of bf16 rows 68 wide: an aligned start, rows 136 bytes apart.
  const at::Tensor narrow_rows = at::randn({5, 4, 68}).to(at::kBFloat16).narrow(-1, 0, 64);
  REQUIRE(is_aligned(narrow_rows));
  CHECK_FALSE(rows_aligned(narrow_rows));
  const at::Tensor copy = aligned_rows(narrow_rows);
  CHECK(copy.data_ptr() != narrow_rows.data_ptr());
  CHECK(rows_aligned(copy));
  CHECK(is_aligned(copy));
  CHECK(at::equal(copy, narrow_rows));

  // Views a model hands in whose rows are aligned stay as they are: a slice
  // of a packed qkv projection, head-major buffers, rows of a 72-wide buffer.
  const at::Tensor qkv = at::empty({5, 3, 4, 64}, kBf16);
  for (const at::Tensor& view :
       {qkv.select(1, 1), at::empty({4, 5, 64}, kBf16).transpose(0, 1),
        at::empty({5, 4, 72}, kBf16).narrow(-1, 0, 64), at::empty({5, 4, 64}, kBf16)}) {
    CAPTURE(view.strides());
    CHECK(rows_aligned(view));
    CHECK(aligned_rows(view).data_ptr() == view.data_ptr());
  }

  // A size-1 dimension's stride is never used, whatever it is; float32 rows
  // need a multiple of four elements.
  CHECK(rows_aligned(at::empty({1, 4, 64}, kBf16).as_strided({1, 4, 64}, {3, 64, 1})));
  CHECK_FALSE(rows_aligned(at::empty({6, 4, 66}).narrow(-1, 0, 64)));
  CHECK(rows_aligned(at::empty({6, 4, 68}).narrow(-1, 0, 64)));
}

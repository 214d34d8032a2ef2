// run_pytorch_path (csrc/pytorch_path.h) on the CPU: each route against
// PyTorch's own at::scaled_dot_product_attention on the same call.
#include <ATen/ATen.h>

#include <optional>

#include "decision.h"
#include "pytorch_path.h"
#include "support.h"

using openwam::Decision;
using openwam::Route;
using openwam_test::Inputs;
using openwam_test::kF32;

namespace {

at::Tensor stock(const Inputs& in) {
  return at::scaled_dot_product_attention(in.query, in.key, in.value, in.attn_mask, in.dropout_p,
                                          in.is_causal, in.scale, in.enable_gqa);
}

at::Tensor routed(const Inputs& in, Route route) {
  Decision d;
  d.route = route;
  return openwam::run_pytorch_path(in.call(), d);
}

}  // namespace

TEST_CASE("run_pytorch_path: the math route hides what a bool mask hides", "[pytorch_path]") {
  // PyTorch's entry turns a bool mask into 0 / -inf before its math backend;
  // the math kernel adds the mask as it is (a bool True added 1, hid nothing).
  Inputs in;
  in.query = at::randn({2, 3, 4, 8}, kF32);
  in.key = at::randn({2, 3, 6, 8}, kF32);
  in.value = at::randn({2, 3, 6, 8}, kF32);
  at::Tensor keep = at::rand({2, 1, 4, 6}).gt(0.5);
  keep.select(-1, 0).fill_(true);
  for (const at::Tensor& mask : {keep, keep.to(at::kFloat).log()}) {
    in.attn_mask = mask;
    for (Route route : {Route::kMath, Route::kPyTorch}) {
      CAPTURE(openwam::to_string(route), mask.scalar_type());
      CHECK(at::allclose(routed(in, route), stock(in), 1e-5, 1e-6));
    }
  }
  // A fully hidden row: PyTorch's math backend gives it 0, as F.sdpa does.
  keep.select(2, 1).fill_(false);
  in.attn_mask = keep;
  const at::Tensor out = routed(in, Route::kMath);
  CHECK(at::allclose(out, stock(in), 1e-5, 1e-6));
  CHECK(out.select(2, 1).abs().max().item<float>() == 0.0f);
}

TEST_CASE("run_pytorch_path: empty head_dim with a bool mask hides the keys",
          "[pytorch_path]") {
  // The decision sends such an empty CPU call to the math route. Every score
  // is equal, so a row is the mean of the values its mask shows (F.sdpa's
  // answer on torch 2.11 and 2.13; torch 2.12's returns zeros for head_dim 0).
  Inputs in;
  in.query = at::randn({1, 2, 4, 0}, kF32);
  in.key = at::randn({1, 2, 5, 0}, kF32);
  in.value = at::randn({1, 2, 5, 8}, kF32);
  in.attn_mask = at::tensor({1, 0, 1, 0, 0}).to(at::kBool).expand({4, 5});
  const at::Tensor want = in.value.index_select(2, at::tensor({0L, 2L}))
                              .mean(2, /*keepdim=*/true)
                              .expand({1, 2, 4, 8});
  CHECK(at::allclose(routed(in, Route::kMath), want, 1e-5, 1e-6));
}

// check_leaf_inputs (csrc/leaf_inputs.h): what a direct call of the leaf ops
// must pass. On the GPU a failed check would otherwise be a cuDNN graph built
// for the query's dtype reading another dtype's memory, or a host pointer.
#include <ATen/ATen.h>

#include <optional>

#include "leaf_inputs.h"
#include "ops.h"
#include "support.h"

using Catch::Matchers::Contains;
using openwam_test::kF32;

namespace {

const auto kBf16 = at::TensorOptions().dtype(at::kBFloat16);

std::string error_of_inputs(const openwam::LeafInputs& in, bool half_only) {
  return openwam_test::error_of([&] { openwam::check_leaf_inputs("op", in, half_only); });
}

}  // namespace

TEST_CASE("check_leaf_inputs: consistent inputs pass", "[leaf_inputs]") {
  const at::Tensor q = at::randn({1, 2, 3, 8}, kBf16), k = at::randn({1, 1, 5, 8}, kBf16);
  const std::optional<at::Tensor> bias = at::zeros({1, 1, 3, 5}, kBf16);
  const at::Tensor lse = at::zeros({1, 2, 3, 1}, kF32);
  CHECK_NOTHROW(openwam::check_leaf_inputs("op", {q, k, k, bias, q, q, lse}, true));
  CHECK_NOTHROW(openwam::check_leaf_inputs("op", {q, k, k, std::nullopt}, true));
  const at::Tensor q32 = q.to(at::kFloat), k32 = k.to(at::kFloat);
  CHECK_NOTHROW(openwam::check_leaf_inputs("op", {q32, k32, k32, std::nullopt}, false));
}

TEST_CASE("check_leaf_inputs: what it refuses", "[leaf_inputs]") {
  const at::Tensor q = at::randn({1, 2, 3, 8}, kBf16), k = at::randn({1, 1, 5, 8}, kBf16);
  const std::optional<at::Tensor> none;
  CHECK(error_of_inputs({q.to(at::kFloat), k, k, none}, true) ==
        "op: the cuDNN kernels take float16 or bfloat16, got query of Float");
  CHECK(error_of_inputs({q, k.to(at::kHalf), k, none}, true) ==
        "op: key must be BFloat16, got Half");
  CHECK(error_of_inputs({q, k, k.to(at::kFloat), none}, false) ==
        "op: value must be BFloat16, got Float");
  const std::optional<at::Tensor> f32_bias = at::zeros({1, 1, 3, 5}, kF32);
  CHECK(error_of_inputs({q, k, k, f32_bias}, true) ==
        "op: attn_bias (additive, in query's dtype) must be BFloat16, got Float");
  CHECK(error_of_inputs({q, k, k, none, q.to(at::kHalf)}, true) ==
        "op: grad_out must be BFloat16, got Half");
  CHECK(error_of_inputs({q, k, k, none, q, q, at::zeros({1, 2, 3, 1}, kBf16)}, true) ==
        "op: logsumexp must be Float, got BFloat16");
  CHECK(error_of_inputs({q.flatten(0, 1), k, k, none}, true) ==
        "op: query, key and value must be 4-D [B, H, S, E], got 3-D, 4-D and 4-D");
  // Sizes cuDNN would read past: another batch, heads that do not group, a
  // value shorter than the key, another head_dim for the key.
  const std::string sizes = "op: query [B, H, L, E], key [B, H_kv, S, E] and value "
                            "[B, H_kv, S, Ev] with H a multiple of H_kv, got ";
  const at::Tensor k2 = at::randn({2, 1, 5, 8}, kBf16), k3 = at::randn({1, 3, 5, 8}, kBf16);
  CHECK(error_of_inputs({q, k2, k2, none}, true) ==
        sizes + "[1, 2, 3, 8], [2, 1, 5, 8] and [2, 1, 5, 8]");
  CHECK(error_of_inputs({q, k3, k3, none}, true) ==
        sizes + "[1, 2, 3, 8], [1, 3, 5, 8] and [1, 3, 5, 8]");
  CHECK(error_of_inputs({q, k, k.narrow(2, 0, 4), none}, true) ==
        sizes + "[1, 2, 3, 8], [1, 1, 5, 8] and [1, 1, 4, 8]");
  CHECK(error_of_inputs({q, k.narrow(3, 0, 4), k, none}, true) ==
        sizes + "[1, 2, 3, 8], [1, 1, 5, 4] and [1, 1, 5, 8]");
  CHECK_NOTHROW(openwam::check_leaf_inputs("op", {q, k, k.narrow(3, 0, 4), none}, true));
  // A tensor on another device than the query's: the meta device stands in
  // for a second one on a machine without a GPU.
  CHECK(error_of_inputs({q, k.to(at::kMeta), k, none}, true) ==
        "op: key must be on query's device (cpu), got meta");
}

TEST_CASE("_cudnn_sdpa's CPU kernels check their inputs", "[leaf_inputs]") {
  const at::Tensor q = at::randn({1, 2, 3, 8}, kF32), k = at::randn({1, 2, 5, 8}, kF32);
  CHECK_THAT(openwam_test::error_of([&] {
               openwam::ops::cudnn_sdpa().call(q, k, k.to(at::kDouble), std::nullopt, 0.0, false,
                                               std::nullopt, true, 0);
             }),
             Contains("openwam::_cudnn_sdpa: value must be Float, got Double"));
  at::AutoGradMode grad_off(false);
  const auto f = openwam::ops::cudnn_sdpa().call(q, k, k, std::nullopt, 0.0, false,
                                                 std::nullopt, true, 0);
  CHECK_THAT(openwam_test::error_of([&] {
               openwam::ops::cudnn_sdpa_backward().call(
                   std::get<0>(f).to(at::kDouble), q, k, k, std::nullopt, std::get<0>(f),
                   std::get<1>(f), std::get<2>(f), std::get<3>(f), 0.0, false, std::nullopt, 0);
             }),
             Contains("openwam::_cudnn_sdpa_backward: grad_out must be Float, got Double"));
}

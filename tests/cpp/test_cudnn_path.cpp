// The guarded cuDNN path's prologue (csrc/cudnn_path.h) on the CPU: 3-D
// inputs, masks of every rank as cuDNN's bias, the plan handed to the leaf
// op. openwam::sdpa never routes a CPU call here, so run_cudnn_path is
// called directly with a decision; the CPU reference kernels stand in for
// cuDNN.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <limits>
#include <string>
#include <vector>

#include "cudnn_path.h"
#include "decision.h"
#include "plan.h"
#include "support.h"

using openwam::Plan;
using openwam_test::bhsd;
using openwam_test::Inputs;
using openwam_test::kBF16;
using openwam_test::kF32;
using openwam_test::rel_diff;

namespace {

// The mask as an additive float64 bias, right-aligned to the scores.
at::Tensor reference_bias(const std::optional<at::Tensor>& mask) {
  if (!mask.has_value()) {
    return at::Tensor();
  }
  if (mask->scalar_type() == at::kBool) {
    return at::zeros(mask->sizes(), openwam_test::kF64)
        .masked_fill(mask->logical_not(), -std::numeric_limits<double>::infinity());
  }
  return mask->to(at::kDouble);
}

openwam::Decision cudnn_decision(int64_t plan) {
  openwam::Decision d;
  d.route = openwam::Route::kCudnn;
  d.plan = Plan::from_int(plan);
  return d;
}

// run_cudnn_path against the float64 reference: output, and the gradients
// of every input that requires grad.
void check(const Inputs& in, int64_t plan, double tolerance) {
  const at::Tensor out = openwam::run_cudnn_path(in.call(), cudnn_decision(plan));
  CHECK(out.sizes() == in.query.sizes());
  CHECK(out.scalar_type() == in.query.scalar_type());
  const at::Tensor grad_out = at::randn(out.sizes(), out.options());
  const auto ref = openwam_test::reference_attention(
      in.query, in.key, in.value, reference_bias(in.attn_mask), in.is_causal, in.scale,
      grad_out);
  CHECK(rel_diff(out, ref.out) <= tolerance);
  if (!in.call().differentiated()) {
    CHECK_FALSE(out.requires_grad());
    return;
  }
  REQUIRE(out.requires_grad());
  const auto grads = torch::autograd::grad({out}, {in.query, in.key, in.value}, {grad_out});
  CHECK(rel_diff(grads[0], ref.dq) <= tolerance);
  CHECK(rel_diff(grads[1], ref.dk) <= tolerance);
  CHECK(rel_diff(grads[2], ref.dv) <= tolerance);
}

Inputs three_d(int64_t N, int64_t L, int64_t S, int64_t D, at::TensorOptions options) {
  Inputs in;
  in.query = at::randn({N, L, D}, options).requires_grad_(true);
  in.key = at::randn({N, S, D}, options).requires_grad_(true);
  in.value = at::randn({N, S, D}, options).requires_grad_(true);
  return in;
}

}  // namespace

TEST_CASE("run_cudnn_path: 4-D inputs under every key plan", "[cudnn_path][numerics]") {
  for (int64_t plan : {0, 1, 2, 4, 7}) {
    CAPTURE(Plan::from_int(plan).to_string());
    check(bhsd(2, 3, 7, 45, 16, kF32), plan, 2e-5);
    Inputs causal = bhsd(2, 3, 9, 130, 16, kF32);
    causal.is_causal = true;
    check(causal, plan, 2e-5);
    check(bhsd(2, 4, 7, 45, 16, kF32, true, 2), plan, 2e-5);  // GQA
  }
}

TEST_CASE("run_cudnn_path: 3-D inputs get a unit head axis and lose it again",
          "[cudnn_path][numerics]") {
  for (int64_t plan : {0, 1, 2, 4}) {
    CAPTURE(Plan::from_int(plan).to_string());
    check(three_d(3, 7, 45, 16, kF32), plan, 2e-5);
    Inputs masked = three_d(3, 7, 45, 16, kF32);
    at::Tensor keep = at::rand({3, 7, 45}).gt(0.4);
    keep.select(-1, 0).fill_(true);
    keep[1][2].fill_(false);  // a row that sees no key: zero output and gradient
    masked.attn_mask = keep;
    check(masked, plan, 2e-5);
    Inputs causal = three_d(3, 9, 5, 16, kF32);
    causal.is_causal = true;
    check(causal, plan, 2e-5);
  }
}

TEST_CASE("run_cudnn_path: masks of every rank and kind become cuDNN's bias",
          "[cudnn_path][numerics]") {
  const int64_t B = 2, H = 3, L = 7, S = 45;
  const std::vector<std::vector<int64_t>> shapes = {
      {S}, {L, S}, {L, 1}, {H, L, S}, {B, 1, L, S}, {B, H, L, S}, {B, 1, 1, S}, {1, 1, 1, 1}};
  for (const auto& shape : shapes) {
    for (auto dtype : {at::kBool, at::kFloat, at::kBFloat16}) {
      for (int64_t plan : {0, 2}) {
        CAPTURE(shape, dtype, plan);
        Inputs in = bhsd(B, H, L, S, 16, kBF16);
        if (dtype == at::kBool) {
          at::Tensor keep = at::rand(shape).gt(0.3);
          keep.select(-1, 0).fill_(true);
          in.attn_mask = keep;
        } else {
          in.attn_mask = at::randn(shape, at::TensorOptions().dtype(dtype));
        }
        check(in, plan, 2e-2);
      }
    }
  }
}

TEST_CASE("run_cudnn_path: one query row with the single-row fix",
          "[cudnn_path][numerics]") {
  for (int64_t plan : {8, 9, 10, 12}) {
    CAPTURE(Plan::from_int(plan).to_string());
    check(bhsd(1, 2, 1, 45, 16, kF32), plan, 2e-5);
    check(three_d(1, 1, 300, 16, kF32), plan, 2e-5);
    Inputs masked = bhsd(1, 4, 1, 45, 16, kF32, true, 2);
    at::Tensor keep = at::rand({45}).gt(0.5);
    keep[0] = true;
    masked.attn_mask = keep;
    check(masked, plan, 2e-5);
  }
}

TEST_CASE("run_cudnn_path: a call that is not differentiated", "[cudnn_path]") {
  check(bhsd(2, 3, 7, 45, 16, kBF16, false), 0, 2e-2);
  Inputs in = bhsd(2, 3, 7, 45, 16, kF32);
  at::AutoGradMode grad_off(false);
  check(in, 0, 2e-5);
}

// The cuDNN path's leaf ops on the CPU, through the dispatcher: their CPU
// kernels run the plans around an fp32 reference attention
// (csrc/cudnn_path_kernels.cpp). Every plan must give what the float64
// reference gives; the Meta kernels must promise the layouts the CPU kernels
// deliver; the autograd node must call the backward op. The padding mask is
// the frontend's (CUDA) fix: on the CPU it changes nothing, bit for bit.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "plan.h"
#include "support.h"
#include "env.h"

using Catch::Matchers::Contains;
using openwam::Plan;
using openwam_test::bhsd;
using openwam_test::bshd;
using openwam_test::Inputs;
using openwam_test::kBF16;
using openwam_test::kF32;
using openwam_test::kF64;
using openwam_test::max_abs_diff;
using openwam_test::reference_attention;
using openwam_test::rel_diff;
using openwam_test::same_layout;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The leaf ops' inputs: 4-D q, k, v and an additive bias in q's dtype (or
// none), none of them requiring grad.
struct LeafCase {
  std::string name;
  Inputs in;
  at::Tensor bias;
  bool one_row() const { return in.query.size(2) == 1; }
};

at::Tensor additive(const at::Tensor& keep, at::TensorOptions options) {
  return at::zeros(keep.sizes(), options).masked_fill(keep.logical_not(), -kInf);
}

Inputs no_grad(Inputs in) {
  in.query = in.query.detach();
  in.key = in.key.detach();
  in.value = in.value.detach();
  return in;
}

std::vector<LeafCase> leaf_cases(at::TensorOptions options) {
  std::vector<LeafCase> cases;
  const auto add = [&](std::string name, Inputs in, at::Tensor bias = at::Tensor()) {
    cases.push_back({std::move(name), no_grad(std::move(in)), std::move(bias)});
  };
  add("no mask", bhsd(2, 2, 7, 45, 16, options, false));
  add("aligned keys", bhsd(2, 2, 7, 128, 16, options, false));
  {
    // A bool mask as cudnn_bias gives it: [B, 1, L, S], one row fully hidden.
    at::Tensor keep = at::rand({2, 1, 7, 45}).gt(0.4);
    keep.select(-1, 0).fill_(true);
    keep[0][0][3].fill_(false);
    add("bool mask, a hidden row", bhsd(2, 2, 7, 45, 16, options, false),
        additive(keep, options));
  }
  add("additive mask [1, 1, L, S]", bhsd(2, 2, 7, 45, 16, options, false),
      at::randn({1, 1, 7, 45}, options));
  add("key-padding mask [B, 1, 1, S]", bhsd(2, 2, 7, 200, 16, options, false),
      additive(at::arange(200).lt(150).view({1, 1, 1, 200}).expand({2, 1, 1, 200})
                   .contiguous(),
               options));
  for (auto [L, S] : std::vector<std::pair<int64_t, int64_t>>{{5, 5}, {3, 9}, {9, 3}, {4, 130}}) {
    Inputs in = bhsd(2, 2, L, S, 8, options, false);
    in.is_causal = true;
    add("causal " + std::to_string(L) + "x" + std::to_string(S), in);
  }
  add("GQA 4/2", bhsd(2, 4, 7, 45, 16, options, false, 2));
  add("BSHD", bshd(2, 3, 7, 45, 16, options, false));
  {
    Inputs in = bhsd(2, 2, 7, 45, 16, options, false);
    in.scale = 0.7;
    add("scale 0.7", in);
  }
  {
    Inputs in = bhsd(2, 2, 7, 45, 16, options, false);
    openwam_test::make_first_row_low(in);
    add("a row with logsumexp near -55", in);
  }
  add("one query row", bhsd(1, 2, 1, 45, 16, options, false));
  add("one query row, one head", bhsd(1, 1, 1, 300, 16, options, false));
  {
    Inputs in = bhsd(1, 2, 1, 45, 16, options, false);
    in.is_causal = true;
    add("one query row, causal", in);
  }
  {
    at::Tensor keep = at::rand({1, 1, 1, 45}).gt(0.5);
    keep.select(-1, 0).fill_(true);
    add("one query row, mask", bhsd(1, 2, 1, 45, 16, options, false),
        additive(keep, options));
  }
  {
    Inputs in = bhsd(1, 4, 1, 45, 16, options, false, 2);
    openwam_test::make_first_row_low(in);
    add("one query row, GQA, logsumexp near -55", in);
  }
  // The one-row backward (single_row_backward) on a row that sees no key,
  // and with a batch, which its products group by key/value head.
  add("one query row, a hidden row", bhsd(1, 4, 1, 45, 16, options, false, 2),
      additive(at::zeros({1, 1, 1, 45}, at::kBool), options));
  add("one query row, batch 3, GQA 6/2", bhsd(3, 6, 1, 77, 16, options, false, 2),
      at::randn({3, 6, 1, 77}, options));
  return cases;
}

std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// out, logsumexp, philox seed and offset, the raised bias (score_shift.h).
using Forward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
constexpr int64_t kShiftScores = 16;
using Backward = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

Forward forward(const LeafCase& c, int64_t plan, bool lse = true) {
  const Inputs& in = c.in;
  return openwam::ops::cudnn_sdpa().call(in.query, in.key, in.value, opt(c.bias),
                                         in.dropout_p, in.is_causal, in.scale, lse, plan);
}

// As the autograd node calls it: after a forward that shifted (its raised
// bias has keys), with the raised bias and a plan that no longer shifts.
Backward backward(const LeafCase& c, const at::Tensor& grad_out, const Forward& f,
                  int64_t plan) {
  const Inputs& in = c.in;
  const at::Tensor& raised = std::get<4>(f);
  const bool shifted = raised.dim() > 0 && raised.size(-1) > 0;
  return openwam::ops::cudnn_sdpa_backward().call(
      grad_out, in.query, in.key, in.value, shifted ? opt(raised) : opt(c.bias), std::get<0>(f),
      std::get<1>(f), std::get<2>(f), std::get<3>(f), in.dropout_p, in.is_causal, in.scale,
      shifted ? plan & ~kShiftScores : plan);
}

// Plans a call can carry: the single-row fix only for one query row.
std::vector<int64_t> plans_for(const LeafCase& c) {
  std::vector<int64_t> plans;
  for (int64_t bits = 0; bits < 16; ++bits) {
    if (!Plan::from_int(bits).pad_query_backward || c.one_row()) {
      plans.push_back(bits);
    }
  }
  return plans;
}

at::Tensor as_meta(const at::Tensor& t) {
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
}

LeafCase on_meta(const LeafCase& c) {
  LeafCase m = c;
  m.in.query = as_meta(c.in.query);
  m.in.key = as_meta(c.in.key);
  m.in.value = as_meta(c.in.value);
  if (c.bias.defined()) {
    m.bias = as_meta(c.bias);
  }
  return m;
}

void check_against_reference(at::TensorOptions options, double tolerance) {
  for (const LeafCase& c : leaf_cases(options)) {
    const Inputs& in = c.in;
    const at::Tensor grad_out = at::randn(in.query.sizes(), options);
    const auto ref = reference_attention(in.query, in.key, in.value, c.bias, in.is_causal,
                                         in.scale, grad_out);
    for (int64_t plan : plans_for(c)) {
      CAPTURE(c.name, Plan::from_int(plan).to_string());
      const Forward f = forward(c, plan);
      const auto& [out, lse, seed, offset, raised] = f;
      CHECK(raised.numel() == 0);  // no plan here shifts
      CHECK(same_layout(out, in.query));
      REQUIRE(lse.sizes() == at::IntArrayRef({in.query.size(0), in.query.size(1),
                                              in.query.size(2), 1}));
      CHECK(lse.scalar_type() == at::kFloat);
      CHECK(rel_diff(out, ref.out) <= tolerance);
      CHECK(rel_diff(lse.squeeze(-1), ref.logsumexp) <= 1e-5);

      const auto [dq, dk, dv] = backward(c, grad_out, f, plan);
      CHECK(same_layout(dq, in.query));
      CHECK(same_layout(dk, in.key));
      CHECK(same_layout(dv, in.value));
      CHECK(rel_diff(dq, ref.dq) <= tolerance);
      CHECK(rel_diff(dk, ref.dk) <= tolerance);
      CHECK(rel_diff(dv, ref.dv) <= tolerance);
    }
  }
}

}  // namespace

TEST_CASE("the openwam schemas are registered", "[leaf_ops]") {
  auto& d = c10::Dispatcher::singleton();
  for (const char* name : {"openwam::sdpa", "openwam::_cudnn_sdpa",
                           "openwam::_cudnn_sdpa_backward", "openwam::pad_keys"}) {
    CAPTURE(name);
    CHECK(d.findSchema({name, ""}).has_value());
  }
  // The dQ repair's op is retired with its kernel (the padding mask fixes the
  // defect at its source): a graph saved with it must fail to load, not run.
  CHECK_FALSE(d.findSchema({"openwam::_repair_dq_", ""}).has_value());
  // pad_keys' multiple defaults to the cuDNN key tile.
  const auto& args = openwam_test::pad_keys_op().schema().arguments();
  REQUIRE(args.size() == 4);
  REQUIRE(args[3].default_value().has_value());
  CHECK(args[3].default_value()->toInt() == 128);
}

TEST_CASE("the float64 reference agrees with ATen's math attention", "[leaf_ops]") {
  // The instrument the leaf ops are measured with, measured once itself, on
  // inputs where ATen's conventions and cuDNN's agree (every row sees a key).
  for (const LeafCase& c : leaf_cases(kF64)) {
    if (c.name.find("a hidden row") != std::string::npos) {
      continue;
    }
    CAPTURE(c.name);
    const Inputs& in = c.in;
    const at::Tensor grad_out = at::randn(in.query.sizes(), kF64);
    const auto ref = reference_attention(in.query, in.key, in.value, c.bias, in.is_causal,
                                         in.scale, grad_out);
    const at::Tensor q = in.query.clone().requires_grad_(true);
    const at::Tensor k = in.key.clone().requires_grad_(true);
    const at::Tensor v = in.value.clone().requires_grad_(true);
    const at::Tensor out = std::get<0>(at::_scaled_dot_product_attention_math(
        q, k, v, opt(c.bias), 0.0, in.is_causal, std::nullopt, in.scale, in.enable_gqa));
    const auto grads = torch::autograd::grad({out}, {q, k, v}, {grad_out});
    CHECK(rel_diff(ref.out, out) <= 1e-12);
    CHECK(rel_diff(ref.dq, grads[0]) <= 1e-12);
    CHECK(rel_diff(ref.dk, grads[1]) <= 1e-12);
    CHECK(rel_diff(ref.dv, grads[2]) <= 1e-12);
  }
}

TEST_CASE("_cudnn_sdpa on the CPU: every plan equals the float64 reference (fp32)",
          "[leaf_ops][numerics]") {
  check_against_reference(kF32, 2e-5);
}

TEST_CASE("_cudnn_sdpa on the CPU: every plan equals the float64 reference (bf16)",
          "[leaf_ops][numerics]") {
  check_against_reference(kBF16, 2e-2);
}

TEST_CASE("_cudnn_sdpa on the CPU: the plans do not change the results",
          "[leaf_ops][numerics]") {
  for (const LeafCase& c : leaf_cases(kF32)) {
    const at::Tensor grad_out = at::randn(c.in.query.sizes(), kF32);
    const Forward f0 = forward(c, 0);
    const auto [dq0, dk0, dv0] = backward(c, grad_out, f0, 0);
    for (int64_t plan : plans_for(c)) {
      const Plan p = Plan::from_int(plan);
      CAPTURE(c.name, p.to_string());
      const Forward f = forward(c, plan);
      if (!p.pad_keys_forward) {
        // Only padding in the forward touches the forward.
        CHECK(std::get<0>(f).equal(std::get<0>(f0)));
        CHECK(std::get<1>(f).equal(std::get<1>(f0)));
      } else {
        CHECK(max_abs_diff(std::get<0>(f), std::get<0>(f0)) <= 1e-5);
        CHECK(max_abs_diff(std::get<1>(f), std::get<1>(f0)) <= 1e-5);
      }
      const auto [dq, dk, dv] = backward(c, grad_out, f, plan);
      if (!p.pads_inputs()) {
        // The padding mask is the frontend's: the reference engine runs the
        // call as it is.
        CHECK(dq.equal(dq0));
        CHECK(dk.equal(dk0));
        CHECK(dv.equal(dv0));
      }
      CHECK(rel_diff(dq, dq0) <= 2e-5);
      CHECK(rel_diff(dk, dk0) <= 2e-5);
      CHECK(rel_diff(dv, dv0) <= 2e-5);
    }
  }
}

TEST_CASE("_cudnn_sdpa: the Meta kernels give the CPU kernels' layouts", "[leaf_ops]") {
  for (const LeafCase& c : leaf_cases(kBF16)) {
    const LeafCase m = on_meta(c);
    const at::Tensor grad_out = at::randn(c.in.query.sizes(), kBF16);
    std::vector<int64_t> plans = plans_for(c);
    if (c.bias.defined() && c.bias.dim() == 4 && c.bias.size(-1) == c.in.key.size(2) &&
        c.bias.stride(-1) == 1 && c.in.dropout_p == 0.0) {
      plans.push_back(kShiftScores);  // a bias of one query row shifts in the forward
    }
    for (int64_t plan : plans) {
      for (bool lse : {true, false}) {
        CAPTURE(c.name, Plan::from_int(plan).to_string(), lse);
        const Forward f = forward(c, plan, lse);
        const Forward fm = forward(m, plan, lse);
        CHECK(std::get<0>(fm).is_meta());
        CHECK(same_layout(std::get<0>(fm), std::get<0>(f)));
        CHECK(same_layout(std::get<1>(fm), std::get<1>(f)));
        CHECK(same_layout(std::get<2>(fm), std::get<2>(f)));
        CHECK(same_layout(std::get<3>(fm), std::get<3>(f)));
        CHECK(same_layout(std::get<4>(fm), std::get<4>(f)));
        if (!lse) {
          CHECK(std::get<1>(f).sizes() == at::IntArrayRef({0}));
          continue;
        }
        const Backward b = backward(c, grad_out, f, plan);
        const Backward bm = backward(m, as_meta(grad_out), fm, plan);
        CHECK(std::get<0>(bm).is_meta());
        CHECK(same_layout(std::get<0>(bm), std::get<0>(b)));
        CHECK(same_layout(std::get<1>(bm), std::get<1>(b)));
        CHECK(same_layout(std::get<2>(bm), std::get<2>(b)));
      }
    }
  }
}

TEST_CASE("_cudnn_sdpa: the autograd node calls the backward op with the plan",
          "[leaf_ops]") {
  for (const LeafCase& c : leaf_cases(kF32)) {
    // None, the padding mask alone (OPENWAM_SDPA_PAD=always at s_kv % 128 == 0),
    // the key-tail plan, and the single-row plan (or the key tail with dropout).
    for (int64_t plan : {int64_t{0}, int64_t{1}, int64_t{3}, c.one_row() ? int64_t{9} : int64_t{5}}) {
      CAPTURE(c.name, Plan::from_int(plan).to_string());
      const at::Tensor q = c.in.query.clone().requires_grad_(true);
      const at::Tensor k = c.in.key.clone().requires_grad_(true);
      const at::Tensor v = c.in.value.clone().requires_grad_(true);
      const at::Tensor out = std::get<0>(openwam::ops::cudnn_sdpa().call(
          q, k, v, opt(c.bias), 0.0, c.in.is_causal, c.in.scale, true, plan));
      REQUIRE(out.requires_grad());
      REQUIRE(out.grad_fn() != nullptr);
      CHECK(out.grad_fn()->name() == "openwam::CudnnSdpaBackward");
      const at::Tensor grad_out = at::randn_like(out);
      const auto grads = torch::autograd::grad({out}, {q, k, v}, {grad_out});

      const Backward direct = backward(c, grad_out, forward(c, plan), plan);
      CHECK(grads[0].equal(std::get<0>(direct)));
      CHECK(grads[1].equal(std::get<1>(direct)));
      CHECK(grads[2].equal(std::get<2>(direct)));
    }
  }
}

TEST_CASE("_cudnn_sdpa: gradients for some inputs only", "[leaf_ops]") {
  const Inputs in = no_grad(bhsd(2, 2, 7, 45, 16, kF32, false));
  const at::Tensor v = in.value.clone().requires_grad_(true);
  const at::Tensor out = std::get<0>(openwam::ops::cudnn_sdpa().call(
      in.query, in.key, v, std::nullopt, 0.0, false, std::nullopt, true, 0));
  REQUIRE(out.requires_grad());
  const at::Tensor grad_out = at::randn_like(out);
  const auto grads = torch::autograd::grad({out}, {v}, {grad_out});
  const auto ref = reference_attention(in.query, in.key, in.value, at::Tensor(), false,
                                       std::nullopt, grad_out);
  CHECK(rel_diff(grads[0], ref.dv) <= 2e-5);
  // Without grad mode: no node.
  at::AutoGradMode grad_off(false);
  const at::Tensor plain = std::get<0>(openwam::ops::cudnn_sdpa().call(
      in.query, in.key, v, std::nullopt, 0.0, false, std::nullopt, false, 0));
  CHECK_FALSE(plain.requires_grad());
}

TEST_CASE("_cudnn_sdpa: the errors", "[leaf_ops]") {
  const Inputs in = no_grad(bhsd(2, 2, 7, 45, 16, kF32, false));
  const at::Tensor q = in.query.clone().requires_grad_(true);
  const auto call = [&](const at::Tensor& query, const std::optional<at::Tensor>& bias,
                        double dropout, bool lse, int64_t plan) {
    return openwam::ops::cudnn_sdpa().call(query, in.key, in.value, bias, dropout, false,
                                           std::nullopt, lse, plan);
  };
  // Recorded without gradients, run with them (run_decompositions()): the
  // training forward, not an error (test_cudnn_path_cpu.py checks the gradients).
  CHECK(std::get<1>(call(q, std::nullopt, 0.0, false, 0)).numel() == 2 * 2 * 7);
  CHECK(openwam_test::error_of([&] {
          call(q, at::zeros({7, 45}, kF32).requires_grad_(true), 0.0, true, 0);
        }) == "openwam::_cudnn_sdpa: attn_bias must not require grad (the cuDNN path "
              "does not differentiate the mask)");
  CHECK(openwam_test::error_of([&] { call(in.query, std::nullopt, 0.5, true, 0); }) ==
        "openwam::_cudnn_sdpa (CPU reference kernel): no dropout, got 0.5");
  for (int64_t plan : {32L, -1L}) {
    CAPTURE(plan);
    CHECK_THAT(openwam_test::error_of([&] { call(in.query, std::nullopt, 0.0, true, plan); }),
               Contains("plan must be a combination of the plan flags"));
  }
  const LeafCase c{"", in, at::Tensor()};
  const Forward f = forward(c, 0);
  const at::Tensor grad_out = at::randn_like(std::get<0>(f));
  CHECK_THAT(openwam_test::error_of([&] { backward(c, grad_out, f, 64); }),
             Contains("plan must be a combination of the plan flags"));
  CHECK(openwam_test::error_of([&] {
          openwam::ops::cudnn_sdpa_backward().call(
              grad_out, in.query, in.key, in.value, std::nullopt, std::get<0>(f),
              std::get<1>(f), std::get<2>(f), std::get<3>(f), 0.25, false, std::nullopt, 0);
        }) == "openwam::_cudnn_sdpa_backward (CPU reference kernel): no dropout, got 0.25");
  // pad_keys_backward (2) with dropout: the backward would replay the forward's
  // pattern over another key length. Refused by every kernel, before its engine.
  const std::string keys_at_backward =
      ": the plan pad_keys_backward is for calls without dropout (with dropout the keys are "
      "padded in the forward: pad_keys_forward), got dropout_p ";
  CHECK(openwam_test::error_of([&] { call(in.query, std::nullopt, 0.5, true, 2); }) ==
        "openwam::_cudnn_sdpa" + keys_at_backward + "0.5");
  CHECK(openwam_test::error_of([&] {
          openwam::ops::cudnn_sdpa_backward().call(
              grad_out, in.query, in.key, in.value, std::nullopt, std::get<0>(f),
              std::get<1>(f), std::get<2>(f), std::get<3>(f), 0.25, false, std::nullopt, 2);
        }) == "openwam::_cudnn_sdpa_backward" + keys_at_backward + "0.25");
}

TEST_CASE("_cudnn_sdpa_backward: pad_query_backward needs one query row", "[leaf_ops]") {
  const LeafCase c{"", no_grad(bhsd(2, 2, 7, 45, 16, kF32, false)), at::Tensor()};
  const Forward f = forward(c, 0);
  const at::Tensor grad_out = at::randn_like(std::get<0>(f));
  for (int64_t plan : {8, 9, 10, 12}) {
    CAPTURE(plan);
    CHECK(openwam_test::error_of([&] { backward(c, grad_out, f, plan); }) ==
          "openwam::_cudnn_sdpa_backward: the plan pad_query_backward is for a single "
          "query row, got 7 rows");
  }
}

TEST_CASE("_cudnn_sdpa: OPENWAM_SDPA_CHECK_FINITE=1 raises on a non-finite gradient",
          "[leaf_ops]") {
  const LeafCase c{"", no_grad(bhsd(2, 2, 7, 45, 16, kF32, false)), at::Tensor()};
  const Forward f = forward(c, 0);
  at::Tensor grad_out = at::randn_like(std::get<0>(f));
  grad_out[0][0][3][0] = std::nan("");
  {
    openwam_test::ScopedSettings checked(nullptr, nullptr, "1");
    const std::string error = openwam_test::error_of([&] { backward(c, grad_out, f, 3); });
    CHECK_THAT(error, Contains("openwam::sdpa: non-finite gradient "
                               "(OPENWAM_SDPA_CHECK_FINITE=1)") &&
                          Contains("plan padding_mask+pad_keys_backward") &&
                          Contains("query [2, 2, 7, 16]"));
    // Finite gradients pass.
    CHECK_NOTHROW(backward(c, at::randn_like(grad_out), f, 3));
  }
  openwam_test::ScopedSettings unchecked(nullptr, nullptr, "0");
  const Backward b = backward(c, grad_out, f, 0);
  CHECK(std::get<0>(b).isnan().any().item<bool>());
}

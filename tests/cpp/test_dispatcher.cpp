// openwam::sdpa and openwam::pad_keys called through the dispatcher, as
// Python and torch.compile call them; and decide() on CPU inputs.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>

#include "dispatch.h"
#include "guards.h"
#include "padding.h"
#include "sdpa_inputs.h"
#include "settings.h"

// Catch2 last: c10/util/logging_is_not_google_glog.h defines a glog-style
// CHECK that aborts; catch.hpp's CHECK must be the one in force.
#undef CHECK
#include <catch2/catch.hpp>

#include "scoped_env.h"

using Catch::Matchers::Contains;

namespace {

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

using SdpaSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const std::optional<at::Tensor>&, double, bool,
                           std::optional<double>, bool);
using PadKeysSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t);

const c10::TypedOperatorHandle<SdpaSig>& sdpa_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("openwam::sdpa", "")
                             .typed<SdpaSig>();
  return op;
}

const c10::TypedOperatorHandle<PadKeysSig>& pad_keys_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("openwam::pad_keys", "")
                             .typed<PadKeysSig>();
  return op;
}


double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  return (a - b).abs().max().item<double>();
}

struct Call {
  std::vector<int64_t> q_shape, kv_shape;
  int mask_kind;  // 0 none, 1 bool [L, S], 2 additive [1, L, S], 3 additive [L, 1]
  bool is_causal;
  std::optional<double> scale;
};

// openwam::sdpa through the dispatcher against at::scaled_dot_product_attention:
// outputs and gradients of q, k, v.
void check_against_stock(const Call& c) {
  at::Tensor q = at::randn(c.q_shape, kF64).requires_grad_(true);
  at::Tensor k = at::randn(c.kv_shape, kF64).requires_grad_(true);
  at::Tensor v = at::randn(c.kv_shape, kF64).requires_grad_(true);
  const int64_t L = c.q_shape[c.q_shape.size() - 2];
  const int64_t S = c.kv_shape[c.kv_shape.size() - 2];
  std::optional<at::Tensor> mask;
  if (c.mask_kind == 1) {
    at::Tensor m = at::rand({L, S}, kF64).gt(0.4);
    m.select(-1, 0).fill_(true);
    mask = m;
  } else if (c.mask_kind == 2) {
    mask = at::randn({1, L, S}, kF64);
  } else if (c.mask_kind == 3) {
    mask = at::randn({L, 1}, kF64);
  }

  at::Tensor out = sdpa_op().call(q, k, v, mask, 0.0, c.is_causal, c.scale, false);
  at::Tensor expected =
      at::scaled_dot_product_attention(q, k, v, mask, 0.0, c.is_causal, c.scale);
  REQUIRE(out.requires_grad());
  CHECK(max_abs_diff(out, expected) <= 1e-12);

  at::Tensor grad_out = at::randn_like(out);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {grad_out});
  auto expected_grads = torch::autograd::grad({expected}, {q, k, v}, {grad_out});
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(max_abs_diff(grads[i], expected_grads[i]) <= 1e-12);
  }
}

const Call kCalls[] = {
    {{2, 3, 7, 16}, {2, 3, 45, 16}, 0, false, std::nullopt},
    {{2, 3, 7, 16}, {2, 3, 45, 16}, 1, false, std::nullopt},
    {{2, 3, 7, 16}, {2, 3, 45, 16}, 2, false, 0.3},
    {{2, 3, 9, 16}, {2, 3, 9, 16}, 0, true, std::nullopt},
    {{2, 3, 5, 16}, {2, 3, 130, 16}, 0, true, std::nullopt},
    {{3, 7, 8}, {3, 20, 8}, 1, false, std::nullopt},
    {{3, 7, 8}, {3, 128, 8}, 0, true, std::nullopt},
    {{3, 7, 8}, {3, 20, 8}, 0, true, std::nullopt},
    {{2, 3, 7, 16}, {2, 3, 45, 16}, 3, false, std::nullopt},
    {{7, 8}, {20, 8}, 1, false, std::nullopt},
    {{2, 2, 3, 7, 8}, {2, 2, 3, 20, 8}, 0, true, 0.5},
};

}  // namespace

TEST_CASE("the openwam schemas are registered", "[dispatcher]") {
  auto& d = c10::Dispatcher::singleton();
  CHECK(d.findSchema({"openwam::sdpa", ""}).has_value());
  CHECK(d.findSchema({"openwam::pad_keys", ""}).has_value());
  CHECK(d.findSchema({"openwam::_repair_dq_", ""}).has_value());
  // pad_keys' multiple defaults to the cuDNN key tile.
  const auto& args = pad_keys_op().schema().arguments();
  REQUIRE(args.size() == 4);
  REQUIRE(args[3].default_value().has_value());
  CHECK(args[3].default_value()->toInt() == openwam::kCudnnKeyTile);
}

TEST_CASE("openwam::sdpa equals at::scaled_dot_product_attention (float64)",
          "[dispatcher][numerics]") {
  ScopedEnv cudnn("OPENWAM_SDPA_CUDNN", nullptr);
  ScopedEnv check("OPENWAM_SDPA_CHECK_FINITE", nullptr);
  const char* pad = GENERATE(as<const char*>{}, "auto", "always", "never");
  ScopedEnv pad_env("OPENWAM_SDPA_PAD", pad);
  const bool prefer_cudnn = GENERATE(false, true);  // cannot serve on CPU anyway
  ScopedEnv cudnn_env("OPENWAM_SDPA_CUDNN", prefer_cudnn ? "1" : nullptr);
  CAPTURE(pad, prefer_cudnn);
  for (size_t i = 0; i < sizeof(kCalls) / sizeof(kCalls[0]); ++i) {
    CAPTURE(i);
    check_against_stock(kCalls[i]);
  }
}

TEST_CASE("openwam::sdpa without grad and in inference mode", "[dispatcher]") {
  at::Tensor q = at::randn({2, 3, 7, 16}, kF64);
  at::Tensor k = at::randn({2, 3, 45, 16}, kF64);
  at::Tensor v = at::randn({2, 3, 45, 16}, kF64);
  at::Tensor expected = at::scaled_dot_product_attention(q, k, v);
  at::Tensor out = sdpa_op().call(q, k, v, std::nullopt, 0.0, false, std::nullopt, false);
  CHECK_FALSE(out.requires_grad());
  CHECK(max_abs_diff(out, expected) <= 1e-12);
  c10::InferenceMode guard;
  at::Tensor qi = at::randn({2, 3, 7, 16}, kF64);
  at::Tensor ki = at::randn({2, 3, 45, 16}, kF64);
  at::Tensor vi = at::randn({2, 3, 45, 16}, kF64);
  at::Tensor out_i =
      sdpa_op().call(qi, ki, vi, std::nullopt, 0.0, true, std::nullopt, false);
  CHECK(max_abs_diff(out_i, at::scaled_dot_product_attention(qi, ki, vi, std::nullopt,
                                                             0.0, true)) <= 1e-12);
}

TEST_CASE("openwam::sdpa with grouped-query attention", "[dispatcher][numerics]") {
  at::Tensor q = at::randn({2, 4, 7, 8}, kF64).requires_grad_(true);
  at::Tensor k = at::randn({2, 2, 30, 8}, kF64).requires_grad_(true);
  at::Tensor v = at::randn({2, 2, 30, 8}, kF64).requires_grad_(true);
  ScopedEnv pad_env("OPENWAM_SDPA_PAD", "always");
  at::Tensor out = sdpa_op().call(q, k, v, std::nullopt, 0.0, false, std::nullopt, true);
  at::Tensor expected = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0,
                                                         false, std::nullopt, true);
  CHECK(max_abs_diff(out, expected) <= 1e-12);
  auto grads = torch::autograd::grad({out.sum()}, {q, k, v});
  auto expected_grads = torch::autograd::grad({expected.sum()}, {q, k, v});
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(max_abs_diff(grads[i], expected_grads[i]) <= 1e-12);
  }
}

TEST_CASE("openwam::pad_keys through the dispatcher", "[dispatcher]") {
  at::Tensor k = at::randn({2, 3, 45, 8}, kF64).requires_grad_(true);
  at::Tensor v = at::randn({2, 3, 45, 8}, kF64).requires_grad_(true);
  at::Tensor m = at::rand({2, 1, 5, 45}, kF64).gt(0.5);
  auto [kp, vp, mp] = pad_keys_op().call(k, v, m, 128);
  auto [kd, vd, md] = openwam::pad_keys(k, v, m, 128);
  CHECK(kp.sizes() == at::IntArrayRef({2, 3, 128, 8}));
  CHECK(kp.equal(kd));
  CHECK(vp.equal(vd));
  CHECK(mp.equal(md));
  CHECK(mp.scalar_type() == at::kBool);

  // Differentiable in key/value: the tail's gradient is dropped.
  REQUIRE(kp.requires_grad());
  at::Tensor w = at::randn_like(kp);
  auto grads = torch::autograd::grad({(kp * w).sum() + vp.sum()}, {k, v});
  CHECK(grads[0].equal(w.narrow(2, 0, 45)));
  CHECK(grads[1].equal(at::ones_like(v)));

  auto [kn, vn, mn] = pad_keys_op().call(k, v, std::nullopt, 64);
  CHECK(kn.size(2) == 64);
  CHECK(mn.sizes() == at::IntArrayRef({1, 64}));
  CHECK_THROWS_WITH(pad_keys_op().call(k, v, std::nullopt, 0), Contains("multiple"));
}

TEST_CASE("openwam::sdpa validation errors through the dispatcher", "[dispatcher]") {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor q = at::randn({2, 3, 7, 16}, kF64);
  at::Tensor k = at::randn({2, 3, 45, 16}, kF64);
  at::Tensor v = at::randn({2, 3, 45, 16}, kF64);
  auto call = [&](const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                  const std::optional<at::Tensor>& m, double dropout, bool causal,
                  bool gqa = false) {
    return sdpa_op().call(q_, k_, v_, m, dropout, causal, std::nullopt, gqa);
  };
  CHECK_THROWS_AS(call(q, k.to(at::kFloat), v, std::nullopt, 0.0, false), c10::Error);
  CHECK_THROWS_WITH(call(q, k.to(at::kFloat), v, std::nullopt, 0.0, false),
                    Contains("openwam::sdpa") && Contains("key") && Contains("dtype"));
  CHECK_THROWS_WITH(call(q, k, v.to(at::kFloat), std::nullopt, 0.0, false),
                    Contains("openwam::sdpa") && Contains("value"));
  CHECK_THROWS_WITH(call(q, k[0], v, std::nullopt, 0.0, false),
                    Contains("openwam::sdpa") && Contains("rank"));
  CHECK_THROWS_WITH(call(q, k, v.narrow(2, 0, 40), std::nullopt, 0.0, false),
                    Contains("openwam::sdpa") && Contains("sequence length"));
  CHECK_THROWS_WITH(call(q, k.narrow(1, 0, 1), v.narrow(1, 0, 1), std::nullopt, 0.0,
                         false),
                    Contains("openwam::sdpa") && Contains("enable_gqa"));
  CHECK_THROWS_WITH(call(q, k, v, at::ones({7, 45}, at::kBool), 0.0, true),
                    Contains("openwam::sdpa") && Contains("is_causal"));
  CHECK_THROWS_WITH(call(q, k, v, at::ones({7, 44}, at::kBool), 0.0, false),
                    Contains("openwam::sdpa") && Contains("attn_mask"));
  CHECK_THROWS_WITH(call(q, k, v, at::zeros({7, 45}, f32), 0.0, false),
                    Contains("openwam::sdpa") && Contains("attn_mask"));
  CHECK_THROWS_WITH(
      call(q, k, v, at::zeros({7, 45}, kF64).requires_grad_(true), 0.0, false),
      Contains("openwam::sdpa") && Contains("requires_grad"));
  CHECK_THROWS_WITH(call(q, k, v, std::nullopt, 1.0, false),
                    Contains("openwam::sdpa") && Contains("dropout_p"));
  CHECK_THROWS_WITH(call(q.to(at::kInt), k.to(at::kInt), v.to(at::kInt), std::nullopt,
                         0.0, false),
                    Contains("openwam::sdpa") && Contains("floating point"));
  CHECK_THROWS_WITH(sdpa_op().call(q, k, v, std::nullopt, 0.0, false, -1.0, false),
                    Contains("openwam::sdpa") && Contains("scale"));
}

TEST_CASE("decide() on CPU inputs never picks cuDNN", "[dispatcher]") {
  openwam::SdpaInputs in;
  in.query = at::randn({2, 3, 7, 16}, kF64).requires_grad_(true);
  in.key = at::randn({2, 3, 45, 16}, kF64).requires_grad_(true);
  in.value = at::randn({2, 3, 45, 16}, kF64).requires_grad_(true);
  at::AutoGradMode grad_on(true);
  REQUIRE(in.differentiated());

  std::string why;
  CHECK_FALSE(openwam::cudnn_can_serve(in, &why));
  CHECK_FALSE(why.empty());
  CHECK_THAT(why, Contains("CUDA"));
  CHECK_FALSE(openwam::cudnn_can_serve(in, nullptr));

  for (auto pref : {openwam::CudnnPreference::kFollowPyTorch,
                    openwam::CudnnPreference::kPrefer,
                    openwam::CudnnPreference::kNever}) {
    for (auto pad : {openwam::PadMode::kAuto, openwam::PadMode::kNever}) {
      CAPTURE(openwam::to_string(pref), openwam::to_string(pad));
      openwam::Settings s;
      s.cudnn = pref;
      s.pad = pad;
      const openwam::Decision d = openwam::decide(in, s);
      CHECK_FALSE(d.use_cudnn);
      CHECK_FALSE(d.exclude_cudnn);
      CHECK(d.pytorch_choice != "cudnn_attention");
      CHECK_FALSE(d.pytorch_choice.empty());
      CHECK(d.plan == openwam::Plan::kNone);
      CHECK(d.rule == nullptr);
      CHECK_FALSE(d.reason.empty());
      if (pref == openwam::CudnnPreference::kPrefer) {
        CHECK_THAT(d.reason, Contains("cannot serve"));
      }
    }
  }

  // OPENWAM_SDPA_PAD=always pads the inputs of a differentiated call whose
  // s_kv is not a multiple of 128, and only then.
  openwam::Settings always;
  always.pad = openwam::PadMode::kAlways;
  CHECK(openwam::decide(in, always).plan == openwam::Plan::kPadInputs);
  {
    at::AutoGradMode grad_off(false);
    CHECK(openwam::decide(in, always).plan == openwam::Plan::kNone);
  }
  openwam::SdpaInputs aligned = in;
  aligned.key = at::randn({2, 3, 128, 16}, kF64).requires_grad_(true);
  aligned.value = at::randn({2, 3, 128, 16}, kF64).requires_grad_(true);
  CHECK(openwam::decide(aligned, always).plan == openwam::Plan::kNone);
}

TEST_CASE("decide() sends empty inputs to PyTorch's math backend", "[dispatcher]") {
  // torch 2.11's fused CPU kernel dies of SIGFPE on zero heads (pytorch
  // #174939); an empty call has nothing for a fused kernel to do.
  const std::vector<std::vector<int64_t>> q_kv_shapes[] = {
      {{0, 2, 3, 8}, {0, 2, 5, 8}},  // empty batch
      {{1, 0, 3, 8}, {1, 0, 5, 8}},  // zero heads
      {{1, 2, 0, 8}, {1, 2, 5, 8}},  // zero-length query
      {{1, 2, 3, 8}, {1, 2, 0, 8}},  // zero-length keys
  };
  at::AutoGradMode grad_on(true);
  for (const auto& shapes : q_kv_shapes) {
    CAPTURE(shapes[0], shapes[1]);
    openwam::SdpaInputs in;
    in.query = at::randn(shapes[0], kF64).requires_grad_(true);
    in.key = at::randn(shapes[1], kF64).requires_grad_(true);
    in.value = at::randn(shapes[1], kF64).requires_grad_(true);
    openwam::Settings always;
    always.pad = openwam::PadMode::kAlways;
    const openwam::Decision d = openwam::decide(in, always);
    CHECK(d.empty_input);
    CHECK_FALSE(d.use_cudnn);
    CHECK(d.plan == openwam::Plan::kNone);
    CHECK_THAT(d.reason, Contains("empty"));

    at::Tensor out = sdpa_op().call(in.query, in.key, in.value, std::nullopt, 0.0,
                                    false, std::nullopt, false);
    std::vector<int64_t> want = shapes[0];
    CHECK(out.sizes() == at::IntArrayRef(want));
    CHECK(out.eq(0).all().item<bool>());  // zero-length keys: zero output
  }
}

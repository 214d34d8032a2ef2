// openwam::sdpa through the dispatcher on the CPU, as Python and
// torch.compile call it: whatever the settings, a CPU call is PyTorch's own
// at::scaled_dot_product_attention, with its values, its gradients and its
// errors.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>

#include <optional>
#include <string>
#include <vector>

#include "support.h"
#include "env.h"

using openwam_test::kBF16;
using openwam_test::kF32;
using openwam_test::kF64;
using openwam_test::max_abs_diff;
using openwam_test::ScopedSettings;

namespace {

at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const std::optional<at::Tensor>& mask = std::nullopt, double dropout = 0.0,
                bool causal = false, std::optional<double> scale = std::nullopt,
                bool gqa = false) {
  return openwam::ops::sdpa().call(q, k, v, mask, dropout, causal, scale, gqa);
}

struct Call {
  std::vector<int64_t> q_shape, kv_shape;
  int mask_kind;  // 0 none, 1 bool [L, S], 2 additive [1, L, S], 3 additive [L, 1]
  bool is_causal;
  std::optional<double> scale;
};

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
    {{1, 1, 1, 64}, {1, 1, 300, 64}, 0, false, std::nullopt},  // batch = heads = s_q = 1
};

// openwam::sdpa against at::scaled_dot_product_attention: output and the
// gradients of q, k, v, within `tolerance` (0: bit for bit).
void check_against_stock(const Call& c, at::TensorOptions options, double tolerance) {
  at::Tensor q = at::randn(c.q_shape, options).requires_grad_(true);
  at::Tensor k = at::randn(c.kv_shape, options).requires_grad_(true);
  at::Tensor v = at::randn(c.kv_shape, options).requires_grad_(true);
  const int64_t L = c.q_shape[c.q_shape.size() - 2];
  const int64_t S = c.kv_shape[c.kv_shape.size() - 2];
  std::optional<at::Tensor> mask;
  if (c.mask_kind == 1) {
    at::Tensor m = at::rand({L, S}).gt(0.4);
    m.select(-1, 0).fill_(true);
    mask = m;
  } else if (c.mask_kind == 2) {
    mask = at::randn({1, L, S}, options);
  } else if (c.mask_kind == 3) {
    mask = at::randn({L, 1}, options);
  }

  at::Tensor out = sdpa(q, k, v, mask, 0.0, c.is_causal, c.scale);
  at::Tensor expected =
      at::scaled_dot_product_attention(q, k, v, mask, 0.0, c.is_causal, c.scale);
  REQUIRE(out.requires_grad());
  CHECK(out.scalar_type() == expected.scalar_type());
  CHECK(out.strides() == expected.strides());
  CHECK(max_abs_diff(out, expected) <= tolerance);

  at::Tensor grad_out = at::randn_like(out);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {grad_out});
  auto expected_grads = torch::autograd::grad({expected}, {q, k, v}, {grad_out});
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(max_abs_diff(grads[i], expected_grads[i]) <= tolerance);
  }
}

// What happens to a call on each side: "" for success (then the outputs
// must agree), else the error message.
void check_same_outcome(const char* what, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const std::optional<at::Tensor>& mask,
                        double dropout, bool causal, std::optional<double> scale = std::nullopt,
                        bool gqa = false) {
  CAPTURE(what);
  at::Tensor ours, theirs;
  const std::string our_error = openwam_test::error_of(
      [&] { ours = sdpa(q, k, v, mask, dropout, causal, scale, gqa); });
  const std::string their_error = openwam_test::error_of([&] {
    theirs = at::scaled_dot_product_attention(q, k, v, mask, dropout, causal, scale, gqa);
  });
  CHECK(our_error == their_error);
  if (our_error.empty() && their_error.empty() && dropout == 0.0) {
    CHECK(max_abs_diff(ours, theirs) == 0.0);
  }
}

}  // namespace

TEST_CASE("openwam::sdpa equals at::scaled_dot_product_attention (float64)",
          "[dispatcher][numerics]") {
  const char* pad = GENERATE(as<const char*>{}, "auto", "always", "never");
  const char* cudnn = GENERATE(as<const char*>{}, "", "1", "0");
  CAPTURE(pad, cudnn);
  ScopedSettings pinned(cudnn, pad);
  for (size_t i = 0; i < sizeof(kCalls) / sizeof(kCalls[0]); ++i) {
    CAPTURE(i);
    check_against_stock(kCalls[i], kF64, 1e-12);
  }
}

TEST_CASE("openwam::sdpa is at::scaled_dot_product_attention bit for bit (bf16, fp32)",
          "[dispatcher][numerics]") {
  ScopedSettings defaults;
  for (auto options : {kBF16, kF32}) {
    for (size_t i = 0; i < sizeof(kCalls) / sizeof(kCalls[0]); ++i) {
      CAPTURE(i, options.dtype());
      check_against_stock(kCalls[i], options, 0.0);
    }
  }
}

TEST_CASE("openwam::sdpa with grouped-query attention and BSHD views",
          "[dispatcher][numerics]") {
  ScopedSettings always(nullptr, "always");
  at::Tensor q = at::randn({2, 4, 7, 8}, kF64).requires_grad_(true);
  at::Tensor k = at::randn({2, 2, 30, 8}, kF64).requires_grad_(true);
  at::Tensor v = at::randn({2, 2, 30, 8}, kF64).requires_grad_(true);
  at::Tensor out = sdpa(q, k, v, std::nullopt, 0.0, false, std::nullopt, true);
  at::Tensor expected = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0,
                                                         false, std::nullopt, true);
  CHECK(max_abs_diff(out, expected) <= 1e-12);
  auto grads = torch::autograd::grad({out.sum()}, {q, k, v});
  auto expected_grads = torch::autograd::grad({expected.sum()}, {q, k, v});
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(max_abs_diff(grads[i], expected_grads[i]) <= 1e-12);
  }

  const auto view = [](int64_t S) {
    return at::randn({2, S, 3, 16}, kBF16).transpose(1, 2).requires_grad_(true);
  };
  at::Tensor qb = view(7), kb = view(45), vb = view(45);
  at::Tensor ob = sdpa(qb, kb, vb);
  at::Tensor eb = at::scaled_dot_product_attention(qb, kb, vb);
  CHECK(ob.equal(eb));
  CHECK(ob.strides() == eb.strides());
}

TEST_CASE("openwam::sdpa without grad and in inference mode", "[dispatcher]") {
  ScopedSettings defaults;
  at::Tensor q = at::randn({2, 3, 7, 16}, kF64);
  at::Tensor k = at::randn({2, 3, 45, 16}, kF64);
  at::Tensor v = at::randn({2, 3, 45, 16}, kF64);
  at::Tensor expected = at::scaled_dot_product_attention(q, k, v);
  at::Tensor out = sdpa(q, k, v);
  CHECK_FALSE(out.requires_grad());
  CHECK(max_abs_diff(out, expected) <= 1e-12);
  {
    at::AutoGradMode grad_off(false);
    at::Tensor qg = q.clone().requires_grad_(true);
    CHECK_FALSE(sdpa(qg, k, v).requires_grad());
  }
  c10::InferenceMode guard;
  at::Tensor qi = at::randn({2, 3, 7, 16}, kF64);
  at::Tensor ki = at::randn({2, 3, 45, 16}, kF64);
  at::Tensor vi = at::randn({2, 3, 45, 16}, kF64);
  at::Tensor out_i = sdpa(qi, ki, vi, std::nullopt, 0.0, true);
  CHECK(max_abs_diff(out_i, at::scaled_dot_product_attention(qi, ki, vi, std::nullopt,
                                                             0.0, true)) <= 1e-12);
}

TEST_CASE("openwam::sdpa with dropout: PyTorch's own dropout", "[dispatcher]") {
  ScopedSettings defaults;
  at::Tensor q = at::randn({2, 3, 7, 16}, kF64);
  at::Tensor k = at::randn({2, 3, 45, 16}, kF64);
  at::Tensor v = at::randn({2, 3, 45, 16}, kF64);
  at::manual_seed(7);
  at::Tensor out = sdpa(q, k, v, std::nullopt, 0.5);
  at::manual_seed(7);
  at::Tensor expected = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.5);
  CHECK(out.equal(expected));
}

TEST_CASE("openwam::sdpa on empty inputs: the math backend's output (PyTorch answers them from "
          "torch 2.13, before it its math backend)",
          "[dispatcher]") {
  const std::vector<std::vector<int64_t>> q_kv_shapes[] = {
      {{0, 2, 3, 8}, {0, 2, 5, 8}},  // empty batch
      {{1, 0, 3, 8}, {1, 0, 5, 8}},  // zero heads
      {{1, 2, 0, 8}, {1, 2, 5, 8}},  // zero-length query
      {{1, 2, 3, 8}, {1, 2, 0, 8}},  // zero-length keys
  };
  const char* pad = GENERATE(as<const char*>{}, "auto", "always");
  ScopedSettings pinned(nullptr, pad);
  for (const auto& shapes : q_kv_shapes) {
    CAPTURE(shapes[0], shapes[1], pad);
    at::Tensor q = at::randn(shapes[0], kF64).requires_grad_(true);
    at::Tensor k = at::randn(shapes[1], kF64).requires_grad_(true);
    at::Tensor v = at::randn(shapes[1], kF64).requires_grad_(true);
    at::Tensor out = sdpa(q, k, v);
    CHECK(out.sizes() == at::IntArrayRef(shapes[0]));
    CHECK(out.eq(0).all().item<bool>());  // zero-length keys: zero output
    const at::Tensor math = std::get<0>(at::_scaled_dot_product_attention_math(q, k, v));
    CHECK(out.equal(math));
    // Differentiable like any other call.
    auto grads = torch::autograd::grad({out.sum()}, {q, k, v}, {}, std::nullopt, false,
                                       /*allow_unused=*/true);
    for (size_t i = 0; i < 3; ++i) {
      CAPTURE(i);
      if (grads[i].defined()) {
        CHECK(grads[i].eq(0).all().item<bool>());
      }
    }
  }
}

TEST_CASE("openwam::sdpa refuses value shorter or longer than key", "[dispatcher]") {
  // PyTorch's fused CPU kernel reads value with key's length (past a shorter
  // value's end); its math backend refuses. The op refuses at every rank:
  // below 4-D F.sdpa runs its math backend and refuses itself, and its error
  // comes first (found in review). On torch 2.14.1 and 2.15 the fused kernel
  // takes 3-D calls too and F.sdpa no longer refuses them: the op's own error.
  ScopedSettings defaults;
  at::Tensor q = at::randn({2, 3, 7, 16}, kF64);
  at::Tensor k = at::randn({2, 3, 45, 16}, kF64);
  for (int64_t s_v : {40, 50}) {
    CAPTURE(s_v);
    at::Tensor v = at::randn({2, 3, s_v, 16}, kF64);
    const std::string expected = "openwam::sdpa: value must have the same sequence length as key "
                                 "(45), got " + std::to_string(s_v);
    CHECK(openwam_test::error_of([&] { sdpa(q, k, v, std::nullopt, 0.0, false); }) == expected);
    const std::string stock_3d = openwam_test::error_of(
        [&] { at::scaled_dot_product_attention(q[0], k[0], v[0]); });
    if (stock_3d.empty()) {
      CHECK(openwam_test::error_of([&] { sdpa(q[0], k[0], v[0], std::nullopt, 0.0, false); }) ==
            expected);
    } else {
      check_same_outcome("3-D", q[0], k[0], v[0], std::nullopt, 0.0, false);
    }
  }
}

TEST_CASE("openwam::sdpa raises PyTorch's own errors", "[dispatcher]") {
  ScopedSettings defaults;
  at::Tensor q = at::randn({2, 3, 7, 16}, kF64);
  at::Tensor k = at::randn({2, 3, 45, 16}, kF64);
  at::Tensor v = at::randn({2, 3, 45, 16}, kF64);
  const auto f32 = kF32;
  check_same_outcome("key dtype", q, k.to(at::kFloat), v, std::nullopt, 0.0, false);
  check_same_outcome("value dtype", q, k, v.to(at::kFloat), std::nullopt, 0.0, false);
  check_same_outcome("key rank", q, k[0], v, std::nullopt, 0.0, false);
  check_same_outcome("1-D", q[0][0][0], k[0][0][0], v[0][0][0], std::nullopt, 0.0, false);
  check_same_outcome("heads without enable_gqa", q, k.narrow(1, 0, 1), v.narrow(1, 0, 1),
                     std::nullopt, 0.0, false);
  check_same_outcome("heads not dividing", q, k.narrow(1, 0, 2), v.narrow(1, 0, 2),
                     std::nullopt, 0.0, false, std::nullopt, true);
  check_same_outcome("head_dim", q, k.narrow(3, 0, 8), v, std::nullopt, 0.0, false);
  check_same_outcome("mask with is_causal", q, k, v, at::ones({7, 45}, at::kBool), 0.0,
                     true);
  check_same_outcome("mask length", q, k, v, at::ones({7, 44}, at::kBool), 0.0, false);
  check_same_outcome("mask float32", q, k, v, at::zeros({7, 45}, f32), 0.0, false);
  check_same_outcome("mask int", q, k, v, at::zeros({7, 45}, at::kInt), 0.0, false);
  check_same_outcome("mask requires grad", q, k, v,
                     at::zeros({7, 45}, kF64).requires_grad_(true), 0.0, false);
  check_same_outcome("dropout 1", q, k, v, std::nullopt, 1.0, false);
  check_same_outcome("dropout -0.5", q, k, v, std::nullopt, -0.5, false);
  check_same_outcome("int inputs", q.to(at::kInt), k.to(at::kInt), v.to(at::kInt),
                     std::nullopt, 0.0, false);
  check_same_outcome("negative scale", q, k, v, std::nullopt, 0.0, false, -1.0);
  check_same_outcome("device", q, at::empty_like(k, k.options().device(at::kMeta)), v,
                     std::nullopt, 0.0, false);
  check_same_outcome("empty and dtype", q.narrow(0, 0, 0), k.narrow(0, 0, 0).to(at::kFloat),
                     v.narrow(0, 0, 0), std::nullopt, 0.0, false);
  // bf16: the inputs the cuDNN path would take on a GPU.
  check_same_outcome("bf16 head_dim 12", at::randn({2, 3, 7, 12}, kBF16),
                     at::randn({2, 3, 45, 12}, kBF16), at::randn({2, 3, 45, 12}, kBF16),
                     std::nullopt, 0.0, false);
  check_same_outcome("bf16 mask rank 5", at::randn({2, 3, 7, 16}, kBF16),
                     at::randn({2, 3, 45, 16}, kBF16), at::randn({2, 3, 45, 16}, kBF16),
                     at::ones({1, 2, 3, 7, 45}, at::kBool), 0.0, false);
}

TEST_CASE("OPENWAM_SDPA_CUDNN=0 restores PyTorch's cuDNN switch after the call",
          "[dispatcher]") {
  ScopedSettings never("0");
  auto& ctx = at::globalContext();
  const bool was = ctx.userEnabledCuDNNSDP();
  at::Tensor q = at::randn({2, 3, 7, 16}, kBF16);
  at::Tensor k = at::randn({2, 3, 45, 16}, kBF16);
  at::Tensor v = at::randn({2, 3, 45, 16}, kBF16);
  for (bool enabled : {true, false, true}) {
    CAPTURE(enabled);
    ctx.setSDPUseCuDNN(enabled);
    CHECK(sdpa(q, k, v).equal(at::scaled_dot_product_attention(q, k, v)));
    CHECK(ctx.userEnabledCuDNNSDP() == enabled);
    // Also when the call raises.
    CHECK_FALSE(openwam_test::error_of([&] { sdpa(q, k.to(at::kHalf), v); }).empty());
    CHECK(ctx.userEnabledCuDNNSDP() == enabled);
  }
  ctx.setSDPUseCuDNN(was);
}

TEST_CASE("openwam::sdpa under CPU autocast casts like F.sdpa", "[dispatcher]") {
  ScopedSettings defaults;
  struct Autocast {
    Autocast() {
      was_ = at::autocast::is_autocast_enabled(at::kCPU);
      at::autocast::set_autocast_enabled(at::kCPU, true);
    }
    ~Autocast() {
      at::autocast::set_autocast_enabled(at::kCPU, was_);
      at::autocast::clear_cache();
    }
    bool was_;
  };
  at::Tensor q = at::randn({2, 3, 7, 16}, kF32).requires_grad_(true);
  at::Tensor k = at::randn({2, 3, 45, 16}, kF32).requires_grad_(true);
  at::Tensor v = at::randn({2, 3, 45, 16}, kF32).requires_grad_(true);
  const std::optional<at::Tensor> masks[] = {std::nullopt, at::randn({7, 45}, kF32),
                                             at::rand({7, 45}).gt(0.3)};
  for (const auto& mask : masks) {
    CAPTURE(mask.has_value() ? mask->scalar_type() : at::kChar);
    at::Tensor out, expected;
    {
      Autocast autocast;
      out = sdpa(q, k, v, mask);
      expected = at::scaled_dot_product_attention(q, k, v, mask);
    }
    CHECK(out.scalar_type() == at::kBFloat16);
    CHECK(expected.scalar_type() == at::kBFloat16);
    CHECK(out.equal(expected));
    auto grads = torch::autograd::grad({out.sum()}, {q, k, v});
    auto expected_grads = torch::autograd::grad({expected.sum()}, {q, k, v});
    for (size_t i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(grads[i].scalar_type() == at::kFloat);
      CHECK(grads[i].equal(expected_grads[i]));
    }
  }
}

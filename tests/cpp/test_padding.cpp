// The padding shim (csrc/padding.h): padded_length, pad_dim, additive_bias,
// pad_keys, pad_keys_for_call. CPU, float64 where numerical.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "padding.h"

// Catch2 last: c10/util/logging_is_not_google_glog.h defines a glog-style
// CHECK that aborts; catch.hpp's CHECK must be the one in force.
#undef CHECK
#include <catch2/catch.hpp>

using Catch::Matchers::Contains;

namespace {

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  return (a - b).abs().max().item<double>();
}

bool all_equal(const at::Tensor& t, double value) {
  return t.eq(value).all().item<bool>();
}

bool all_neg_inf(const at::Tensor& t) {
  return (t.isinf() & t.lt(0)).all().item<bool>();
}

// softmax(q k^T * scale + bias) v, bias additive (undefined: none).
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& bias) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (bias.defined()) {
    scores = scores + bias;
  }
  return at::matmul(at::softmax(scores, -1), v);
}

}  // namespace

TEST_CASE("padded_length rounds up to the multiple", "[padding]") {
  CHECK(openwam::padded_length(0, 128) == 0);
  CHECK(openwam::padded_length(1, 128) == 128);
  CHECK(openwam::padded_length(127, 128) == 128);
  CHECK(openwam::padded_length(128, 128) == 128);
  CHECK(openwam::padded_length(129, 128) == 256);
  CHECK(openwam::padded_length(704, 128) == 768);
  CHECK(openwam::padded_length(5, 1) == 5);
  CHECK(openwam::padded_length(65, 64) == 128);
}

TEST_CASE("padded_length rejects a non-positive multiple", "[padding]") {
  CHECK_THROWS_AS(openwam::padded_length(10, 0), c10::Error);
  CHECK_THROWS_WITH(openwam::padded_length(10, 0), Contains("multiple"));
  CHECK_THROWS_WITH(openwam::padded_length(10, -128), Contains("multiple"));
  CHECK_THROWS_AS(openwam::padded_length(-1, 128), c10::Error);
}

TEST_CASE("pad_dim keeps the stride order of a BSHD view", "[padding]") {
  const int64_t B = 2, S = 5, H = 3, D = 4, S_pad = 8;
  at::Tensor bshd = at::randn({B, S, H, D}, kF64);
  at::Tensor t = bshd.transpose(1, 2);  // [B, H, S, D] view of BSHD storage
  at::Tensor p = openwam::pad_dim(t, 2, S_pad, 0);

  REQUIRE(p.sizes() == at::IntArrayRef({B, H, S_pad, D}));
  // Physical order B, S, H, D, as in the input.
  CHECK(p.stride(0) > p.stride(2));
  CHECK(p.stride(2) > p.stride(1));
  CHECK(p.stride(1) > p.stride(3));
  CHECK(p.transpose(1, 2).is_contiguous());
  CHECK(p.narrow(2, 0, S).equal(t));
  CHECK(all_equal(p.narrow(2, S, S_pad - S), 0.0));

  // Negative dims wrap; the fill value is honoured.
  at::Tensor q = openwam::pad_dim(t, -2, S_pad, -3.5);
  CHECK(q.narrow(2, 0, S).equal(t));
  CHECK(all_equal(q.narrow(2, S, S_pad - S), -3.5));
}

TEST_CASE("pad_dim keeps a contiguous BHSD tensor contiguous", "[padding]") {
  at::Tensor t = at::randn({2, 3, 5, 4}, kF64);
  at::Tensor p = openwam::pad_dim(t, 2, 128, 0);
  CHECK(p.is_contiguous());
  CHECK(p.narrow(2, 0, 5).equal(t));
  CHECK(all_equal(p.narrow(2, 5, 123), 0.0));
}

TEST_CASE("pad_dim keeps stride-0 broadcast axes", "[padding]") {
  const int64_t B = 2, H = 4, S = 5, D = 3, S_pad = 16;
  at::Tensor base = at::randn({B, 1, S, D}, kF64);
  at::Tensor t = base.expand({B, H, S, D});
  REQUIRE(t.stride(1) == 0);
  at::Tensor p = openwam::pad_dim(t, 2, S_pad, 0);
  REQUIRE(p.sizes() == at::IntArrayRef({B, H, S_pad, D}));
  CHECK(p.stride(1) == 0);
  CHECK(p.narrow(2, 0, S).equal(t));
  CHECK(all_equal(p.narrow(2, S, S_pad - S), 0.0));
  // Stored once: the buffer holds B * S_pad * D elements, not H times that.
  CHECK(p.storage().nbytes() ==
        static_cast<size_t>(B * S_pad * D) * sizeof(double));
}

TEST_CASE("pad_dim returns the same tensor when nothing grows", "[padding]") {
  at::Tensor t = at::randn({2, 3, 128, 4}, kF64).transpose(1, 2);
  at::Tensor p = openwam::pad_dim(t, 1, t.size(1), 0);
  CHECK(p.is_same(t));
  CHECK(p.data_ptr() == t.data_ptr());
}

TEST_CASE("additive_bias: bool mask becomes 0 / -inf", "[padding]") {
  // [B, 1, L, S] with a broadcast head axis; the shape must be kept.
  at::Tensor mask = at::rand({2, 1, 3, 5}, kF64).gt(0.5);
  mask.select(-1, 0).fill_(true);
  mask.select(-1, 1).fill_(false);
  for (auto dtype : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16}) {
    at::Tensor bias = openwam::additive_bias(mask, dtype);
    CHECK(bias.scalar_type() == dtype);
    CHECK(bias.sizes() == mask.sizes());
    at::Tensor b = bias.to(at::kDouble);
    CHECK(all_equal(b.masked_select(mask), 0.0));
    CHECK(all_neg_inf(b.masked_select(mask.logical_not())));
  }
  // A key-padding mask [1, S] stays [1, S].
  at::Tensor key_mask = at::arange(6).lt(4).view({1, 6});
  CHECK(openwam::additive_bias(key_mask, at::kDouble).sizes() ==
        at::IntArrayRef({1, 6}));
}

TEST_CASE("additive_bias: additive mask is cast", "[padding]") {
  at::Tensor mask = at::randn({3, 5}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor bias = openwam::additive_bias(mask, at::kDouble);
  CHECK(bias.scalar_type() == at::kDouble);
  CHECK(bias.sizes() == mask.sizes());
  CHECK(bias.equal(mask.to(at::kDouble)));
  // Already in the requested dtype: no copy.
  at::Tensor same = openwam::additive_bias(bias, at::kDouble);
  CHECK(same.is_same(bias));
}

TEST_CASE("pad_keys: key/value shapes, strides and zero tail", "[padding]") {
  const int64_t B = 2, H = 3, S = 100, D = 8, Dv = 6;
  at::Tensor k = at::randn({B, S, H, D}, kF64).transpose(1, 2);  // BSHD view
  at::Tensor v = at::randn({B, H, S, Dv}, kF64);                  // BHSD
  auto [kp, vp, mask] = openwam::pad_keys(k, v, std::nullopt, 128);
  REQUIRE(kp.sizes() == at::IntArrayRef({B, H, 128, D}));
  REQUIRE(vp.sizes() == at::IntArrayRef({B, H, 128, Dv}));
  CHECK(kp.transpose(1, 2).is_contiguous());
  CHECK(vp.is_contiguous());
  CHECK(kp.narrow(2, 0, S).equal(k));
  CHECK(vp.narrow(2, 0, S).equal(v));
  CHECK(all_equal(kp.narrow(2, S, 128 - S), 0.0));
  CHECK(all_equal(vp.narrow(2, S, 128 - S), 0.0));

  // No mask: a [1, S_pad] bool key-padding mask, True for the real keys.
  REQUIRE(mask.scalar_type() == at::kBool);
  REQUIRE(mask.sizes() == at::IntArrayRef({1, 128}));
  CHECK(mask.narrow(1, 0, S).all().item<bool>());
  CHECK_FALSE(mask.narrow(1, S, 128 - S).any().item<bool>());
}

TEST_CASE("pad_keys: masks are padded in their own kind", "[padding]") {
  const int64_t B = 2, H = 3, L = 4, S = 70, D = 8;
  at::Tensor k = at::randn({B, H, S, D}, kF64);
  at::Tensor v = at::randn({B, H, S, D}, kF64);

  SECTION("bool mask stays bool with a False tail") {
    at::Tensor m = at::rand({B, 1, L, S}, kF64).gt(0.3);
    auto [kp, vp, mp] = openwam::pad_keys(k, v, m, 128);
    REQUIRE(mp.scalar_type() == at::kBool);
    REQUIRE(mp.sizes() == at::IntArrayRef({B, 1, L, 128}));
    CHECK(mp.narrow(-1, 0, S).equal(m));
    CHECK_FALSE(mp.narrow(-1, S, 128 - S).any().item<bool>());
  }
  SECTION("additive mask gets a -inf tail") {
    at::Tensor m = at::randn({L, S}, kF64);
    auto [kp, vp, mp] = openwam::pad_keys(k, v, m, 128);
    REQUIRE(mp.scalar_type() == at::kDouble);
    REQUIRE(mp.sizes() == at::IntArrayRef({L, 128}));
    CHECK(mp.narrow(-1, 0, S).equal(m));
    CHECK(all_neg_inf(mp.narrow(-1, S, 128 - S)));
  }
  SECTION("a mask broadcast along keys is materialised along keys only") {
    at::Tensor m = at::rand({B, 1, 1, 1}, kF64).gt(0.5);
    m[0].fill_(true);
    auto [kp, vp, mp] = openwam::pad_keys(k, v, m, 128);
    REQUIRE(mp.scalar_type() == at::kBool);
    REQUIRE(mp.sizes() == at::IntArrayRef({B, 1, 1, 128}));
    CHECK(mp.stride(-1) != 0);
    CHECK(mp.narrow(-1, 0, S).equal(m.expand({B, 1, 1, S})));
    CHECK_FALSE(mp.narrow(-1, S, 128 - S).any().item<bool>());

    at::Tensor add = at::randn({1, 1, L, 1}, kF64);
    auto [kp2, vp2, ap] = openwam::pad_keys(k, v, add, 128);
    REQUIRE(ap.sizes() == at::IntArrayRef({1, 1, L, 128}));
    CHECK(ap.narrow(-1, 0, S).equal(add.expand({1, 1, L, S})));
    CHECK(all_neg_inf(ap.narrow(-1, S, 128 - S)));
  }
  SECTION("nothing grows at a multiple of 128") {
    at::Tensor k2 = at::randn({B, H, 256, D}, kF64);
    at::Tensor v2 = at::randn({B, H, 256, D}, kF64);
    at::Tensor m = at::rand({B, 1, L, 256}, kF64).gt(0.5);
    auto [kp, vp, mp] = openwam::pad_keys(k2, v2, m, 128);
    CHECK(kp.equal(k2));
    CHECK(vp.equal(v2));
    CHECK(mp.equal(m));
  }
  SECTION("other multiples") {
    auto [kp, vp, mp] = openwam::pad_keys(k, v, std::nullopt, 64);
    CHECK(kp.size(2) == 128);
    auto [kq, vq, mq] = openwam::pad_keys(k, v, std::nullopt, 7);
    CHECK(kq.size(2) == 70);
  }
}

TEST_CASE("pad_keys: 3-D inputs keep their rank", "[padding]") {
  const int64_t N = 3, L = 5, S = 9, D = 4;
  at::Tensor k = at::randn({N, S, D}, kF64);
  at::Tensor v = at::randn({N, S, D}, kF64);
  at::Tensor m = at::rand({N, L, S}, kF64).gt(0.5);
  auto [kp, vp, mp] = openwam::pad_keys(k, v, m, 128);
  CHECK(kp.sizes() == at::IntArrayRef({N, 128, D}));
  CHECK(vp.sizes() == at::IntArrayRef({N, 128, D}));
  CHECK(mp.sizes() == at::IntArrayRef({N, L, 128}));
  auto [kn, vn, mn] = openwam::pad_keys(k, v, std::nullopt, 128);
  CHECK(kn.dim() == 3);
  CHECK(mn.sizes() == at::IntArrayRef({1, 128}));
}

TEST_CASE("pad_keys rejects bad arguments", "[padding]") {
  at::Tensor k = at::randn({2, 9, 4}, kF64);
  at::Tensor v = at::randn({2, 9, 4}, kF64);
  CHECK_THROWS_WITH(openwam::pad_keys(k, v, std::nullopt, 0), Contains("multiple"));
  CHECK_THROWS_WITH(openwam::pad_keys(k, at::randn({2, 8, 4}, kF64), std::nullopt, 128),
                    Contains("value"));
  CHECK_THROWS_WITH(openwam::pad_keys(k, v, at::ones({2, 5, 8}, at::kBool), 128),
                    Contains("attn_mask"));
  CHECK_THROWS_WITH(openwam::pad_keys(k, v, at::ones({2, 5, 9}, at::kInt), 128),
                    Contains("attn_mask"));
}

TEST_CASE("pad_keys is exact in float64: outputs and gradients", "[padding][numerics]") {
  const int64_t B = 2, H = 3, L = 7, S = 45, D = 16;
  at::Tensor q = at::randn({B, H, L, D}, kF64).requires_grad_(true);
  at::Tensor k = at::randn({B, H, S, D}, kF64).requires_grad_(true);
  at::Tensor v = at::randn({B, H, S, D}, kF64).requires_grad_(true);
  at::Tensor grad_out = at::randn({B, H, L, D}, kF64);

  std::optional<at::Tensor> mask;
  const int kind = GENERATE(0, 1, 2);  // none, bool, additive
  if (kind == 1) {
    at::Tensor m = at::rand({B, 1, L, S}, kF64).gt(0.4);
    m.select(-1, 0).fill_(true);  // every row sees a key
    mask = m;
  } else if (kind == 2) {
    mask = at::randn({L, S}, kF64) * 3.0;
  }
  CAPTURE(kind);

  const at::Tensor bias =
      mask.has_value() ? openwam::additive_bias(*mask, at::kDouble) : at::Tensor();
  at::Tensor out = reference_attention(q, k, v, bias);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {grad_out});

  auto [kp, vp, mp] = openwam::pad_keys(k, v, mask, 128);
  REQUIRE(kp.size(2) == 128);
  at::Tensor out_p =
      reference_attention(q, kp, vp, openwam::additive_bias(mp, at::kDouble));
  auto grads_p = torch::autograd::grad({out_p}, {q, k, v}, {grad_out});

  CHECK(max_abs_diff(out_p, out) <= 1e-12);
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    REQUIRE(grads_p[i].defined());
    CHECK(max_abs_diff(grads_p[i], grads[i]) <= 1e-12);
  }

  // Also against ATen's math reference on the unpadded inputs (it adds the
  // mask as given: bool masks are converted by its caller, F.sdpa).
  std::optional<at::Tensor> math_bias;
  if (bias.defined()) math_bias = bias;
  auto ref = at::_scaled_dot_product_attention_math(q, k, v, math_bias);
  const double diff_math = max_abs_diff(out_p, std::get<0>(ref));
  CAPTURE(diff_math);
  CHECK(diff_math <= 1e-12);
}

TEST_CASE("pad_keys_for_call folds a top-left causal mask", "[padding][numerics]") {
  const int64_t B = 2, H = 2, D = 8;
  const auto [L, S] = GENERATE(table<int64_t, int64_t>({{5, 5}, {3, 9}, {9, 3}, {4, 130}}));
  CAPTURE(L, S);
  at::Tensor q = at::randn({B, H, L, D}, kF64).requires_grad_(true);
  at::Tensor k = at::randn({B, H, S, D}, kF64).requires_grad_(true);
  at::Tensor v = at::randn({B, H, S, D}, kF64).requires_grad_(true);

  openwam::PaddedKeys p = openwam::pad_keys_for_call(q, k, v, std::nullopt, true);
  const int64_t S_pad = openwam::padded_length(S, 128);
  REQUIRE(p.key.size(2) == S_pad);
  REQUIRE(p.mask.scalar_type() == at::kBool);
  REQUIRE(p.mask.dim() >= 2);
  REQUIRE(p.mask.size(-1) == S_pad);
  at::Tensor expected =
      at::arange(S_pad).view({1, S_pad}).le(at::arange(L).view({L, 1})) &
      at::arange(S_pad).lt(S).view({1, S_pad});
  CHECK(p.mask.expand({L, S_pad}).equal(expected));

  // Numerically the causal call: F.sdpa's is_causal is top-left aligned.
  at::Tensor grad_out = at::randn({B, H, L, D}, kF64);
  at::Tensor out = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {grad_out});
  at::Tensor out_p =
      reference_attention(q, p.key, p.value, openwam::additive_bias(p.mask, at::kDouble));
  auto grads_p = torch::autograd::grad({out_p}, {q, k, v}, {grad_out});
  CHECK(max_abs_diff(out_p, out) <= 1e-12);
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(max_abs_diff(grads_p[i], grads[i]) <= 1e-12);
  }
}

TEST_CASE("pad_keys_for_call without is_causal is pad_keys at 128", "[padding]") {
  at::Tensor q = at::randn({2, 5, 4}, kF64);
  at::Tensor k = at::randn({2, 9, 4}, kF64);
  at::Tensor v = at::randn({2, 9, 4}, kF64);
  at::Tensor m = at::rand({2, 5, 9}, kF64).gt(0.5);
  openwam::PaddedKeys p = openwam::pad_keys_for_call(q, k, v, m, false);
  auto [kp, vp, mp] = openwam::pad_keys(k, v, m, openwam::kCudnnKeyTile);
  CHECK(p.key.equal(kp));
  CHECK(p.value.equal(vp));
  CHECK(p.mask.equal(mp));
}

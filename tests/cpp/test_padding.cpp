// The padding shim (csrc/padding.h): padded_length, pad_dim, pad_keys, on
// the CPU, float64 where numerical. (The causal folding the cuDNN path's
// plans add on top is tested with the leaf ops, test_leaf_ops.cpp.)
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <limits>
#include <vector>

#include "cudnn_attention.h"
#include "padding.h"
#include "support.h"

using Catch::Matchers::Contains;
using openwam_test::kF64;
using openwam_test::max_abs_diff;

namespace {

bool all_equal(const at::Tensor& t, double value) { return t.eq(value).all().item<bool>(); }

bool all_neg_inf(const at::Tensor& t) { return t.isneginf().all().item<bool>(); }

// ATen's math attention (differentiable) with an additive bias or none.
at::Tensor math_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& bias) {
  return std::get<0>(at::_scaled_dot_product_attention_math(q, k, v, bias));
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

TEST_CASE("padded_length rejects a non-positive multiple or length", "[padding]") {
  CHECK(openwam_test::error_of([] { openwam::padded_length(10, 0); }) ==
        "openwam::pad_keys: multiple must be a positive integer, got 0");
  CHECK(openwam_test::error_of([] { openwam::padded_length(10, -128); }) ==
        "openwam::pad_keys: multiple must be a positive integer, got -128");
  CHECK(openwam_test::error_of([] { openwam::padded_length(-1, 128); }) ==
        "openwam::pad_keys: length must be >= 0, got -1");
}

TEST_CASE("shim_takes_bias: a biased key-tail backward that adds at most 1/32 of the keys",
          "[padding]") {
  openwam::Plan key_tail;
  key_tail.padding_mask = key_tail.pad_keys_backward = true;
  CHECK(openwam::shim_takes_bias(key_tail, true, 4032, 0.0));   // 64 of 4096 keys added
  CHECK(openwam::shim_takes_bias(key_tail, true, 2048 + 64, 0.0));  // 64 of 2176, at 1/33
  CHECK_FALSE(openwam::shim_takes_bias(key_tail, true, 1024 + 64, 0.0));  // 64 of 1152
  CHECK_FALSE(openwam::shim_takes_bias(key_tail, true, 704, 0.0));
  CHECK_FALSE(openwam::shim_takes_bias(key_tail, false, 4032, 0.0));  // no bias
  CHECK_FALSE(openwam::shim_takes_bias(key_tail, true, 4032, 0.1));   // dropout
  openwam::Plan mask_only;
  mask_only.padding_mask = true;
  CHECK_FALSE(openwam::shim_takes_bias(mask_only, true, 4032, 0.0));
}

TEST_CASE("padded_length of a SymInt", "[padding]") {
  CHECK(openwam::padded_length(c10::SymInt(4032), 128) == 4096);
  CHECK(openwam::padded_length(c10::SymInt(4096), 128) == 4096);
  CHECK(openwam::padded_length(c10::SymInt(1), 128) == 128);
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
  CHECK(p.storage().nbytes() == static_cast<size_t>(B * S_pad * D) * sizeof(double));
}

TEST_CASE("pad_dim along an axis the tensor is broadcast on keeps the last dim "
          "contiguous", "[padding]") {
  // A key mask [1, 1, 1, 1] expanded to [1, 1, 1, S]: padding the key axis.
  at::Tensor t = at::ones({1, 1, 3, 1}, kF64).expand({1, 1, 3, 5});
  REQUIRE(t.stride(-1) == 0);
  at::Tensor p = openwam::pad_dim(t, -1, 8, -1.0);
  CHECK(p.sizes() == at::IntArrayRef({1, 1, 3, 8}));
  CHECK(p.stride(-1) == 1);
  CHECK(all_equal(p.narrow(-1, 0, 5), 1.0));
  CHECK(all_equal(p.narrow(-1, 5, 3), -1.0));
}

TEST_CASE("pad_dim returns the same tensor when nothing grows", "[padding]") {
  at::Tensor t = at::randn({2, 3, 128, 4}, kF64).transpose(1, 2);
  at::Tensor p = openwam::pad_dim(t, 1, t.size(1), 0);
  CHECK(p.is_same(t));
  CHECK(p.data_ptr() == t.data_ptr());
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
    CHECK(kp.is_same(k2));
    CHECK(vp.is_same(v2));
    CHECK(mp.equal(m));
    auto [kn, vn, mn] = openwam::pad_keys(k2, v2, std::nullopt, 128);
    CHECK(mn.sizes() == at::IntArrayRef({1, 256}));
    CHECK(mn.all().item<bool>());
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
  const auto error = [](auto&& f) { return openwam_test::error_of(f); };
  CHECK(error([&] { openwam::pad_keys(k, v, std::nullopt, 0); }) ==
        "openwam::pad_keys: multiple must be a positive integer, got 0");
  CHECK(error([&] { openwam::pad_keys(k[0][0], v, std::nullopt, 128); }) ==
        "openwam::pad_keys: key must have at least 2 dims [..., S, E], got 1-D");
  CHECK(error([&] { openwam::pad_keys(k, v[0][0], std::nullopt, 128); }) ==
        "openwam::pad_keys: value must have at least 2 dims [..., S, Ev], got 1-D");
  CHECK(error([&] { openwam::pad_keys(k, v[0], std::nullopt, 128); }) ==
        "openwam::pad_keys: value must have key's rank (3-D), got 2-D");
  CHECK(error([&] { openwam::pad_keys(k, at::randn({2, 8, 4}, kF64), std::nullopt, 128); }) ==
        "openwam::pad_keys: value must have the same sequence length as key (9), got 8");
  CHECK(error([&] { openwam::pad_keys(k, v, at::ones({2, 5, 8}, at::kBool), 128); }) ==
        "openwam::pad_keys: attn_mask's last dim must be the key length (9) or 1, got 8");
  CHECK(error([&] { openwam::pad_keys(k, v, at::ones({2, 5, 9}, at::kInt), 128); }) ==
        "openwam::pad_keys: attn_mask must be bool or floating point, got Int");
  CHECK(error([&] { openwam::pad_keys(k, v, at::ones({}, at::kBool), 128); }) ==
        "openwam::pad_keys: attn_mask must have at least 1 dim, got 0-D");
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

  std::optional<at::Tensor> bias;
  if (mask.has_value()) {
    bias = openwam::cudnn_bias(*mask, at::kDouble, 4, S);
  }
  at::Tensor out = math_attention(q, k, v, bias);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {grad_out});

  auto [kp, vp, mp] = openwam::pad_keys(k, v, mask, 128);
  REQUIRE(kp.size(2) == 128);
  at::Tensor out_p = math_attention(q, kp, vp, openwam::cudnn_bias(mp, at::kDouble, 4, 128));
  auto grads_p = torch::autograd::grad({out_p}, {q, k, v}, {grad_out}, /*retain_graph=*/true);

  CHECK(max_abs_diff(out_p, out) <= 1e-12);
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    REQUIRE(grads_p[i].defined());
    CHECK(max_abs_diff(grads_p[i], grads[i]) <= 1e-12);
  }
  // The padded keys and values get exactly zero gradient.
  auto tail = torch::autograd::grad({out_p}, {kp, vp}, {grad_out});
  CHECK(all_equal(tail[0].narrow(2, S, 128 - S), 0.0));
  CHECK(all_equal(tail[1].narrow(2, S, 128 - S), 0.0));
}

TEST_CASE("openwam::pad_keys through the dispatcher", "[padding][dispatcher]") {
  at::Tensor k = at::randn({2, 3, 45, 8}, kF64).requires_grad_(true);
  at::Tensor v = at::randn({2, 3, 45, 8}, kF64).requires_grad_(true);
  at::Tensor m = at::rand({2, 1, 5, 45}, kF64).gt(0.5);
  auto [kp, vp, mp] = openwam_test::pad_keys_op().call(k, v, m, 128);
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

  // ...and in an additive mask.
  at::Tensor add = at::randn({5, 45}, kF64).requires_grad_(true);
  auto [ka, va, ma] = openwam_test::pad_keys_op().call(k, v, add, 128);
  REQUIRE(ma.requires_grad());
  auto mask_grad = torch::autograd::grad({ma.narrow(-1, 0, 45).sum()}, {add});
  CHECK(mask_grad[0].equal(at::ones_like(add)));

  auto [kn, vn, mn] = openwam_test::pad_keys_op().call(k, v, std::nullopt, 64);
  CHECK(kn.size(2) == 64);
  CHECK(mn.sizes() == at::IntArrayRef({1, 64}));
  CHECK_THROWS_WITH(openwam_test::pad_keys_op().call(k, v, std::nullopt, 0),
                    Contains("multiple"));

  // Meta tensors: shapes and strides without data.
  const at::Tensor km = at::empty_strided(k.sizes(), k.strides(), k.options().device(at::kMeta));
  auto [kpm, vpm, mpm] = openwam_test::pad_keys_op().call(km, km, std::nullopt, 128);
  CHECK(kpm.is_meta());
  CHECK(kpm.sizes() == kp.sizes());
  CHECK(kpm.strides() == kp.strides());
  CHECK(mpm.sizes() == at::IntArrayRef({1, 128}));
}

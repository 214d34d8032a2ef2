// The score shift (csrc/score_shift.h) on the CPU: c per bias row, the
// shifted logsumexp, the bias restored bit for bit, and the backward on
// shifted scores equal to the unshifted one. The CUDA kernels run the same
// row arithmetic (ShiftRows, shift_of); tests/gpu/test_score_shift_gpu.py
// compares them with this reference.
#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "reference_attention.h"
#include "score_shift.h"
#include "support.h"

using openwam_test::max_abs_diff;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// A bool mask's bias: 0 where kept, -inf where hidden.
at::Tensor bias_of(const at::Tensor& keep, at::ScalarType dtype) {
  return at::zeros(keep.sizes(), at::TensorOptions().dtype(dtype))
      .masked_fill(keep.logical_not(), -kInf);
}

}  // namespace

TEST_CASE("shift_of: a power of two that lifts the row to >= 0, below the dtype's limit",
          "[shift]") {
  const openwam::ShiftLimits bf16 = openwam::shift_limits(at::kBFloat16);
  CHECK(openwam::shift_limits(at::kFloat).below == bf16.below);
  CHECK(openwam::shift_of(kInf, bf16) == 0.0f);    // no finite logsumexp
  CHECK(openwam::shift_of(5.0f, bf16) == 0.0f);
  CHECK(openwam::shift_of(-20.0f, bf16) == 0.0f);  // ordinary rows: untouched
  CHECK(openwam::shift_of(-32.0f, bf16) == 0.0f);
  CHECK(openwam::shift_of(-32.5f, bf16) == 64.0f);
  CHECK(openwam::shift_of(-103.0f, bf16) == 128.0f);
  CHECK(openwam::shift_of(-128.0f, bf16) == 256.0f);  // strictly above
  CHECK(openwam::shift_of(-65504.0f, bf16) == 65536.0f);
  CHECK(openwam::shift_of(-3.0e38f, bf16) == std::ldexp(1.0f, 126));  // the cap
  // fp16: every row below 0 (its dS overflows from a logsumexp of -11.1 on),
  // by at least 1, and by 2^15 at most.
  const openwam::ShiftLimits fp16 = openwam::shift_limits(at::kHalf);
  CHECK(openwam::shift_of(0.0f, fp16) == 0.0f);
  CHECK(openwam::shift_of(-1e-30f, fp16) == 1.0f);
  CHECK(openwam::shift_of(-0.75f, fp16) == 1.0f);
  CHECK(openwam::shift_of(-20.0f, fp16) == 32.0f);
  CHECK(openwam::shift_of(-65504.0f, fp16) == 32768.0f);
}

TEST_CASE("shift_rows: broadcast axes and axes of stride 0 share one c", "[shift]") {
  const at::Tensor lse = at::zeros({2, 3, 5, 1});
  const auto rows = [&](const at::Tensor& bias) { return openwam::shift_rows(bias, lse); };
  auto r = rows(at::zeros({2, 1, 5, 7}));
  CHECK(r.groups() == 10);
  CHECK(r.entries() == 3);
  r = rows(at::zeros({2, 1, 1, 7}));  // a key mask: one row per batch element
  CHECK(r.groups() == 2);
  CHECK(r.entries() == 15);
  r = rows(at::zeros({1, 1, 5, 7}).expand({2, 3, 5, 7}));  // expanded: stride 0
  CHECK(r.groups() == 5);
  CHECK(r.entries() == 6);
  r = rows(at::zeros({2, 3, 5, 7}));
  CHECK(r.groups() == 30);
  CHECK(r.entries() == 1);
}

TEST_CASE("shift_rows: a contiguous row's entries are one run of the logsumexp", "[shift]") {
  // The kernel reads a contiguous row as logsumexp[g * entries + e]: that must
  // be lse_index's entry wherever shift_rows says contiguous.
  const at::Tensor lse = at::zeros({2, 3, 5, 1});
  const auto contiguous = [&](const at::Tensor& bias) {
    const openwam::ShiftRows r = openwam::shift_rows(bias, lse);
    for (int64_t g = 0; g < r.groups() && r.contiguous; ++g) {
      int64_t gb, gh, gl;
      r.row_of(g, gb, gh, gl);
      for (int64_t e = 0; e < r.entries(); ++e) {
        REQUIRE(r.lse_index(gb, gh, gl, e) == g * r.entries() + e);
      }
    }
    return r.contiguous;
  };
  CHECK(contiguous(at::zeros({2, 1, 1, 7})));         // a key mask
  CHECK(contiguous(at::zeros({1, 1, 1, 7})));         // one row for all
  CHECK(contiguous(at::zeros({2, 3, 1, 7})));         // per head, every query
  CHECK(contiguous(at::zeros({2, 3, 5, 7})));         // no broadcast
  CHECK_FALSE(contiguous(at::zeros({2, 1, 5, 7})));   // heads between the rows
  CHECK_FALSE(contiguous(at::zeros({1, 3, 5, 7})));   // batch apart from the rest
  CHECK_FALSE(contiguous(at::zeros({1, 3, 1, 7})));
  const at::Tensor one_head = at::zeros({2, 1, 5, 1});  // H = 1: the heads axis is no gap
  CHECK(openwam::shift_rows(at::zeros({2, 1, 1, 7}), one_head).contiguous);
  CHECK(openwam::shift_rows(at::zeros({1, 1, 5, 7}), one_head).contiguous == false);
}

TEST_CASE("shift_scores: each bias row's c, -inf rows to the largest float, bias restored",
          "[shift]") {
  using openwam::BiasWrite;
  for (const auto& [dtype, write] :
       {std::pair{at::kBFloat16, BiasWrite::kInPlace}, std::pair{at::kHalf, BiasWrite::kInPlace},
        std::pair{at::kFloat, BiasWrite::kInPlace}, std::pair{at::kBFloat16, BiasWrite::kCopy},
        std::pair{at::kHalf, BiasWrite::kCopy}, std::pair{at::kFloat, BiasWrite::kCopy}}) {
    CAPTURE(dtype, write == BiasWrite::kCopy);
    // [B=2, 1, L=3, S=4] bias; logsumexp [2, H=2, 3, 1].
    at::Tensor keep = at::ones({2, 1, 3, 4}, at::kBool);
    keep.index_put_({1, 0, 2}, false);  // row (1, 2) sees no key
    keep.index_put_({0, 0, 1, 3}, false);
    const at::Tensor bias = bias_of(keep, dtype);
    const at::Tensor before = bias.clone();
    const at::Tensor lse = at::tensor({1.0f, -40.0f, 2.0f,     // b0 h0
                                       3.0f, 0.5f, -103.0f,    // b0 h1
                                       -1.0f, -20.0f, -kInf,   // b1 h0
                                       4.0f, -33.0f, -kInf})   // b1 h1
                               .reshape({2, 2, 3, 1});
    const openwam::ShiftedScores s = openwam::shift_scores(bias, lse, write);
    const at::Tensor& shifted = s.logsumexp;
    CHECK(shifted.sizes() == lse.sizes());
    CHECK(shifted.is_contiguous());
    // Where the bias was copied, the given one is untouched and the copy has
    // its strides.
    CHECK(s.bias.defined() == (write == BiasWrite::kCopy));
    const at::Tensor raised = s.bias.defined() ? s.bias : bias;
    if (s.bias.defined()) {
      CHECK(at::equal(bias, before));
      CHECK(s.bias.strides() == bias.strides());
    }
    // Row (b, i): c from the smallest finite logsumexp over the heads. fp16
    // also lifts row (1, 0), whose smallest is -1.
    const float c10 = dtype == at::kHalf ? 2.0f : 0.0f;
    const float c[2][3] = {{0.0f, 64.0f, 128.0f}, {c10, 64.0f, 0.0f}};
    for (int b = 0; b < 2; ++b) {
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < 3; ++i) {
          const float x = lse[b][h][i][0].item<float>();
          const float want = std::isinf(x) ? std::numeric_limits<float>::max() : x + c[b][i];
          CHECK(shifted[b][h][i][0].item<float>() == want);
        }
      }
      for (int i = 0; i < 3; ++i) {
        const at::Tensor row = raised[b][0][i].to(at::kFloat);
        const at::Tensor want = before[b][0][i].to(at::kFloat) + c[b][i];
        CHECK(at::equal(row, want));  // -inf + c is -inf
      }
    }
    if (write == BiasWrite::kInPlace) {
      CHECK(at::equal(at::from_blob(s.shifts, {6}),
                      at::tensor({0.0f, 64.0f, 128.0f, c10, 64.0f, 0.0f})));
    } else {
      CHECK(s.shifts == nullptr);  // nothing to restore
    }
    openwam::unshift_scores(bias, s);
    CHECK(at::equal(bias, before));
  }
}

TEST_CASE("shift_scores: the bias is copied where it is no larger than the logsumexp",
          "[shift]") {
  const at::Tensor lse = at::full({2, 3, 5, 1}, -100.0f);  // 30 entries, 120 bytes
  const auto copied = [&](const at::Tensor& bias) {
    const at::Tensor before = bias.clone();
    const openwam::ShiftedScores s = openwam::shift_scores(bias, lse);
    const bool copy = s.bias.defined();
    CHECK(at::equal(bias, before) == copy);  // in place, the rows were raised
    openwam::unshift_scores(bias, s);
    CHECK(at::equal(bias, before));
    return copy;
  };
  CHECK(copied(at::zeros({2, 1, 1, 7}, at::kBFloat16)));   // a key mask: 28 bytes
  CHECK(copied(at::zeros({2, 1, 5, 6}, at::kBFloat16)));   // 120 bytes
  CHECK_FALSE(copied(at::zeros({2, 1, 5, 7}, at::kBFloat16)));  // 140 bytes
  CHECK_FALSE(copied(at::zeros({2, 1, 5, 6}, at::kFloat)));     // 240 bytes
}

TEST_CASE("shift_scores: the backward on shifted scores is the unshifted one", "[shift]") {
  // Rows of very negative logits (logsumexp near -100), a row that sees no
  // key, and bias shapes that broadcast three ways; fp32 reference attention.
  const int64_t B = 2, H = 3, L = 5, S = 9, E = 8;
  at::manual_seed(0);
  const at::Tensor u = at::full({E}, 1.0 / std::sqrt(static_cast<double>(E)));
  const at::Tensor k = at::randn({B, H, S, E}) * 0.5 + 30.0 * u;
  const at::Tensor v = at::randn({B, H, S, E});
  at::Tensor q = at::randn({B, H, L, E});
  q.index_put_({0, 1, 2}, -(110.0 / (30.0 / std::sqrt(static_cast<double>(E)))) * u);
  q.index_put_({1, 0, 4}, -(110.0 / (30.0 / std::sqrt(static_cast<double>(E)))) * u);
  const at::Tensor go = at::randn({B, H, L, E});
  at::Tensor keep = at::rand({B, 1, L, S}) > 0.3;
  keep.index_put_({at::indexing::Slice(), 0, at::indexing::Slice(), 0}, true);
  keep.index_put_({1, 0, 3}, false);  // a row that sees no key
  for (const at::Tensor& mask : {keep, keep.index({at::indexing::Slice(), at::indexing::Slice(),
                                                   at::indexing::Slice(0, 1)}),
                                 keep.index({at::indexing::Slice(0, 1)})}) {
    const at::Tensor bias = bias_of(mask, at::kFloat);
    const auto [out, lse] = openwam::reference_forward(q, k, v, bias, false, std::nullopt);
    CHECK(lse.isfinite().logical_not().sum().item<int64_t>() <= H * 1);
    CHECK(lse.nan_to_num(0, 0, 0).min().item<float>() < -90.0f);
    const auto [dq0, dk0, dv0] =
        openwam::reference_backward(go, q, k, v, out, lse, bias, false, std::nullopt);
    using openwam::BiasWrite;
    for (const BiasWrite write : {BiasWrite::kInPlace, BiasWrite::kCopy}) {
      const at::Tensor before = bias.clone();
      const openwam::ShiftedScores s = openwam::shift_scores(bias, lse, write);
      const at::Tensor& shifted = s.logsumexp;
      const at::Tensor raised = s.bias.defined() ? s.bias : bias;
      // No row left below -32 (the shifted ones at >= 0): exp(0 - lse) stays
      // far from float's overflow, so the defect cannot fire.
      CHECK(shifted.min().item<float>() >= openwam::shift_limits(at::kFloat).below);
      CHECK_FALSE(at::equal(raised, before));
      const auto [dq, dk, dv] =
          openwam::reference_backward(go, q, k, v, out, shifted, raised, false, std::nullopt);
      openwam::unshift_scores(bias, s);
      CHECK(at::equal(bias, before));
      for (const auto& [a, b] : {std::pair{dq, dq0}, std::pair{dk, dk0}, std::pair{dv, dv0}}) {
        CHECK(a.isfinite().all().item<bool>());
        CHECK(max_abs_diff(a, b) <= 1e-4 * b.abs().max().item<double>());
      }
    }
  }
}

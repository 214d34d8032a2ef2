// What the project knows about ATen's cuDNN attention (csrc/cudnn_attention.h):
// cudnn_rejects, one test per reason, and the inputs it accepts; cudnn_bias;
// the facts of a CPU-only process.
#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <cmath>
#include <limits>
#include <string>

#include "cudnn_attention.h"
#include "support.h"

using openwam_test::bhsd;
using openwam_test::bshd;
using openwam_test::Inputs;
using openwam_test::kBF16;
using openwam_test::kF16;
using openwam_test::kF32;
using openwam_test::kF64;

namespace {

std::string rejects(const Inputs& in) {
  const char* why = openwam::cudnn_rejects(in.call());
  return why == nullptr ? std::string("<accepted>") : std::string(why);
}

// A valid call to break one way at a time: bf16 [2, 4, 8, 320, 64].
Inputs valid() { return bhsd(2, 4, 8, 320, 64, kBF16, false); }

const at::Tensor& as_meta(at::Tensor& t) {
  t = at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
  return t;
}

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

TEST_CASE("cudnn facts: the key tile, the version, CPU tensors", "[cudnn_attention]") {
  CHECK(openwam::kCudnnKeyTile == 128);
  // 0 in a CPU-only process; the loaded cuDNN (9.x: 90000 + ...) otherwise.
  const long version = openwam::runtime_cudnn_version();
  if (at::hasCUDA() && at::globalContext().hasCuDNN()) {
    CHECK(version >= 90000);
  } else {
    CHECK(version == 0);
  }
  const at::Tensor q = at::randn({2, 4, 8, 64}, kBF16);
  CHECK(std::string(openwam::cudnn_unavailable(q)) == "inputs are not on a CUDA device");
}

TEST_CASE("cudnn_rejects accepts what the cuDNN path takes", "[cudnn_attention]") {
  SECTION("4-D and 3-D, fp16 and bf16, with and without grad") {
    for (auto options : {kBF16, kF16}) {
      for (bool grad : {false, true}) {
        CHECK(rejects(bhsd(2, 4, 8, 320, 64, options, grad)) == "<accepted>");
        Inputs three_d;
        three_d.query = at::randn({6, 8, 64}, options).requires_grad_(grad);
        three_d.key = at::randn({6, 320, 64}, options);
        three_d.value = at::randn({6, 320, 64}, options);
        CHECK(rejects(three_d) == "<accepted>");
      }
    }
  }
  SECTION("degenerate sizes: batch 1, one head, one query row, two keys") {
    CHECK(rejects(bhsd(1, 1, 1, 2, 8)) == "<accepted>");
    CHECK(rejects(bhsd(1, 1, 1, 300, 256)) == "<accepted>");
  }
  SECTION("grouped-query attention with enable_gqa") {
    CHECK(rejects(bhsd(2, 8, 8, 320, 64, kBF16, true, 2)) == "<accepted>");
    CHECK(rejects(bhsd(2, 8, 8, 320, 64, kBF16, true, 1)) == "<accepted>");
  }
  SECTION("BSHD storage viewed as BHSD") {
    const Inputs in = bshd(2, 4, 8, 320, 64);
    REQUIRE_FALSE(in.query.is_contiguous());
    CHECK(rejects(in) == "<accepted>");
  }
  SECTION("masks broadcasting to [..., L, S], rank 2 to 4") {
    Inputs in = valid();
    const std::vector<std::vector<int64_t>> shapes = {
        {8, 320}, {1, 320}, {8, 1}, {4, 8, 320}, {1, 1, 320},
        {2, 4, 8, 320}, {2, 1, 8, 320}, {1, 4, 1, 320}, {2, 1, 1, 320}, {1, 1, 1, 1}};
    for (const auto& shape : shapes) {
      for (auto dtype : {at::kBool, at::kFloat, at::kBFloat16}) {
        CAPTURE(shape, dtype);
        in.attn_mask = at::zeros(shape, at::TensorOptions().dtype(dtype));
        CHECK(rejects(in) == "<accepted>");
      }
    }
    // Expanded (stride-0) masks too.
    in.attn_mask = at::ones({2, 1, 1, 320}, at::kBool).expand({2, 4, 8, 320});
    CHECK(rejects(in) == "<accepted>");
    // 3-D inputs take masks up to rank 3.
    Inputs three_d;
    three_d.query = at::randn({6, 8, 64}, kBF16);
    three_d.key = at::randn({6, 320, 64}, kBF16);
    three_d.value = at::randn({6, 320, 64}, kBF16);
    for (const auto& shape : {std::vector<int64_t>{8, 320}, {6, 8, 320}, {6, 1, 320}}) {
      CAPTURE(shape);
      three_d.attn_mask = at::zeros(shape, at::kBool);
      CHECK(rejects(three_d) == "<accepted>");
    }
  }
  SECTION("dropout in sixteenths, causal, explicit scales") {
    Inputs in = valid();
    for (double p : {0.0625, 0.125, 0.5, 0.9375}) {
      CAPTURE(p);
      in.dropout_p = p;
      CHECK(rejects(in) == "<accepted>");
    }
    in.dropout_p = 0.0;
    in.is_causal = true;
    CHECK(rejects(in) == "<accepted>");
    for (double scale : {0.5, -0.25, 0.0, 1e6}) {
      CAPTURE(scale);
      in.scale = scale;
      CHECK(rejects(in) == "<accepted>");
    }
  }
  SECTION("deterministic algorithms in warn-only mode") {
    auto& ctx = at::globalContext();
    const bool was = ctx.deterministicAlgorithms(), was_warn = ctx.deterministicAlgorithmsWarnOnly();
    ctx.setDeterministicAlgorithms(true, /*warn_only=*/true);
    const std::string got = rejects(valid());
    ctx.setDeterministicAlgorithms(was, was_warn);
    CHECK(got == "<accepted>");
  }
}

TEST_CASE("cudnn_rejects: an input is not a dense strided tensor", "[cudnn_attention]") {
  Inputs in = valid();
  in.key = in.key.to_sparse();
  CHECK(rejects(in) == "an input is not a dense strided tensor");
  in = valid();
  in.query = in.query.to_sparse();
  CHECK(rejects(in) == "an input is not a dense strided tensor");
}

TEST_CASE("cudnn_rejects: inputs are not 3-D or 4-D", "[cudnn_attention]") {
  Inputs in;
  in.query = at::randn({8, 64}, kBF16);
  in.key = at::randn({320, 64}, kBF16);
  in.value = at::randn({320, 64}, kBF16);
  CHECK(rejects(in) == "inputs are not 3-D or 4-D");
  in.query = at::randn({2, 2, 4, 8, 64}, kBF16);
  in.key = at::randn({2, 2, 4, 320, 64}, kBF16);
  in.value = at::randn({2, 2, 4, 320, 64}, kBF16);
  CHECK(rejects(in) == "inputs are not 3-D or 4-D");
}

TEST_CASE("cudnn_rejects: inputs differ in rank", "[cudnn_attention]") {
  Inputs in = valid();
  in.key = in.key[0];
  CHECK(rejects(in) == "inputs differ in rank");
  in = valid();
  in.value = in.value[0];
  CHECK(rejects(in) == "inputs differ in rank");
}

TEST_CASE("cudnn_rejects: dtype is not float16/bfloat16", "[cudnn_attention]") {
  for (auto options : {kF32, kF64}) {
    CHECK(rejects(bhsd(2, 4, 8, 320, 64, options, false)) == "dtype is not float16/bfloat16");
  }
}

TEST_CASE("cudnn_rejects: inputs differ in dtype", "[cudnn_attention]") {
  Inputs in = valid();
  in.key = in.key.to(at::kHalf);
  CHECK(rejects(in) == "inputs differ in dtype");
  in = valid();
  in.value = in.value.to(at::kFloat);
  CHECK(rejects(in) == "inputs differ in dtype");
}

TEST_CASE("cudnn_rejects: inputs differ in device", "[cudnn_attention]") {
  Inputs in = valid();
  as_meta(in.key);
  CHECK(rejects(in) == "inputs differ in device");
  in = valid();
  as_meta(in.value);
  CHECK(rejects(in) == "inputs differ in device");
}

TEST_CASE("cudnn_rejects: an input is empty", "[cudnn_attention]") {
  CHECK(rejects(bhsd(0, 4, 8, 320, 64)) == "an input is empty");
  CHECK(rejects(bhsd(2, 0, 8, 320, 64)) == "an input is empty");
  CHECK(rejects(bhsd(2, 4, 0, 320, 64)) == "an input is empty");
  CHECK(rejects(bhsd(2, 4, 8, 0, 64)) == "an input is empty");
}

TEST_CASE("cudnn_rejects: inputs differ in batch size", "[cudnn_attention]") {
  Inputs in = valid();
  in.key = at::randn({1, 4, 320, 64}, kBF16);
  in.value = at::randn({1, 4, 320, 64}, kBF16);
  CHECK(rejects(in) == "inputs differ in batch size");
  in = valid();
  in.value = at::randn({3, 4, 320, 64}, kBF16);
  CHECK(rejects(in) == "inputs differ in batch size");
}

TEST_CASE("cudnn_rejects: key and value differ in heads", "[cudnn_attention]") {
  Inputs in = valid();
  in.value = at::randn({2, 2, 320, 64}, kBF16);
  in.enable_gqa = true;
  CHECK(rejects(in) == "key and value differ in heads");
}

TEST_CASE("cudnn_rejects: query heads differ from key heads without grouped-query "
          "attention", "[cudnn_attention]") {
  const std::string why = "query heads differ from key heads without grouped-query attention";
  Inputs in = bhsd(2, 8, 8, 320, 64, kBF16, false, 2);
  in.enable_gqa = false;
  CHECK(rejects(in) == why);
  // enable_gqa, but the heads do not divide.
  in = bhsd(2, 6, 8, 320, 64, kBF16, false, 4);
  REQUIRE(in.enable_gqa);
  CHECK(rejects(in) == why);
  // More key heads than query heads.
  in = bhsd(2, 2, 8, 320, 64, kBF16, false, 4);
  CHECK(rejects(in) == why);
}

TEST_CASE("cudnn_rejects: key's head_dim differs from query's", "[cudnn_attention]") {
  Inputs in = valid();
  in.key = at::randn({2, 4, 320, 32}, kBF16);
  in.value = at::randn({2, 4, 320, 32}, kBF16);
  CHECK(rejects(in) == "key's head_dim differs from query's");
}

TEST_CASE("cudnn_rejects: a value head_dim of its own is taken", "[cudnn_attention]") {
  // As F.sdpa and cuDNN take it (PyTorch's test_cudnn_attention_different_dk_dv).
  Inputs in = valid();
  in.value = at::randn({2, 4, 320, 128}, kBF16);
  CHECK(rejects(in) == "<accepted>");
  in.value = at::randn({2, 4, 320, 12}, kBF16);
  CHECK(rejects(in) == "head_dim is not a multiple of 8 up to 256");
}

TEST_CASE("cudnn_rejects: head_dim is not a multiple of 8 up to 256", "[cudnn_attention]") {
  for (int64_t d : {4, 12, 60, 100, 264, 512}) {
    CAPTURE(d);
    CHECK(rejects(bhsd(2, 4, 8, 320, d, kBF16, false)) ==
          "head_dim is not a multiple of 8 up to 256");
  }
}

TEST_CASE("cudnn_rejects: key and value differ in length", "[cudnn_attention]") {
  Inputs in = valid();
  in.value = at::randn({2, 4, 300, 64}, kBF16);
  CHECK(rejects(in) == "key and value differ in length");
}

TEST_CASE("cudnn_rejects: s_kv <= 1", "[cudnn_attention]") {
  CHECK(rejects(bhsd(2, 4, 8, 1, 64)) == "s_kv <= 1");
  CHECK(rejects(bhsd(1, 1, 1, 1, 64)) == "s_kv <= 1");
}

TEST_CASE("cudnn_rejects: last dim of query/key/value is not contiguous",
          "[cudnn_attention]") {
  const std::string why = "last dim of query/key/value is not contiguous";
  // [B, H, D, S] storage viewed as [B, H, S, D]: the last dim strides by S.
  const auto strided = [](int64_t S) {
    return at::randn({2, 4, 64, S}, kBF16).transpose(-1, -2);
  };
  Inputs in = valid();
  in.query = strided(8);
  CHECK(rejects(in) == why);
  in = valid();
  in.key = strided(320);
  CHECK(rejects(in) == why);
  in = valid();
  in.value = strided(320);
  CHECK(rejects(in) == why);
  // Every other element of a wider last dim.
  in = valid();
  in.query = at::randn({2, 4, 8, 128}, kBF16).slice(-1, 0, 128, 2);
  CHECK(rejects(in) == why);
}

TEST_CASE("cudnn_rejects: dropout_p outside 0 to 1", "[cudnn_attention]") {
  Inputs in = valid();
  for (double p : {1.0, 1.5, -0.0625, std::nan("")}) {
    CAPTURE(p);
    in.dropout_p = p;
    CHECK(rejects(in) == "dropout_p outside [0, 1)");
  }
}

TEST_CASE("cudnn_rejects: dropout with s_q == 1", "[cudnn_attention]") {
  Inputs in = bhsd(2, 4, 1, 320, 64);
  in.dropout_p = 0.5;
  CHECK(rejects(in) == "dropout with s_q == 1");
}

TEST_CASE("cudnn_rejects: dropout_p is not a multiple of 1/16", "[cudnn_attention]") {
  Inputs in = valid();
  for (double p : {0.1, 0.3, 0.01, 0.0625 + 1e-9}) {
    CAPTURE(p);
    in.dropout_p = p;
    CHECK(rejects(in) == "dropout_p is not a multiple of 1/16");
  }
}

TEST_CASE("cudnn_rejects: scale is not finite", "[cudnn_attention]") {
  Inputs in = valid();
  for (double scale : {kInf, -kInf, std::nan("")}) {
    CAPTURE(scale);
    in.scale = scale;
    CHECK(rejects(in) == "scale is not finite");
  }
}

TEST_CASE("cudnn_rejects: attn_mask with is_causal=True", "[cudnn_attention]") {
  Inputs in = valid();
  in.attn_mask = at::ones({8, 320}, at::kBool);
  in.is_causal = true;
  CHECK(rejects(in) == "attn_mask with is_causal=True");
}

TEST_CASE("cudnn_rejects: attn_mask is not a dense strided tensor", "[cudnn_attention]") {
  Inputs in = valid();
  in.attn_mask = at::ones({8, 320}, kF32).to_sparse();
  CHECK(rejects(in) == "attn_mask is not a dense strided tensor");
}

TEST_CASE("cudnn_rejects: attn_mask requires grad", "[cudnn_attention]") {
  Inputs in = valid();
  in.attn_mask = at::zeros({8, 320}, kBF16).requires_grad_(true);
  CHECK(rejects(in) == "attn_mask requires grad");
}

TEST_CASE("cudnn_rejects: attn_mask is on another device", "[cudnn_attention]") {
  Inputs in = valid();
  at::Tensor mask = at::ones({8, 320}, at::kBool);
  in.attn_mask = as_meta(mask);
  CHECK(rejects(in) == "attn_mask is on another device");
}

TEST_CASE("cudnn_rejects: attn_mask dtype is not bool, float32 or query's",
          "[cudnn_attention]") {
  Inputs in = valid();
  for (auto dtype : {at::kDouble, at::kHalf, at::kInt, at::kLong, at::kByte}) {
    CAPTURE(dtype);
    in.attn_mask = at::zeros({8, 320}, at::TensorOptions().dtype(dtype));
    CHECK(rejects(in) == "attn_mask dtype is not bool, float32 or query's");
  }
}

TEST_CASE("cudnn_rejects: attn_mask does not broadcast to the scores",
          "[cudnn_attention]") {
  Inputs in = valid();
  // {320} and {1} broadcast, but PyTorch's selector raises on a 1-D mask
  // (OPENWAM_SDPA_CUDNN=1 does not ask it): PyTorch's error, not cuDNN's run.
  for (const auto& shape : {std::vector<int64_t>{}, {300}, {320}, {1}, {8, 300}, {7, 320},
                            {3, 8, 320}, {2, 3, 8, 320}, {3, 4, 8, 320},
                            {1, 2, 4, 8, 320}}) {
    CAPTURE(shape);
    in.attn_mask = at::zeros(shape, at::kBool);
    CHECK(rejects(in) == "attn_mask does not broadcast to [..., L, S]");
  }
  // A 4-D mask for 3-D inputs.
  Inputs three_d;
  three_d.query = at::randn({6, 8, 64}, kBF16);
  three_d.key = at::randn({6, 320, 64}, kBF16);
  three_d.value = at::randn({6, 320, 64}, kBF16);
  three_d.attn_mask = at::zeros({1, 6, 8, 320}, at::kBool);
  CHECK(rejects(three_d) == "attn_mask does not broadcast to [..., L, S]");
}

TEST_CASE("cudnn_rejects: torch.use_deterministic_algorithms(True) is set",
          "[cudnn_attention]") {
  auto& ctx = at::globalContext();
  const bool was = ctx.deterministicAlgorithms(), was_warn = ctx.deterministicAlgorithmsWarnOnly();
  ctx.setDeterministicAlgorithms(true, /*warn_only=*/false);
  const std::string got = rejects(valid());
  ctx.setDeterministicAlgorithms(was, was_warn);
  CHECK(got == "torch.use_deterministic_algorithms(True) is set");
}

TEST_CASE("cudnn_bias: a bool mask becomes 0 / -inf in the dtype", "[cudnn_attention]") {
  // [B, 1, L, S] with a broadcast head axis; the shape must be kept.
  at::Tensor mask = at::rand({2, 1, 3, 5}, kF64).gt(0.5);
  mask.select(-1, 0).fill_(true);
  mask.select(-1, 1).fill_(false);
  for (auto dtype : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16}) {
    CAPTURE(dtype);
    const at::Tensor bias = openwam::cudnn_bias(mask, dtype, 4, 5);
    CHECK(bias.scalar_type() == dtype);
    CHECK(bias.sizes() == mask.sizes());
    CHECK(bias.stride(-1) == 1);
    const at::Tensor b = bias.to(at::kDouble);
    CHECK(b.masked_select(mask).eq(0).all().item<bool>());
    CHECK(b.masked_select(mask.logical_not()).isneginf().all().item<bool>());
  }
}

TEST_CASE("cudnn_bias: an additive mask is cast, or kept as it is", "[cudnn_attention]") {
  const at::Tensor mask = at::randn({2, 1, 3, 5}, kF32);
  const at::Tensor bias = openwam::cudnn_bias(mask, at::kBFloat16, 4, 5);
  CHECK(bias.scalar_type() == at::kBFloat16);
  CHECK(bias.sizes() == mask.sizes());
  CHECK(bias.equal(mask.to(at::kBFloat16)));
  // Already in the dtype, 4-D, last dim contiguous: the mask itself.
  const at::Tensor same = at::randn({2, 1, 3, 5}, kBF16);
  CHECK(openwam::cudnn_bias(same, at::kBFloat16, 4, 5).is_same(same));
  // -inf in an additive mask stays -inf.
  at::Tensor hidden = at::zeros({3, 5}, kF32);
  hidden.select(-1, 2).fill_(-kInf);
  const at::Tensor hb = openwam::cudnn_bias(hidden, at::kHalf, 4, 5);
  CHECK(hb.select(-1, 2).isneginf().all().item<bool>());
}

TEST_CASE("cudnn_bias: right-aligned to 4-D, a 3-D call gets a unit head axis",
          "[cudnn_attention]") {
  struct Case {
    std::vector<int64_t> mask, expected;
    int64_t rank;
  };
  const Case cases[] = {
      {{5}, {1, 1, 1, 5}, 4},
      {{3, 5}, {1, 1, 3, 5}, 4},
      {{4, 3, 5}, {1, 4, 3, 5}, 4},
      {{2, 4, 3, 5}, {2, 4, 3, 5}, 4},
      {{2, 1, 1, 5}, {2, 1, 1, 5}, 4},
      {{5}, {1, 1, 1, 5}, 3},
      {{3, 5}, {1, 1, 3, 5}, 3},
      {{2, 3, 5}, {2, 1, 3, 5}, 3},
      {{2, 1, 5}, {2, 1, 1, 5}, 3},
  };
  for (const Case& c : cases) {
    for (auto dtype : {at::kBool, at::kFloat}) {
      CAPTURE(c.mask, c.rank, dtype);
      const at::Tensor mask = at::ones(c.mask, at::TensorOptions().dtype(dtype));
      const at::Tensor bias = openwam::cudnn_bias(mask, at::kBFloat16, c.rank, 5);
      CHECK(bias.sizes() == at::IntArrayRef(c.expected));
      CHECK(bias.stride(-1) == 1);
      CHECK(bias.eq(dtype == at::kBool ? 0.0 : 1.0).all().item<bool>());
    }
  }
}

TEST_CASE("cudnn_bias: grown to s_kv_padded for the K/V shim, -inf past s_kv",
          "[cudnn_attention]") {
  SECTION("a bool mask [B, 1, L, S]") {
    at::Tensor mask = at::rand({2, 1, 3, 5}, kF64).gt(0.5);
    mask.select(-1, 0).fill_(true);
    const at::Tensor bias = openwam::cudnn_bias(mask, at::kBFloat16, 4, 5, c10::SymInt(8));
    CHECK(bias.sizes() == at::IntArrayRef({2, 1, 3, 8}));
    CHECK(bias.is_contiguous());
    CHECK(bias.narrow(-1, 0, 5).equal(openwam::cudnn_bias(mask, at::kBFloat16, 4, 5)));
    CHECK(bias.narrow(-1, 5, 3).isneginf().all().item<bool>());
  }
  SECTION("an additive mask of another dtype, 3-D call") {
    const at::Tensor mask = at::randn({3, 5}, kF32);
    const at::Tensor bias = openwam::cudnn_bias(mask, at::kHalf, 3, 5, c10::SymInt(8));
    CHECK(bias.sizes() == at::IntArrayRef({1, 1, 3, 8}));
    CHECK(bias.scalar_type() == at::kHalf);
    CHECK(bias.narrow(-1, 0, 5).equal(mask.to(at::kHalf).view({1, 1, 3, 5})));
    CHECK(bias.narrow(-1, 5, 3).isneginf().all().item<bool>());
  }
  SECTION("a mask broadcast along the keys") {
    at::Tensor mask = at::zeros({2, 1, 1, 1}, at::kBool);
    mask[0].fill_(true);
    const at::Tensor bias = openwam::cudnn_bias(mask, at::kBFloat16, 4, 6, c10::SymInt(8));
    CHECK(bias.sizes() == at::IntArrayRef({2, 1, 1, 8}));
    CHECK(bias[0].narrow(-1, 0, 6).eq(0).all().item<bool>());
    CHECK(bias[0].narrow(-1, 6, 2).isneginf().all().item<bool>());
    CHECK(bias[1].isneginf().all().item<bool>());
  }
}

TEST_CASE("cudnn_bias: the last dim is materialised and contiguous", "[cudnn_attention]") {
  SECTION("a mask broadcast along the keys (size 1)") {
    const at::Tensor mask = at::randn({3, 1}, kF32);
    const at::Tensor bias = openwam::cudnn_bias(mask, at::kHalf, 4, 7);
    CHECK(bias.sizes() == at::IntArrayRef({1, 1, 3, 7}));
    CHECK(bias.is_contiguous());
    CHECK(bias.equal(mask.to(at::kHalf).expand({3, 7}).reshape({1, 1, 3, 7})));
  }
  SECTION("a bool mask [B, 1, 1, 1]") {
    at::Tensor mask = at::zeros({2, 1, 1, 1}, at::kBool);
    mask[0].fill_(true);
    const at::Tensor bias = openwam::cudnn_bias(mask, at::kBFloat16, 4, 6);
    CHECK(bias.sizes() == at::IntArrayRef({2, 1, 1, 6}));
    CHECK(bias.is_contiguous());
    CHECK(bias[0].eq(0).all().item<bool>());
    CHECK(bias[1].isneginf().all().item<bool>());
  }
  SECTION("a mask expanded along the keys (stride 0)") {
    const at::Tensor mask = at::randn({1, 1, 3, 1}, kBF16).expand({1, 1, 3, 7});
    REQUIRE(mask.stride(-1) == 0);
    const at::Tensor bias = openwam::cudnn_bias(mask, at::kBFloat16, 4, 7);
    CHECK(bias.stride(-1) == 1);
    CHECK(bias.is_contiguous());
    CHECK(bias.equal(mask));
  }
  SECTION("a mask strided along the keys") {
    const at::Tensor wide = at::randn({1, 1, 3, 14}, kBF16);
    const at::Tensor mask = wide.slice(-1, 0, 14, 2);
    REQUIRE(mask.stride(-1) == 2);
    const at::Tensor bias = openwam::cudnn_bias(mask, at::kBFloat16, 4, 7);
    CHECK(bias.stride(-1) == 1);
    CHECK(bias.equal(mask));
  }
}

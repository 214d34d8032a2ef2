// The guard table (csrc/guards.h): key_tail_defect, plan_for_cudnn,
// guard_rules, rule_avoiding_cudnn.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstring>
#include <string>

#include "guards.h"
#include "sdpa_inputs.h"
#include "settings.h"

// Catch2 last: c10/util/logging_is_not_google_glog.h defines a glog-style
// CHECK that aborts; catch.hpp's CHECK must be the one in force.
#undef CHECK
#include <catch2/catch.hpp>

using openwam::Plan;

namespace {

// q [B, H, s_q, head_dim], k/v [B, H, s_kv, head_dim]; contents irrelevant.
openwam::SdpaInputs make_inputs(int64_t s_q, int64_t s_kv, int64_t head_dim,
                                bool requires_grad = true, double dropout_p = 0.0,
                                bool is_causal = false, int64_t B = 2,
                                int64_t H = 2) {
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  openwam::SdpaInputs in;
  in.query = at::zeros({B, H, s_q, head_dim}, opts).requires_grad_(requires_grad);
  in.key = at::zeros({B, H, s_kv, head_dim}, opts).requires_grad_(requires_grad);
  in.value = at::zeros({B, H, s_kv, head_dim}, opts).requires_grad_(requires_grad);
  in.dropout_p = dropout_p;
  in.is_causal = is_causal;
  return in;
}

openwam::Settings settings_with(openwam::PadMode pad) {
  openwam::Settings s;
  s.pad = pad;
  return s;
}

// A non-null value that plan_for_cudnn must overwrite.
const openwam::GuardRule* sentinel() { return &openwam::guard_rules().back(); }

std::string rule_name(const openwam::GuardRule* rule) {
  return rule == nullptr ? std::string("<none>") : std::string(rule->name);
}

}  // namespace

TEST_CASE("key_tail_defect on cuDNN 9.19.0, head_dim 64/128: only r == 64, not causal",
          "[guards]") {
  for (int64_t head_dim : {64, 128}) {
    for (int64_t base : {0, 256, 1024}) {
      for (int64_t r = 1; r < 128; ++r) {
        const int64_t s_kv = base + r;
        CAPTURE(head_dim, s_kv);
        CHECK(openwam::key_tail_defect(91900, s_kv, head_dim, false) == (r == 64));
        CHECK_FALSE(openwam::key_tail_defect(91900, s_kv, head_dim, true));
      }
    }
  }
}

TEST_CASE("key_tail_defect on cuDNN 9.19.0, other head_dims: any remainder", "[guards]") {
  for (int64_t head_dim : {32, 96, 256}) {
    for (int64_t r = 1; r < 128; ++r) {
      CAPTURE(head_dim, r);
      CHECK(openwam::key_tail_defect(91900, 256 + r, head_dim, false));
    }
  }
}

TEST_CASE("key_tail_defect before the fix: every remainder", "[guards]") {
  for (long version : {90701L, 91500L, 92501L, 92599L}) {
    for (int64_t r = 1; r < 128; ++r) {
      CAPTURE(version, r);
      CHECK(openwam::key_tail_defect(version, 256 + r, 64, false));
      CHECK(openwam::key_tail_defect(version, r, 128, false));
      CHECK(openwam::key_tail_defect(version, 256 + r, 96, true));
    }
  }
}

TEST_CASE("key_tail_defect from 9.26.0 on, and on multiples of 128: never", "[guards]") {
  for (long version : {92600L, 92601L, 92700L, 100000L}) {
    for (int64_t r = 0; r < 128; ++r) {
      CAPTURE(version, r);
      CHECK_FALSE(openwam::key_tail_defect(version, 256 + r, 64, false));
      CHECK_FALSE(openwam::key_tail_defect(version, 256 + r, 96, false));
    }
  }
  for (long version : {90701L, 91900L, 92501L}) {
    for (int64_t s_kv : {128, 256, 1024, 4096}) {
      for (int64_t head_dim : {64, 96, 128}) {
        CAPTURE(version, s_kv, head_dim);
        CHECK_FALSE(openwam::key_tail_defect(version, s_kv, head_dim, false));
      }
    }
  }
}

TEST_CASE("repair_supported follows the build", "[guards]") {
  const auto in = make_inputs(8, 320, 64);
#ifdef OPENWAM_WITH_CUDA
  CHECK(openwam::repair_supported(in));
  CHECK_FALSE(openwam::repair_supported(make_inputs(8, 320, 64, true, 0.25)));
#else
  CHECK_FALSE(openwam::repair_supported(in));
#endif
}

TEST_CASE("plan_for_cudnn: OPENWAM_SDPA_PAD=never", "[guards]") {
  const auto in = make_inputs(8, 320, 64);  // affected on 9.19.0
  const openwam::GuardRule* rule = sentinel();
  CHECK(openwam::plan_for_cudnn(in, settings_with(openwam::PadMode::kNever), 91900,
                                &rule) == Plan::kNone);
  CHECK(rule == nullptr);
}

TEST_CASE("plan_for_cudnn: OPENWAM_SDPA_PAD=always", "[guards]") {
  const auto always = settings_with(openwam::PadMode::kAlways);
  const openwam::GuardRule* rule = sentinel();
  // Unaffected shapes and versions are padded too.
  for (long version : {91900L, 92700L}) {
    CAPTURE(version);
    CHECK(openwam::plan_for_cudnn(make_inputs(8, 300, 64), always, version, &rule) ==
          Plan::kPadBackward);
    CHECK(rule == nullptr);
    CHECK(openwam::plan_for_cudnn(make_inputs(8, 300, 64, true, 0.25), always, version,
                                  &rule) == Plan::kPadForward);
    CHECK(rule == nullptr);
  }
  // Nothing to pad on a multiple of 128.
  CHECK(openwam::plan_for_cudnn(make_inputs(8, 256, 64), always, 91900, &rule) ==
        Plan::kNone);
}

TEST_CASE("plan_for_cudnn: auto on unaffected calls", "[guards]") {
  const auto automatic = settings_with(openwam::PadMode::kAuto);
  const openwam::GuardRule* rule = sentinel();
  CHECK(openwam::plan_for_cudnn(make_inputs(8, 300, 64), automatic, 91900, &rule) ==
        Plan::kNone);
  CHECK(rule == nullptr);
  rule = sentinel();
  CHECK(openwam::plan_for_cudnn(make_inputs(8, 320, 64, true, 0.0, true), automatic,
                                91900, &rule) == Plan::kNone);
  CHECK(rule == nullptr);
  rule = sentinel();
  CHECK(openwam::plan_for_cudnn(make_inputs(8, 320, 64), automatic, 92600, &rule) ==
        Plan::kNone);
  CHECK(rule == nullptr);
  rule = sentinel();
  CHECK(openwam::plan_for_cudnn(make_inputs(8, 384, 96), automatic, 90701, &rule) ==
        Plan::kNone);
  CHECK(rule == nullptr);
}

TEST_CASE("plan_for_cudnn: auto on affected calls", "[guards]") {
  const auto automatic = settings_with(openwam::PadMode::kAuto);
  struct Case {
    long version;
    int64_t s_kv, head_dim;
    const char* rule;
  };
  const Case cases[] = {
      {91900, 320, 64, "key_tail_nan_dq_9.19"},
      {91900, 192, 128, "key_tail_nan_dq_9.19"},
      {91900, 300, 96, "key_tail_nan_dq"},
      {90701, 300, 64, "key_tail_nan_dq"},
      {92501, 129, 128, "key_tail_nan_dq"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.version, c.s_kv, c.head_dim);
    const auto in = make_inputs(8, c.s_kv, c.head_dim);
    const openwam::GuardRule* rule = nullptr;
    const Plan expected =
        openwam::repair_supported(in) ? Plan::kRepairDq : Plan::kPadBackward;
    CHECK(openwam::plan_for_cudnn(in, automatic, c.version, &rule) == expected);
#ifndef OPENWAM_WITH_CUDA
    CHECK(expected == Plan::kPadBackward);
#endif
    CHECK(rule_name(rule) == c.rule);

    rule = nullptr;
    const auto dropout = make_inputs(8, c.s_kv, c.head_dim, true, 0.25);
    CHECK(openwam::plan_for_cudnn(dropout, automatic, c.version, &rule) ==
          Plan::kPadForward);
    CHECK(rule_name(rule) == c.rule);
  }
}

TEST_CASE("guard_rules: every field filled in", "[guards]") {
  const auto& rules = openwam::guard_rules();
  REQUIRE_FALSE(rules.empty());
  for (const auto& rule : rules) {
    for (const char* field : {rule.name, rule.versions, rule.defect, rule.action,
                              rule.source}) {
      REQUIRE(field != nullptr);
      CHECK(std::strlen(field) > 0);
    }
  }
}

TEST_CASE("rule_avoiding_cudnn: cuDNN 9.25.1 - 9.26.x defects", "[guards]") {
  at::AutoGradMode grad_on(true);
  SECTION("B == H == s_q == 1: plan segfault") {
    const auto in = make_inputs(1, 300, 64, true, 0.0, false, 1, 1);
    for (long version : {92501L, 92600L, 92699L}) {
      CAPTURE(version);
      CHECK(rule_name(openwam::rule_avoiding_cudnn(in, version)) == "bhsq1_plan_segfault");
    }
    // 3-D [N, L, E] has one head.
    openwam::SdpaInputs three_d;
    const auto opts = at::TensorOptions().dtype(at::kDouble);
    three_d.query = at::zeros({1, 1, 64}, opts).requires_grad_(true);
    three_d.key = at::zeros({1, 300, 64}, opts).requires_grad_(true);
    three_d.value = at::zeros({1, 300, 64}, opts).requires_grad_(true);
    CHECK(rule_name(openwam::rule_avoiding_cudnn(three_d, 92501)) == "bhsq1_plan_segfault");
  }
  SECTION("s_q == 1, s_kv == 128: NaN dK/dV") {
    const auto in = make_inputs(1, 128, 64, true, 0.0, false, 2, 4);
    CHECK(rule_name(openwam::rule_avoiding_cudnn(in, 92501)) == "sq1_dkdv_nan");
    CHECK(rule_name(openwam::rule_avoiding_cudnn(in, 92600)) == "sq1_dkdv_nan");
  }
  SECTION("outside the versions or the shapes: none") {
    const auto segv = make_inputs(1, 300, 64, true, 0.0, false, 1, 1);
    const auto nan = make_inputs(1, 128, 64, true, 0.0, false, 2, 4);
    for (long version : {0L, 91900L, 92500L, 92700L}) {
      CAPTURE(version);
      CHECK(openwam::rule_avoiding_cudnn(segv, version) == nullptr);
      CHECK(openwam::rule_avoiding_cudnn(nan, version) == nullptr);
    }
    CHECK(openwam::rule_avoiding_cudnn(make_inputs(1, 129, 64, true, 0.0, false, 2, 4),
                                       92501) == nullptr);
    // s_q == 1 alone (B or H > 1, s_kv != 128) is fine.
    CHECK(openwam::rule_avoiding_cudnn(make_inputs(1, 300, 64, true, 0.0, false, 2, 1),
                                       92501) == nullptr);
    CHECK(openwam::rule_avoiding_cudnn(make_inputs(1, 300, 64, true, 0.0, false, 1, 2),
                                       92501) == nullptr);
    CHECK(openwam::rule_avoiding_cudnn(make_inputs(2, 300, 64, true, 0.0, false, 1, 1),
                                       92501) == nullptr);
    CHECK(openwam::rule_avoiding_cudnn(make_inputs(2, 128, 64, true, 0.0, false, 2, 4),
                                       92501) == nullptr);
  }
  SECTION("not differentiated: none") {
    const auto no_grad = make_inputs(1, 128, 64, false, 0.0, false, 1, 1);
    CHECK(openwam::rule_avoiding_cudnn(no_grad, 92501) == nullptr);
    const auto in = make_inputs(1, 128, 64, true, 0.0, false, 1, 1);
    at::AutoGradMode grad_off(false);
    CHECK(openwam::rule_avoiding_cudnn(in, 92501) == nullptr);
  }
}

TEST_CASE("Plan names", "[guards]") {
  CHECK(std::string(openwam::to_string(Plan::kNone)) == "none");
  CHECK(std::string(openwam::to_string(Plan::kRepairDq)) == "repair_dq");
  CHECK(std::string(openwam::to_string(Plan::kPadBackward)) == "pad_backward");
  CHECK(std::string(openwam::to_string(Plan::kPadForward)) == "pad_forward");
  CHECK(std::string(openwam::to_string(Plan::kPadInputs)) == "pad_inputs");
}

// The guard table (csrc/guards.h): one test per rule row (its versions and
// its predicate), the rules that cover a call (rules_covering), the folding
// of the rows into one plan (check_guards),
// key_tail_defect, the warning, and the rows' fields.
#include <c10/util/Exception.h>

#include <cstring>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "guards.h"
#include "support.h"

using openwam::CallShape;
using openwam::Fix;
using openwam::GuardRule;
using openwam::Plan;
using openwam::cudnn_version;
using openwam::kNewestKnownCudnn;

namespace {

constexpr long k9_7_1 = cudnn_version(9, 7, 1);
constexpr long k9_15_0 = cudnn_version(9, 15, 0);
constexpr long k9_19_0 = cudnn_version(9, 19, 0);
constexpr long k9_25_0 = cudnn_version(9, 25, 0);
constexpr long k9_25_1 = cudnn_version(9, 25, 1);
constexpr long k9_26_0 = cudnn_version(9, 26, 0);
constexpr long kTooNew = kNewestKnownCudnn + 1;

const GuardRule& rule(const char* name) {
  for (const GuardRule& r : openwam::guard_rules()) {
    if (std::strcmp(r.name, name) == 0) {
      return r;
    }
  }
  FAIL("no guard rule named " << name);
  throw;  // unreachable: FAIL throws
}

std::string name_of(const GuardRule* r) {
  return r == nullptr ? std::string("<none>") : std::string(r->name);
}

CallShape shape(int64_t batch, int64_t heads, int64_t s_q, int64_t s_kv,
                int64_t head_dim, bool is_causal = false, double dropout_p = 0.0) {
  CallShape s;
  s.batch = batch;
  s.heads = heads;
  s.kv_heads = heads;
  s.s_q = s_q;
  s.s_kv = s_kv;
  s.head_dim = head_dim;
  s.head_dim_v = head_dim;
  s.is_causal = is_causal;
  s.dropout_p = dropout_p;
  return s;
}

}  // namespace

TEST_CASE("version encoding and ranges", "[guards]") {
  CHECK(cudnn_version(9, 19, 0) == 91900);
  CHECK(cudnn_version(9, 26, 99) == 92699);
  CHECK(kNewestKnownCudnn == 92699);
  const openwam::VersionRange r{100, 200};
  CHECK(r.contains(100));
  CHECK(r.contains(199));
  CHECK_FALSE(r.contains(200));
  CHECK_FALSE(r.contains(99));
  CHECK_FALSE(r.empty());
  CHECK(openwam::VersionRange{}.empty());
  CHECK_FALSE(openwam::VersionRange{}.contains(0));
}

TEST_CASE("guard_rules: the rows, in order", "[guards]") {
  std::vector<std::string> names;
  for (const GuardRule& r : openwam::guard_rules()) {
    names.emplace_back(r.name);
  }
  // The avoid rule comes first: check_guards stops at it.
  CHECK(names == std::vector<std::string>{"bhsq1_backward_plan_segfault",
                                          "key_tail_nan_dq_9.19", "key_tail_nan_dq",
                                          "sq1_nan_dk_dv_9.19", "sq1_nan_dk_dv",
                                          "ragged_adversarial_dq_9.19", "ragged_unmeasured",
                                          "ragged_unmeasured_old"});
  // warn_once has a flag for every row only up to kMaxGuardRules.
  CHECK(openwam::guard_rules().size() <= openwam::kMaxGuardRules);
}

TEST_CASE("guard_rules: every field filled in", "[guards]") {
  const auto& rules = openwam::guard_rules();
  REQUIRE_FALSE(rules.empty());
  std::set<std::string> names;
  for (const GuardRule& r : rules) {
    CAPTURE(r.name);
    for (const char* field : {r.name, r.versions_text, r.defect, r.action, r.source}) {
      REQUIRE(field != nullptr);
      CHECK(std::strlen(field) > 0);
    }
    CHECK(r.hits != nullptr);
    CHECK_FALSE(r.versions.empty());
    // What was measured lies inside what the rule covers.
    if (!r.measured.empty()) {
      CHECK(r.versions.contains(r.measured.first));
      CHECK(r.versions.contains(r.measured.end - 1));
    }
    // Only the rows of defects with no known fix reach past the newest
    // version the table knows, and they say so.
    if (r.versions.contains(kTooNew)) {
      CHECK_THAT(std::string(r.versions_text) + r.source,
                 Catch::Matchers::Contains("no fix known") ||
                     Catch::Matchers::Contains("this project found the engine right on 9.19.0"));
    }
    names.insert(r.name);
  }
  CHECK(names.size() == rules.size());
}

TEST_CASE("guard_rules: a row with nothing measured says so", "[guards]") {
  // The doctor and the warning print the source: a conservative row must not
  // read as this project's measurement.
  for (const GuardRule& r : openwam::guard_rules()) {
    CAPTURE(r.name, r.source);
    if (r.measured.empty()) {
      CHECK_THAT(r.source, Catch::Matchers::Contains("conservative"));
      CHECK_THAT(r.source, !Catch::Matchers::Contains("measured by this project on"));
    } else {
      // The stack it was measured on, in words.
      CHECK_THAT(r.source, Catch::Matchers::Contains("measured by this project on an H200") &&
                               Catch::Matchers::Contains("cuDNN 9.19.0"));
      CHECK_THAT(r.source, !Catch::Matchers::Contains("conservative"));
    }
  }
}

TEST_CASE("torch 2.15's cuDNN 9.26.0: the rows that apply, all conservative",
          "[guards]") {
  // torch 2.15.0's CUDA wheels pin nvidia-cudnn-cu13==9.26.0.51.
  const long pinned = k9_26_0;
  REQUIRE(pinned <= kNewestKnownCudnn);
  std::vector<std::string> applying;
  for (const GuardRule& r : openwam::guard_rules()) {
    // openwam::sdpa's rows (the ragged rows cover sdpa_varlen's cuDNN engine).
    if (!r.versions.contains(pinned) || openwam::ragged_layout_rule(r)) {
      continue;
    }
    CAPTURE(r.name);
    applying.emplace_back(r.name);
    CHECK_FALSE(r.measured.contains(pinned));
    CHECK_THAT(r.versions_text, Catch::Matchers::Contains("9.26") &&
                                    Catch::Matchers::Contains("torch 2.15"));
    CHECK_THAT(r.source, Catch::Matchers::Contains("9.26.0.51") &&
                             Catch::Matchers::Contains("conservative"));
  }
  CHECK(applying ==
        std::vector<std::string>{"bhsq1_backward_plan_segfault", "sq1_nan_dk_dv"});
  // The key-tail rows end before it, and the one that ends there says why.
  CHECK_THAT(rule("key_tail_nan_dq").source,
             Catch::Matchers::Contains("fixed in cuDNN 9.26") &&
                 Catch::Matchers::Contains("reported upstream"));
  // What the op does there: the single-row calls are still guarded, a key
  // tail alone is not.
  CHECK(name_of(openwam::check_guards(shape(1, 1, 1, 300, 64), pinned).avoid) ==
        "bhsq1_backward_plan_segfault");
  CHECK(openwam::check_guards(shape(1, 4, 1, 320, 64), pinned).plan.to_string() ==
        "padding_mask+pad_query_backward");
  CHECK(openwam::check_guards(shape(2, 4, 8, 320, 64), pinned).plan.none());
  CHECK(openwam::check_guards(shape(2, 4, 8, 300, 96, true, 0.25), pinned).plan.none());
}

TEST_CASE("rule bhsq1_backward_plan_segfault: 9.25.1 up to the newest known",
          "[guards]") {
  const GuardRule& r = rule("bhsq1_backward_plan_segfault");
  CHECK(r.fix == Fix::kAvoidCudnn);
  CHECK(r.measured.empty());
  const CallShape hit = shape(1, 1, 1, 300, 64);
  // No fix known: on past the newest version the table knows.
  for (long v : {k9_25_1, k9_26_0, kNewestKnownCudnn, kTooNew}) {
    CAPTURE(v);
    CHECK(r.covers(hit, v));
  }
  for (long v : {0L, k9_7_1, k9_19_0, k9_25_0, k9_25_1 - 1}) {
    CAPTURE(v);
    CHECK_FALSE(r.versions.contains(v));
  }
  // The predicate: batch, heads and s_q all 1, whatever else.
  CHECK(r.hits(shape(1, 1, 1, 2, 8), k9_25_1));
  CHECK(r.hits(shape(1, 1, 1, 128, 256, true), k9_25_1));
  CHECK_FALSE(r.hits(shape(2, 1, 1, 300, 64), k9_25_1));
  CHECK_FALSE(r.hits(shape(1, 2, 1, 300, 64), k9_25_1));
  CHECK_FALSE(r.hits(shape(1, 1, 2, 300, 64), k9_25_1));
  CHECK_FALSE(r.hits(shape(4, 8, 16, 300, 64), k9_25_1));
}

TEST_CASE("rule key_tail_nan_dq_9.19: measured, 9.19.0 at head_dim 64/128", "[guards]") {
  const GuardRule& r = rule("key_tail_nan_dq_9.19");
  CHECK(r.fix == Fix::kKeyTail);
  CHECK(r.versions.contains(k9_19_0));
  CHECK_FALSE(r.versions.contains(k9_19_0 - 1));
  CHECK_FALSE(r.versions.contains(k9_19_0 + 1));
  CHECK(r.measured.contains(k9_19_0));
  // The predicate: s_kv % 128 == 64, not causal, head_dim 64 or 128.
  for (int64_t head_dim : {64, 128}) {
    for (int64_t s_kv : {64, 192, 320, 704, 1088}) {
      CAPTURE(head_dim, s_kv);
      CHECK(r.hits(shape(2, 4, 8, s_kv, head_dim), k9_19_0));
      CHECK(r.hits(shape(1, 1, 1, s_kv, head_dim), k9_19_0));  // degenerate sizes too
      CHECK_FALSE(r.hits(shape(2, 4, 8, s_kv, head_dim, true), k9_19_0));
    }
    for (int64_t s_kv : {2, 63, 65, 77, 128, 256, 300, 383, 392, 512}) {
      CAPTURE(head_dim, s_kv);
      CHECK_FALSE(r.hits(shape(2, 4, 8, s_kv, head_dim), k9_19_0));
    }
  }
  for (int64_t head_dim : {8, 32, 96, 256}) {
    CAPTURE(head_dim);
    CHECK_FALSE(r.hits(shape(2, 4, 8, 320, head_dim), k9_19_0));
  }
  // The predicate itself knows its stack.
  CHECK_FALSE(r.hits(shape(2, 4, 8, 320, 64), k9_25_1));
  // A value head_dim unlike the query's was not swept (found in review): the
  // conservative row takes it, every s_kv % 128 != 0.
  CallShape narrow_v = shape(2, 4, 8, 288, 128);
  narrow_v.head_dim_v = 64;
  CHECK_FALSE(r.hits(narrow_v, k9_19_0));
  CHECK(rule("key_tail_nan_dq").hits(narrow_v, k9_19_0));
}

TEST_CASE("rule key_tail_nan_dq: conservative, before 9.26.0", "[guards]") {
  const GuardRule& r = rule("key_tail_nan_dq");
  CHECK(r.fix == Fix::kKeyTail);
  CHECK(r.measured.empty());
  for (long v : {0L, k9_7_1, k9_15_0, k9_19_0, k9_25_1, k9_26_0 - 1}) {
    CAPTURE(v);
    CHECK(r.versions.contains(v));
  }
  for (long v : {k9_26_0, kNewestKnownCudnn, kTooNew}) {
    CAPTURE(v);
    CHECK_FALSE(r.versions.contains(v));
  }
  // The predicate: any s_kv % 128 != 0, causal or not...
  for (int64_t s_kv : {2, 45, 127, 129, 300, 320, 4000}) {
    CAPTURE(s_kv);
    CHECK(r.hits(shape(2, 4, 8, s_kv, 64), k9_7_1));
    CHECK(r.hits(shape(2, 4, 8, s_kv, 64, true), k9_25_1));
    CHECK(r.hits(shape(1, 1, 1, s_kv, 8), k9_15_0));
    CHECK(r.hits(shape(2, 4, 8, s_kv, 96), k9_19_0));  // 9.19.0, unmeasured head_dim
  }
  for (int64_t s_kv : {128, 256, 1024, 4096}) {
    CAPTURE(s_kv);
    CHECK_FALSE(r.hits(shape(2, 4, 8, s_kv, 64), k9_7_1));
    CHECK_FALSE(r.hits(shape(2, 4, 8, s_kv, 96), k9_19_0));
  }
  // ...except on the measured stack, where the row above speaks.
  for (int64_t head_dim : {64, 128}) {
    CAPTURE(head_dim);
    CHECK_FALSE(r.hits(shape(2, 4, 8, 320, head_dim), k9_19_0));
    CHECK_FALSE(r.hits(shape(2, 4, 8, 300, head_dim), k9_19_0));
    CHECK(r.hits(shape(2, 4, 8, 300, head_dim), k9_25_1));
  }
}

TEST_CASE("rule sq1_nan_dk_dv_9.19: measured, batch 1 and one query row, not causal",
          "[guards]") {
  const GuardRule& r = rule("sq1_nan_dk_dv_9.19");
  CHECK(r.fix == Fix::kSingleQueryRow);
  CHECK(r.measured.contains(k9_19_0));
  CHECK(r.versions.contains(k9_19_0));
  CHECK_FALSE(r.versions.contains(k9_19_0 + 1));
  CHECK_FALSE(r.versions.contains(k9_25_1));
  // Batch 1 and s_q 1 at every s_kv (multiples of 128 included), head count
  // and head_dim; the sweep saw no failure with is_causal.
  for (int64_t heads : {1, 2, 8}) {
    for (int64_t s_kv : {2, 64, 128, 300, 1024}) {
      CAPTURE(heads, s_kv);
      CHECK(r.hits(shape(1, heads, 1, s_kv, 64), k9_19_0));
      CHECK_FALSE(r.hits(shape(1, heads, 1, s_kv, 64, true), k9_19_0));
    }
  }
  CHECK_FALSE(r.hits(shape(2, 1, 1, 128, 64), k9_19_0));
  CHECK_FALSE(r.hits(shape(1, 1, 2, 128, 64), k9_19_0));
  CHECK_FALSE(r.hits(shape(4, 8, 1, 128, 64), k9_19_0));
  CHECK_FALSE(r.hits(shape(1, 8, 16, 128, 64), k9_19_0));
}

TEST_CASE("rule sq1_nan_dk_dv: conservative elsewhere, up to the newest known",
          "[guards]") {
  const GuardRule& r = rule("sq1_nan_dk_dv");
  CHECK(r.fix == Fix::kSingleQueryRow);
  CHECK(r.measured.empty());
  for (long v : {0L, k9_7_1, k9_25_1, k9_26_0, kNewestKnownCudnn, kTooNew}) {
    CAPTURE(v);
    CHECK(r.versions.contains(v));
    // Causal included: not measured there.
    CHECK(r.hits(shape(1, 4, 1, 300, 128, true), v));
    CHECK(r.hits(shape(1, 1, 1, 128, 64), v));
    CHECK_FALSE(r.hits(shape(2, 1, 1, 128, 64), v));
    CHECK_FALSE(r.hits(shape(1, 1, 2, 128, 64), v));
  }
  // 9.19.0 has the measured row above, and its sweep found causal calls
  // clean in bf16 at head_dim 64, 128 and 256...
  CHECK_FALSE(r.hits(shape(1, 4, 1, 300, 128), k9_19_0));
  for (int64_t d : {64, 128, 256}) {
    CAPTURE(d);
    CHECK_FALSE(r.hits(shape(1, 4, 1, 300, d, true), k9_19_0));
  }
  // ...and no further (found in review): another head_dim, or fp16.
  CHECK(r.hits(shape(1, 4, 1, 300, 96, true), k9_19_0));
  CallShape fp16 = shape(1, 4, 1, 300, 128, true);
  fp16.fp16 = true;
  CHECK(r.hits(fp16, k9_19_0));
  CHECK_FALSE(r.hits(shape(2, 4, 1, 300, 96, true), k9_19_0));
}

TEST_CASE("check_guards: no rule for an ordinary call", "[guards]") {
  for (long v : {k9_7_1, k9_19_0, k9_25_1, k9_26_0, kNewestKnownCudnn}) {
    CAPTURE(v);
    const auto verdict = openwam::check_guards(shape(2, 4, 8, 256, 64), v);
    CHECK(verdict.plan.none());
    CHECK(verdict.avoid == nullptr);
    CHECK(verdict.first_hit == nullptr);
  }
}

TEST_CASE("check_guards: the key-tail rows take the padding mask, the fallback pads the keys",
          "[guards]") {
  struct Case {
    long version;
    int64_t s_kv, head_dim;
    bool is_causal;
    const char* rule;
  };
  const Case cases[] = {
      {k9_19_0, 320, 64, false, "key_tail_nan_dq_9.19"},
      {k9_19_0, 192, 128, false, "key_tail_nan_dq_9.19"},
      {k9_19_0, 300, 96, false, "key_tail_nan_dq"},
      {k9_19_0, 300, 96, true, "key_tail_nan_dq"},
      {k9_7_1, 300, 64, false, "key_tail_nan_dq"},
      {k9_25_1, 129, 128, true, "key_tail_nan_dq"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.version, c.s_kv, c.head_dim, c.is_causal);
    auto verdict = openwam::check_guards(shape(2, 4, 8, c.s_kv, c.head_dim, c.is_causal), c.version);
    CHECK(verdict.plan.to_string() == "padding_mask+pad_keys_backward");
    CHECK(verdict.avoid == nullptr);
    CHECK(name_of(verdict.first_hit) == c.rule);

    // With dropout the fallback pads the keys in the forward too: the
    // backward must see the key length the forward's dropout was drawn for.
    verdict = openwam::check_guards(
        shape(2, 4, 8, c.s_kv, c.head_dim, c.is_causal, 0.25), c.version);
    CHECK(verdict.plan.to_string() == "padding_mask+pad_keys_forward");
    CHECK(name_of(verdict.first_hit) == c.rule);
  }
}

TEST_CASE("check_guards: with a bool mask the key-tail rows shift the scores on 9.19.0",
          "[guards]") {
  // A bool mask's bias holds 0 and -inf, which the score shift raises exactly
  // (score_shift.h): on either engine, with dropout too, no padding; on the
  // version it was measured on. Elsewhere, and with an additive mask, the
  // padding mask.
  for (const auto& [version, s_kv, head_dim] :
       {std::tuple{k9_19_0, 320, 64}, std::tuple{k9_19_0, 704, 128},
        std::tuple{k9_19_0, 300, 96}, std::tuple{k9_25_1, 129, 128},
        std::tuple{k9_7_1, 300, 64}}) {
    CAPTURE(version, s_kv, head_dim);
    for (const double dropout_p : {0.0, 0.25}) {
      const char* padded =
          dropout_p > 0.0 ? "padding_mask+pad_keys_forward" : "padding_mask+pad_keys_backward";
      CallShape s = shape(2, 4, 8, s_kv, head_dim, false, dropout_p);
      s.has_mask = s.bool_mask = true;
      CHECK(openwam::check_guards(s, version).plan.to_string() ==
            (version == k9_19_0 ? "shift_scores" : padded));
      CHECK(openwam::score_shift_measured(s, version) == (version == k9_19_0));
      s.bool_mask = false;  // an additive mask keeps the padding mask
      CHECK(openwam::check_guards(s, version).plan.to_string() == padded);
    }
  }
  // Batch 1, one query row, on the key tail: the one-row fix keeps its own
  // backward; the shift applies where that one runs cuDNN (with dropout).
  CallShape s = shape(1, 4, 1, 320, 64);
  s.has_mask = s.bool_mask = true;
  CHECK(openwam::check_guards(s, k9_19_0).plan.to_string() ==
        "padding_mask+shift_scores+pad_query_backward");
  // Clean key lengths take nothing, mask or not.
  s = shape(2, 4, 8, 256, 64);
  s.has_mask = s.bool_mask = true;
  CHECK(openwam::check_guards(s, k9_19_0).plan.none());
}

TEST_CASE("check_guards: a value head_dim of its own takes the same plan", "[guards]") {
  // The padding mask and the K/V shim take any value head_dim: the plan is
  // the same. The row is the conservative one: the sweep measured the value's
  // head_dim equal to the query's only.
  CallShape s = shape(2, 4, 8, 320, 64);
  s.head_dim_v = 128;
  auto verdict = openwam::check_guards(s, k9_19_0);
  CHECK(verdict.plan.to_string() == "padding_mask+pad_keys_backward");
  CHECK(name_of(verdict.first_hit) == "key_tail_nan_dq");
  s.dropout_p = 0.25;
  CHECK(openwam::check_guards(s, k9_19_0).plan.to_string() == "padding_mask+pad_keys_forward");
}

TEST_CASE("check_guards: key tail and one query row fold into one plan", "[guards]") {
  // Batch 1, one query row, s_kv % 128 == 64 on 9.19.0: both defects.
  auto verdict = openwam::check_guards(shape(1, 2, 1, 320, 64), k9_19_0);
  CHECK(verdict.plan.to_string() == "padding_mask+pad_keys_backward+pad_query_backward");
  CHECK(verdict.avoid == nullptr);
  CHECK(name_of(verdict.first_hit) == "key_tail_nan_dq_9.19");

  // One head too, on 9.19.0 (before the segfault's versions): still both.
  verdict = openwam::check_guards(shape(1, 1, 1, 320, 64), k9_19_0);
  CHECK(verdict.plan.to_string() == "padding_mask+pad_keys_backward+pad_query_backward");

  // Only the single-row defect: an aligned key length.
  verdict = openwam::check_guards(shape(1, 2, 1, 256, 64), k9_19_0);
  CHECK(verdict.plan.to_string() == "padding_mask+pad_query_backward");
  CHECK(name_of(verdict.first_hit) == "sq1_nan_dk_dv_9.19");
  verdict = openwam::check_guards(shape(1, 2, 1, 256, 64), k9_25_1);
  CHECK(name_of(verdict.first_hit) == "sq1_nan_dk_dv");

  // With dropout the key tail pads the keys instead.
  verdict = openwam::check_guards(shape(1, 2, 1, 300, 64, false, 0.5), k9_7_1);
  CHECK(verdict.plan.to_string() == "padding_mask+pad_keys_forward+pad_query_backward");
  CHECK(name_of(verdict.first_hit) == "key_tail_nan_dq");
}

TEST_CASE("rules_covering: every row that covers the call, in table order", "[guards]") {
  const auto names = [](const std::vector<const GuardRule*>& rules) {
    std::vector<std::string> out;
    for (const GuardRule* r : rules) out.push_back(r->name);
    return out;
  };
  // Batch 1, one query row, s_kv % 128 == 64 on 9.19.0: both measured rows.
  CHECK(names(openwam::rules_covering(shape(1, 2, 1, 320, 64), k9_19_0)) ==
        std::vector<std::string>{"key_tail_nan_dq_9.19", "sq1_nan_dk_dv_9.19"});
  // On 9.25.1 with one head the avoid row comes first, and the walk does not
  // stop there (check_guards does).
  CHECK(names(openwam::rules_covering(shape(1, 1, 1, 300, 64), k9_25_1)) ==
        std::vector<std::string>{"bhsq1_backward_plan_segfault", "key_tail_nan_dq",
                                 "sq1_nan_dk_dv"});
  CHECK(openwam::rules_covering(shape(2, 8, 128, 256, 64), k9_19_0).empty());
  // Newer than the table knows: the key tail's rows end (fixed in 9.26), the
  // one-query-row row does not.
  CHECK(names(openwam::rules_covering(shape(1, 2, 1, 320, 64), kTooNew)) ==
        std::vector<std::string>{"sq1_nan_dk_dv"});
  CHECK(openwam::rules_covering(shape(2, 2, 8, 320, 64), kTooNew).empty());
}

TEST_CASE("check_guards: the avoid rule wins and stops", "[guards]") {
  // On 9.25.1 batch = heads = s_q = 1 with an unaligned key length would hit
  // the key tail and the single-row rows too: the avoid rule is checked
  // first and ends the walk, with no plan.
  for (long v : {k9_25_1, k9_26_0 - 1}) {
    CAPTURE(v);
    const auto verdict = openwam::check_guards(shape(1, 1, 1, 300, 64), v);
    CHECK(name_of(verdict.avoid) == "bhsq1_backward_plan_segfault");
    CHECK(verdict.first_hit == verdict.avoid);
    CHECK(verdict.plan.none());
  }
  const auto fixed = openwam::check_guards(shape(1, 1, 1, 256, 64), k9_26_0);
  CHECK(name_of(fixed.avoid) == "bhsq1_backward_plan_segfault");
  CHECK(fixed.plan.none());
  // Two heads: no segfault, both fixes.
  const auto two_heads = openwam::check_guards(shape(1, 2, 1, 300, 64), k9_25_1);
  CHECK(two_heads.avoid == nullptr);
  CHECK(two_heads.plan.to_string() == "padding_mask+pad_keys_backward+pad_query_backward");
}

TEST_CASE("check_guards: a cuDNN newer than the table knows keeps the rows with no known fix",
          "[guards]") {
  // The key tail (fixed in 9.26) gets no rule; one query row (cudnn-frontend
  // #1072) and batch = heads = s_q = 1 (#1071) keep theirs: nothing says a
  // later cuDNN fixed them.
  const CallShape key_tail[] = {shape(2, 4, 8, 320, 64), shape(2, 4, 8, 300, 96, true, 0.25),
                                shape(2, 1, 8, 128, 128)};
  for (long v : {kTooNew, cudnn_version(9, 27, 0), cudnn_version(10, 0, 0)}) {
    for (const CallShape& s : key_tail) {
      CAPTURE(v, s.batch, s.heads, s.s_q, s.s_kv, s.head_dim);
      const auto verdict = openwam::check_guards(s, v);
      CHECK(verdict.plan.none());
      CHECK(verdict.avoid == nullptr);
      CHECK(verdict.first_hit == nullptr);
    }
    CAPTURE(v);
    CHECK(name_of(openwam::check_guards(shape(1, 1, 1, 300, 64), v).avoid) ==
          "bhsq1_backward_plan_segfault");
    CHECK(openwam::check_guards(shape(1, 4, 1, 320, 64), v).plan.to_string() ==
          "padding_mask+pad_query_backward");
  }
  // The newest known version itself is still guarded.
  CHECK(openwam::check_guards(shape(1, 1, 1, 300, 64), kNewestKnownCudnn).avoid != nullptr);
  CHECK(openwam::check_guards(shape(1, 4, 1, 300, 64), kNewestKnownCudnn)
            .plan.to_string() == "padding_mask+pad_query_backward");
}

TEST_CASE("key_tail_defect on cuDNN 9.19.0, head_dim 64/128: only r == 64, not causal",
          "[guards]") {
  for (int64_t head_dim : {64, 128}) {
    for (int64_t base : {0, 256, 1024}) {
      for (int64_t r = 1; r < 128; ++r) {
        const int64_t s_kv = base + r;
        CAPTURE(head_dim, s_kv);
        CHECK(openwam::key_tail_defect(k9_19_0, s_kv, head_dim, false) == (r == 64));
        CHECK_FALSE(openwam::key_tail_defect(k9_19_0, s_kv, head_dim, true));
      }
    }
  }
}

TEST_CASE("key_tail_defect on cuDNN 9.19.0, other head_dims: any remainder", "[guards]") {
  for (int64_t head_dim : {32, 96, 256}) {
    for (int64_t r = 1; r < 128; ++r) {
      CAPTURE(head_dim, r);
      CHECK(openwam::key_tail_defect(k9_19_0, 256 + r, head_dim, false));
      CHECK(openwam::key_tail_defect(k9_19_0, 256 + r, head_dim, true));
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
  for (long version : {92600L, 92601L, 92699L, 92700L, 100000L}) {
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

TEST_CASE("key_tail_defect ignores the other rows", "[guards]") {
  // The single-row and segfault rows would fire for key_tail_defect's
  // placeholder shape (batch, heads and s_q 1); an aligned key length on an
  // affected version must still answer false.
  CHECK_FALSE(openwam::key_tail_defect(k9_25_1, 256, 64, false));
  CHECK_FALSE(openwam::key_tail_defect(k9_19_0, 256, 64, false));
}

TEST_CASE("warn_once: one warning per rule per process", "[guards]") {
  struct Collect : c10::WarningHandler {
    std::vector<std::string> messages;
    void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
  } collect;
  c10::WarningUtils::WarningHandlerGuard guard(&collect);
  const auto& rules = openwam::guard_rules();
  for (int round = 0; round < 3; ++round) {
    for (const GuardRule& r : rules) {
      openwam::warn_once(r);
    }
  }
  REQUIRE(collect.messages.size() == rules.size());
  for (size_t i = 0; i < rules.size(); ++i) {
    CAPTURE(collect.messages[i]);
    CHECK_THAT(collect.messages[i], Catch::Matchers::Contains(rules[i].name) &&
                                        Catch::Matchers::Contains(rules[i].source) &&
                                        Catch::Matchers::Contains(rules[i].action));
  }
}

TEST_CASE("rules ragged_unmeasured(_old): ragged calls, every version but 9.19.0",
          "[guards]") {
  const GuardRule& after = rule("ragged_unmeasured");
  const GuardRule& before = rule("ragged_unmeasured_old");
  for (const GuardRule* r : {&after, &before}) {
    CHECK(r->fix == Fix::kAvoidCudnn);
    CHECK(r->measured.empty());
    CHECK(openwam::ragged_layout_rule(*r));
  }
  // Every other row is about the dense calls F.sdpa makes (the doctor counts those).
  for (const GuardRule& r : openwam::guard_rules()) {
    CAPTURE(r.name);
    CHECK(openwam::ragged_layout_rule(r) == (std::string(r.name).rfind("ragged_", 0) == 0));
  }
  for (long version : {k9_7_1, k9_19_0, k9_26_0}) {
    for (int64_t s_q : {1, 64}) {
      CAPTURE(version, s_q);
      CallShape dense = shape(1, 1, s_q, 192, 128);
      CHECK_FALSE(after.covers(dense, version));
      CHECK_FALSE(before.covers(dense, version));
      CallShape ragged = dense;
      ragged.ragged = true;
      // 9.19.0 is the version the admission sweep measured: neither row there.
      CHECK(after.covers(ragged, version) == (version > k9_19_0));
      CHECK(before.covers(ragged, version) == (version < k9_19_0));
    }
  }
  // check_guards (openwam::sdpa's dense calls) never meets a ragged row.
  CHECK(name_of(openwam::check_guards(shape(4, 8, 64, 256, 128), k9_19_0).avoid) == "<none>");
}

TEST_CASE("rule ragged_adversarial_dq_9.19: ragged calls on 9.19.0 but at head_dim 64/128/256",
          "[guards]") {
  const GuardRule& r = rule("ragged_adversarial_dq_9.19");
  CHECK(r.fix == Fix::kAvoidCudnn);
  CHECK(openwam::ragged_layout_rule(r));
  CHECK(r.measured.contains(k9_19_0));
  for (int64_t e : {16, 32, 64, 80, 96, 128, 160, 192, 256}) {
    for (bool causal : {false, true}) {
      CAPTURE(e, causal);
      CallShape dense = shape(2, 4, 64, 320, e);
      dense.is_causal = causal;
      CallShape ragged = dense;
      ragged.ragged = true;
      CHECK_FALSE(r.covers(dense, k9_19_0));  // openwam::sdpa's calls: never
      CHECK(r.covers(ragged, k9_19_0) == (e != 64 && e != 128 && e != 256));
      // Other versions: the unmeasured rows keep every ragged call off already.
      CHECK_FALSE(r.covers(ragged, k9_26_0));
      CHECK_FALSE(r.covers(ragged, k9_19_0 - 1));
    }
  }
}

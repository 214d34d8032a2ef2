// The guard table: cuDNN versions and call shapes with known SDPA backward
// defects, and what a differentiated call on the cuDNN path does about each.
// A rule is one row: its versions, its condition, its fix and its source.
// Adding a rule means adding a row (guards.cpp) and its test
// (tests/cpp/test_guards.cpp), within kMaxGuardRules rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "plan.h"
#include "sdpa_call.h"

namespace openwam {

// cuDNN encodes 9.x.y as 90000 + 100 * x + y.
constexpr long cudnn_version(int major, int minor, int patch) {
  return major * 10000L + minor * 100L + patch;
}

// The newest cuDNN the table knows: 9.26, which torch 2.15.0's CUDA wheels pin
// (nvidia-cudnn-cu13==9.26.0.51). A newer runtime keeps the rows of defects
// with no known fix (one query row, batch = heads = s_q = 1, the ragged
// layout) and none of the key tail's (fixed in 9.26); the doctor reports the
// stack as unverified.
constexpr long kNewestKnownCudnn = cudnn_version(9, 26, 99);

// [first, end) of runtime cuDNN versions; {0, 0} is empty.
struct VersionRange {
  long first = 0;
  long end = 0;
  bool contains(long version) const { return version >= first && version < end; }
  bool empty() const { return first >= end; }
};

// What a rule does to a differentiated call it hits.
enum class Fix {
  kAvoidCudnn,       // no fix on cuDNN: the call runs on PyTorch's next backend
  kKeyTail,          // the key-tail dQ defect: with a bool mask on 9.19.0 the
                     // score shift (both engines); otherwise cuDNN's padding mask on
                     // the frontend, and on the ATen fallback K/V padded to a
                     // multiple of 128 (with dropout, in the forward too)
  kSingleQueryRow,   // the one-query-row dK/dV defect: the backward in fp32
                     // without cuDNN (dropout with one query row never reaches
                     // cuDNN)
};

struct GuardRule {
  const char* name;
  VersionRange versions;  // runtime cuDNN versions the rule covers
  VersionRange measured;  // the part this project measured (empty: none)
  // Does the defect hit this differentiated call on this cuDNN version?
  bool (*hits)(const CallShape& shape, long cudnn_version);
  Fix fix;
  const char* versions_text;  // the range in words
  const char* defect;
  const char* action;
  const char* source;
  // A ragged row about rounding (no crash, no NaN): where FlashAttention-2
  // cannot take the call, the ragged layout still runs it rather than the
  // block-diagonal fallback, whose memory grows as total_q x total_k.
  bool rounding_only = false;

  // Whether the rule covers this call: its versions hold `cudnn_version` and
  // the defect hits the call's shape.
  bool covers(const CallShape& shape, long cudnn_version) const {
    return versions.contains(cudnn_version) && hits(shape, cudnn_version);
  }
};

// Every rule, in the order they are checked.
const std::vector<GuardRule>& guard_rules();

// Whether the rule is about cuDNN's ragged layout (sdpa_varlen's cuDNN engine)
// rather than a defect of the dense calls F.sdpa makes (the doctor's verdict
// counts only those).
bool ragged_layout_rule(const GuardRule& rule);

// The rules that cover a differentiated call of this shape on `cudnn_version`,
// in table order (explain's answer for a cuDNN that need not be loaded).
std::vector<const GuardRule*> rules_covering(const CallShape& shape, long cudnn_version);

// warn_once keeps one flag per row, for at most this many rows.
constexpr std::size_t kMaxGuardRules = 16;

// The rules a differentiated call on `cudnn_version` hits, folded into one
// plan under OPENWAM_SDPA_PAD=auto: `avoid` is set to the first kAvoidCudnn
// rule that hits (then the plan does not matter), `first_hit` to the first rule
// that hit at all (both nullptr when none).
struct GuardVerdict {
  Plan plan;
  const GuardRule* avoid = nullptr;
  const GuardRule* first_hit = nullptr;
};
GuardVerdict check_guards(const CallShape& shape, long cudnn_version);

// The key-tail dQ defect alone (the doctor's and the README's question): does
// the runtime cuDNN give NaN in dQ for this key length and head_dim?
bool key_tail_defect(long cudnn_version, int64_t s_kv, int64_t head_dim,
                     bool is_causal);

// Whether a key-tail fix may be the score shift (score_shift.h): a bool
// mask's call, on a cuDNN the shift was measured on.
bool score_shift_measured(const CallShape& shape, long cudnn_version);

// One warning per process per rule.
void warn_once(const GuardRule& rule);

}  // namespace openwam

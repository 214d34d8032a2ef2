// The guard table: cuDNN versions and shapes with known SDPA defects, and what
// a differentiated cuDNN call must do about each. Every rule cites its source.
#pragma once

#include <string>
#include <vector>

#include "sdpa_inputs.h"
#include "settings.h"

namespace openwam {

// How a differentiated call on the cuDNN path avoids the key-tail defect.
enum class Plan {
  kNone,         // stock forward and backward
  kRepairDq,     // stock forward and backward, then recompute in fp32 the dQ
                 // rows whose logsumexp is below the overflow threshold
  kPadBackward,  // stock forward; the backward runs on K/V zero-padded to a
                 // multiple of 128 with the padded keys hidden by -inf
  kPadForward,   // forward and backward both on padded K/V (dropout: the
                 // backward must replay the forward's dropout pattern)
  kPadInputs,    // not cuDNN: PyTorch's kernel runs on padded inputs
                 // (OPENWAM_SDPA_PAD=always)
};

const char* to_string(Plan plan);

struct GuardRule {
  const char* name;
  const char* versions;  // human-readable range of the runtime cuDNN
  const char* defect;
  const char* action;
  const char* source;
};

// Every rule, for `python -m openwam_sdpa doctor` and the README.
const std::vector<GuardRule>& guard_rules();

// Key-tail dQ defect: does the runtime cuDNN (e.g. 91900) give NaN in dQ for
// this key length and head_dim? Measured where the table says so, otherwise
// conservative (every s_kv % 128 != 0 below 9.26.0).
bool key_tail_defect(long cudnn_version, int64_t s_kv, int64_t head_dim,
                     bool is_causal);

// A rule that keeps a differentiated call off cuDNN altogether (defects that
// padding cannot fix), or nullptr.
const GuardRule* rule_avoiding_cudnn(const SdpaInputs& in, long cudnn_version);

// The plan for a differentiated call that runs on cuDNN; `rule` is set to the
// rule that fired, if any.
Plan plan_for_cudnn(const SdpaInputs& in, const Settings& settings,
                    long cudnn_version, const GuardRule** rule);

// Whether the fp32 dQ-row repair kernel serves these inputs.
bool repair_supported(const SdpaInputs& in);

// One warning per process per rule.
void warn_once(const GuardRule& rule);

// The runtime cuDNN version (e.g. 91900), 0 where none is loaded.
long runtime_cudnn_version();

}  // namespace openwam

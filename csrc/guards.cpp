#include "guards.h"

#include <c10/util/Exception.h>

#include <array>
#include <limits>
#include <mutex>

#include "cudnn_attention.h"

namespace openwam {
namespace {

constexpr long k9_19_0 = cudnn_version(9, 19, 0);
constexpr long k9_25_1 = cudnn_version(9, 25, 1);
constexpr long k9_26_0 = cudnn_version(9, 26, 0);
// A row of a defect with no known fix runs on past the newest known version:
// nothing says a later cuDNN fixed it (conservative where unmeasured).
constexpr long kNoFixKnown = std::numeric_limits<long>::max();

// The key-tail sweep on the H200 covered cuDNN 9.19.0 at head_dim 64 and 128,
// the value's head_dim the query's (d_v 64 under d_qk 128 was not swept).
bool key_tail_measured_stack(long version, const CallShape& s) {
  return version == k9_19_0 && (s.head_dim == 64 || s.head_dim == 128) &&
         s.head_dim_v == s.head_dim;
}

bool key_tail_measured_hits(const CallShape& s, long version) {
  return key_tail_measured_stack(version, s) && !s.is_causal && s.s_kv % kCudnnKeyTile == 64;
}

bool key_tail_conservative_hits(const CallShape& s, long version) {
  return !key_tail_measured_stack(version, s) && s.s_kv % kCudnnKeyTile != 0;
}

// The single-query-row sweep on the H200 covered cuDNN 9.19.0 in bf16, and
// is_causal at head_dim 64, 128 and 256 only: it never failed there.
bool single_query_row_causal_measured(const CallShape& s, long version) {
  return version == k9_19_0 && s.is_causal && !s.fp16 &&
         (s.head_dim == 64 || s.head_dim == 128 || s.head_dim == 256);
}

bool single_query_row_measured_hits(const CallShape& s, long /*version*/) {
  return s.batch == 1 && s.s_q == 1 && !s.is_causal;
}

// Everywhere else, causal calls the sweep did not reach on 9.19.0 included.
bool single_query_row_hits(const CallShape& s, long version) {
  return s.batch == 1 && s.s_q == 1 && (version != k9_19_0 || s.is_causal) &&
         !single_query_row_causal_measured(s, version);
}

bool single_row_single_head_hits(const CallShape& s, long /*version*/) {
  return s.batch == 1 && s.heads == 1 && s.s_q == 1;
}

// ---- The ragged layout (openwam::sdpa_varlen's cuDNN engine) ----
// A ragged call's s_q and s_kv are its longest sequences; dense calls never
// hit these rows.
bool ragged_hits(const CallShape& s, long /*version*/) { return s.ragged; }

// On 9.19.0 the varlen fuzz drew head_dim 64, 128, 192 and 256 (about 900
// packed cases each, two in three with an adversarial row per sequence). At
// 192 the engine rounded an adversarial row's dQ (logsumexp about -115) up to
// 5.4x coarser than stock: 2.77e-2 relative against 5.1e-3 for stock F.sdpa and
// FlashAttention-2 varlen (34 causal tokens, bf16, H100), 2.72e-2 against
// 5.7e-3 and 4.5e-3 (85 tokens, not causal; H200): docs/varlen.md.
// In both cases it equals, to every digit, stock cuDNN on the sequence with
// its keys zero-padded to 128 and hidden by a bool mask (what a padded batch
// from transformers gives stock F.sdpa): the 34-token case on the H100 (the
// probe on branch probe/ragged-adversarial-dq-d192), the 85-token one on the
// H200. cuDNN under is_causal alone rounds the 34-token row 9x finer (3.1e-3).
// So this is cuDNN's arithmetic under a mask at head_dim 192, not the ragged
// layout's. At 128 (causal, 34-200 tokens) every form of cuDNN gave the same
// error, stock as called too, so the rule passes there.
// 64, 128 and 256 passed every case; the head_dims the fuzz never drew are
// kept off as well (conservative where unmeasured).
bool ragged_head_dim_hits(const CallShape& s, long /*version*/) {
  return s.ragged && !(s.head_dim == 64 || s.head_dim == 128 || s.head_dim == 256);
}

// The two rows around 9.19.0 (a version range holds one interval) say the same.
constexpr const char* kRaggedUnmeasured =
    "cuDNN's ragged layout is measured right on 9.19.0 only (TransformerEngine #3249: a "
    "ragged backward read its stats as dense before cuDNN 9.26)";
constexpr const char* kRaggedAction =
    "varlen_sdpa runs the call on FlashAttention-2 varlen (or its block-diagonal fallback); "
    "OPENWAM_SDPA_VARLEN=cudnn overrides";
constexpr const char* kRaggedSource =
    "conservative: this project found the engine right on 9.19.0 only (H200, torch 2.11.0); "
    "related: TransformerEngine #3249, pytorch #186142 (why not ATen's ragged call)";

// Both key-tail rows. A bool mask's bias takes the score shift (score_shift.h
// says why), on either engine, on the version it was measured on; padding.h's
// shim_takes_bias says why the shim takes an additive mask whose keys it grows
// by at most 1/32.
constexpr const char* kKeyTailAction =
    "with a bool mask on cuDNN 9.19.0, the backward runs on scores shifted so that no "
    "logsumexp is below 0 (the mask's bias and the logsumexp raised by one power of two per "
    "bias row); otherwise with cuDNN's padding mask, or, with a mask (no dropout) and at most "
    "1/32 more keys to the next multiple of 128, on K, V and the mask padded to it (ATen "
    "fallback: K/V padded to a multiple of 128)";

const std::vector<GuardRule>& table() {
  static const std::vector<GuardRule> rules = {
      {"bhsq1_backward_plan_segfault",
       {k9_25_1, kNoFixKnown},
       {},
       &single_row_single_head_hits,
       Fix::kAvoidCudnn,
       "9.25.1 and later (torch 2.15 pins 9.26.0; no fix known)",
       "segfault building the backward plan when batch, heads and s_q are all 1",
       "never sent to cuDNN: the call runs on PyTorch's next backend",
       "cudnn-frontend #1071 (reported on 9.26.0.51, torch 2.15.0's pin); "
       "conservative: not measured by this project"},
      // Measured on an H200 (torch 2.11.0+cu130, cuDNN 9.19.0), stock cuDNN
      // through ATen: s_kv = 256 + r for r = 1..127, s_kv in 1..127 and
      // 1025..1151 at head_dim 64 and 128: only r == 64 gave NaN dQ, is_causal
      // never did (nor with s_q != s_kv: s_q = s_kv - 64, + 64 and 2 s_kv at
      // s_kv 320 and 704, bf16, one or every row adversarial). The same graphs
      // through the frontend: NaN at r == 64 for head_dim 64-256, bf16 and
      // fp16, none with the padding mask (docs/design.md, "The defects").
      {"key_tail_nan_dq_9.19",
       {k9_19_0, k9_19_0 + 1},
       {k9_19_0, k9_19_0 + 1},
       &key_tail_measured_hits,
       Fix::kKeyTail,
       "9.19.0, head_dim 64 and 128 (value's alike)",
       "backward NaN in dQ rows with logsumexp < -88.7 when s_kv % 128 == 64",
       kKeyTailAction,
       "cudnn-frontend #160, PR #628; pytorch #196678; measured by this project on an "
       "H200 (torch 2.11.0, cuDNN 9.19.0)"},
      // The same defect elsewhere before its fix. torch 2.7.1 with cuDNN 9.7.1
      // failed for every s_kv % 128 != 0; versions and head_dims nobody
      // measured are treated the same way. The fix in 9.26 is upstream's word.
      {"key_tail_nan_dq",
       {0, k9_26_0},
       {},
       &key_tail_conservative_hits,
       Fix::kKeyTail,
       "< 9.26.0 (other than 9.19.0 at head_dim 64/128)",
       "backward NaN in dQ rows with logsumexp < -88.7 when s_kv % 128 != 0",
       kKeyTailAction,
       "cudnn-frontend #160, PR #628 (fixed in cuDNN 9.26, reported upstream); "
       "pytorch #196678; conservative: every s_kv % 128 != 0 failed on cuDNN 9.7.1"},
      // Measured on 9.19.0 (H200, tools/sweep_single_query_row.py): of 798
      // cells, stock cuDNN wrote NaN into dK (and dV) in 157, every one at
      // batch 1 with one query row and a logsumexp at or below -89 (clean at
      // -88 and above, at batch 2 and 3 and at s_q 2), with no mask, bool and
      // additive masks, grouped-query attention and head_dim 64, 128 and 256;
      // never with is_causal (bf16, head_dim 64, 128 and 256: other causal
      // calls on 9.19.0 take the conservative row below). The padding mask
      // removed it at head_dim 64-256.
      {"sq1_nan_dk_dv_9.19",
       {k9_19_0, k9_19_0 + 1},
       {k9_19_0, k9_19_0 + 1},
       &single_query_row_measured_hits,
       Fix::kSingleQueryRow,
       "9.19.0",
       "backward NaN in dK and dV for batch 1, s_q == 1 and a logsumexp below "
       "about -89 (not with is_causal)",
       "the backward is computed in fp32 without cuDNN (dropout with one query row never "
       "reaches cuDNN)",
       "cudnn-frontend #1072 (reported on 9.25.1 and 9.26); measured by this project on "
       "an H200 (torch 2.11.0, cuDNN 9.19.0)"},
      // Reported on 9.25.1.1 and 9.26.0.51 (torch 2.15.0's pin); the versions
      // between are assumed affected, is_causal included; on 9.19.0, causal
      // calls in fp16 or at a head_dim other than 64, 128 and 256 (not swept).
      {"sq1_nan_dk_dv",
       {0, kNoFixKnown},
       {},
       &single_query_row_hits,
       Fix::kSingleQueryRow,
       "every version but 9.19.0, and on 9.19.0 causal calls the sweep did not reach "
       "(torch 2.15 pins 9.26.0; no fix known)",
       "backward NaN in all of dK and dV for batch 1, s_q == 1 and a very "
       "negative logsumexp",
       "the backward is computed in fp32 without cuDNN (dropout with one query row never "
       "reaches cuDNN)",
       "cudnn-frontend #1072 (reported on 9.25.1.1 and 9.26.0.51, torch 2.15.0's "
       "pin); conservative: measured on 9.19.0 only (row above; its causal calls in "
       "bf16 at head_dim 64, 128 and 256)"},
      // ---- The ragged layout (openwam::sdpa_varlen's cuDNN engine, on the
      // frontend's graphs: ragged_engine.h). On 9.19.0 (torch 2.11.0+cu130,
      // H200) the admission sweep of tests/gpu/test_varlen_gpu.py found it
      // finite and within stock's error: sequences of 64 mod 128 tokens with
      // adversarial rows, one query per sequence, one sequence of one query,
      // empty sequences, GQA, causal with s_q == s_k and s_q != s_k, head_dim
      // 64-192 (docs/varlen.md says what is not rerun yet); the varlen fuzz
      // then kept it to head_dim 64, 128 and 256 (the first row below).
      // Other versions are not measured: the last two rows keep them off.
      // ATen's own call of the layout stays unused: its backward takes the
      // longest sequence from query.size(2), head_dim for packed inputs
      // (pytorch #186142), which gave wrong dQ, 93-186 ms per step and a hang
      // on 9.19.0.
      {"ragged_adversarial_dq_9.19",
       {k9_19_0, k9_19_0 + 1},
       {k9_19_0, k9_19_0 + 1},
       &ragged_head_dim_hits,
       Fix::kAvoidCudnn,
       "9.19.0, head_dim other than 64, 128 and 256",
       "cuDNN's ragged layout rounds the dQ of a row with a logsumexp near -115 up to 5.4x "
       "coarser than stock F.sdpa and FlashAttention-2 varlen at head_dim 192 (relative "
       "2.8e-2 against 5.1e-3)",
       "varlen_sdpa runs the call on FlashAttention-2 varlen, or where that cannot serve on "
       "the ragged layout still (the block-diagonal fallback's memory grows as total_q x "
       "total_k); OPENWAM_SDPA_VARLEN=cudnn overrides",
       "measured by this project on an H200 and an H100 (torch 2.11.0, cuDNN 9.19.0): the "
       "varlen fuzz at head_dim 192 (docs/varlen.md#measured-on-the-gpu); the head_dims it "
       "does not draw, unmeasured, are kept off with it (64, 128 and 256 passed every case)",
       /*rounding_only=*/true},
      {"ragged_unmeasured",
       {k9_19_0 + 1, kNoFixKnown},
       {},
       &ragged_hits,
       Fix::kAvoidCudnn,
       "after 9.19.0 (torch 2.12-2.15 pin 9.20-9.26)",
       kRaggedUnmeasured,
       kRaggedAction,
       kRaggedSource},
      {"ragged_unmeasured_old",
       {0, k9_19_0},
       {},
       &ragged_hits,
       Fix::kAvoidCudnn,
       "before 9.19.0 (torch older than 2.11)",
       kRaggedUnmeasured,
       kRaggedAction,
       kRaggedSource},
  };
  return rules;
}

}  // namespace

const std::vector<GuardRule>& guard_rules() { return table(); }

bool ragged_layout_rule(const GuardRule& rule) {
  return rule.hits == &ragged_hits || rule.hits == &ragged_head_dim_hits;
}

std::vector<const GuardRule*> rules_covering(const CallShape& shape, long cudnn_version) {
  std::vector<const GuardRule*> rules;
  for (const GuardRule& rule : table()) {
    if (rule.covers(shape, cudnn_version)) {
      rules.push_back(&rule);
    }
  }
  return rules;
}

// The score shift rests on the defect's mechanism (the tail scored 0), which
// this project measured on 9.19.0: the probe on branch probe/score-shift
// (head_dim 64-256, bf16 and fp16, H100) and the GPU suite and fuzz since.
// Other versions keep the padding mask, which bounds the tile whatever the
// mechanism (conservative where unmeasured).
bool score_shift_measured(const CallShape& shape, long cudnn_version) {
  return shape.bool_mask && cudnn_version == k9_19_0;
}

GuardVerdict check_guards(const CallShape& shape, long cudnn_version) {
  GuardVerdict verdict;
  for (const GuardRule& rule : table()) {
    if (!rule.covers(shape, cudnn_version)) {
      continue;
    }
    if (verdict.first_hit == nullptr) {
      verdict.first_hit = &rule;
    }
    switch (rule.fix) {
      case Fix::kAvoidCudnn:
        verdict.avoid = &rule;
        return verdict;
      case Fix::kKeyTail:
        if (score_shift_measured(shape, cudnn_version)) {
          verdict.plan.shift_scores = true;
        } else {
          verdict.plan.padding_mask = true;
          (shape.dropout_p > 0.0 ? verdict.plan.pad_keys_forward
                                 : verdict.plan.pad_keys_backward) = true;
        }
        break;
      case Fix::kSingleQueryRow:
        verdict.plan.padding_mask = true;
        verdict.plan.pad_query_backward = true;
        break;
    }
  }
  return verdict;
}

bool key_tail_defect(long cudnn_version, int64_t s_kv, int64_t head_dim,
                     bool is_causal) {
  CallShape shape;
  shape.s_kv = s_kv;
  shape.head_dim = head_dim;
  shape.head_dim_v = head_dim;
  shape.is_causal = is_causal;
  for (const GuardRule& rule : table()) {
    if (rule.fix == Fix::kKeyTail && rule.covers(shape, cudnn_version)) {
      return true;
    }
  }
  return false;
}

void warn_once(const GuardRule& rule) {
  static std::array<std::once_flag, kMaxGuardRules> flags;
  const auto index = static_cast<size_t>(&rule - table().data());
  TORCH_INTERNAL_ASSERT(index < table().size() && index < flags.size(),
                        "warn_once: not a row of the guard table");
  std::call_once(flags[index], [&] {
    TORCH_WARN("openwam_sdpa: guard rule '", rule.name, "' fired (cuDNN ",
               rule.versions_text, ": ", rule.defect, "; ", rule.source,
               "). Action: ", rule.action,
               ". This warning is shown once per process.");
  });
}

}  // namespace openwam

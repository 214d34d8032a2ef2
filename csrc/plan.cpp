#include "plan.h"

#include <c10/util/Exception.h>

namespace openwam {
namespace {

constexpr int64_t kPaddingMask = 1;
constexpr int64_t kPadKeysBackward = 2;
constexpr int64_t kPadKeysForward = 4;
constexpr int64_t kPadQueryBackward = 8;
constexpr int64_t kShiftScores = 16;
constexpr int64_t kAll =
    kPaddingMask | kPadKeysBackward | kPadKeysForward | kPadQueryBackward | kShiftScores;

}  // namespace

int64_t Plan::to_int() const {
  return (padding_mask ? kPaddingMask : 0) | (pad_keys_backward ? kPadKeysBackward : 0) |
         (pad_keys_forward ? kPadKeysForward : 0) |
         (pad_query_backward ? kPadQueryBackward : 0) | (shift_scores ? kShiftScores : 0);
}

Plan Plan::from_int(int64_t bits) {
  TORCH_CHECK(bits >= 0 && (bits & ~kAll) == 0,
              "openwam: plan must be a combination of the plan flags (0..", kAll,
              "), got ", bits);
  Plan p;
  p.padding_mask = (bits & kPaddingMask) != 0;
  p.pad_keys_backward = (bits & kPadKeysBackward) != 0;
  p.pad_keys_forward = (bits & kPadKeysForward) != 0;
  p.pad_query_backward = (bits & kPadQueryBackward) != 0;
  p.shift_scores = (bits & kShiftScores) != 0;
  return p;
}

std::string Plan::to_string() const {
  std::string out;
  const auto add = [&out](bool on, const char* name) {
    if (on) {
      out += out.empty() ? "" : "+";
      out += name;
    }
  };
  add(padding_mask, "padding_mask");
  add(shift_scores, "shift_scores");
  add(pad_keys_backward, "pad_keys_backward");
  add(pad_keys_forward, "pad_keys_forward");
  add(pad_query_backward, "pad_query_backward");
  return out.empty() ? "none" : out;
}

}  // namespace openwam

// What a differentiated call on the cuDNN path does about the cuDNN backward
// defects that hit it. The guard table (guards.h) sets it; the cuDNN path's
// backward (cudnn_path_kernels.cpp) carries it out. Fixes combine: a call can
// hit two defects at once (batch 1, one query row, s_kv % 128 == 64).
#pragma once

#include <cstdint>
#include <string>

namespace openwam {

struct Plan {
  // Stock forward and backward, then the dQ rows with a very negative
  // logsumexp are recomputed (repair_dq.h; on tensor cores with fp32
  // accumulation, on the CPU an exact reference): the key-tail defect.
  bool repair_dq = false;
  // The backward runs on K/V zero-padded to a multiple of 128, the padded keys
  // hidden by -inf (OPENWAM_SDPA_PAD=always, or a key-tail call whose value
  // head_dim differs from the query's: guards.cpp): the key-tail defect.
  bool pad_keys_backward = false;
  // Forward and backward on padded K/V: with dropout the backward must see the
  // key length the forward's dropout pattern was drawn for.
  bool pad_keys_forward = false;
  // The backward runs with a second, zero query row (zero dO, zero output):
  // cuDNN writes NaN into all of dK and dV for batch 1 and a single query
  // row with a very negative logsumexp (cudnn-frontend #1072).
  bool pad_query_backward = false;

  bool none() const {
    return !repair_dq && !pad_keys_backward && !pad_keys_forward && !pad_query_backward;
  }
  bool pads_keys() const { return pad_keys_backward || pad_keys_forward; }

  // The op schemas carry the plan as an int.
  int64_t to_int() const;
  static Plan from_int(int64_t bits);
  // "none", or the fixes joined by '+', e.g. "repair_dq+pad_query_backward".
  std::string to_string() const;

  bool operator==(const Plan& o) const { return to_int() == o.to_int(); }
  bool operator!=(const Plan& o) const { return !(*this == o); }
};

}  // namespace openwam

// What a differentiated call on the cuDNN path does about the cuDNN backward
// defects that hit it. The guard table (guards.h) sets it; the cuDNN path's
// kernels (cudnn_path_kernels.cpp) carry it out.
//
// A plan names one fix per engine. A call whose bias comes from a bool mask
// shifts its scores (score_shift.h), on either engine. On the cuDNN frontend
// (cudnn_frontend/), the op's own graphs, the other calls' fix is cuDNN's
// padding mask. Where the frontend cannot build a graph for a call, the call
// runs on ATen's cuDNN attention, whose wrappers hide that mask, and the fix
// is to pad the inputs instead.
// Fixes combine: a call can hit two defects at once (batch 1, one query row,
// s_kv % 128 == 64).
#pragma once

#include <cstdint>
#include <string>

namespace openwam {

struct Plan {
  // Frontend: the backward graph runs with cuDNN's padding mask, seq_len_q and
  // seq_len_kv set to the full lengths. It removes the key-tail dQ NaN at the
  // source (cudnn-frontend #160): the kernel then treats the key rows past
  // s_kv in the last tile as out of range instead of scoring them 0. The
  // one-query-row dK/dV NaN (#1072) it removed in most cells but not all (25
  // of 360 degenerate cells, H200, cuDNN 9.19.0): pad_query_backward below.
  bool padding_mask = false;

  // Both engines, a bias from a bool mask (finite entries 0): the backward
  // runs stock's graph on scores shifted by a power of two per bias row, the
  // bias raised by it and the logsumexp with it, so that no row's logsumexp
  // is below 0 (score_shift.h). It removes the key-tail dQ NaN at stock's
  // cost, where the padding mask's biased backward is cuDNN's slow corner.
  // Takes the place of padding_mask and the K/V padding for such calls.
  bool shift_scores = false;

  // The key-tail defect on ATen's cuDNN attention (the fallback): the backward
  // runs on K/V zero-padded to a multiple of 128, the padded keys hidden by
  // -inf. On the frontend, a backward with a bias takes the same K/V shim
  // where it adds at most 1/32 of the keys (shim_takes_bias, padding.h), the
  // padding mask's biased backward being cuDNN's slow corner.
  bool pad_keys_backward = false;
  // ATen fallback, the key-tail defect with dropout: forward and backward on
  // the padded K/V, since the backward must see the key length the forward's
  // dropout pattern was drawn for.
  bool pad_keys_forward = false;
  // The one-query-row defect (batch 1), on both engines: the backward is
  // computed in fp32 with ATen ops (single_row_backward, reference_attention.h).
  // Never with dropout: the leaf ops refuse dropout with one query row
  // (plan_of_call), and openwam::sdpa hands such calls to PyTorch.
  bool pad_query_backward = false;

  bool none() const {
    return !padding_mask && !shift_scores && !pad_keys_backward && !pad_keys_forward &&
           !pad_query_backward;
  }
  bool pads_keys() const { return pad_keys_backward || pad_keys_forward; }
  // The part that the ATen fallback carries out.
  bool pads_inputs() const { return pads_keys() || pad_query_backward; }

  // The op schemas carry the plan as an int.
  int64_t to_int() const;
  static Plan from_int(int64_t bits);
  // "none", or the fixes joined by '+', e.g. "padding_mask+pad_keys_backward"
  // (the frontend's fix, then the ATen fallback's).
  std::string to_string() const;

  bool operator==(const Plan& o) const { return to_int() == o.to_int(); }
  bool operator!=(const Plan& o) const { return !(*this == o); }
};

}  // namespace openwam

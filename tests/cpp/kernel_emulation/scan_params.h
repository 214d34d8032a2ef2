// The row scan's parameters as repair/repair_dq.cu sets them, for the emulation
// tests (one set-up for all of them).
#pragma once

#include "simt_emu.h"  // first: it stands in for the CUDA features

#include <cstdint>

#include "cuda/repair/scan.cuh"
#include "cuda/repair/tile_types.cuh"

namespace openwam {
namespace repair {

// kRepairLseThreshold of repair_dq.h (which needs ATen).
constexpr float kTestLseThreshold = -40.0f;

// A logsumexp [B, heads, s_q] (float32, contiguous), and dQ rows of
// `head_dim` elements at strides `dq_st`; `repaired` may be nullptr.
inline ScanParams scan_params(const float* lse, int64_t B, int64_t heads, int64_t s_q,
                              uint16_t* dq, const RowStrides& dq_st, int head_dim, bool dq_vec,
                              unsigned long long* repaired) {
  ScanParams sp{};
  sp.lse = lse;
  sp.lse_b = heads * s_q;
  sp.lse_h = s_q;
  sp.lse_s = 1;
  sp.dq = dq;
  sp.dq_b = dq_st.b, sp.dq_h = dq_st.h, sp.dq_s = dq_st.s;
  sp.heads = heads;
  sp.s_q = s_q;
  sp.head_dim = head_dim;
  sp.dq_vec = dq_vec;
  sp.lse_vec = lse_vectorizable(lse, B, heads, sp.lse_b, sp.lse_h, sp.lse_s);
  sp.threshold = kTestLseThreshold;
  sp.repaired = repaired;
  return sp;
}

}  // namespace repair
}  // namespace openwam

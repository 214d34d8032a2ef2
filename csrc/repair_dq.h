// The dQ-row repair: the cheap, exact fix for the cuDNN key-tail defect.
//
// The defect (cudnn-frontend #160; cuDNN < 9.26 on sm90) corrupts only the dQ
// rows of query rows whose logsumexp is very negative: the out-of-range key
// rows of the last tile are scored 0, exp(0 - lse) overflows, and inf * 0
// writes NaN. Output, logsumexp, dK and dV are right (measured on the H200,
// cuDNN 9.19.0: every non-finite element lay in such a row; dK/dV finite).
// So after the stock backward, one kernel reads logsumexp and recomputes in
// fp32, from q, k, v, out and dO, exactly the dQ rows below the threshold:
//   dQ_i = scale * sum_j P_ij (dO_i . v_j - dO_i . o_i) k_j,
//   P_ij = exp(scale * q_i . k_j + bias_ij - lse_i).
// On ordinary data no row is below the threshold and the kernel only reads
// logsumexp (4 bytes per query row). No host synchronisation.
#pragma once

#include <ATen/ATen.h>
#include <optional>

namespace openwam {

// Rows with logsumexp below this are recomputed. NaN needs
// exp(-lse) * |dO_i . o_i| > FLT_MAX, i.e. lse < -88.72 + ln|dO_i . o_i|; on
// the H200 a row at lse = -82.4 already failed with dO scaled by 1e3. -40
// covers |dO_i . o_i| up to e^48; recomputing a healthy row is harmless (the
// fp32 recompute is exact up to rounding), only slower.
constexpr float kRepairLseThreshold = -40.0f;

// Calls openwam::_repair_dq_ through the dispatcher (so torch.compile traces
// it). All tensors 4-D [B, H, S, E]; key/value may have fewer heads (GQA);
// `bias` additive in the query's dtype, broadcastable, or undefined.
void repair_dq_(at::Tensor& grad_query, const at::Tensor& grad_out,
                const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& value, const at::Tensor& out,
                const at::Tensor& logsumexp, const at::Tensor& bias,
                bool is_causal, double scale);

}  // namespace openwam

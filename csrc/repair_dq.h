// The dQ-row repair: the cheap, exact fix for the cuDNN key-tail defect.
//
// The defect (cudnn-frontend #160; cuDNN < 9.26 on sm90) corrupts only the dQ
// rows of query rows whose logsumexp is very negative: the out-of-range key
// rows of the last tile are scored 0, exp(0 - lse) overflows, and inf * 0
// writes NaN. Output, logsumexp, dK and dV are right (measured on the H200,
// cuDNN 9.19.0: every non-finite element lay in such a row; dK/dV finite).
// So after the stock backward, the repair reads logsumexp and recomputes, from
// q, k, v, out and dO, exactly the dQ rows below the threshold:
//   dQ_i = scale * sum_j P_ij (dO_i . v_j - dO_i . o_i) k_j,
//   P_ij = exp(scale * q_i . k_j + bias_ij - lse_i).
// A row with lse = -inf (every key hidden) gets zeros. On ordinary data no row
// is below the threshold and the repair only reads logsumexp. No host
// synchronisation.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace openwam {

// Rows with logsumexp below this are recomputed. NaN needs
// exp(-lse) * |dO_i . o_i| > FLT_MAX, i.e. lse < -88.72 + ln|dO_i . o_i|; on
// the H200 a row at lse = -82.4 already failed with dO scaled by 1e3. -40
// covers |dO_i . o_i| up to e^48; recomputing a healthy row is harmless (as
// accurate as a flash backward), only slower.
constexpr float kRepairLseThreshold = -40.0f;

// The CUDA repair (csrc/cuda/repair/repair_dq.cu; CUDA builds only), on the current
// stream. Tensors 4-D [B, H, S, D], any strides but a contiguous last dim;
// key/value may have fewer heads (GQA: head h reads kv head h / (H / Hkv));
// D a multiple of 8 up to 256, the same for query, key and value; `bias`
// additive in the query's dtype, broadcastable to [B, H, L, S] (stride 0 on
// broadcast axes), or undefined; logsumexp float32 [B, H, L(, 1)], any
// strides. is_causal is top-left (row i sees keys 0..i). Rows with
// logsumexp -inf get zeros; rows with a finite logsumexp below
// kRepairLseThreshold are recomputed (tensor cores, fp32 accumulation), and
// their number is added on the device to *repaired_rows (int64, atomicAdd;
// nullptr: none). Every other row of grad_query is left untouched. One
// kernel launch, no workspace, no host synchronisation (capturable in a CUDA
// graph).
//
// behind_backward: the call comes right after cuDNN's backward on this
// stream, which wrote grad_query and none of the other tensors (the op's
// backward). On sm_90 the kernel may then start before that backward's
// last kernel has finished, and waits for it only before writing
// grad_query (a programmatic dependent launch). Otherwise (the standalone
// op, whose caller's last kernel may have written any input) a plain launch.
void repair_dq_rows(at::Tensor& grad_query, const at::Tensor& grad_out,
                    const at::Tensor& query, const at::Tensor& key,
                    const at::Tensor& value, const at::Tensor& out,
                    const at::Tensor& logsumexp, const at::Tensor& bias,
                    bool is_causal, double scale, int64_t* repaired_rows,
                    bool behind_backward);

}  // namespace openwam

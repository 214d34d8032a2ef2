// The host side shared by the CUDA-core repair probes (probe_row_stream.py,
// probe_split_keys.py; their load_inline puts scripts/ on the include path).
// Each probe's kernels read a Params struct of their own, laid out as its
// runs measured it (N1-N3, Q1-Q4); the fields they have in common are
// checked and filled here.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace probe {

inline const uint16_t* bits(const at::Tensor& t) {
  return static_cast<const uint16_t*>(t.data_ptr());
}

// bf16 BHSD views with head_dim 64 or 128, the last dimension contiguous; a
// bias is broadcast to [B, H, s_q, s_kv] for its strides.
template <class Params>
void fill_row_params(Params& p, const at::Tensor& dq, const at::Tensor& go, const at::Tensor& q,
                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                     const at::Tensor& lse, const c10::optional<at::Tensor>& bias, double scale,
                     double threshold) {
  const int64_t D = q.size(3);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && (D == 64 || D == 128), "bf16, D 64 or 128");
  for (const at::Tensor* t : {&dq, &go, &q, &k, &v, &o}) TORCH_CHECK(t->stride(3) == 1);
  p.q = bits(q); p.k = bits(k); p.v = bits(v); p.o = bits(o); p.go = bits(go);
  p.dq = static_cast<uint16_t*>(dq.data_ptr());
  p.lse = lse.data_ptr<float>();
  p.q_b = q.stride(0); p.q_h = q.stride(1); p.q_s = q.stride(2);
  p.k_b = k.stride(0); p.k_h = k.stride(1); p.k_s = k.stride(2);
  p.v_b = v.stride(0); p.v_h = v.stride(1); p.v_s = v.stride(2);
  p.o_b = o.stride(0); p.o_h = o.stride(1); p.o_s = o.stride(2);
  p.go_b = go.stride(0); p.go_h = go.stride(1); p.go_s = go.stride(2);
  p.dq_b = dq.stride(0); p.dq_h = dq.stride(1); p.dq_s = dq.stride(2);
  p.lse_b = lse.stride(0); p.lse_h = lse.stride(1); p.lse_s = lse.stride(2);
  p.H = static_cast<int>(q.size(1));
  p.kv_group = static_cast<int>(q.size(1) / k.size(1));
  p.s_q = static_cast<int>(q.size(2));
  p.s_kv = static_cast<int>(k.size(2));
  if (bias.has_value() && bias->defined()) {
    const at::Tensor e = bias->expand({q.size(0), q.size(1), q.size(2), k.size(2)});
    p.bias = bits(*bias);
    p.bias_b = e.stride(0); p.bias_h = e.stride(1); p.bias_s = e.stride(2); p.bias_e = e.stride(3);
  }
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.threshold = static_cast<float>(threshold);
}

}  // namespace probe

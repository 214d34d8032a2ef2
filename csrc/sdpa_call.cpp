#include "sdpa_call.h"

#include <ATen/core/grad_mode.h>

namespace openwam {

bool SdpaCall::differentiated() const {
  return at::GradMode::is_enabled() &&
         (query.requires_grad() || key.requires_grad() || value.requires_grad());
}

CallShape shape_of(const SdpaCall& call) {
  CallShape s;
  const bool four_d = call.query.dim() == 4;
  s.batch = call.query.sym_size(0);
  s.heads = four_d ? call.query.sym_size(1) : c10::SymInt(1);
  s.kv_heads = four_d ? call.key.sym_size(1) : c10::SymInt(1);
  s.s_q = call.query.sym_size(-2);
  s.s_kv = call.key.sym_size(-2);
  s.head_dim = call.query.sym_size(-1);
  s.head_dim_v = call.value.sym_size(-1);
  s.is_causal = call.is_causal;
  s.has_mask = call.attn_mask.has_value();
  s.dropout_p = call.dropout_p;
  return s;
}

}  // namespace openwam

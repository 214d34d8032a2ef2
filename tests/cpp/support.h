// What the test files share: Catch2 (included after torch), handles of the
// ops the tests call through the dispatcher, inputs, comparisons and a
// float64 reference attention. Include it after the csrc headers.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Logging.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ops.h"
#include "sdpa_call.h"

// Catch2 last: c10/util/logging_is_not_google_glog.h defines a glog-style
// CHECK that aborts; catch.hpp's CHECK must be the one in force.
#undef CHECK
#include <catch2/catch.hpp>

namespace openwam_test {

const auto kF64 = at::TensorOptions().dtype(at::kDouble);
const auto kF32 = at::TensorOptions().dtype(at::kFloat);
const auto kBF16 = at::TensorOptions().dtype(at::kBFloat16);
const auto kF16 = at::TensorOptions().dtype(at::kHalf);

// ------------------------------------------------------------ op handles

using PadKeysSchema = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t);

inline const c10::TypedOperatorHandle<PadKeysSchema>& pad_keys_op() {
  static const auto op = openwam::ops::lookup<PadKeysSchema>("openwam::pad_keys");
  return op;
}

// ------------------------------------------------------------ inputs

// The arguments of one call, owned; call() views them as an SdpaCall (valid
// while this object lives).
struct Inputs {
  at::Tensor query, key, value;
  std::optional<at::Tensor> attn_mask;
  double dropout_p = 0.0;
  bool is_causal = false;
  std::optional<double> scale;
  bool enable_gqa = false;

  openwam::SdpaCall call() const {
    return {query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa};
  }
};

// Random q [B, H, s_q, D], k/v [B, kv_heads, s_kv, D] (kv_heads 0: H; GQA
// sets enable_gqa), in `options`, requiring grad if asked.
Inputs bhsd(int64_t B, int64_t H, int64_t s_q, int64_t s_kv, int64_t D,
            at::TensorOptions options = kBF16, bool requires_grad = true,
            int64_t kv_heads = 0);

// The same sizes as [B, S, H, D] storage viewed as [B, H, S, D].
Inputs bshd(int64_t B, int64_t H, int64_t s_q, int64_t s_kv, int64_t D,
            at::TensorOptions options = kBF16, bool requires_grad = true);

// Makes the first query row of every (batch, head) attend with a logsumexp
// near -55 (very negative, yet far above -inf): it is anti-aligned with a
// large component all keys share. Keys keep their
// random content elsewhere. D >= 2; default scale 1/sqrt(D).
void make_first_row_low(Inputs& in);

// ------------------------------------------------------------ comparisons

// max |a - b| in float64; equal infinities count as equal, NaN never does.
double max_abs_diff(const at::Tensor& a, const at::Tensor& b);

// max |a - b| / (max finite |b| + 1).
double rel_diff(const at::Tensor& a, const at::Tensor& b);

bool same_layout(const at::Tensor& a, const at::Tensor& b);

// The message of a c10::Error thrown by f, without the backtrace ("" when
// nothing was thrown).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// ------------------------------------------------------------ reference

// softmax(q k^T * scale + bias) v in float64 through ATen's softmax and
// autograd, with cuDNN's conventions: a -inf bias hides a key, is_causal is
// top-left, a row that sees no key gets zero output, logsumexp -inf and zero
// gradient. q [..., L, E]; k, v [..., S, E] (4-D: fewer heads for GQA);
// bias additive, broadcastable to [..., L, S], or undefined.
struct Reference {
  at::Tensor out, logsumexp;    // logsumexp [..., L]
  at::Tensor dq, dk, dv;        // undefined when grad_out is
};
Reference reference_attention(const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& bias,
                              bool is_causal, std::optional<double> scale,
                              const at::Tensor& grad_out = at::Tensor());

}  // namespace openwam_test

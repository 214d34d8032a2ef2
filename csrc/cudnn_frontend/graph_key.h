// The descriptor of one cuDNN SDPA graph: every fact that changes the graph
// the frontend builds, and nothing that does not (data pointers, the scale,
// the dropout seed, the lengths behind the padding mask are bound when the
// graph runs). Two calls with equal keys run the same built graph; the graph
// cache (graph_cache.h) is keyed on it. Plain C++: the CPU tests check it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>

namespace openwam::frontend {

// Which graph: the forward without statistics (nothing will differentiate
// it), the forward that also writes the logsumexp, or the backward.
enum class Pass : uint8_t { kInference, kTraining, kBackward };

inline const char* to_string(Pass pass) {
  switch (pass) {
    case Pass::kInference: return "forward (inference)";
    case Pass::kTraining: return "forward";
    case Pass::kBackward: return "backward";
  }
  return "?";
}

// A 4-D tensor's sizes and strides, in elements. All zero: absent.
struct Layout {
  std::array<int64_t, 4> sizes{};
  std::array<int64_t, 4> strides{};

  bool operator==(const Layout& o) const { return sizes == o.sizes && strides == o.strides; }
  bool operator!=(const Layout& o) const { return !(*this == o); }
  bool present() const { return sizes[0] != 0; }
};

struct SdpaGraphKey {
  int device = 0;
  bool bf16 = false;  // else fp16
  Pass pass = Pass::kInference;
  Layout q, k, v;
  Layout o;        // the output; in the backward also grad_out's layout
  Layout grad_out; // backward: the upstream gradient (often o's layout)
  Layout dq, dk, dv;  // backward: the gradients
  Layout bias;     // additive, in the inputs' dtype, or absent
  bool is_causal = false;
  bool padding_mask = false;  // cuDNN's padding mask at the full lengths
  double dropout_p = 0.0;
  // The ragged layout (sdpa_varlen): q/k/v/o are packed [total, heads, E]
  // buffers seen as [B, H, S, E] with per-sequence offsets, B and S the
  // buckets of the sequence count and the longest sequence (ragged_engine.h),
  // the padding mask carries the true lengths, and the logsumexp is packed
  // [total_q, H, 1] too. The backward sizes its dQ accumulator by the
  // bucketed total token counts.
  bool ragged = false;
  int64_t max_total_q = 0;
  int64_t max_total_kv = 0;

  bool operator==(const SdpaGraphKey& o) const {
    return device == o.device && bf16 == o.bf16 && pass == o.pass && q == o.q && k == o.k &&
           v == o.v && this->o == o.o && grad_out == o.grad_out && dq == o.dq &&
           dk == o.dk && dv == o.dv && bias == o.bias && is_causal == o.is_causal &&
           padding_mask == o.padding_mask && dropout_p == o.dropout_p && ragged == o.ragged &&
           max_total_q == o.max_total_q && max_total_kv == o.max_total_kv;
  }
  bool operator!=(const SdpaGraphKey& o) const { return !(*this == o); }

  size_t hash() const {
    size_t h = 1469598103934665603ULL;
    const auto mix = [&h](uint64_t x) { h = (h ^ x) * 1099511628211ULL; };
    mix(static_cast<uint64_t>(device));
    mix((bf16 ? 1u : 0u) | (is_causal ? 2u : 0u) | (padding_mask ? 4u : 0u) |
        (ragged ? 8u : 0u) | (static_cast<uint64_t>(pass) << 4));
    mix(static_cast<uint64_t>(max_total_q));
    mix(static_cast<uint64_t>(max_total_kv));
    mix(std::hash<double>{}(dropout_p));
    for (const Layout* l : {&q, &k, &v, &this->o, &grad_out, &dq, &dk, &dv, &bias}) {
      for (int i = 0; i < 4; ++i) {
        mix(static_cast<uint64_t>(l->sizes[i]));
        mix(static_cast<uint64_t>(l->strides[i]));
      }
    }
    return h;
  }

  // For messages: "backward graph, bf16, q [2, 8, 200, 64] ..., causal".
  std::string describe() const {
    std::ostringstream s;
    const auto layout = [&s](const char* name, const Layout& l) {
      if (!l.present()) return;
      s << ", " << name << " [" << l.sizes[0] << ", " << l.sizes[1] << ", " << l.sizes[2]
        << ", " << l.sizes[3] << "] strides [" << l.strides[0] << ", " << l.strides[1]
        << ", " << l.strides[2] << ", " << l.strides[3] << "]";
    };
    s << to_string(pass) << " graph, " << (bf16 ? "bf16" : "fp16");
    layout("q", q);
    layout("k", k);
    layout("v", v);
    layout("bias", bias);
    if (is_causal) s << ", causal";
    if (dropout_p > 0.0) s << ", dropout " << dropout_p;
    if (padding_mask) s << ", padding mask";
    if (ragged) {
      s << ", ragged";
      if (pass == Pass::kBackward) s << " (max total " << max_total_q << "/" << max_total_kv << ")";
    }
    return s.str();
  }
};

struct SdpaGraphKeyHash {
  size_t operator()(const SdpaGraphKey& k) const { return k.hash(); }
};

}  // namespace openwam::frontend

// What the emulated repair tests share: a printf-style CHECK, the tensors
// (layouts, guard keys) and the case description the kernels run on.
#pragma once

#include "simt_emu.h"  // first: it stands in for the CUDA features

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/repair/layout.cuh"

namespace emu_test {

using namespace openwam::repair;

// CHECK with a printf-style message, shown when it fails.
#define EXPECT(cond, ...)                                 \
  do {                                                    \
    char expect_msg_[256];                                \
    std::snprintf(expect_msg_, sizeof expect_msg_, __VA_ARGS__); \
    INFO(expect_msg_);                                    \
    CHECK((cond));                                        \
  } while (0)

// ---------------------------------------------------------------- tensors
enum class Layout { kBhsd, kBshd, kPadded };  // kPadded: rows D+3 apart, base off by 1

struct Tensor4 {
  std::vector<uint16_t> storage;
  int64_t size[4];
  int64_t stride[4];
  int64_t offset = 0;
  uint16_t* data() { return storage.data() + offset; }
  const uint16_t* data() const { return storage.data() + offset; }
  uint16_t& at(int64_t a, int64_t b, int64_t c, int64_t d) {
    return data()[a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3]];
  }
  uint16_t at(int64_t a, int64_t b, int64_t c, int64_t d) const {
    return data()[a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3]];
  }
};

inline Tensor4 make_tensor(int64_t B, int64_t H, int64_t S, int64_t D, Layout layout) {
  Tensor4 t;
  t.size[0] = B, t.size[1] = H, t.size[2] = S, t.size[3] = D;
  if (layout == Layout::kBhsd) {
    t.stride[3] = 1, t.stride[2] = D, t.stride[1] = S * D, t.stride[0] = H * S * D;
    t.storage.assign(B * H * S * D, 0);
  } else if (layout == Layout::kBshd) {
    t.stride[3] = 1, t.stride[1] = D, t.stride[2] = H * D, t.stride[0] = S * H * D;
    t.storage.assign(B * H * S * D, 0);
  } else {
    const int64_t row = D + 3;
    t.stride[3] = 1, t.stride[2] = row, t.stride[1] = S * row, t.stride[0] = H * S * row;
    t.offset = 1;
    t.storage.assign(B * H * S * row + 1, 0);
  }
  return t;
}

// K or V: the first S keys of a tensor of S + kGuardKeys, whose keys past S
// are NaN, so that a kernel reading a key past s_kv (the loader must
// zero-fill those) puts 0 * NaN into dS K and a NaN into dQ.
constexpr int kGuardKeys = 64;
inline Tensor4 make_keys(int64_t B, int64_t H, int64_t S, int64_t D, Layout layout, bool fp16) {
  Tensor4 t = make_tensor(B, H, S + kGuardKeys, D, layout);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = S; j < S + kGuardKeys; ++j)
        for (int64_t d = 0; d < D; ++d) t.at(b, h, j, d) = fp16 ? 0x7e00 : 0x7fc0;
  t.size[2] = S;
  return t;
}

// 16-byte aligned storage: std::vector<uint16_t> gives 16 on glibc, but be sure.
inline bool aligned_rows(const Tensor4& t, int64_t elements) {
  if (reinterpret_cast<uintptr_t>(t.data()) % (elements * 2) != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.size[d] > 1 && t.stride[d] % elements != 0) return false;
  }
  return true;
}

template <class Elt>
struct Case {
  std::string name;
  int B = 1, H = 2, Hkv = 2, s_q = 70, s_kv = 130, D = 64;
  bool causal = false;
  enum { kNoBias, kKeyPad, kRows, kFull } bias = kNoBias;
  Layout layout = Layout::kBhsd;
  double share = 1.0;        // of rows made adversarial; < 0: one per head
  int rows_per_head = 0;     // > 0: exactly this many adversarial rows per head (share unused)
  int first_affected = 0;    // rows below this are ordinary
  int hot_key = -1;          // >= 0: this key's logits are 10% less negative (P ~ 1000x)
  int slots = 5;             // resident blocks the grid size assumes
  int masked_rows = 0;       // rows with every key hidden (needs a row bias)
  bool nan_lse_row = false;  // one row gets lse NaN: must stay untouched
  int stages = 0;            // 0: as on an H200 (tile_stages)
  int cluster = 1;           // blocks per cluster (kClusterBlocks: split tiles)
};

// H200: 228 KB of shared memory per SM, 1 KB reserved per block.
constexpr int kH200SmemPerSm = 233472, kH200Reserved = 1024;
inline int blocks_per_sm(int width) { return width <= 64 ? 3 : width <= 128 ? 2 : 1; }

inline double to_d(uint16_t x, bool fp16) {
  return fp16 ? f16_to_float(x) : bf16_to_float(x);
}
inline uint16_t from_d(double x, bool fp16) {
  return fp16 ? float_to_f16(static_cast<float>(x)) : float_to_bf16(static_cast<float>(x));
}

}  // namespace emu_test

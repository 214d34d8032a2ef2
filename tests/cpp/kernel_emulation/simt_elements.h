// The element types the kernels are templated on: bf16 and fp16 conversion
// (round to nearest even), and the Bf16 / Fp16 traits whose mma and wgmma
// are the emulated ones; fast_exp2 as an exact exp2.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simt_warp.h"
#include "simt_wgmma.h"

namespace openwam {
namespace repair {

inline float bf16_to_float(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_float(uint16_t x) {
  _Float16 h;
  std::memcpy(&h, &x, 2);
  return static_cast<float>(h);
}

inline uint16_t float_to_f16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t x;
  std::memcpy(&x, &h, 2);
  return x;
}

struct Bf16 {
  static constexpr bool kCenterKeys = false;
  static float to_float(uint16_t x) { return bf16_to_float(x); }
  static uint16_t from_float(float x) { return float_to_bf16(x); }
  static uint32_t pack(float lo, float hi) {
    return float_to_bf16(lo) | (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
  }
  static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    emu_mma(d, a, b0, b1, bf16_to_float);
  }
  template <int kN, int kTransB>
  static void wgmma(float (&d)[kN][4], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    emu_wgmma<kN>(d, a, desc, accumulate != 0, kTransB != 0, bf16_to_float);
  }
};

struct Fp16 {
  static constexpr bool kCenterKeys = true;
  static float to_float(uint16_t x) { return f16_to_float(x); }
  static uint16_t from_float(float x) { return float_to_f16(x); }
  static uint32_t pack(float lo, float hi) {
    return float_to_f16(lo) | (static_cast<uint32_t>(float_to_f16(hi)) << 16);
  }
  static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    emu_mma(d, a, b0, b1, f16_to_float);
  }
  template <int kN, int kTransB>
  static void wgmma(float (&d)[kN][4], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    emu_wgmma<kN>(d, a, desc, accumulate != 0, kTransB != 0, f16_to_float);
  }
};

inline float fast_exp2(float x) { return std::exp2(x); }

}  // namespace repair
}  // namespace openwam

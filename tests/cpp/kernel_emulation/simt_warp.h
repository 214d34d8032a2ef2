// The warp's collectives, each a barrier among its 32 fibers that trade
// values through their slots: shuffles and ballots, ldmatrix (with a count
// of bank conflicts) and mma.sync m16n8k16, in the PTX ISA's fragment
// layouts.
#pragma once

#include <cstdint>
#include <cstring>

#include "simt_memory.h"
#include "simt_scheduler.h"

template <typename T>
inline T emu_exchange(T v, int src_lane, bool take) {
  static_assert(sizeof(T) <= 8, "scalar only");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  emu::my_slot()[0] = bits;
  emu::warp_sync();
  const uint64_t got = emu::slot_of(src_lane)[0];
  emu::warp_sync();
  if (!take) return v;
  T r;
  std::memcpy(&r, &got, sizeof(T));
  return r;
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  if (mask != 0xffffffffu) emu::fail("only full-warp shuffles are emulated");
  return emu_exchange(v, emu::cur->lane ^ lane_mask, true);
}

template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta) {
  if (mask != 0xffffffffu) emu::fail("only full-warp shuffles are emulated");
  const int lane = emu::cur->lane;
  const int src = lane >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane;
  return emu_exchange(v, src, true);
}

inline unsigned __ballot_sync(unsigned mask, bool pred) {
  if (mask != 0xffffffffu) emu::fail("only full-warp ballots are emulated");
  emu::my_slot()[0] = pred ? 1 : 0;
  emu::warp_sync();
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= static_cast<unsigned>(emu::slot_of(l)[0] & 1) << l;
  emu::warp_sync();
  return r;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }

namespace openwam {
namespace repair {

// ldmatrix .x4: lane l gives the row address for row l % 8 of matrix l / 8.
inline void emu_ldsm(uint32_t (&r)[4], uint32_t addr, bool trans) {
  const unsigned char* p = smem_base() + addr;
  emu::check_smem(p, 16, 16);
  ++emu::stats.ldsm;
  emu::my_slot()[0] = reinterpret_cast<uint64_t>(p);
  emu::warp_sync();
  const int lane = emu::cur->lane;
  if (lane == 0) {  // bank groups of each matrix's 8 rows must differ
    for (int m = 0; m < 4; ++m) {
      unsigned seen = 0;
      for (int i = 0; i < 8; ++i) {
        const unsigned group = (emu::slot_of(8 * m + i)[0] / 16) % 8;
        if (seen & (1u << group)) ++emu::stats.ldsm_conflicts;
        seen |= 1u << group;
      }
    }
  }
  for (int m = 0; m < 4; ++m) {
    uint16_t e[2];
    for (int k = 0; k < 2; ++k) {
      // Without .trans: row lane/4, columns 2 (lane%4) + k. With .trans:
      // row 2 (lane%4) + k, column lane/4.
      const int row = trans ? 2 * (lane % 4) + k : lane / 4;
      const int col = trans ? lane / 4 : 2 * (lane % 4) + k;
      const auto* addr = reinterpret_cast<const uint16_t*>(emu::slot_of(8 * m + row)[0]);
      e[k] = addr[col];
    }
    r[m] = e[0] | (static_cast<uint32_t>(e[1]) << 16);
  }
  emu::warp_sync();
}

inline void ldsm_x4(uint32_t (&r)[4], uint32_t addr) { emu_ldsm(r, addr, false); }
inline void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) { emu_ldsm(r, addr, true); }

// mma.m16n8k16 row.col with fp32 accumulators; `to_float` decodes a 16-bit
// element. Fragments (PTX ISA): A a0 (g, 2t..2t+1), a1 (g+8, ..), a2 (g,
// 2t+8..), a3 (g+8, 2t+8..); B b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g);
// C c0, c1 (g, 2t..), c2, c3 (g+8, 2t..), with g = lane/4, t = lane%4.
template <class ToFloat>
inline void emu_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                    ToFloat to_float) {
  ++emu::stats.mma;
  uint64_t* s = emu::my_slot();
  for (int i = 0; i < 4; ++i) s[i] = a[i];
  s[4] = b0;
  s[5] = b1;
  emu::warp_sync();
  auto a_elem = [&](int row, int k) {
    const int lane = (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    const uint32_t w = static_cast<uint32_t>(emu::slot_of(lane)[reg]);
    return to_float(static_cast<uint16_t>((k & 1) ? w >> 16 : w));
  };
  auto b_elem = [&](int k, int n) {
    const int lane = n * 4 + (k % 8) / 2;
    const int reg = 4 + (k >= 8 ? 1 : 0);
    const uint32_t w = static_cast<uint32_t>(emu::slot_of(lane)[reg]);
    return to_float(static_cast<uint16_t>((k & 1) ? w >> 16 : w));
  };
  const int lane = emu::cur->lane;
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = lane / 4 + (e >= 2 ? 8 : 0);
    const int col = 2 * (lane % 4) + (e & 1);
    float acc = d[e];
    for (int k = 0; k < 16; ++k) acc += a_elem(row, k) * b_elem(k, col);
    out[e] = acc;
  }
  emu::warp_sync();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

}  // namespace repair
}  // namespace openwam

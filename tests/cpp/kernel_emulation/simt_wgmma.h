// wgmma (sm_90a) for a block of one warpgroup: the shared-memory operand
// read through its descriptor (128-byte swizzle) at issue and again at the
// wgmma.wait_group that retires the op, each warp issuing and retiring its
// own 16 rows, and results landing only at that wait. What makes the
// asynchrony show fails: a wgmma without a wgmma.fence since the thread's
// last wait, an operand a cp.async landed that its writer has not passed
// fence.proxy.async for, shared memory changed while the op was in flight.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "simt_memory.h"
#include "simt_scheduler.h"

namespace openwam {
namespace repair {

// A shared-memory operand through its descriptor (PTX ISA, "Matrix
// Descriptor Format", 128-byte swizzle): element (k, n) of B, k < 16. K-major:
// 8-row groups of n `stride` apart, rows 128 bytes apart, k contiguous.
// MN-major: 64-column blocks of n `leading` apart, 8-row groups of k
// `stride` apart, rows 128 bytes apart, n contiguous. The swizzle XORs bits
// 4-6 of the address with bits 7-9. `at_issue`: the read of a wgmma being
// issued (its data must have passed fence.proxy.async), not the check at
// its retiring wait that the data is unchanged.
inline uint16_t wgmma_b_elem(uint64_t desc, bool trans_b, int k, int n, bool at_issue = true) {
  const uint32_t start = static_cast<uint32_t>(desc & 0x3fff) << 4;
  const uint32_t leading = static_cast<uint32_t>((desc >> 16) & 0x3fff) << 4;
  const uint32_t stride = static_cast<uint32_t>((desc >> 32) & 0x3fff) << 4;
  if ((desc >> 62) != 1) emu::fail("wgmma descriptor: not the 128-byte swizzle");
  if (((desc >> 49) & 7) != 0) emu::fail("wgmma descriptor: base offset");
  if ((start & 0x380) != 0) emu::fail("wgmma operand start not within 128 bytes of a 1024-byte atom");
  const uint32_t addr = trans_b ? start + (n / 64) * leading + (k / 8) * stride + (k % 8) * 128 +
                                      (n % 64) * 2
                                : start + (n / 8) * stride + (n % 8) * 128 + k * 2;
  const uint32_t swizzled = addr ^ (((addr >> 7) & 7) << 4);
  const unsigned char* p = smem_base() + swizzled;
  emu::check_smem(p, 2, 2);
  if (at_issue && emu::blk->unfenced[swizzled] != 0)
    emu::fail("wgmma reads cp.async data not yet passed through fence.proxy.async");
  uint16_t x;
  std::memcpy(&x, p, 2);
  return x;
}

// The values an in-flight wgmma leaves in `d` (an earlier op of a chain), or
// d's own.
inline const float* wgmma_pending(float* d) {
  for (auto it = emu::cur->wgmma_open.rbegin(); it != emu::cur->wgmma_open.rend(); ++it)
    if (it->d == d) return it->values.data();
  for (auto g = emu::cur->wgmma_groups.rbegin(); g != emu::cur->wgmma_groups.rend(); ++g)
    for (auto it = g->rbegin(); it != g->rend(); ++it)
      if (it->d == d) return it->values.data();
  return d;
}

// d (64 x 8 kN) (+)= A (64 x 16: mma.m16n8k16 A fragments, warp w rows
// 16 w..) * B (16 x 8 kN, shared memory through `desc`). Each warp computes
// and retires its own 16 rows, synchronized only within the warp, as
// `.sync.aligned` promises: another warp of the warpgroup may still be
// reading B after this one's wait returned (a stage refilled on one warp's
// wait alone fails at the other warps' waits). Every warp must issue the
// same sequence of wgmma (checked against the first warp's).
template <int kN, class ToFloat>
inline void emu_wgmma(float (&d)[kN][4], const uint32_t (&a)[4], uint64_t desc, bool accumulate,
                      bool trans_b, ToFloat to_float) {
  if (emu::blk->threads.size() != 128) emu::fail("wgmma: the block must be one warpgroup");
  if (!emu::cur->wgmma_fenced) emu::fail("wgmma without a wgmma.fence since the last wait");
  ++emu::stats.wgmma;
  emu::WgmmaSlot& mine = emu::blk->wgmma_slots[emu::cur->tid.x];
  std::memcpy(mine.a, a, sizeof mine.a);
  mine.desc = desc, mine.n_tiles = kN, mine.accumulate = accumulate, mine.trans_b = trans_b;
  emu::warp_sync();
  const int warp = emu::cur->warp, lane = emu::cur->lane;
  const emu::WgmmaSlot& first = emu::blk->wgmma_slots[32 * warp];
  auto same = [](const emu::WgmmaSlot& x, const emu::WgmmaSlot& y) {
    return x.desc == y.desc && x.n_tiles == y.n_tiles && x.accumulate == y.accumulate &&
           x.trans_b == y.trans_b;
  };
  if (!same(mine, first)) emu::fail("wgmma: the warp's threads disagree on the instruction");
  if (lane == 0) {
    std::vector<emu::WgmmaSlot>& log = emu::blk->wgmma_log;
    const size_t i = emu::blk->warps[warp].wgmma_issued++;
    if (i == log.size()) {
      log.push_back(first);
    } else if (!same(first, log[i])) {
      emu::fail("wgmma: the warpgroup's warps disagree on the instruction");
    }
  }
  auto a_elem = [&](int row, int k) {  // rows of this warp: its own threads' registers
    const int thread = (row / 16) * 32 + (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row % 16 >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    const uint32_t w = emu::blk->wgmma_slots[thread].a[reg];
    return to_float(static_cast<uint16_t>((k & 1) ? w >> 16 : w));
  };
  const float* base = wgmma_pending(&d[0][0]);
  std::vector<float> out(4 * kN);
  for (int j = 0; j < kN; ++j) {
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * warp + lane / 4 + (e >= 2 ? 8 : 0);
      const int col = 8 * j + 2 * (lane % 4) + (e & 1);
      float acc = accumulate ? base[4 * j + e] : 0.0f;
      for (int k = 0; k < 16; ++k)
        acc += a_elem(row, k) * to_float(wgmma_b_elem(desc, trans_b, k, col));
      out[4 * j + e] = acc;
    }
  }
  emu::WgmmaResult result{&d[0][0], std::move(out), desc, trans_b, 8 * kN, {}};
  if (lane == 0) {  // the operand as this warp read it, checked again at its wait
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < 8 * kN; ++n) result.b_value.push_back(wgmma_b_elem(desc, trans_b, k, n));
  }
  emu::warp_sync();  // every thread of the warp read the slots
  emu::cur->wgmma_open.push_back(std::move(result));
}

inline void wgmma_fence() { emu::cur->wgmma_fenced = true; }
template <int kN>
inline void wgmma_fence_operand(float (&)[kN][4]) {}

inline void wgmma_commit() { emu::commit_group(emu::cur->wgmma_open, emu::cur->wgmma_groups); }

template <int kPending>
inline void wgmma_wait() {
  emu::cur->wgmma_fenced = false;  // the registers are the program's again
  emu::retire_groups(emu::cur->wgmma_groups, kPending, [](const emu::WgmmaResult& r) {
    for (size_t i = 0; i < r.b_value.size(); ++i) {  // unchanged while in flight
      const int k = static_cast<int>(i) / r.n_cols, n = static_cast<int>(i) % r.n_cols;
      if (wgmma_b_elem(r.desc, r.trans_b, k, n, false) != r.b_value[i])
        emu::fail("shared memory read by a wgmma changed before the wait that retires it");
    }
    std::copy(r.values.begin(), r.values.end(), r.d);
  });
}

}  // namespace repair
}  // namespace openwam

// The key loop of a tile (phase 4 of repair_tile, tile.cuh): dQ += dS K
// over the tile's key blocks, K, V and bias streaming through the cp.async
// stages. key_loop is the pipeline; walk_keys_narrow, walk_keys_mma and
// walk_keys_wgmma the three ways a tile's warps share the work.
#pragma once

#include <cstdint>

#include "layout.cuh"
#include "tile_types.cuh"
#include "tile_warp.cuh"
#ifndef OPENWAM_REPAIR_EMULATE  // the CPU emulation of the tests brings its own
#include "ptx.cuh"
#endif

namespace openwam {
namespace repair {

// Waits until at most the `newest` (0..2) most recent cp.async groups are
// in flight (cp.async.wait_group takes a constant; the count follows the
// stages).
__device__ __forceinline__ void cp_async_wait_all_but(int newest) {
  if (newest == 1) {  // first: the key loop's count with 3 stages
    cp_async_wait<1>();
  } else if (newest == 0) {
    cp_async_wait<0>();
  } else {
    cp_async_wait<2>();
  }
}

// Phase 4, the pipeline every key walk shares: one barrier per key block
// (the wgmma walk adds one of its own: see there). Past it every warp has
// finished its reads of block kb - 1 (on wgmma all but the last dS K, still
// in flight: see there), so that block's stage takes block kb + stages - 1
// (the `refill` each walk calls); blocks kb + 1 .. kb + stages - 2 may still
// be in flight when block kb is needed. `before_barrier(kb)` runs ahead of
// the waits; `compute(stage, bias_tile, key_base, refill)` takes block kb.
template <bool kWgmma, int kChunks, class BeforeBarrier, class Compute>
__device__ __forceinline__ void key_loop(const Tile<kChunks>& t, uint32_t smem_s,
                                         BeforeBarrier&& before_barrier, Compute&& compute) {
  unsigned char* smem = smem_base();
  const int stages = t.layout.stages;
  int use = 0;            // the stage of block kb
  int fill = stages - 1;  // the stage of block kb - 1, refilled with kb + stages - 1
  for (int kb = t.keys.begin; kb < t.keys.end; ++kb) {
    before_barrier(kb);
    cp_async_wait_all_but(stages - 2);          // block kb landed
    if constexpr (kWgmma) fence_proxy_async();  // this thread's cp.async data, for wgmma
    __syncthreads();
    auto refill = [&]() {  // a group every iteration, even empty (wait accounting)
      if (kb + stages - 1 < t.keys.end) t.load_key_block(kb + stages - 1, fill);
      cp_async_commit();
    };
    const uint16_t* bias_tile =
        t.bias != nullptr ? reinterpret_cast<const uint16_t*>(smem + t.layout.stage(use) +
                                                              2 * t.layout.kv_tile_bytes())
                          : nullptr;
    compute(smem_s + t.layout.stage(use), bias_tile, kb * kKeyBlock, refill);
    use = use + 1 == stages ? 0 : use + 1;
    fill = fill + 1 == stages ? 0 : fill + 1;
  }
}

// Phase 4, narrow tile: all 4 warps on the same 16 rows, each taking 16 keys
// of every block (partial dQ, summed by write_rows_narrow).
template <class Elt, int kWidth, bool kWgmma>
__device__ __forceinline__ void walk_keys_narrow(const Tile<TileShape<kWidth>::kChunks>& t,
                                                 const WarpTile& wt, const WarpRows& wr,
                                                 DqAcc<kWidth>& acc, float (&ds_sum)[2],
                                                 RowFrags<kWidth>& qf, RowFrags<kWidth>& dof) {
  key_loop<kWgmma>(t, wt.smem_s, [](int) {},
                   [&](uint32_t stage, const uint16_t* bias_tile, int key_base, auto&& refill) {
                     refill();
                     warp_key_block<Elt, kWidth, 2>(
                         acc, ds_sum, qf, dof, wt.q_tile_s, wt.do_tile_s, stage, bias_tile,
                         t.layout.kv_tile_bytes(), 0, wt.warp * 16, key_base, t.p.scale_log2,
                         wr, wt.lc, wt.lane);
                   });
}

// Phase 4, wide tile on mma.sync: each warp its own 16 rows; a warp past the
// tile's rows idles (`active`). Only kernels without wgmma take it.
template <class Elt, int kWidth>
__device__ __forceinline__ void walk_keys_mma(const Tile<TileShape<kWidth>::kChunks>& t,
                                              const WarpTile& wt, const WarpRows& wr, bool active,
                                              DqAcc<kWidth>& acc, float (&ds_sum)[2],
                                              RowFrags<kWidth>& qf, RowFrags<kWidth>& dof) {
  using Shape = TileShape<kWidth>;
  key_loop<false>(t, wt.smem_s, [](int) {},
                  [&](uint32_t stage, const uint16_t* bias_tile, int key_base, auto&& refill) {
                    refill();
                    if (active) {
#pragma unroll
                      for (int part = 0; part < kKeyBlock / (8 * Shape::kWideNT); ++part) {
                        warp_key_block<Elt, kWidth, Shape::kWideNT>(
                            acc, ds_sum, qf, dof, wt.q_tile_s, wt.do_tile_s, stage, bias_tile,
                            t.layout.kv_tile_bytes(), wt.row0, part * 8 * Shape::kWideNT,
                            key_base, t.p.scale_log2, wr, wt.lc, wt.lane);
                      }
                    }
                  });
}

// Phase 4, wide tile on wgmma (sm_90a, head_dim <= 128): the 4 warps as one
// warpgroup. Two parts of 32 keys per block (A, B). Each part's dS K is left
// in flight and retired by the next part's first wait; part B's is issued at
// the top of the next iteration, ahead of the barrier (it overlaps the
// loop's waits), so that no wgmma is in flight across the loop's back edge
// (there ptxas serializes every wgmma: C7515, nvcc 13.0). The refill
// overwrites the stage that block kb - 1's last dS K reads: part A's first
// wait retires it, but only for the waiting warp (a wgmma is `.sync.aligned`
// per warp; each warp's rows finish on their own), so a barrier past part A
// lets no warp refill before every warp's wait. At head_dim 128 it sits
// after part B's products are issued: part A's dS K and part B's Q K^T and
// dO V^T keep the tensor cores busy while warps wait there (between the
// parts it cost about 3% of the kernel at 4096x4032 every row, H200). Only
// there, in bf16: at 64, whose kernel is capped at 168 registers, and in
// fp16, whose descriptors take more, the refill's addresses beside part B's
// products in flight spill (inside the loop at 64; nvcc 13.0), and the
// barrier stays between the parts.
template <class Elt, int kWidth>
__device__ __forceinline__ void walk_keys_wgmma(const Tile<TileShape<kWidth>::kChunks>& t,
                                                const WarpTile& wt, const WarpRows& wr,
                                                DqAcc<kWidth>& acc, float (&ds_sum)[2],
                                                RowFrags<kWidth>& qf, RowFrags<kWidth>& dof) {
  constexpr int kNT = TileShape<kWidth>::kWgmmaNT;
  static_assert(kKeyBlock == 16 * kNT, "two parts per key block");
  constexpr bool kLateRefill = kWidth == 128 && !Elt::kCenterKeys;
  uint32_t ds_b[kNT / 2][4];  // part B's dS, for its dS K
  uint32_t stage_b = 0;       // and its stage
  const int row0 = wt.row0, lane = wt.lane;
  const TileSmem& layout = t.layout;
  const TileParams& p = t.p;
  key_loop<true>(
      t, wt.smem_s,
      [&](int kb) {
        // stage_b != 0 past the first block (a stage is never at address 0).
        if (stage_b != 0) warpgroup_ds_k<Elt, kWidth, kNT>(acc, ds_b, stage_b, 8 * kNT);
      },
      [&](uint32_t stage, const uint16_t* bias_tile, int key_base, auto&& refill) {
        uint32_t ds_a[kNT / 2][4];
        warpgroup_scores_to_ds<Elt, kWidth, kNT>(ds_a, ds_sum, qf, dof, stage, bias_tile,
                                                 layout.kv_tile_bytes(), row0, 0, key_base,
                                                 p.scale_log2, wr, lane, [] {});
        warpgroup_ds_k<Elt, kWidth, kNT>(acc, ds_a, stage, 0);
        // Every warp's part A retired block kb - 1's last dS K past it.
        auto barrier_and_refill = [&] {
          __syncthreads();
          refill();
        };
        auto late = [&] {
          if constexpr (kLateRefill) barrier_and_refill();
        };
        if constexpr (!kLateRefill) barrier_and_refill();
        warpgroup_scores_to_ds<Elt, kWidth, kNT>(ds_b, ds_sum, qf, dof, stage, bias_tile,
                                                 layout.kv_tile_bytes(), row0, 8 * kNT,
                                                 key_base, p.scale_log2, wr, lane, late);
        stage_b = stage;
      });
  if (t.keys.end > t.keys.begin) warpgroup_ds_k<Elt, kWidth, kNT>(acc, ds_b, stage_b, 8 * kNT);
  wgmma_wait<0>();
  wgmma_fence_operand(acc);
}

}  // namespace repair
}  // namespace openwam

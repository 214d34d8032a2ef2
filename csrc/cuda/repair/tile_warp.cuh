// The warp-level math of the tile phase (tile.cuh): one warp,
// 16 query rows, 8 kNT keys of a key block, on mma.sync m16n8k16 with fp32
// accumulators:
//   S = Q K^T, P = exp2(S scale log2e + bias log2e - lse log2e),
//   dP = dO V^T, dS = P (dP - delta), dQ += dS K.
// Operands come from shared memory through ldmatrix (K and V; Q and dO when
// they do not stay in registers); dS goes from accumulators straight into
// the A operand of dS K. On sm_90a, wide tiles run the same math for the
// whole block at once on wgmma (warpgroup_scores_to_ds, warpgroup_ds_k), K
// and V read by the tensor cores straight from the shared-memory tiles.
#pragma once

#include <cstdint>

#include "layout.cuh"
#ifndef OPENWAM_REPAIR_EMULATE  // the CPU emulation of the tests brings its own
#include "ptx.cuh"
#endif

namespace openwam {
namespace repair {

template <int kWidth>
struct TileShape {
  static constexpr int kChunks = kWidth / 8;   // 16-byte chunks per row
  static constexpr int kKSteps = kWidth / 16;  // k-steps of Q K^T and dO V^T
  static constexpr int kDTiles = kWidth / 8;   // n-tiles of dS K
  static constexpr bool kQInRegs = kWidth <= 128;
  static constexpr int kFrags = kQInRegs ? kKSteps : 1;
  // Keys per warp_key_block call in a wide tile, in n-tiles of 8: the
  // scores and dP of that many keys are live at once beside the dQ
  // accumulators (16 x 256 fp32 leave room for 16 keys, not 32).
  static constexpr int kWideNT = kWidth <= 128 ? 4 : 2;
  // The same on wgmma (warpgroup_scores_to_ds): 32 keys too. The whole key
  // block (m64n64 scores) was 7% slower at 4096x4032 every row (H200).
  static constexpr int kWgmmaNT = 4;
};

// Everything a warp needs about its two accumulator rows (lane / 4 and 8
// below) while it walks the keys.
struct WarpRows {
  float lse2[2];   // logsumexp * log2(e); +inf for padding rows (P = 0)
  float delta[2];  // dO_i . o_i
  int limit[2];    // keys at or past this are masked (s_kv, or i + 1 causal)
  int row[2];      // the query row, -1 for padding
  // Keys below this are visible to every row of the tile: s_kv, or under
  // is_causal its first row + 1. Padding rows need no mask: their Q (and
  // bias) are zeros and their lse2 +inf, so P = exp2(-inf) = 0.
  int full;
};

// A lane's ldmatrix chunk offsets (lane_chunk_offset) for the two lane bits
// in use: `hi` = lane / 16 (A operands, and .trans B operands), `mid` =
// (lane / 8) % 2 (B operands).
struct LaneChunks {
  int hi[4];
  int mid[4];
  __device__ __forceinline__ explicit LaneChunks(int lane) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      hi[i] = lane_chunk_offset(lane, lane >> 4, i);
      mid[i] = lane_chunk_offset(lane, (lane >> 3) & 1, i);
    }
  }
};

// dot(a8, b8) of two chunks of 8 elements each.
template <class Elt>
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
  const uint32_t aw[4] = {a.x, a.y, a.z, a.w};
  const uint32_t bw[4] = {b.x, b.y, b.z, b.w};
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s = fmaf(Elt::to_float(static_cast<uint16_t>(aw[i])),
             Elt::to_float(static_cast<uint16_t>(bw[i])), s);
    s = fmaf(Elt::to_float(static_cast<uint16_t>(aw[i] >> 16)),
             Elt::to_float(static_cast<uint16_t>(bw[i] >> 16)), s);
  }
  return s;
}

// acc (16 rows x kNT*8 keys) += A (16 rows x kWidth, registers or tile
// `a_tile` at row0) times the key tile `b_tile` (keys key0.. x kWidth)^T.
// Tiles are shared-space addresses (smem_u32).
template <class Elt, int kWidth, int kNT>
__device__ __forceinline__ void rows_times_keys(
    float (&acc)[kNT][4], const uint32_t (&frags)[TileShape<kWidth>::kFrags][4],
    uint32_t a_tile, int row0, uint32_t b_tile, int key0, const LaneChunks& lc, int lane) {
  using Shape = TileShape<kWidth>;
  constexpr int kRowBytes = kTileRowBytes;  // rows within a column block (tile_offset)
  const uint32_t a_row = a_tile + (row0 + ldsm_a_row(lane)) * kRowBytes;
  const uint32_t b_row = b_tile + (key0 + ldsm_b_row(lane)) * kRowBytes;
#pragma unroll
  for (int kk = 0; kk < Shape::kKSteps; ++kk) {
    uint32_t a[4];
    if constexpr (Shape::kQInRegs) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = frags[kk][i];
    } else {
      ldsm_x4(a, a_row + lc.hi[kk & 3] + step_offset(kk));
    }
#pragma unroll
    for (int jp = 0; jp < kNT / 2; ++jp) {
      uint32_t b[4];
      ldsm_x4(b, b_row + 16 * jp * kRowBytes + lc.mid[kk & 3] + step_offset(kk));
      Elt::mma(acc[2 * jp], a, b[0], b[1]);
      Elt::mma(acc[2 * jp + 1], a, b[2], b[3]);
    }
  }
}

// P = exp2(S scale log2e + bias log2e - lse log2e) in place of the scores S
// of a warp's 16 rows (row0..) and keys key0 .. key0 + 8 kNT - 1 of the key
// block; 0 where masked. kBias: add the bias tile's entries. kMasked: test
// each key against its row's limit; without it the caller has found every
// one of these keys below every row's limit (WarpRows::full).
template <class Elt, int kNT, bool kBias, bool kMasked>
__device__ __forceinline__ void scores_to_probs_as(float (&p)[kNT][4], const uint16_t* bias_tile,
                                                   int row0, int key0, int key_base,
                                                   float scale_log2, const WarpRows& wr,
                                                   int lane) {
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int col = key0 + 8 * j + frag_col(lane, 0);  // within the block
      // fma(S, scale log2e, bias log2e - lse log2e): one rounding without a
      // bias (the old S scale log2e + bias log2e - lse log2e had two).
      float c0 = -wr.lse2[rr], c1 = -wr.lse2[rr];
      if constexpr (kBias) {
        const uint32_t w = *reinterpret_cast<const uint32_t*>(
            bias_tile + (row0 + frag_row(lane, 2 * rr)) * kBiasPitch + col);
        c0 = fmaf(Elt::to_float(static_cast<uint16_t>(w)), kLog2e, c0);
        c1 = fmaf(Elt::to_float(static_cast<uint16_t>(w >> 16)), kLog2e, c1);
      }
      const float e0 = fast_exp2(fmaf(p[j][2 * rr], scale_log2, c0));
      const float e1 = fast_exp2(fmaf(p[j][2 * rr + 1], scale_log2, c1));
      if constexpr (kMasked) {
        p[j][2 * rr] = key_base + col < wr.limit[rr] ? e0 : 0.0f;
        p[j][2 * rr + 1] = key_base + col + 1 < wr.limit[rr] ? e1 : 0.0f;
      } else {
        p[j][2 * rr] = e0;
        p[j][2 * rr + 1] = e1;
      }
    }
  }
}

// scores_to_probs_as with the bias test and the key mask taken once per
// call instead of per element: both are uniform across the warp, and as
// per-element predicates they were about a third of the instructions of a
// wgmma key block without a bias (SASS, nvcc 13.0, head_dim 128). The mask
// is needed only in the key blocks that hold s_kv or, under is_causal, a
// tile row's diagonal.
template <class Elt, int kNT>
__device__ __forceinline__ void scores_to_probs(float (&p)[kNT][4], const uint16_t* bias_tile,
                                                int row0, int key0, int key_base,
                                                float scale_log2, const WarpRows& wr, int lane) {
  const bool masked = key_base + key0 + 8 * kNT > wr.full;
  if (bias_tile != nullptr) {
    if (masked) {
      scores_to_probs_as<Elt, kNT, true, true>(p, bias_tile, row0, key0, key_base, scale_log2,
                                               wr, lane);
    } else {
      scores_to_probs_as<Elt, kNT, true, false>(p, bias_tile, row0, key0, key_base, scale_log2,
                                                wr, lane);
    }
  } else if (masked) {
    scores_to_probs_as<Elt, kNT, false, true>(p, bias_tile, row0, key0, key_base, scale_log2,
                                              wr, lane);
  } else {
    scores_to_probs_as<Elt, kNT, false, false>(p, bias_tile, row0, key0, key_base, scale_log2,
                                               wr, lane);
  }
}

// dS = P (dP - delta) in place of dP.
template <int kNT>
__device__ __forceinline__ void probs_to_ds(const float (&p)[kNT][4], float (&ds)[kNT][4],
                                            const WarpRows& wr) {
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) ds[j][e] = p[j][e] * (ds[j][e] - wr.delta[e >> 1]);
  }
}

// The A operand of dS K for k-step t (keys 16 t .. 16 t + 15 of the kNT * 8):
// dS is already in A-operand order (FlashAttention-2's P V trick), n-tiles
// 2t and 2t+1 of the accumulator. With Elt::kCenterKeys also ds_sum[rr] +=
// the row's dS as rounded for the mma (this lane's columns; the tile sums
// the quad), for the centring of repair_tile.
template <class Elt, int kNT>
__device__ __forceinline__ void ds_operand(uint32_t (&a)[4], const float (&ds)[kNT][4], int t,
                                           float (&ds_sum)[2]) {
  a[0] = Elt::pack(ds[2 * t][0], ds[2 * t][1]);
  a[1] = Elt::pack(ds[2 * t][2], ds[2 * t][3]);
  a[2] = Elt::pack(ds[2 * t + 1][0], ds[2 * t + 1][1]);
  a[3] = Elt::pack(ds[2 * t + 1][2], ds[2 * t + 1][3]);
  if constexpr (Elt::kCenterKeys) {  // a[0], a[2]: row lane / 4; a[1], a[3]: 8 below
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      ds_sum[i & 1] += Elt::to_float(static_cast<uint16_t>(a[i])) +
                       Elt::to_float(static_cast<uint16_t>(a[i] >> 16));
    }
  }
}

// One warp, one key block, keys key0 .. key0 + 8 kNT - 1 of it:
// dq_acc += dS K for the warp's 16 rows (row0..); ds_sum as ds_operand.
template <class Elt, int kWidth, int kNT>
__device__ __forceinline__ void warp_key_block(
    float (&dq_acc)[TileShape<kWidth>::kDTiles][4], float (&ds_sum)[2],
    const uint32_t (&qf)[TileShape<kWidth>::kFrags][4],
    const uint32_t (&dof)[TileShape<kWidth>::kFrags][4], uint32_t q_tile, uint32_t do_tile,
    uint32_t stage, const uint16_t* bias_tile, int kv_tile_bytes, int row0, int key0,
    int key_base, float scale_log2, const WarpRows& wr, const LaneChunks& lc, int lane) {
  using Shape = TileShape<kWidth>;
  constexpr int kRowBytes = kTileRowBytes;  // rows within a column block (tile_offset)
  const uint32_t k_tile = stage;
  const uint32_t v_tile = stage + kv_tile_bytes;

  // S and dP first, then the softmax: its branches (scores_to_probs) would
  // otherwise keep dP's loads and mma from overlapping it, and a narrow tile
  // is a chain of such latencies (one row per head: 9% slower that way, H200).
  float p[kNT][4], ds[kNT][4];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) p[j][e] = ds[j][e] = 0.0f;
  }
  rows_times_keys<Elt, kWidth, kNT>(p, qf, q_tile, row0, k_tile, key0, lc, lane);
  rows_times_keys<Elt, kWidth, kNT>(ds, dof, do_tile, row0, v_tile, key0, lc, lane);
  scores_to_probs<Elt, kNT>(p, bias_tile, row0, key0, key_base, scale_log2, wr, lane);
  probs_to_ds<kNT>(p, ds, wr);

  const uint32_t kt_row = k_tile + (key0 + ldsm_bt_row(lane)) * kRowBytes;
#pragma unroll
  for (int t = 0; t < kNT / 2; ++t) {
    uint32_t a[4];
    ds_operand<Elt, kNT>(a, ds, t, ds_sum);
#pragma unroll
    for (int jd = 0; jd < Shape::kDTiles / 2; ++jd) {
      uint32_t b[4];
      ldsm_x4_trans(b, kt_row + 16 * t * kRowBytes + lc.hi[jd & 3] + step_offset(jd));
      Elt::mma(dq_acc[2 * jd], a, b[0], b[1]);
      Elt::mma(dq_acc[2 * jd + 1], a, b[2], b[3]);
    }
  }
}

// The same for the whole block as one warpgroup on wgmma (sm_90a; Q and dO
// in registers, head_dim width 64 or 128), in two halves: the 64 rows of a
// wide tile (warp w: rows 16 w..) and keys key0 .. key0 + 8 kNT - 1 of the
// key block. K and V are read from shared memory once per warpgroup instead
// of once per warp, which bounded the mma.sync tile at about a third of the
// tensor cores' rate (331 TFLOP/s at
// 4096x4032). Every warp of the block calls them; rows past the tile's end
// are zeros with lse +inf (P = 0).
//
// Descriptors: one add each from the tile's start (gmma_desc_at), except
// for fp16, whose kernel then spilled 172 bytes at head_dim 128 against 24
// (ptxas, nvcc 13.0); it builds each anew (gmma_desc).
template <class Elt>
__device__ __forceinline__ uint64_t tile_desc(uint32_t start16, uint32_t offset,
                                              uint32_t leading) {
  if constexpr (Elt::kCenterKeys) {
    return gmma_desc(start16 * 16 + offset, leading, kGmmaGroupBytes);
  } else {
    return gmma_desc_at(start16, offset, leading, kGmmaGroupBytes);
  }
}

// First half: S = Q K^T and dP = dO V^T on the tensor cores, then dS, packed
// as the A operand of dS K (ds_operand) into `a`. Its first wait also retires
// a dS K still in flight (warpgroup_ds_k of the previous part).
// `while_in_flight()` runs once both products are issued, before the first
// wait: what it waits for overlaps them on the tensor cores.
template <class Elt, int kWidth, int kNT, class WhileInFlight>
__device__ __forceinline__ void warpgroup_scores_to_ds(
    uint32_t (&a)[kNT / 2][4], float (&ds_sum)[2],
    const uint32_t (&qf)[TileShape<kWidth>::kFrags][4],
    const uint32_t (&dof)[TileShape<kWidth>::kFrags][4], uint32_t stage,
    const uint16_t* bias_tile, int kv_tile_bytes, int row0, int key0, int key_base,
    float scale_log2, const WarpRows& wr, int lane, WhileInFlight&& while_in_flight) {
  using Shape = TileShape<kWidth>;
  static_assert(Shape::kQInRegs, "wgmma takes Q and dO from registers");
  const uint32_t k_start16 = (stage + key0 * kTileRowBytes) >> 4;
  const uint32_t v_start16 = (stage + kv_tile_bytes + key0 * kTileRowBytes) >> 4;
  // k-step kk of Q K^T: head_dim 16 kk .. 16 kk + 15, 32 bytes into a row of
  // column block kk / 4.
  auto keys_desc = [&](uint32_t start16, int kk) {
    return tile_desc<Elt>(start16, step_offset(kk) + (kk & 3) * 32, 16);
  };

  float p[kNT][4], ds[kNT][4];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) p[j][e] = ds[j][e] = 0.0f;
  }
  wgmma_fence_operand(p);
  wgmma_fence_operand(ds);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Shape::kKSteps; ++kk) {
    Elt::template wgmma<kNT, 0>(p, qf[kk], keys_desc(k_start16, kk), kk);
  }
  wgmma_commit();
#pragma unroll
  for (int kk = 0; kk < Shape::kKSteps; ++kk) {
    Elt::template wgmma<kNT, 0>(ds, dof[kk], keys_desc(v_start16, kk), kk);
  }
  wgmma_commit();
  while_in_flight();
  wgmma_wait<1>();  // S landed (and a dS K before it); dO V^T may still run
  wgmma_fence_operand(p);
  scores_to_probs<Elt, kNT>(p, bias_tile, row0, key0, key_base, scale_log2, wr, lane);
  wgmma_wait<0>();
  wgmma_fence_operand(ds);
  probs_to_ds<kNT>(p, ds, wr);
#pragma unroll
  for (int t = 0; t < kNT / 2; ++t) ds_operand<Elt, kNT>(a[t], ds, t, ds_sum);
}

// Second half: dq_acc += dS K for the same keys, left in flight: the next
// part's Q K^T and dO V^T queue behind it on the tensor cores, and the next
// warpgroup_scores_to_ds retires it (repair_tile retires the tile's last).
template <class Elt, int kWidth, int kNT>
__device__ __forceinline__ void warpgroup_ds_k(float (&dq_acc)[TileShape<kWidth>::kDTiles][4],
                                               const uint32_t (&a)[kNT / 2][4], uint32_t stage,
                                               int key0) {
  const uint32_t k_start16 = (stage + key0 * kTileRowBytes) >> 4;
  wgmma_fence_operand(dq_acc);
  wgmma_fence();
#pragma unroll
  for (int t = 0; t < kNT / 2; ++t) {  // keys 16 t..: k-step t of dS K
    Elt::template wgmma<TileShape<kWidth>::kDTiles, 1>(
        dq_acc, a[t], tile_desc<Elt>(k_start16, 16 * t * kTileRowBytes, kColumnBlockBytes), 1);
  }
  wgmma_commit();
  wgmma_fence_operand(dq_acc);
}

}  // namespace repair
}  // namespace openwam

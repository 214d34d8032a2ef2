// The warp-level math of the tile phase (repair_dq_tile.cuh): one warp,
// 16 query rows, 8 kNT keys of a key block, on mma.sync m16n8k16 with fp32
// accumulators:
//   S = Q K^T, P = exp2(S scale log2e + bias log2e - lse log2e),
//   dP = dO V^T, dS = P (dP - delta), dQ += dS K.
// Operands come from shared memory through ldmatrix (K and V; Q and dO when
// they do not stay in registers); dS goes from accumulators straight into
// the A operand of dS K.
#pragma once

#include <cstdint>

#include "repair_dq_layout.cuh"
#ifndef OPENWAM_REPAIR_EMULATE  // the CPU emulation of the tests brings its own
#include "repair_dq_ptx.cuh"
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
};

// Everything a warp needs about its two accumulator rows (lane / 4 and 8
// below) while it walks the keys.
struct WarpRows {
  float lse2[2];   // logsumexp * log2(e); +inf for padding rows (P = 0)
  float delta[2];  // dO_i . o_i
  int limit[2];    // keys at or past this are masked (s_kv, or i + 1 causal)
  int row[2];      // the query row, -1 for padding
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
  constexpr int kRowBytes = kWidth * 2;
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

// One warp, one key block, keys key0 .. key0 + 8 kNT - 1 of it:
// dq_acc += dS K for the warp's 16 rows (row0..); with Elt::kCenterKeys
// also ds_sum[rr] += the row's dS as rounded for the mma (this lane's
// columns; the tile sums the quad), for the centring of repair_tile.
template <class Elt, int kWidth, int kNT>
__device__ __forceinline__ void warp_key_block(
    float (&dq_acc)[TileShape<kWidth>::kDTiles][4], float (&ds_sum)[2],
    const uint32_t (&qf)[TileShape<kWidth>::kFrags][4],
    const uint32_t (&dof)[TileShape<kWidth>::kFrags][4], uint32_t q_tile, uint32_t do_tile,
    uint32_t stage, const uint16_t* bias_tile, int kv_tile_bytes, int row0, int key0,
    int key_base, float scale_log2, const WarpRows& wr, const LaneChunks& lc, int lane) {
  using Shape = TileShape<kWidth>;
  constexpr int kRowBytes = kWidth * 2;
  const uint32_t k_tile = stage;
  const uint32_t v_tile = stage + kv_tile_bytes;

  // P = exp2(S scale log2e + bias log2e - lse log2e), 0 where masked.
  float p[kNT][4];
#pragma unroll
  for (int j = 0; j < kNT; ++j) p[j][0] = p[j][1] = p[j][2] = p[j][3] = 0.0f;
  rows_times_keys<Elt, kWidth, kNT>(p, qf, q_tile, row0, k_tile, key0, lc, lane);
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int col = key0 + 8 * j + frag_col(lane, 0);  // within the block
      float bias0 = 0.0f, bias1 = 0.0f;
      if (bias_tile != nullptr) {
        const uint32_t w = *reinterpret_cast<const uint32_t*>(
            bias_tile + (row0 + frag_row(lane, 2 * rr)) * kBiasPitch + col);
        bias0 = Elt::to_float(static_cast<uint16_t>(w)) * kLog2e;
        bias1 = Elt::to_float(static_cast<uint16_t>(w >> 16)) * kLog2e;
      }
      const float x0 = fmaf(p[j][2 * rr], scale_log2, bias0) - wr.lse2[rr];
      const float x1 = fmaf(p[j][2 * rr + 1], scale_log2, bias1) - wr.lse2[rr];
      p[j][2 * rr] = key_base + col < wr.limit[rr] ? fast_exp2(x0) : 0.0f;
      p[j][2 * rr + 1] = key_base + col + 1 < wr.limit[rr] ? fast_exp2(x1) : 0.0f;
    }
  }

  // dP = dO V^T, then dS = P (dP - delta) in place.
  float ds[kNT][4];
#pragma unroll
  for (int j = 0; j < kNT; ++j) ds[j][0] = ds[j][1] = ds[j][2] = ds[j][3] = 0.0f;
  rows_times_keys<Elt, kWidth, kNT>(ds, dof, do_tile, row0, v_tile, key0, lc, lane);
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) ds[j][e] = p[j][e] * (ds[j][e] - wr.delta[e >> 1]);
  }

  // dQ += dS K: dS is already in A-operand order (FlashAttention-2's P V
  // trick): n-tiles 2t and 2t+1 of the accumulator are k-step t.
  const uint32_t kt_row = k_tile + (key0 + ldsm_bt_row(lane)) * kRowBytes;
#pragma unroll
  for (int t = 0; t < kNT / 2; ++t) {
    uint32_t a[4];
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
#pragma unroll
    for (int jd = 0; jd < Shape::kDTiles / 2; ++jd) {
      uint32_t b[4];
      ldsm_x4_trans(b, kt_row + 16 * t * kRowBytes + lc.hi[jd & 3] + step_offset(jd));
      Elt::mma(dq_acc[2 * jd], a, b[0], b[1]);
      Elt::mma(dq_acc[2 * jd + 1], a, b[2], b[3]);
    }
  }
}

}  // namespace repair
}  // namespace openwam

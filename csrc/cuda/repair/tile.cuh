// The recompute of the dQ-row repair: the affected rows, on tensor cores.
//
// With lse and delta_i = dO_i . o_i known, a row's gradient is
//   dQ_i = scale * sum_j P_ij (dO_i . v_j - delta_i) k_j,
//   P_ij = exp(scale q_i . k_j + bias_ij - lse_i),
// the dQ half of a FlashAttention-2 backward with the softmax statistics
// given. A tile is up to 64 listed rows of one head (rows gathered by index,
// so 10% of rows cost about 10% of a full dQ pass, not all of it), walked
// over key blocks of 64 on tensor cores (tile_warp.cuh), K and V
// (and the bias tile) streaming through a 2- or 3-stage cp.async pipeline
// (tile_load.cuh, tile_stages). Each warp owns 16 rows; a tile of
// at most 16 rows ("narrow": one affected row per head) has all 4 warps on
// the same rows, each taking 16 keys of a block; at the end each warp sums
// the 4 partial dQ of a quarter of the columns. A narrow tile moves only its
// 16 rows of Q, dO and bias (tile_rows_loaded). Built for sm_90a, wide tiles
// at head_dim <= 128 run on wgmma instead, the 4 warps as one warpgroup
// (kWgmma, walk_keys_wgmma): every row of 4096x4032 ran at 331 TFLOP/s on
// mma.sync and runs at 512 on wgmma (H200).
//
// Registers: for head_dim <= 128 the 16 rows of Q and dO of a warp stay in
// registers for the whole tile (staged once through the last pipeline stage);
// at 256 they are read from shared memory at every k-step.
//
// Centred keys (fp16, Elt::kCenterKeys): sum_j dS_ij = 0 in exact
// arithmetic, so dQ_i = scale * sum_j dS_ij (k_j - m) for any vector m. The
// rows repaired here have logits far below zero because every key shares a
// large component (a "massive activation"; 30 / sqrt(D) per element in
// openwam_sdpa.adversarial, against a spread of 0.5), and the computed dS do
// not sum to 0: P is recomputed with S ~ -1000 accumulated in fp32, so it is
// not exactly the P behind cuDNN's lse and o; delta comes from the fp16 o;
// dS is rounded to fp16 for the mma. With plain dS K that sum multiplies the
// shared component; with m = the mean of the first key block it multiplies
// only k_j - m. The mma still takes k_j (no extra registers in the key loop):
// the tile subtracts m * sum_j dS_ij (the dS as rounded for the mma) at the
// end. Emulated on such rows (test_repair_accuracy.cpp, head_dim 96): worst
// row error 2.9 -> 0.67 fp16 eps x the row's max |dQ| (0.5 is the rounding
// of dQ itself). bf16 keeps the plain product.
//
// The phases of a tile, in order (repair_tile):
//   1. issue_tile_loads: Q and dO of the rows, the first key blocks (cp.async);
//   2. tile_delta: delta_i = dO_i . o_i while they land;
//   3. load_row_fragments, warp_rows: each warp's rows into registers;
//   4. the key loop, dQ += dS K over the tile's key blocks (tile_walk.cuh):
//      walk_keys_narrow, walk_keys_mma or walk_keys_wgmma;
//   5. subtract_key_mean: the centred keys' correction (fp16);
//   6. write_rows_narrow or write_rows_wide: the dQ rows to global memory.
// The types they share are in tile_types.cuh, the run of tiles a block
// takes in run.cuh.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "layout.cuh"
#include "scan.cuh"
#include "tile_load.cuh"
#include "tile_types.cuh"
#include "tile_walk.cuh"
#include "tile_warp.cuh"
#ifndef OPENWAM_REPAIR_EMULATE  // the CPU emulation of the tests brings its own
#include "ptx.cuh"
#endif

namespace openwam {
namespace repair {

// m of the centred keys: the mean of the first key block's keys (zeros past
// s_kv excluded), one column per thread, from the block's K tile at `k_tile`.
template <class Elt, int kWidth>
__device__ __forceinline__ void mean_of_keys(float* key_mean, const unsigned char* k_tile,
                                             int s_kv) {
  constexpr int kChunks = kWidth / 8;
  const int n = cmin(s_kv, kKeyBlock);
  for (int d = threadIdx.x; d < kWidth; d += kTileThreads) {
    float sum = 0.0f;
    for (int key = 0; key < n; ++key) {
      const uint16_t x = *reinterpret_cast<const uint16_t*>(
          k_tile + tile_offset<kChunks>(key, d / 8) + (d % 8) * 2);
      sum += Elt::to_float(x);
    }
    key_mean[d] = sum / static_cast<float>(n);
  }
}

// a += b, lane by lane: the narrow tile's partial dQ sums (write_rows_narrow).
__device__ __forceinline__ void add4(float4& a, const float4& b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
}

// Phase 1. Q and dO of the listed rows (one group), then the first stages-1
// key blocks (a group each). Every group is committed even when empty, so
// that a count of pending groups always names a block: here "all but the
// newest stages-1" is Q and dO; in the key loop, whose refill is committed
// after its wait, "all but the newest stages-2" is block kb.
template <int kChunks>
__device__ __forceinline__ void issue_tile_loads(const Tile<kChunks>& t) {
  t.loader.rows(t.layout.q_tile(), t.q, t.p.q_st.s, t.hdr.row, t.n_rows, t.p.vec);
  t.loader.rows(t.layout.do_tile(), t.go, t.p.go_st.s, t.hdr.row, t.n_rows, t.p.vec);
  cp_async_commit();
  for (int s = 0; s + 1 < t.layout.stages; ++s) {
    if (t.keys.begin + s < t.keys.end) t.load_key_block(t.keys.begin + s, s);
    cp_async_commit();
  }
}

// Phase 2. delta = dO . o in fp32, kT threads per row, each kChunks / kT
// adjacent chunks (wide tiles sum in the order they always did); the output
// rows go straight to registers while Q and dO land. A narrow tile puts 8
// threads on each of its 16 rows: 2 threads on each of 64 rows left 7 of
// 8 threads idle there and the other two with 4 times the loads (a fifth
// of the instructions of a head with one affected row: Nsight Compute,
// H200). Centred keys: the mean of key block 0 too, once it has landed.
template <class Elt, int kWidth, int kT>
__device__ __forceinline__ void tile_delta(const Tile<TileShape<kWidth>::kChunks>& t) {
  constexpr int kChunks = TileShape<kWidth>::kChunks;
  constexpr int kPer = kChunks / kT;
  static_assert(kChunks % kT == 0 && kTileThreads / kT <= kTileRows, "whole rows");
  const TileParams& p = t.p;
  unsigned char* smem = smem_base();
  const unsigned char* do_tile = smem + t.layout.do_tile();
  const int r = threadIdx.x / kT;
  const int part = threadIdx.x % kT;
  uint4 o[kPer];
  const uint16_t* o_row = r < t.n_rows ? t.o + t.hdr.row[r] * p.o_st.s : nullptr;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = part * kPer + i;
    o[i].x = o[i].y = o[i].z = o[i].w = 0u;
    if (o_row != nullptr && c * 8 < p.head_dim) {
      const uint16_t* src = o_row + c * 8;
      o[i] = p.vec ? *reinterpret_cast<const uint4*>(src) : load8_scalar(src);
    }
  }
  if constexpr (Elt::kCenterKeys) {  // Q, dO and key block 0 (for its mean) landed
    cp_async_wait_all_but(t.layout.stages - 2);
  } else {
    cp_async_wait_all_but(t.layout.stages - 1);  // Q and dO landed
  }
  __syncthreads();
  if constexpr (Elt::kCenterKeys) {  // read after the key loop's barriers
    mean_of_keys<Elt, kWidth>(t.hdr.key_mean, smem + t.layout.stage(0), p.s_kv);
  }
  // Rows past n_rows: their dO rows were loaded as zeros, dot = 0.
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const uint4 g =
        *reinterpret_cast<const uint4*>(do_tile + tile_offset<kChunks>(r, part * kPer + i));
    dot += dot8<Elt>(g, o[i]);
  }
#pragma unroll
  for (int m = 1; m < kT; m <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, m);
  if (part == 0) t.hdr.delta[r] = dot;
}

// Phase 3a. The warp's 16 rows of Q and dO into registers, where they stay
// for the tile (TileShape::kQInRegs; at head_dim 256 the key loop reads them
// from shared memory at every k-step).
template <int kWidth>
__device__ __forceinline__ void load_row_fragments(RowFrags<kWidth>& qf, RowFrags<kWidth>& dof,
                                                   const WarpTile& wt) {
  const int row_off = (wt.row0 + ldsm_a_row(wt.lane)) * kTileRowBytes;
#pragma unroll
  for (int kk = 0; kk < TileShape<kWidth>::kKSteps; ++kk) {
    const int off = row_off + wt.lc.hi[kk & 3] + step_offset(kk);
    ldsm_x4(qf[kk], wt.q_tile_s + off);
    ldsm_x4(dof[kk], wt.do_tile_s + off);
  }
}

// Phase 3b. The two rows each lane holds: index, statistics and the keys
// each sees, and the keys every row of the tile sees (the key loop's mask).
template <int kChunks>
__device__ __forceinline__ WarpRows warp_rows(const Tile<kChunks>& t, const WarpTile& wt) {
  const TileParams& p = t.p;
  WarpRows wr;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = wt.row0 + frag_row(wt.lane, 2 * rr);
    wr.row[rr] = t.hdr.row[r];
    wr.lse2[rr] = t.hdr.lse2[r];
    wr.delta[rr] = t.hdr.delta[r];
    wr.limit[rr] = wr.row[rr] < 0 ? 0 : p.causal ? cmin(p.s_kv, wr.row[rr] + 1) : p.s_kv;
  }
  wr.full = p.causal ? cmin(p.s_kv, t.hdr.row[0] + 1) : p.s_kv;  // rows ascending, row[0] >= 0
  return wr;
}

// Phase 5 (centred keys): acc -= m * sum_j dS. Per warp: the narrow sum is
// linear.
template <int kWidth>
__device__ __forceinline__ void subtract_key_mean(DqAcc<kWidth>& acc, float (&ds_sum)[2],
                                                  const float* key_mean, int lane) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    ds_sum[rr] += __shfl_xor_sync(0xffffffffu, ds_sum[rr], 1);
    ds_sum[rr] += __shfl_xor_sync(0xffffffffu, ds_sum[rr], 2);
  }
#pragma unroll
  for (int j = 0; j < TileShape<kWidth>::kDTiles; ++j) {
    const int col = 8 * j + frag_col(lane, 0);
    const float m0 = key_mean[col], m1 = key_mean[col + 1];
    acc[j][0] -= m0 * ds_sum[0];
    acc[j][1] -= m1 * ds_sum[0];
    acc[j][2] -= m0 * ds_sum[1];
    acc[j][3] -= m1 * ds_sum[1];
  }
}

// dQ columns col, col + 1 of row `row`, scaled. cuDNN's backward writes dQ
// ahead of the repair: the caller waited for it (wait_for_grid_ahead).
template <class Elt, int kChunks>
__device__ __forceinline__ void store_dq_pair(const Tile<kChunks>& t, int row, int col, float v0,
                                              float v1) {
  const TileParams& p = t.p;
  uint16_t* dst = t.dq + row * p.dq_st.s;
  if (p.dq_pair) {
    *reinterpret_cast<uint32_t*>(dst + col) = Elt::pack(v0 * p.scale, v1 * p.scale);
  } else {
    dst[col] = Elt::from_float(v0 * p.scale);
    dst[col + 1] = Elt::from_float(v1 * p.scale);
  }
}

// Phase 6, narrow tile. The 4 warps' partial dQ (key quarters) through
// shared memory; each warp then sums and writes a quarter of the columns.
// Warp 0 alone summing all of them kept the other three at the closing
// barrier (the largest stall with one affected row per head: Nsight Compute,
// H200).
//
// A split tile (kCluster, split_rank >= 0) adds the other block's sums: the
// cluster's second block writes its quarter sums into the first block's
// stage 1 (free once that block's key loop is done: the first cluster
// barrier), the first adds them after the second barrier and writes the
// rows. Each block arrives at the first barrier as soon as its own stages
// are free.
template <class Elt, int kWidth, bool kCluster>
__device__ __forceinline__ void write_rows_narrow(const Tile<TileShape<kWidth>::kChunks>& t,
                                                  const WarpTile& wt, const WarpRows& wr,
                                                  const DqAcc<kWidth>& acc, int split_rank) {
  using Shape = TileShape<kWidth>;
  constexpr int kPerWarp = Shape::kDTiles / 4;
  static_assert(Shape::kDTiles % 4 == 0, "a quarter of the columns per warp");
  static_assert(4 * Shape::kDTiles * 32 * 16 <= 2 * kKeyBlock * kWidth * 2,
                "the partials fit in stage 0's K and V tiles");
  unsigned char* smem = smem_base();
  const int warp = wt.warp, lane = wt.lane;
  const bool split = kCluster && split_rank >= 0;
  if (split) cluster_arrive();
  float4* partial = reinterpret_cast<float4*>(smem + t.layout.stage(0));
#pragma unroll
  for (int j = 0; j < Shape::kDTiles; ++j) {
    float4 v;
    v.x = acc[j][0];
    v.y = acc[j][1];
    v.z = acc[j][2];
    v.w = acc[j][3];
    partial[(warp * Shape::kDTiles + j) * 32 + lane] = v;
  }
  __syncthreads();
  float4 sum[kPerWarp];
#pragma unroll
  for (int jj = 0; jj < kPerWarp; ++jj) {
    const int j = warp * kPerWarp + jj;
    sum[jj] = partial[j * 32 + lane];
#pragma unroll
    for (int w = 1; w < 4; ++w) {
      const float4 v = partial[(w * Shape::kDTiles + j) * 32 + lane];
      add4(sum[jj], v);
    }
  }
  if (split) {
    // [kDTiles][32] float4: a quarter of the columns per warp, as `sum`.
    float4* shared_sums = reinterpret_cast<float4*>(smem + t.layout.stage(1));
    cluster_wait();
    if (split_rank != 0) {
      float4* first = cluster_peer(shared_sums, 0);
#pragma unroll
      for (int jj = 0; jj < kPerWarp; ++jj) first[(warp * kPerWarp + jj) * 32 + lane] = sum[jj];
    }
    cluster_arrive();
    cluster_wait();
    if (split_rank == 0) {
#pragma unroll
      for (int jj = 0; jj < kPerWarp; ++jj) {
        const float4 v = shared_sums[(warp * kPerWarp + jj) * 32 + lane];
        add4(sum[jj], v);
      }
    }
  }
  if (split_rank <= 0) {
#pragma unroll
    for (int jj = 0; jj < kPerWarp; ++jj) {
      const int j = warp * kPerWarp + jj;
      if (8 * j >= t.p.head_dim) break;
      const int col = 8 * j + frag_col(lane, 0);
      if (wr.row[0] >= 0) store_dq_pair<Elt>(t, wr.row[0], col, sum[jj].x, sum[jj].y);
      if (wr.row[1] >= 0) store_dq_pair<Elt>(t, wr.row[1], col, sum[jj].z, sum[jj].w);
    }
  }
}

// Phase 6, wide tile: each warp writes its own rows.
template <class Elt, int kWidth>
__device__ __forceinline__ void write_rows_wide(const Tile<TileShape<kWidth>::kChunks>& t,
                                                const WarpTile& wt, const WarpRows& wr,
                                                const DqAcc<kWidth>& acc) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    if (wr.row[rr] < 0) continue;
#pragma unroll
    for (int j = 0; j < TileShape<kWidth>::kDTiles; ++j) {
      if (8 * j >= t.p.head_dim) break;
      store_dq_pair<Elt>(t, wr.row[rr], 8 * j + frag_col(wt.lane, 0), acc[j][2 * rr],
                         acc[j][2 * rr + 1]);
    }
  }
}

// Recompute and write the dQ rows hdr.row[0 .. n_rows - 1] (ascending) of
// the head at `pos`. All threads of the block call it. kWgmma: wide tiles on
// wgmma (walk_keys_wgmma) instead of mma.sync. kCluster: the kernel runs in
// clusters of kClusterBlocks (see layout.cuh), and split_rank >= 0 marks a
// narrow tile split across the cluster (split_tile), this block's rank in
// it: the block walks its share of the key blocks (split_keys), and the
// cluster's first block writes the rows. The epilogue reads it again from
// hdr.run (held in a register through the key loop, it made the wide tiles'
// refill spill at head_dim 128).
template <class Elt, int kWidth, bool kWgmma, bool kCluster>
__device__ __forceinline__ void repair_tile(const TileParams& p, const TileSmem& layout,
                                            const TileHeader& hdr, HeadPos pos, int n_rows,
                                            int split_rank) {
  using Shape = TileShape<kWidth>;
  // Rows are listed in order: the last one sees the most keys under is_causal.
  const int n_blocks = tile_key_blocks(p, hdr.row[n_rows - 1]);
  const KeyRange keys = kCluster && split_rank >= 0
                            ? split_keys(n_blocks, split_rank, kClusterBlocks)
                            : KeyRange{0, n_blocks};
  const Tile<Shape::kChunks> t(p, layout, hdr, pos, n_rows, keys);

  issue_tile_loads(t);
  const bool narrow = n_rows <= kNarrowRows;
  if (narrow) {
    tile_delta<Elt, kWidth, kTileThreads / kNarrowRows>(t);
  } else {
    tile_delta<Elt, kWidth, kTileThreads / kTileRows>(t);
  }

  const WarpTile wt(layout, narrow);
  // A warp past a wide tile's rows idles on mma.sync; a wgmma needs the
  // whole warpgroup (its rows are zeros, P = 0).
  const bool active = narrow || kWgmma || wt.row0 < n_rows;
  RowFrags<kWidth> qf;
  RowFrags<kWidth> dof;
  if constexpr (Shape::kQInRegs) {
    if (active) load_row_fragments<kWidth>(qf, dof, wt);
  }
  __syncthreads();  // delta written; the stage where Q, dO were staged is free
  const WarpRows wr = warp_rows(t, wt);

  DqAcc<kWidth> acc;
#pragma unroll
  for (int j = 0; j < Shape::kDTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  // The zeros materialized here: without this, nvcc 13.0 staged them in
  // uniform registers and copied each at the key loop (about 120
  // instructions a tile at head_dim 128).
  wgmma_fence_operand(acc);
  float ds_sum[2] = {0.0f, 0.0f};  // Elt::kCenterKeys: sum_j dS of the two rows

  if (narrow) {
    walk_keys_narrow<Elt, kWidth, kWgmma>(t, wt, wr, acc, ds_sum, qf, dof);
  } else if constexpr (kWgmma) {
    walk_keys_wgmma<Elt, kWidth>(t, wt, wr, acc, ds_sum, qf, dof);
  } else {
    walk_keys_mma<Elt, kWidth>(t, wt, wr, active, acc, ds_sum, qf, dof);
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages (the narrow sum reuses stage 0)

  if constexpr (Elt::kCenterKeys) subtract_key_mean<kWidth>(acc, ds_sum, hdr.key_mean, wt.lane);

  wait_for_grid_ahead();  // dQ: written by cuDNN's backward ahead of the repair
  if (narrow) {
    if constexpr (kCluster) split_rank = hdr.run->split_rank;  // written before the tile's barriers
    write_rows_narrow<Elt, kWidth, kCluster>(t, wt, wr, acc, split_rank);
  } else if (active) {
    write_rows_wide<Elt, kWidth>(t, wt, wr, acc);
  }
  __syncthreads();  // the header and the stages are reused by the next tile
}

}  // namespace repair
}  // namespace openwam

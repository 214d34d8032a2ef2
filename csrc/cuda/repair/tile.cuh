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
// (kWgmma, warpgroup_scores_to_ds / warpgroup_ds_k): every row 4096x4032
// went from 331 to 407-430 TFLOP/s (H200),
// then to 512 with dS K in flight across the key loop's barrier and the
// softmax's tests taken once per call, before the barrier that now
// guards the wgmma refill).
//
// Work: the grid is persistent (see tile_grid_size). The (head, tile) items,
// head-major, are cut into one contiguous run per block, or per cluster of
// two blocks on sm_90 (kCluster: launch_cluster, layout.cuh). A
// block first probes the logsumexp of its run's heads at once (the first
// kProbeHeads of them; probe_heads); for each head with a row to act on it
// counts the head's
// affected rows (scan.cuh) and recomputes those of its tiles that
// have rows, gathering each tile's rows into shared memory first. In a
// cluster both blocks count every head of the run and take its tiles in
// turn, except a long narrow tile, which they split by keys and sum through
// distributed shared memory (split_tile). Otherwise blocks never wait for
// each other. On ordinary data every tile is empty and the probe is a
// block's whole work.
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
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "layout.cuh"
#include "scan.cuh"
#include "tile_load.cuh"
#include "tile_warp.cuh"
#ifndef OPENWAM_REPAIR_EMULATE  // the CPU emulation of the tests brings its own
#include "ptx.cuh"
#endif

// For the CPU emulation tests: they record each tile of work a block recomputes.
#ifndef OPENWAM_REPAIR_TRACE_TILE
#define OPENWAM_REPAIR_TRACE_TILE(head, work, n_rows, parts) ((void)0)
#endif

namespace openwam {
namespace repair {

struct RowStrides {
  int64_t b, h, s;  // the last dimension is contiguous
};

struct TileParams {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const uint16_t* o;
  const uint16_t* go;
  const uint16_t* bias;  // nullptr: no bias
  uint16_t* dq;
  RowStrides q_st, k_st, v_st, o_st, go_st, dq_st;
  int64_t bias_b, bias_h, bias_s, bias_e;
  int64_t heads, kv_group, s_q;
  int s_kv;
  int head_dim;
  int64_t tiles_per_head, n_items;
  int stages;        // pipeline depth, 2 or 3 (tile_stages)
  float scale;       // softmax scale
  float scale_log2;  // scale * log2(e)
  bool causal;       // top-left: row i sees keys 0..i
  bool vec;          // q, k, v, out, grad_out rows 16-byte aligned: cp.async
  bool bias_vec;     // bias rows 16-byte aligned, keys contiguous: cp.async
  bool dq_pair;      // dQ element pairs 4-byte aligned: 32-bit stores
};

// Where a block is in its run of items, kept in shared memory across
// repair_tile: held in registers through it, the run's state spilled
// (repair_tile takes all 255 at head_dim 128).
struct RunState {
  int64_t end, head;
  RowCursor cursor;
  int pos_b, pos_h, work, work_end, end_tile, count, turn;
  int split_rank;  // the current tile's (repair_tile), read where it is used
};

// The shared-memory header: the current tile's rows, the scan's warp sums,
// the tile's key mean and the run's state (TileSmem::kHeaderBytes).
struct TileHeader {
  int* row;         // [kTileRows]: query row, -1 past the tile's rows
  float* lse2;      // [kTileRows]: logsumexp * log2(e), +inf past the rows
  float* delta;     // [kTileRows]
  int* warp_sums;   // [kTileThreads / 32]
  float* key_mean;  // [kMaxWidth]: m of the centred keys (fp16 only)
  uint64_t* probe_words;  // [kTileThreads / 32]: probe_heads's OR
  volatile RunState* run;

  __device__ __forceinline__ explicit TileHeader(unsigned char* smem)
      : row(reinterpret_cast<int*>(smem)),
        lse2(reinterpret_cast<float*>(row + kTileRows)),
        delta(lse2 + kTileRows),
        warp_sums(reinterpret_cast<int*>(delta + kTileRows)),
        key_mean(reinterpret_cast<float*>(warp_sums + kTileThreads / 32)),
        probe_words(reinterpret_cast<uint64_t*>(key_mean + kMaxWidth)),
        run(reinterpret_cast<RunState*>(probe_words + kTileThreads / 32)) {}
};
constexpr int kHeaderWordBytes = (3 * kTileRows + kTileThreads / 32 + kMaxWidth) * 4;
static_assert(kHeaderWordBytes % 8 == 0, "probe_words misaligned");
static_assert(kHeaderWordBytes + kTileThreads / 32 * 8 + sizeof(RunState) <=
                  TileSmem::kHeaderBytes,
              "the header outgrew its bytes");
static_assert((kHeaderWordBytes + kTileThreads / 32 * 8) % alignof(RunState) == 0,
              "RunState misaligned");

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

// a += b, lane by lane: the narrow tile's partial dQ sums (repair_tile).
__device__ __forceinline__ void add4(float4& a, const float4& b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
}

// Key blocks a tile whose last (largest) row is `last_row` walks.
__device__ __forceinline__ int tile_key_blocks(const TileParams& p, int last_row) {
  const int kv_end = p.causal ? cmin(p.s_kv, last_row + 1) : p.s_kv;
  return (kv_end + kKeyBlock - 1) / kKeyBlock;
}

// Recompute and write the dQ rows hdr.row[0 .. n_rows - 1] (ascending) of
// the head at `pos`. All threads of the block call it. kWgmma: wide tiles on
// wgmma (warpgroup_scores_to_ds, warpgroup_ds_k) instead of mma.sync.
// kCluster: the kernel runs in clusters of kClusterBlocks (see
// layout.cuh), and split_rank >= 0 marks a narrow tile split
// across the cluster (split_tile), this block's rank in it: the block walks
// its share of the key blocks (split_keys), and the cluster's first block
// writes the rows. The epilogue reads it again from hdr.run (held in a
// register through the key loop, it made the wide tiles' refill spill at
// head_dim 128).
template <class Elt, int kWidth, bool kWgmma, bool kCluster>
__device__ __forceinline__ void repair_tile(const TileParams& p, const TileSmem& layout,
                                            const TileHeader& hdr, HeadPos pos, int n_rows,
                                            int split_rank) {
  using Shape = TileShape<kWidth>;
  constexpr int kChunks = Shape::kChunks;
  unsigned char* smem = smem_base();
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int b = pos.b, h = pos.h;
  const int hk = h / static_cast<int>(p.kv_group);
  const bool has_bias = p.bias != nullptr;

  // Rows are listed in order: the last one sees the most keys under is_causal.
  const int n_blocks = tile_key_blocks(p, hdr.row[n_rows - 1]);
  const KeyRange keys = kCluster && split_rank >= 0
                            ? split_keys(n_blocks, split_rank, kClusterBlocks)
                            : KeyRange{0, n_blocks};

  const uint16_t* q_head = p.q + b * p.q_st.b + h * p.q_st.h;
  const uint16_t* go_head = p.go + b * p.go_st.b + h * p.go_st.h;
  const uint16_t* o_head = p.o + b * p.o_st.b + h * p.o_st.h;
  const uint16_t* k_head = p.k + b * p.k_st.b + hk * p.k_st.h;
  const uint16_t* v_head = p.v + b * p.v_st.b + hk * p.v_st.h;
  const uint16_t* bias_head = has_bias ? p.bias + b * p.bias_b + h * p.bias_h : nullptr;
  uint16_t* dq_head = p.dq + b * p.dq_st.b + h * p.dq_st.h;
  const unsigned char* do_tile = smem + layout.do_tile();

  const TileLoader<kChunks> loader(p.head_dim);
  auto load_key_block = [&](int kb, int stage_index) {
    const int stage = layout.stage(stage_index);
    loader.keys(stage, k_head, p.k_st.s, kb * kKeyBlock, p.s_kv, p.vec);
    loader.keys(stage + layout.kv_tile_bytes(), v_head, p.v_st.s, kb * kKeyBlock, p.s_kv, p.vec);
    if (has_bias) {
      load_bias_tile(stage + 2 * layout.kv_tile_bytes(), bias_head, p.bias_s, p.bias_e, p.s_kv,
                     hdr.row, n_rows, kb, p.bias_vec);
    }
  };

  // Q and dO of the listed rows (one group), then the first stages-1 key
  // blocks (a group each). Every group is committed even when empty, so that a
  // count of pending groups always names a block: here "all but the newest
  // stages-1" is Q and dO; in the key loop, whose refill is committed after
  // its wait, "all but the newest stages-2" is block kb.
  loader.rows(layout.q_tile(), q_head, p.q_st.s, hdr.row, n_rows, p.vec);
  loader.rows(layout.do_tile(), go_head, p.go_st.s, hdr.row, n_rows, p.vec);
  cp_async_commit();
  for (int s = 0; s + 1 < layout.stages; ++s) {
    if (keys.begin + s < keys.end) load_key_block(keys.begin + s, s);
    cp_async_commit();
  }
  // Waits until at most the `newest` (0..2) most recent groups are in flight
  // (cp.async.wait_group takes a constant; the count follows the stages).
  auto wait_all_but = [](int newest) {
    if (newest == 1) {  // first: the key loop's count with 3 stages
      cp_async_wait<1>();
    } else if (newest == 0) {
      cp_async_wait<0>();
    } else {
      cp_async_wait<2>();
    }
  };

  // delta = dO . o in fp32, kT threads per row, each kChunks / kT adjacent
  // chunks (wide tiles sum in the order they always did); the output rows
  // go straight to registers while Q and dO land. A narrow tile puts 8
  // threads on each of its 16 rows: 2 threads on each of 64 rows left 7 of
  // 8 threads idle there and the other two with 4 times the loads (a fifth
  // of the instructions of a head with one affected row: Nsight Compute,
  // H200).
  auto delta_rows = [&](auto threads_per_row) {
    constexpr int kT = decltype(threads_per_row)::value;
    constexpr int kPer = kChunks / kT;
    static_assert(kChunks % kT == 0 && kTileThreads / kT <= kTileRows, "whole rows");
    const int r = tid / kT;
    const int part = tid % kT;
    uint4 o[kPer];
    const uint16_t* o_row = r < n_rows ? o_head + hdr.row[r] * p.o_st.s : nullptr;
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
      wait_all_but(layout.stages - 2);
    } else {
      wait_all_but(layout.stages - 1);  // Q and dO landed
    }
    __syncthreads();
    if constexpr (Elt::kCenterKeys) {  // read after the key loop's barriers
      mean_of_keys<Elt, kWidth>(hdr.key_mean, smem + layout.stage(0), p.s_kv);
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
    if (part == 0) hdr.delta[r] = dot;
  };
  const bool narrow = n_rows <= kNarrowRows;
  if (narrow) {
    delta_rows(std::integral_constant<int, kTileThreads / kNarrowRows>{});
  } else {
    delta_rows(std::integral_constant<int, kTileThreads / kTileRows>{});
  }

  const int row0 = narrow ? 0 : warp * 16;
  // A warp past a wide tile's rows idles on mma.sync; a wgmma needs the
  // whole warpgroup (its rows are zeros, P = 0).
  const bool active = narrow || kWgmma || row0 < n_rows;

  const LaneChunks lc(lane);
  const uint32_t smem_s = smem_u32(smem);
  const uint32_t q_tile_s = smem_s + layout.q_tile();
  const uint32_t do_tile_s = smem_s + layout.do_tile();
  uint32_t qf[Shape::kFrags][4];
  uint32_t dof[Shape::kFrags][4];
  if constexpr (Shape::kQInRegs) {
    if (active) {
      const int row_off = (row0 + ldsm_a_row(lane)) * kTileRowBytes;
#pragma unroll
      for (int kk = 0; kk < Shape::kKSteps; ++kk) {
        const int off = row_off + lc.hi[kk & 3] + step_offset(kk);
        ldsm_x4(qf[kk], q_tile_s + off);
        ldsm_x4(dof[kk], do_tile_s + off);
      }
    }
  }
  __syncthreads();  // delta written; the stage where Q, dO were staged is free

  WarpRows wr;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = row0 + frag_row(lane, 2 * rr);
    wr.row[rr] = hdr.row[r];
    wr.lse2[rr] = hdr.lse2[r];
    wr.delta[rr] = hdr.delta[r];
    wr.limit[rr] = wr.row[rr] < 0 ? 0 : p.causal ? cmin(p.s_kv, wr.row[rr] + 1) : p.s_kv;
  }
  wr.full = p.causal ? cmin(p.s_kv, hdr.row[0] + 1) : p.s_kv;  // rows ascending, row[0] >= 0

  float acc[Shape::kDTiles][4];
#pragma unroll
  for (int j = 0; j < Shape::kDTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  // The zeros materialized here: without this, nvcc 13.0 staged them in
  // uniform registers and copied each at the key loop (about 120
  // instructions a tile at head_dim 128).
  wgmma_fence_operand(acc);
  float ds_sum[2] = {0.0f, 0.0f};  // Elt::kCenterKeys: sum_j dS of the two rows

  // The key loop: one barrier per key block (the wgmma path adds one of
  // its own: see there). Past it every warp has
  // finished its reads of block kb - 1 (on wgmma all but the last dS K,
  // still in flight: see there), so that block's stage takes block
  // kb + stages - 1 (the `refill` each path calls); blocks kb + 1 ..
  // kb + stages - 2 may still be in flight when block kb is needed.
  // `before_barrier(kb)` runs ahead of the waits.
  auto key_loop = [&](auto&& before_barrier, auto&& compute) {
    int use = 0;                   // the stage of block kb
    int fill = layout.stages - 1;  // the stage of block kb - 1, refilled with kb + stages - 1
    for (int kb = keys.begin; kb < keys.end; ++kb) {
      before_barrier(kb);
      wait_all_but(layout.stages - 2);  // block kb landed
      if constexpr (kWgmma) fence_proxy_async();  // this thread's cp.async data, for wgmma
      __syncthreads();
      auto refill = [&]() {  // a group every iteration, even empty (wait accounting)
        if (kb + layout.stages - 1 < keys.end) load_key_block(kb + layout.stages - 1, fill);
        cp_async_commit();
      };
      const uint16_t* bias_tile =
          has_bias ? reinterpret_cast<const uint16_t*>(smem + layout.stage(use) +
                                                       2 * layout.kv_tile_bytes())
                   : nullptr;
      compute(smem_s + layout.stage(use), bias_tile, kb * kKeyBlock, refill);
      use = use + 1 == layout.stages ? 0 : use + 1;
      fill = fill + 1 == layout.stages ? 0 : fill + 1;
    }
  };
  auto nothing = [](int) {};
  if (narrow) {
    key_loop(nothing, [&](uint32_t stage, const uint16_t* bias_tile, int key_base, auto&& refill) {
      refill();
      warp_key_block<Elt, kWidth, 2>(acc, ds_sum, qf, dof, q_tile_s, do_tile_s, stage, bias_tile,
                                     layout.kv_tile_bytes(), 0, warp * 16, key_base,
                                     p.scale_log2, wr, lc, lane);
    });
  } else if constexpr (kWgmma) {
    // Two parts of 32 keys per block (A, B). Each part's dS K is left in
    // flight and retired by the next part's first wait; part B's is issued
    // at the top of the next iteration, ahead of the barrier (it overlaps
    // the loop's waits), so that no wgmma is in flight across the loop's
    // back edge (there ptxas serializes every wgmma: C7515, nvcc 13.0). The
    // refill overwrites the stage that block kb - 1's last dS K reads: part
    // A's first wait retires it, but only for the waiting warp (a wgmma is
    // `.sync.aligned` per warp; each warp's rows finish on their own), so a
    // barrier past part A lets no warp refill before every warp's wait. At
    // head_dim 128 it sits after part B's products are issued: part A's dS K
    // and part B's Q K^T and dO V^T keep the tensor cores busy while warps
    // wait there (between the parts it cost about 3% of the kernel at
    // 4096x4032 every row: d404b44 without it, 42aa82d with it, H200 runs
    // H2 and I2 on two machines). Only there, in bf16: at 64, whose kernel
    // is capped at 168 registers, and in fp16, whose descriptors take more,
    // the refill's addresses beside part B's products in flight spill
    // (inside the loop at 64; nvcc 13.0), and the barrier stays between the
    // parts.
    constexpr int kNT = Shape::kWgmmaNT;
    static_assert(kKeyBlock == 16 * kNT, "two parts per key block");
    constexpr bool kLateRefill = kWidth == 128 && !Elt::kCenterKeys;
    uint32_t ds_b[kNT / 2][4];  // part B's dS, for its dS K
    uint32_t stage_b = 0;       // and its stage
    key_loop(
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
    if (keys.end > keys.begin) warpgroup_ds_k<Elt, kWidth, kNT>(acc, ds_b, stage_b, 8 * kNT);
    wgmma_wait<0>();
    wgmma_fence_operand(acc);
  } else {
    key_loop(nothing, [&](uint32_t stage, const uint16_t* bias_tile, int key_base, auto&& refill) {
      refill();
      if (active) {
#pragma unroll
        for (int part = 0; part < kKeyBlock / (8 * Shape::kWideNT); ++part) {
          warp_key_block<Elt, kWidth, Shape::kWideNT>(
              acc, ds_sum, qf, dof, q_tile_s, do_tile_s, stage, bias_tile, layout.kv_tile_bytes(),
              row0, part * 8 * Shape::kWideNT, key_base, p.scale_log2, wr, lc, lane);
        }
      }
    });
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages (the narrow sum reuses stage 0)

  if constexpr (Elt::kCenterKeys) {  // acc -= m * sum_j dS (per warp: the narrow sum is linear)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      ds_sum[rr] += __shfl_xor_sync(0xffffffffu, ds_sum[rr], 1);
      ds_sum[rr] += __shfl_xor_sync(0xffffffffu, ds_sum[rr], 2);
    }
#pragma unroll
    for (int j = 0; j < Shape::kDTiles; ++j) {
      const int col = 8 * j + frag_col(lane, 0);
      const float m0 = hdr.key_mean[col], m1 = hdr.key_mean[col + 1];
      acc[j][0] -= m0 * ds_sum[0];
      acc[j][1] -= m1 * ds_sum[0];
      acc[j][2] -= m0 * ds_sum[1];
      acc[j][3] -= m1 * ds_sum[1];
    }
  }

  // dQ columns col, col + 1 of row `row`, written by cuDNN's backward
  // ahead of the repair: this thread waits for it first.
  wait_for_grid_ahead();
  auto store = [&](int row, int col, float v0, float v1) {
    uint16_t* dst = dq_head + row * p.dq_st.s;
    if (p.dq_pair) {
      *reinterpret_cast<uint32_t*>(dst + col) = Elt::pack(v0 * p.scale, v1 * p.scale);
    } else {
      dst[col] = Elt::from_float(v0 * p.scale);
      dst[col + 1] = Elt::from_float(v1 * p.scale);
    }
  };

  if (narrow) {
    // The 4 warps' partial dQ (key quarters) through shared memory; each
    // warp then sums and writes a quarter of the columns. Warp 0 alone
    // summing all of them kept the other three at the closing barrier
    // (the largest stall with one affected row per head: Nsight Compute,
    // H200).
    //
    // A split tile adds the other block's sums: the cluster's second block
    // writes its quarter sums into the first block's stage 1 (free once
    // that block's key loop is done: the first cluster barrier), the first
    // adds them after the second barrier and writes the rows. Each block
    // arrives at the first barrier as soon as its own stages are free.
    constexpr int kPerWarp = Shape::kDTiles / 4;
    static_assert(Shape::kDTiles % 4 == 0, "a quarter of the columns per warp");
    static_assert(4 * Shape::kDTiles * 32 * 16 <= 2 * kKeyBlock * kWidth * 2,
                  "the partials fit in stage 0's K and V tiles");
    if constexpr (kCluster) split_rank = hdr.run->split_rank;  // written before the tile's barriers
    const bool split = kCluster && split_rank >= 0;
    if (split) cluster_arrive();
    float4* partial = reinterpret_cast<float4*>(smem + layout.stage(0));
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
      float4* shared_sums = reinterpret_cast<float4*>(smem + layout.stage(1));
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
        if (8 * j >= p.head_dim) break;
        const int col = 8 * j + frag_col(lane, 0);
        if (wr.row[0] >= 0) store(wr.row[0], col, sum[jj].x, sum[jj].y);
        if (wr.row[1] >= 0) store(wr.row[1], col, sum[jj].z, sum[jj].w);
      }
    }
  } else if (active) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      if (wr.row[rr] < 0) continue;
#pragma unroll
      for (int j = 0; j < Shape::kDTiles; ++j) {
        if (8 * j >= p.head_dim) break;
        store(wr.row[rr], 8 * j + frag_col(lane, 0), acc[j][2 * rr], acc[j][2 * rr + 1]);
      }
    }
  }
  __syncthreads();  // the header and the stages are reused by the next tile
}

// The block's run of (head, tile) items: the whole grid covers every item
// once. All threads of the block call it. kCluster: the grid is clusters of
// kClusterBlocks blocks, each cluster's blocks sharing one run.
template <class Elt, int kWidth, bool kWgmma, bool kCluster>
__device__ __forceinline__ void repair_tiles(const ScanParams& scan, const TileParams& p) {
  unsigned char* smem = smem_base();
  const TileHeader hdr(smem);
  const TileSmem layout{kWidth, p.bias != nullptr, p.stages};
  const int tiles = static_cast<int>(p.tiles_per_head);
  const int heads = static_cast<int>(p.heads);
  // The run belongs to the block's cluster (kClusterBlocks consecutive
  // blocks; without clusters, the block alone), whose blocks walk it
  // together.
  constexpr int kBlocks = kCluster ? kClusterBlocks : 1;
  const int rank = static_cast<int>(blockIdx.x % kBlocks);
  const int64_t units = gridDim.x / kBlocks;
  const int64_t unit = blockIdx.x / kBlocks;
  const int64_t begin = unit * p.n_items / units;
  int64_t end = (unit + 1) * p.n_items / units;
  // Tiles of the run not split across the cluster so far: the cluster's
  // blocks take them in turn.
  int turn = 0;
  // The run's first head; every later one starts at its tile 0.
  int64_t head = item_head(begin, tiles);
  int first_tile = static_cast<int>(item_tile(begin, tiles));
  HeadPos pos = head_pos(head, heads);
  const int64_t first_head = head;
  uint64_t flagged = 0;
  if (begin < end) {
    const int64_t n_heads = item_head(end - 1, tiles) - head + 1;
    prefetch_lse(scan, pos, n_heads);
    flagged = probe_heads(scan, pos, n_heads, hdr.probe_words);
  }
  // Each step goes to the next head's items; every head after the run's
  // first starts at its tile 0.
  int end_tile = 0;
  for (int64_t item = begin; item < end;
       item = head * tiles + end_tile, ++head, first_tile = 0, next_head(pos, heads)) {
    end_tile = static_cast<int>(cmin<int64_t>(tiles, first_tile + (end - item)));
    if (!probed(flagged, head - first_head)) continue;  // nothing to count or recompute
    // The run holding a head's tile 0 recomputes its tile of work 0 (at
    // item 0): the count walk gathers that tile's rows (one walk per head
    // less where one tile holds all of a head's rows, as with one affected
    // row per head). Its first block owns the head's -inf rows and telemetry.
    int count = count_head(scan, pos, first_tile == 0, first_tile == 0 && rank == 0, hdr.row,
                           hdr.lse2, hdr.warp_sums);
    // The head's n_work tiles with rows sit at items 0, stride, 2 stride, ...
    // of the head, spread over its items so that every block's run gets its
    // share of them (at 10% of rows, the rows of 64-row ranks 0..6 of a
    // 4032-key head would otherwise all fall to the one block holding its
    // first items). This run's share: those at its tiles of the head.
    const WorkRange work = work_range(count, tiles, first_tile, end_tile);
    int work_end = work.end;
    RowCursor cursor;
    for (int j = work.begin; j < work_end; ++j) {
      const int lo = j * kTileRows;
      const int n_rows = cmin(kTileRows, count - lo);
      // At most kNarrowRows rows: the head's only tile (j = 0), its rows
      // from count_head, whose last barrier orders them.
      const bool split = kCluster && count <= kNarrowRows &&
                         split_tile(kBlocks, Elt::kCenterKeys, count,
                                    tile_key_blocks(p, hdr.row[count - 1]));
      if (kCluster && !split && turn++ % kBlocks != rank) continue;
      if (threadIdx.x < kTileRows && static_cast<int>(threadIdx.x) >= n_rows) {
        hdr.row[threadIdx.x] = -1;
        hdr.lse2[threadIdx.x] = INFINITY;
      }
      if (j == 0) {
        // The rows came with count_head, whose last barrier orders them, and
        // repair_tile reads the -1 slots only after barriers of its own; this
        // one keeps the gather path's rule (the header complete before
        // repair_tile) for one barrier per head.
        __syncthreads();
      } else {
        gather_rows(scan, pos, cursor, lo, lo + n_rows, hdr.row, hdr.lse2, hdr.warp_sums);
      }
      if (threadIdx.x == 0) {  // read back after repair_tile's closing barrier
        hdr.run->end = end;
        hdr.run->head = head;
        hdr.run->pos_b = pos.b;
        hdr.run->pos_h = pos.h;
        hdr.run->work = j;
        hdr.run->work_end = work_end;
        hdr.run->end_tile = end_tile;
        hdr.run->cursor.row = cursor.row;
        hdr.run->cursor.rank = cursor.rank;
        hdr.run->count = count;
        if constexpr (kCluster) {
          hdr.run->turn = turn;
          hdr.run->split_rank = split ? rank : -1;
        }
      }
      OPENWAM_REPAIR_TRACE_TILE(head, j, n_rows, split ? kBlocks : 1);
      repair_tile<Elt, kWidth, kWgmma, kCluster>(p, layout, hdr, pos, n_rows, split ? rank : -1);
      end = hdr.run->end;
      head = hdr.run->head;
      pos.b = hdr.run->pos_b;
      pos.h = hdr.run->pos_h;
      j = hdr.run->work;
      work_end = hdr.run->work_end;
      end_tile = hdr.run->end_tile;
      cursor.row = hdr.run->cursor.row;
      cursor.rank = hdr.run->cursor.rank;
      count = hdr.run->count;
      if constexpr (kCluster) turn = hdr.run->turn;
    }
  }
}

// Blocks per SM the registers are capped for: 3 at head_dim <= 64 (168
// registers; nvcc 13.0 spills up to 24 bytes there), 2 at 128 (255), 1 at
// 256 (shared memory allows no more).
template <int kWidth>
constexpr int kTileBlocksPerSm = kWidth <= 64 ? 3 : kWidth <= 128 ? 2 : 1;

}  // namespace repair
}  // namespace openwam

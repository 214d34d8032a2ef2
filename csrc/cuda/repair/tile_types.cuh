// The types the repair's tiles share: the launch's parameters (TileParams),
// the shared-memory header the scan fills for each tile (TileHeader), a
// block's place in its run of items, kept across tiles (RunState), one tile
// as its phases see it (Tile), a warp's place in it (WarpTile), and the
// key walk's registers (DqAcc, RowFrags).
#pragma once

#include <cstdint>

#include "layout.cuh"
#include "scan.cuh"
#include "tile_load.cuh"
#include "tile_warp.cuh"
#ifndef OPENWAM_REPAIR_EMULATE  // the CPU emulation of the tests brings its own
#include "ptx.cuh"
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

// Key blocks a tile whose last (largest) row is `last_row` walks.
__device__ __forceinline__ int tile_key_blocks(const TileParams& p, int last_row) {
  const int kv_end = p.causal ? cmin(p.s_kv, last_row + 1) : p.s_kv;
  return (kv_end + kKeyBlock - 1) / kKeyBlock;
}

// One tile as its phases see it: the launch, the shared memory, the tile's
// rows (hdr.row[0 .. n_rows - 1], ascending) of the head at `pos`, that
// head's rows of every operand, and the key blocks this block walks.
template <int kChunks>
struct Tile {
  const TileParams& p;
  const TileSmem& layout;
  const TileHeader& hdr;
  int n_rows;
  KeyRange keys;
  const uint16_t* q;
  const uint16_t* go;
  const uint16_t* o;
  const uint16_t* k;
  const uint16_t* v;
  const uint16_t* bias;  // nullptr: no bias
  uint16_t* dq;
  TileLoader<kChunks> loader;

  __device__ __forceinline__ Tile(const TileParams& p_, const TileSmem& layout_,
                                  const TileHeader& hdr_, HeadPos pos, int n_rows_, KeyRange keys_)
      : p(p_),
        layout(layout_),
        hdr(hdr_),
        n_rows(n_rows_),
        keys(keys_),
        q(p_.q + pos.b * p_.q_st.b + pos.h * p_.q_st.h),
        go(p_.go + pos.b * p_.go_st.b + pos.h * p_.go_st.h),
        o(p_.o + pos.b * p_.o_st.b + pos.h * p_.o_st.h),
        k(p_.k + pos.b * p_.k_st.b + pos.h / static_cast<int>(p_.kv_group) * p_.k_st.h),
        v(p_.v + pos.b * p_.v_st.b + pos.h / static_cast<int>(p_.kv_group) * p_.v_st.h),
        bias(p_.bias != nullptr ? p_.bias + pos.b * p_.bias_b + pos.h * p_.bias_h : nullptr),
        dq(p_.dq + pos.b * p_.dq_st.b + pos.h * p_.dq_st.h),
        loader(p_.head_dim) {}

  // Key block kb's K, V (and bias) tiles into stage `stage_index`.
  __device__ __forceinline__ void load_key_block(int kb, int stage_index) const {
    const int stage = layout.stage(stage_index);
    loader.keys(stage, k, p.k_st.s, kb * kKeyBlock, p.s_kv, p.vec);
    loader.keys(stage + layout.kv_tile_bytes(), v, p.v_st.s, kb * kKeyBlock, p.s_kv, p.vec);
    if (bias != nullptr) {
      load_bias_tile(stage + 2 * layout.kv_tile_bytes(), bias, p.bias_s, p.bias_e, p.s_kv,
                     hdr.row, n_rows, kb, p.bias_vec);
    }
  }
};

// A warp's place in the tile: its first row, its lanes' chunk offsets and
// the tile's shared-memory addresses. A narrow tile (at most kNarrowRows
// rows) has every warp on rows 0..15.
struct WarpTile {
  int lane, warp, row0;
  LaneChunks lc;
  uint32_t smem_s, q_tile_s, do_tile_s;

  __device__ __forceinline__ WarpTile(const TileSmem& layout, bool narrow)
      : lane(threadIdx.x & 31),
        warp(threadIdx.x >> 5),
        row0(narrow ? 0 : (threadIdx.x >> 5) * 16),
        lc(threadIdx.x & 31),
        smem_s(smem_u32(smem_base())),
        q_tile_s(smem_s + layout.q_tile()),
        do_tile_s(smem_s + layout.do_tile()) {}
};

// A warp's registers in the key walks: dQ of its rows (DqAcc; the fragments
// of mma.sync and wgmma share a layout) and its rows of Q and dO (RowFrags,
// where TileShape::kQInRegs).
template <int kWidth>
using DqAcc = float[TileShape<kWidth>::kDTiles][4];
template <int kWidth>
using RowFrags = uint32_t[TileShape<kWidth>::kFrags][4];

}  // namespace repair
}  // namespace openwam

// Moving the tile phase's operands into shared memory (tile.cuh).
//
// Q and dO rows are gathered by index, K and V rows are consecutive keys,
// the bias tile is the listed rows' bias for one key block. Rows 16-byte
// aligned (the usual case) go through cp.async, 16 bytes per instruction;
// other strides (a view whose rows start at odd offsets) take element loads
// and a plain store, which the same barriers make visible.
#pragma once

#include <cstdint>

#include "layout.cuh"
#ifndef OPENWAM_REPAIR_EMULATE  // the CPU emulation of the tests brings its own
#include "ptx.cuh"
#endif

namespace openwam {
namespace repair {

// 8 elements from `src`, one 16-bit load each (no alignment needed).
__device__ __forceinline__ uint4 load8_scalar(const uint16_t* src) {
  uint4 r;
  r.x = src[0] | (static_cast<uint32_t>(src[1]) << 16);
  r.y = src[2] | (static_cast<uint32_t>(src[3]) << 16);
  r.z = src[4] | (static_cast<uint32_t>(src[5]) << 16);
  r.w = src[6] | (static_cast<uint32_t>(src[7]) << 16);
  return r;
}

// Tiles of kRows rows x kChunks 16-byte chunks go to shared memory at byte
// offset `tile`, swizzled (tile_offset); rows past their end and chunks past
// head_dim are zeros. Thread t always moves chunk t % kChunks of rows
// t / kChunks + i * kRowStep: with the chunk fixed, each 16 bytes cost a
// few instructions. `vec` (16-byte aligned rows) takes cp.async; otherwise
// element loads and a plain store (visible after the next barrier, like the
// cp.async data after its wait).
template <int kChunks>
struct TileLoader {
  static constexpr int kRowStep = kTileThreads / kChunks;
  int c;        // this thread's chunk
  int r0;       // its first row
  bool in_row;  // the chunk lies within head_dim

  __device__ __forceinline__ explicit TileLoader(int head_dim)
      : c(threadIdx.x % kChunks), r0(threadIdx.x / kChunks), in_row(c * 8 < head_dim) {}

  // kRows rows; row_src(i) = (source of row r0 + i * kRowStep's chunk, valid).
  // The vec test sits outside the unrolled loops.
  template <int kRows, class RowSrc>
  __device__ __forceinline__ void copy(int tile, RowSrc row_src, const uint16_t* any,
                                       bool vec) const {
    if (vec) {
      const uint32_t base = smem_u32(smem_base()) + tile;
#pragma unroll
      for (int i = 0; i < kRows / kRowStep; ++i) {
        bool ok;
        const uint16_t* src = row_src(i, ok);
        cp_async_16(base + tile_offset<kChunks>(r0 + i * kRowStep, c), ok ? src : any,
                    ok ? 16 : 0);
      }
    } else {
      unsigned char* base = smem_base() + tile;
#pragma unroll
      for (int i = 0; i < kRows / kRowStep; ++i) {
        bool ok;
        const uint16_t* src = row_src(i, ok);
        uint4 w;
        w.x = w.y = w.z = w.w = 0u;
        if (ok) w = load8_scalar(src);
        *reinterpret_cast<uint4*>(base + tile_offset<kChunks>(r0 + i * kRowStep, c)) = w;
      }
    }
  }

  // Keys first_key .. first_key + kKeyBlock - 1 of K or V (zeros past s_kv:
  // those keys are masked, and zeros keep 0 * garbage out of dS K).
  __device__ __forceinline__ void keys(int tile, const uint16_t* head, int64_t stride,
                                       int first_key, int s_kv, bool vec) const {
    const uint16_t* src = head + static_cast<int64_t>(first_key + r0) * stride + c * 8;
    const int64_t step = kRowStep * stride;
    const int left = s_kv - first_key - r0;  // rows r0 + i * kRowStep < left are keys
    if (vec && in_row && kKeyBlock - kRowStep < left) {
      // Every row this thread moves is a key (all but the last key block),
      // and no bound test is left per row: the general path's came to 8
      // instructions per 16 bytes, a fifth of a wgmma key block's (SASS,
      // nvcc 13.0, head_dim 128).
      const uint32_t base = smem_u32(smem_base()) + tile;
#pragma unroll
      for (int i = 0; i < kKeyBlock / kRowStep; ++i) {
        cp_async_16(base + tile_offset<kChunks>(r0 + i * kRowStep, c), src + i * step, 16);
      }
      return;
    }
    copy<kKeyBlock>(
        tile,
        [&](int i, bool& ok) {
          ok = in_row && i * kRowStep < left;
          return src + i * step;
        },
        head, vec);
  }

  // The listed query rows s_row[0 .. n_rows - 1] of Q or dO, zeros up to
  // tile_rows_loaded(n_rows).
  __device__ __forceinline__ void rows(int tile, const uint16_t* head, int64_t stride,
                                       const int* s_row, int n_rows, bool vec) const {
    static_assert(kNarrowRows % kRowStep == 0, "a narrow tile is whole rounds of rows");
    auto row_src = [&](int i, bool& ok) {
      const int r = r0 + i * kRowStep;
      ok = in_row && r < n_rows;
      return head + static_cast<int64_t>(ok ? s_row[r] : 0) * stride + c * 8;
    };
    if (n_rows <= kNarrowRows) {
      copy<kNarrowRows>(tile, row_src, head, vec);
    } else {
      copy<kTileRows>(tile, row_src, head, vec);
    }
  }
};

// load_bias_tile's loop over kRows rows (zeros past n_rows).
template <int kRows>
__device__ __forceinline__ void load_bias_rows(int tile, const uint16_t* head,
                                               int64_t row_stride, int64_t key_stride, int s_kv,
                                               const int* s_row, int n_rows, int kb, bool vec) {
  constexpr int kChunksPerRow = kKeyBlock / 8;
  constexpr int kRowStep = kTileThreads / kChunksPerRow;
  unsigned char* smem = smem_base();
  const uint32_t smem_s = smem_u32(smem);
  const int c = threadIdx.x % kChunksPerRow;
  const int r0 = threadIdx.x / kChunksPerRow;
  const int key0 = kb * kKeyBlock + c * 8;
  const int n_keys = cmax(0, cmin(8, s_kv - key0));  // 8 but in the last block
  static_assert(kRows % kRowStep == 0, "whole rounds of rows");
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const int r = r0 + i * kRowStep;
    const int n = r < n_rows ? n_keys : 0;
    const uint16_t* src = n > 0 ? head + s_row[r] * row_stride + key0 * key_stride : nullptr;
    const int off = tile + (r * kBiasPitch + c * 8) * 2;
    if (vec) {
      cp_async_16(smem_s + off, src != nullptr ? src : head, n * 2);
    } else {
      uint16_t e[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) e[k] = k < n ? src[k * key_stride] : 0;
      uint4 w;
      w.x = e[0] | (static_cast<uint32_t>(e[1]) << 16);
      w.y = e[2] | (static_cast<uint32_t>(e[3]) << 16);
      w.z = e[4] | (static_cast<uint32_t>(e[5]) << 16);
      w.w = e[6] | (static_cast<uint32_t>(e[7]) << 16);
      *reinterpret_cast<uint4*>(smem + off) = w;
    }
  }
}

// The bias of the listed rows s_row[0 .. n_rows - 1] for keys kb*64 ..
// kb*64+63 (zeros up to tile_rows_loaded(n_rows)), rows kBiasPitch elements
// apart (not swizzled: read element-wise, see kBiasPitch). `head` is the bias
// of the (b, h), `row_stride` and `key_stride` its strides; `vec`: rows
// 16-byte aligned, keys contiguous.
__device__ __forceinline__ void load_bias_tile(int tile, const uint16_t* head, int64_t row_stride,
                                               int64_t key_stride, int s_kv, const int* s_row,
                                               int n_rows, int kb, bool vec) {
  if (n_rows <= kNarrowRows) {
    load_bias_rows<kNarrowRows>(tile, head, row_stride, key_stride, s_kv, s_row, n_rows, kb, vec);
  } else {
    load_bias_rows<kTileRows>(tile, head, row_stride, key_stride, s_kv, s_row, n_rows, kb, vec);
  }
}

}  // namespace repair
}  // namespace openwam

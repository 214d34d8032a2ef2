// The block's run of (head, tile) items: which tiles a block recomputes.
//
// The grid is persistent (see tile_grid_size). The (head, tile) items,
// head-major, are cut into one contiguous run per block, or per cluster of
// two blocks on sm_90 (kCluster: launch_cluster, layout.cuh). A block first
// probes the logsumexp of its run's heads at once (the first kProbeHeads of
// them; probe_heads); for each head with a row to act on it counts the
// head's affected rows (scan.cuh) and recomputes those of its tiles that
// have rows (repair_tile, tile.cuh), gathering each tile's rows into shared
// memory first. In a cluster both blocks count every head of the run and
// take its tiles in turn, except a long narrow tile, which they split by
// keys and sum through distributed shared memory (split_tile). Otherwise
// blocks never wait for each other. On ordinary data every tile is empty
// and the probe is a block's whole work.
#pragma once

#include <cmath>
#include <cstdint>

#include "layout.cuh"
#include "scan.cuh"
#include "tile.cuh"
#include "tile_types.cuh"

// For the CPU emulation tests: they record each tile of work a block recomputes.
#ifndef OPENWAM_REPAIR_TRACE_TILE
#define OPENWAM_REPAIR_TRACE_TILE(head, work, n_rows, parts) ((void)0)
#endif

namespace openwam {
namespace repair {

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

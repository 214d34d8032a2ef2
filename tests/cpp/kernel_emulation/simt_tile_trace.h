// The tile trace: OPENWAM_REPAIR_TRACE_TILE, the kernel's hook between
// tiles of work, records each tile in emu::tile_trace and refills the shared
// memory past the header with 0xff, so that any tile (not only a block's
// first) that reads rows it never loaded shows.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "simt_scheduler.h"

namespace emu {

// The tiles of work repair_tiles recomputes, in launch order: a tile repaired
// twice writes the same values, so only this record shows it.
struct TileRecord {
  unsigned block;
  int64_t head, work;
  int n_rows;
  int parts;  // blocks of the cluster sharing the tile's keys (1: not split)
};
inline std::vector<TileRecord> tile_trace;

// Called by every thread of the block, between tiles (no copy in flight).
inline void trace_tile(int64_t head, int64_t work, int n_rows, int parts, size_t header_bytes) {
  block_sync();  // every thread is past the previous tile
  if (cur->tid.x == 0) {
    tile_trace.push_back({blk->bid.x, head, work, n_rows, parts});
    std::fill(blk->smem.begin() + header_bytes, blk->smem.end(), 0xff);
  }
  block_sync();
}

}  // namespace emu

#define OPENWAM_REPAIR_TRACE_TILE(head, work, n_rows, parts) \
  emu::trace_tile((head), (work), (n_rows), (parts), openwam::repair::TileSmem::kHeaderBytes)

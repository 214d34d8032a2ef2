// The pure index math of the dQ-row repair (csrc/cuda/repair/layout.cuh):
// swizzle, ldmatrix offsets, fragments, grid and stages, and every tile of
// work placed in exactly one block, over all small grids. No GPU, no libtorch.

#include "simt_emu.h"  // first: it stands in for the CUDA features

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cinttypes>
#include <numeric>
#include <random>
#include <set>
#include <string>

#include "cuda/repair/layout.cuh"
#include "cuda/repair/scan.cuh"
#include "cuda/repair/tile.cuh"
#include "emu_support.h"
#include "scan_params.h"

using namespace openwam::repair;
using namespace emu_test;

namespace {

// ---------------------------------------------------------------- work placement
// Block b's run of items as repair_tiles walks it: visit(head, work) for each
// head the run reaches, `work` the tiles of work of the head that the block
// recomputes; count_of(head): the head's affected rows.
template <class CountOf, class Visit>
void walk_run(int64_t b, int64_t grid, int64_t n_items, int64_t tiles, CountOf count_of,
              Visit visit) {
  const int64_t end = (b + 1) * n_items / grid;
  for (int64_t item = b * n_items / grid; item < end;) {
    const int64_t head = item_head(item, tiles), first_tile = item_tile(item, tiles);
    const int64_t end_tile = std::min(tiles, first_tile + (end - item));
    visit(head, work_range(count_of(head), tiles, first_tile, end_tile));
    item = head * tiles + end_tile;
  }
}


// ---------------------------------------------------------------- layout
void layout_checks() {
  // The swizzle is a bijection within each row, and a warp's 8 ldmatrix rows
  // (8 consecutive rows, one chunk column) hit 8 different bank groups.
  for (int row = 0; row < 64; ++row) {
    unsigned seen = 0;
    for (int c = 0; c < 8; ++c) seen |= 1u << ((tile_offset<8>(row, c) / 16) % 8);
    EXPECT(seen == 0xffu, "row %d", row);
  }
  for (int c = 0; c < 16; ++c) {
    unsigned seen = 0;
    for (int row = 8; row < 16; ++row) seen |= 1u << ((tile_offset<16>(row, c) / 16) % 8);
    EXPECT(seen == 0xffu, "chunk %d", c);
  }
  // The bias tile: lanes (g, t) read row g, columns 2t, 2t+1: 32 banks.
  unsigned banks = 0;
  for (int lane = 0; lane < 32; ++lane)
    banks |= 1u << (((frag_row(lane, 0) * kBiasPitch + frag_col(lane, 0)) * 2 / 4) % 32);
  EXPECT(banks == 0xffffffffu, "bias tile banks %x", banks);
  // The grid: one block per slot at most, and the runs of items cover every
  // item once, in runs whose lengths differ by at most one.
  EXPECT(tile_grid_size(5, 264) == 5, "small");
  EXPECT(tile_grid_size(6144, 264) == 264, "%" PRId64, tile_grid_size(6144, 264));
  EXPECT(tile_grid_size(0, 264) == 1, "empty");
  for (const int64_t n : {1L, 7L, 4224L, 6144L}) {
    const int64_t g = tile_grid_size(n, 264);
    int64_t covered = 0, shortest = n, longest = 0;
    for (int64_t b = 0; b < g; ++b) {
      const int64_t len = (b + 1) * n / g - b * n / g;
      EXPECT(b * n / g == covered, "run %" PRId64 " starts at %" PRId64, b, b * n / g);
      covered += len;
      shortest = std::min(shortest, len);
      longest = std::max(longest, len);
    }
    EXPECT(covered == n && longest - shortest <= 1, "n %" PRId64, n);
  }
  // Where the work lands: per block, the tiles of work its run holds (the
  // kernel's own placement functions), for the benchmark's shapes and
  // shares on an H200's slots. No block gets more than one tile above the
  // even share; with each head's work at its first items instead, a block
  // got 7 at 4096x4032 and 10% of rows (the even share is 3).
  struct Grid { int64_t heads, s_q, slots; };
  for (const Grid g : {Grid{384, 704, 264}, Grid{768, 360, 264}, Grid{96, 4096, 264},
                       Grid{96, 4096, 396}, Grid{384, 704, 396}}) {
    const int64_t tiles = (g.s_q + kTileRows - 1) / kTileRows, n = g.heads * tiles;
    const int64_t grid = tile_grid_size(n, g.slots);
    for (const int64_t count : {int64_t{1}, g.s_q / 10, g.s_q}) {
      int64_t most = 0, total = 0;
      for (int64_t b = 0; b < grid; ++b) {
        int64_t load = 0;
        walk_run(b, grid, n, tiles, [&](int64_t) { return count; },
                 [&](int64_t, WorkRange work) { load += work.end - work.begin; });
        most = std::max(most, load);
        total += load;
      }
      EXPECT(total == g.heads * work_tiles(count), "every tile of work once: %" PRId64, total);
      EXPECT(most <= (total + grid - 1) / grid + 1, "%" PRId64 " heads x %" PRId64
             " rows, %" PRId64 " affected: a block holds %" PRId64 " of %" PRId64 " tiles",
             g.heads, g.s_q, count, most, total);
    }
  }
  // The split ldmatrix offsets equal the swizzled ones for every row whose
  // last 3 bits are the lane's.
  for (int lane = 0; lane < 32; ++lane)
    for (int bit = 0; bit < 2; ++bit)
      for (int step = 0; step < 16; ++step)
        for (int base = 0; base < 64; base += 8) {
          const int row = base + (lane & 7);
          EXPECT(row * kTileRowBytes + lane_chunk_offset(lane, bit, step % 4) + step_offset(step) ==
                    tile_offset<32>(row, 2 * step + bit),
                "lane %d bit %d step %d", lane, bit, step);
        }
  // wgmma descriptors: the fields where the PTX ISA puts them, and
  // gmma_desc_at equal to gmma_desc at every 16-byte start of 227 KB of
  // shared memory plus every offset a kernel adds, for both operand kinds.
  EXPECT(gmma_desc(0x1230, 16, 1024) == ((0x123ull) | (1ull << 16) | (64ull << 32) | (1ull << 62)),
         "descriptor fields %llx", static_cast<unsigned long long>(gmma_desc(0x1230, 16, 1024)));
  {
    long bad = 0;
    for (uint32_t start = 0; start + 4 * kColumnBlockBytes <= 227 * 1024; start += 16) {
      for (uint32_t off = 0; off < 4 * kColumnBlockBytes; off += 16) {
        bad += gmma_desc_at(start >> 4, off, 16, kGmmaGroupBytes) !=
               gmma_desc(start + off, 16, kGmmaGroupBytes);
        bad += gmma_desc_at(start >> 4, off, kColumnBlockBytes, kGmmaGroupBytes) !=
               gmma_desc(start + off, kColumnBlockBytes, kGmmaGroupBytes);
      }
    }
    EXPECT(bad == 0, "%ld descriptors differ", bad);
  }
  EXPECT(tile_stages(128, false, 2, kH200SmemPerSm, kH200Reserved) == 3, "128 no bias");
  EXPECT(tile_stages(128, true, 2, kH200SmemPerSm, kH200Reserved) == 2, "128 bias");
  EXPECT(tile_stages(64, false, 3, kH200SmemPerSm, kH200Reserved) == 3, "64 no bias");
  EXPECT(tile_stages(64, true, 3, kH200SmemPerSm, kH200Reserved) == 2, "64 bias");
  EXPECT(tile_stages(256, false, 1, kH200SmemPerSm, kH200Reserved) == 2, "256");
  EXPECT((TileSmem{256, true, 2}.total() <= 227 * 1024), "256 fits");
  EXPECT(head_dim_width(8) == 64 && head_dim_width(72) == 128 && head_dim_width(256) == 256 &&
            head_dim_width(264) == 0,
        "widths");
  // The 32-bit work count at the int32 limit (count + 63 would overflow).
  EXPECT(work_tiles(0) == 0 && work_tiles(1) == 1 && work_tiles(64) == 1 && work_tiles(65) == 2 &&
             work_tiles(INT32_MAX) == INT32_MAX / kTileRows + 1,
         "work_tiles");
  // HeadPos stepped head by head equals the division, across batch entries.
  for (const int heads : {1, 3, 24}) {
    HeadPos pos = head_pos(0, heads);
    long bad = 0;
    for (int64_t head = 0; head < 5 * heads; ++head, next_head(pos, heads)) {
      const HeadPos want = head_pos(head, heads);
      bad += pos.b != want.b || pos.h != want.h || want.b * heads + want.h != head;
    }
    EXPECT(bad == 0, "%d heads: %ld steps off", heads, bad);
  }
  // Float4 logsumexp rows: contiguous rows, every head 16-byte aligned; a
  // size-1 axis's stride does not matter.
  alignas(16) static float lse[64];
  EXPECT(lse_vectorizable(lse, 2, 3, 12, 4, 1), "aligned heads");
  EXPECT(!lse_vectorizable(lse, 2, 3, 15, 5, 1), "heads 5 rows apart");
  EXPECT(lse_vectorizable(lse, 1, 1, 5, 5, 1), "one head, any strides");
  EXPECT(!lse_vectorizable(lse, 1, 2, 5, 6, 1), "two heads 6 rows apart");
  EXPECT(!lse_vectorizable(lse + 1, 1, 1, 4, 4, 1), "misaligned start");
  EXPECT(!lse_vectorizable(lse, 1, 1, 4, 4, 2), "strided rows");
  // Clusters: where keys are longer than one key block and the device has
  // them; a split's key ranges cover the tile's key blocks once, in order,
  // each block at least one; only the head's only, narrow, long tile, bf16.
  // Clusters where they can pay: two tiles a head or keys to split, keys
  // longer than one key block, and a device that has them.
  EXPECT(launch_cluster(704, 11, 132) == kClusterBlocks, "704x704");
  EXPECT(launch_cluster(65, 2, 132) == kClusterBlocks, "65 keys, two tiles a head");
  EXPECT(launch_cluster(64, 6, 132) == 1, "one key block (360x64)");
  EXPECT(launch_cluster(200, 1, 132) == 1, "one tile a head, short keys (32x200)");
  EXPECT(launch_cluster(64 * kSplitMinKeyBlocks, 1, 132) == kClusterBlocks, "keys to split");
  EXPECT(launch_cluster(4032, 63, 0) == 1, "no clusters on the device");
  for (int n = kSplitMinKeyBlocks; n < 70; ++n) {
    int next = 0;
    for (int r = 0; r < kClusterBlocks; ++r) {
      const KeyRange k = split_keys(n, r, kClusterBlocks);
      EXPECT(k.begin == next && k.end > k.begin, "n %d rank %d: [%d, %d)", n, r, k.begin, k.end);
      next = k.end;
    }
    EXPECT(next == n, "n %d: the ranges end at %d", n, next);
  }
  EXPECT(split_tile(2, false, 1, kSplitMinKeyBlocks), "one row, long keys");
  EXPECT(split_tile(2, false, kNarrowRows, 63), "a full narrow tile");
  EXPECT(!split_tile(2, false, kNarrowRows + 1, 63), "a wide tile");
  EXPECT(!split_tile(2, false, 1, kSplitMinKeyBlocks - 1), "short keys");
  EXPECT(!split_tile(2, true, 1, 63), "centred keys");
  EXPECT(!split_tile(1, false, 1, 63), "no cluster");
}

// work_range, which picks the tiles of work a block recomputes, against a
// brute-force loop over j; then whole launches of the index math: for heads
// of 1..40 tiles, 1..5 heads and every grid size up to one block per item,
// every tile of work of every head falls to exactly one block. Counts: 0 and
// both ends of each 64-row band (the range depends on count only through
// work_tiles), every band, the heads of a launch in different bands.
void work_placement_checks() {
  constexpr int64_t kMaxTiles = 40, kMaxHeads = 5;
  auto band_ends = [](int64_t w) {
    return w == 0 ? std::vector<int64_t>{0} : std::vector<int64_t>{64 * w - 63, 64 * w};
  };
  for (int64_t tiles = 1; tiles <= kMaxTiles; ++tiles) {
    long bad = 0;
    char first_bad[160] = "";
    for (int64_t n_work = 0; n_work <= tiles; ++n_work) {
      const int64_t stride = work_stride(n_work, tiles);
      for (const int64_t count : band_ends(n_work)) {
        for (int64_t first = 0; first <= tiles; ++first) {
          for (int64_t end = first; end <= tiles; ++end) {
            int64_t lo = 0, hi = 0;  // the j with first <= j stride < end: lo .. hi - 1
            for (int64_t j = 0; j < n_work; ++j) {
              if (j * stride < first || j * stride >= end) continue;
              if (hi == 0) lo = j;
              hi = j + 1;
            }
            const WorkRange work = work_range(count, tiles, first, end);
            const bool ok = hi > 0 ? work.begin == lo && work.end == hi : work.begin == work.end;
            if (!ok && bad++ == 0) {
              std::snprintf(first_bad, sizeof first_bad,
                            "count %" PRId64 ", tiles [%" PRId64 ", %" PRId64 "): j [%" PRId64
                            ", %" PRId64 "), brute force [%" PRId64 ", %" PRId64 ")",
                            count, first, end, work.begin, work.end, lo, hi);
            }
          }
        }
      }
    }
    EXPECT(bad == 0, "%" PRId64 " tiles per head, %ld ranges wrong, first %s", tiles, bad,
           first_bad);
  }

  for (int64_t tiles = 1; tiles <= kMaxTiles; ++tiles) {
    for (int64_t heads = 1; heads <= kMaxHeads; ++heads) {
      const int64_t n_items = heads * tiles;
      long bad = 0;
      char first_bad[160] = "";
      std::vector<int64_t> count(heads);
      std::vector<int> times(n_items);  // [head * tiles + j]: blocks that recomputed tile j
      for (int64_t band = 0; band <= tiles; ++band) {
        for (int64_t head = 0; head < heads; ++head) {
          const int64_t w = (band + head) % (tiles + 1);
          count[head] = band_ends(w)[(band + head) % band_ends(w).size()];
        }
        for (int64_t grid = 1; grid <= n_items; ++grid) {
          std::fill(times.begin(), times.end(), 0);
          for (int64_t b = 0; b < grid; ++b) {
            walk_run(b, grid, n_items, tiles, [&](int64_t head) { return count[head]; },
                     [&](int64_t head, WorkRange work) {
                       const int64_t stride = work_stride(work_tiles(count[head]), tiles);
                       for (int64_t j = work.begin; j < work.end; ++j) {
                         ++times[head * tiles + j];
                         const int64_t item = head * tiles + j * stride;
                         if ((item < b * n_items / grid || item >= (b + 1) * n_items / grid) &&
                             bad++ == 0) {
                           std::snprintf(first_bad, sizeof first_bad,
                                         "block %" PRId64 " of %" PRId64 " recomputes head %"
                                         PRId64 " tile %" PRId64 " at item %" PRId64,
                                         b, grid, head, j, item);
                         }
                       }
                     });
          }
          for (int64_t head = 0; head < heads; ++head) {
            for (int64_t j = 0; j < tiles; ++j) {
              const int want = j < work_tiles(count[head]) ? 1 : 0;
              if (times[head * tiles + j] != want && bad++ == 0) {
                std::snprintf(first_bad, sizeof first_bad,
                              "grid %" PRId64 ": head %" PRId64 " (%" PRId64 " rows) tile %" PRId64
                              " recomputed %d times",
                              grid, head, count[head], j, times[head * tiles + j]);
              }
            }
          }
        }
      }
      EXPECT(bad == 0, "%" PRId64 " heads of %" PRId64 " tiles: %ld wrong, first %s", heads,
             tiles, bad, first_bad);
    }
  }
}

}  // namespace

TEST_CASE("repair layout: swizzle ldmatrix offsets fragments grid stages", "[repair]") {
  layout_checks();
}

TEST_CASE("repair work placement: each tile of work to exactly one block", "[repair]") {
  work_placement_checks();
}

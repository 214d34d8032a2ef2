// Index arithmetic of the dQ-row repair, shared by host and device.
//
// Everything here is plain integer math with no CUDA intrinsic, so the CPU
// tests (and the CPU emulation of the kernels) check the very functions the
// kernels use: the shared-memory swizzle, which tile element each lane of an
// mma.sync holds, which row address each lane hands to ldmatrix, how work
// items map to heads and tiles, and how many blocks the repair kernel gets.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define OPENWAM_HD __host__ __device__ __forceinline__
#else
#define OPENWAM_HD inline
#endif

namespace openwam {
namespace repair {

// Query rows per tile: 4 warps x 16 rows (the m of mma.m16n8k16).
constexpr int kTileRows = 64;
// Keys per pipeline stage.
constexpr int kKeyBlock = 64;
// Threads of the repair kernel's blocks (4 warps), finding rows and recomputing them.
constexpr int kTileThreads = 128;
constexpr int kScanThreads = kTileThreads;
// Rows each thread reads per round of the row walk (consecutive, so that
// ranks follow row order).
constexpr int kScanRowsPerThread = 4;
// A tile with at most this many rows is "narrow": all 4 warps share its 16
// rows and split each key block four ways instead of idling 3 warps.
constexpr int kNarrowRows = 16;
// Rows of Q, dO and the bias that a tile of n_rows rows moves to shared
// memory (zeros past n_rows): the 16 its warps read when the tile is narrow,
// else all 64. One affected row per head then moves 16 rows instead of 64
// (the narrow tile spent most of its instructions on loads: Nsight Compute,
// H200); wide tiles keep their unrolled loads.
OPENWAM_HD int tile_rows_loaded(int n_rows) {
  return n_rows <= kNarrowRows ? kNarrowRows : kTileRows;
}
// The widest compiled head_dim (head_dim_width).
constexpr int kMaxWidth = 256;
// Row pitch of the bias tile in shared memory, in elements: 8 more than a
// key block, so that the 8 rows a warp reads at once sit 4 banks apart.
constexpr int kBiasPitch = kKeyBlock + 8;

constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
OPENWAM_HD T cmin(T a, T b) { return a < b ? a : b; }
template <typename T>
OPENWAM_HD T cmax(T a, T b) { return a < b ? b : a; }

// ---------------------------------------------------------------- tiles
// Q, dO, K and V tiles (64 rows each: kTileRows query rows, kKeyBlock keys)
// live in shared memory as column blocks of 64 elements: block b holds
// columns 64 b .. 64 b + 63 of all 64 rows, 128 bytes (8 chunks of 16 bytes)
// a row. Chunk c of a row is stored at chunk c ^ (row % 8) of its 128 bytes:
// ldmatrix reads one chunk column of 8 consecutive rows, and this XOR puts
// those 8 chunks in 8 different bank groups (no conflicts). With each tile
// 1024-byte aligned this is exactly the 128-byte swizzle of Hopper's wgmma
// shared-memory descriptors (bits 4-6 of an address XOR bits 7-9), so the
// same tiles feed ldmatrix and wgmma (gmma_desc below).
constexpr int kTileRowBytes = 128;                 // one column block's row
constexpr int kColumnBlockBytes = 64 * kTileRowBytes;  // 64 rows of a column block
static_assert(kTileRows == 64 && kKeyBlock == 64, "tiles of 64 rows");

template <int kChunks>
OPENWAM_HD int tile_offset(int row, int chunk) {
  static_assert(kChunks >= 8 && kChunks % 8 == 0, "a row must hold at least 8 chunks");
  return (chunk >> 3) * kColumnBlockBytes + row * kTileRowBytes + ((chunk & 7) ^ (row & 7)) * 16;
}

// The same offset split for ldmatrix, whose rows always start at a multiple
// of 8 plus lane % 8: tile_offset<kChunks>(row, 2 step + bit) equals
//   row * kTileRowBytes + lane_chunk_offset(lane, bit, step % 4) + step_offset(step).
// With `step` a compile-time constant, a kernel keeps 4 lane offsets in
// registers and the rest folds into the instruction's immediate offset
// (instead of one register per address, which spills at head_dim 256).
OPENWAM_HD int lane_chunk_offset(int lane, int bit, int step4) {
  return ((2 * step4 + bit) ^ (lane & 7)) * 16;
}
OPENWAM_HD constexpr int step_offset(int step) { return (step >> 2) * kColumnBlockBytes; }

// ---------------------------------------------------------------- wgmma
// A Hopper wgmma shared-memory matrix descriptor for the tiles above, with
// the 128-byte swizzle (PTX ISA, "Matrix Descriptor Format"): start address,
// leading and stride byte offsets (all in 16-byte units), layout type 1
// (128B swizzle) in bits 62-63, base offset 0 (every operand starts at a
// multiple of 1024 bytes plus at most 96: bits 7-9 of it are 0).
//   K-major operands (K or V as the B of Q K^T and dO V^T: 8 rows of 128
//   bytes per swizzle atom): stride = 1024 (from one 8-row group to the
//   next), leading unused (1).
//   MN-major operands (K as the B of dS K, transposed: keys are the k of the
//   product, head_dim its n): leading = kColumnBlockBytes (from one 64-column
//   block to the next), stride = 1024 (from one group of 8 keys to the next).
OPENWAM_HD uint64_t gmma_desc(uint32_t smem_addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_addr >> 4) & 0x3fff) |
         (static_cast<uint64_t>((leading_bytes >> 4) & 0x3fff) << 16) |
         (static_cast<uint64_t>((stride_bytes >> 4) & 0x3fff) << 32) |
         (static_cast<uint64_t>(1) << 62);
}
// gmma_desc(16 * start16 + offset_bytes, ...) for a 16-byte aligned start
// given in 16-byte units, without gmma_desc's masks: with start16 computed
// once per tile and the rest compile-time constants, each descriptor is one
// add (building each anew was 21% of the instructions of a wide tile:
// Nsight Compute, H200). No shared address reaches
// 2^18 bytes, so the start never carries into the next field.
OPENWAM_HD uint64_t gmma_desc_at(uint32_t start16, uint32_t offset_bytes, uint32_t leading_bytes,
                                 uint32_t stride_bytes) {
  const uint32_t lo = start16 + (offset_bytes >> 4) + ((leading_bytes >> 4) << 16);
  const uint32_t hi = (stride_bytes >> 4) | (1u << 30);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
constexpr uint32_t kGmmaGroupBytes = 8 * kTileRowBytes;  // one 8-row swizzle atom

// ---------------------------------------------------------------- mma.m16n8k16
// Lane `lane` of a warp holds accumulator elements e = 0..3 of a 16 x 8 tile
// at (frag_row, frag_col) (PTX ISA, "Matrix Fragments for mma.m16n8k16"):
// e = 0, 1 in row lane / 4, e = 2, 3 eight rows below; columns 2 (lane % 4)
// and one more.
OPENWAM_HD int frag_row(int lane, int e) { return (lane >> 2) + ((e & 2) << 2); }
OPENWAM_HD int frag_col(int lane, int e) { return ((lane & 3) << 1) + (e & 1); }

// ldmatrix.x4: lane l hands over the address of row l % 8 of matrix l / 8,
// and receives register m filled from matrix m. The three uses:
//
// A operand (16 x 16 of a row-major [row][k] tile, one k-step): matrices
// (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15,
// k 8-15) give registers a0..a3 in mma order.
OPENWAM_HD int ldsm_a_row(int lane) { return lane & 15; }
OPENWAM_HD int ldsm_a_chunk(int lane) { return lane >> 4; }
// B operand of two n-tiles from an [n][k] tile (keys x head_dim, for Q K^T
// and dO V^T), one k-step: matrices (n 0-7, k 0-7), (n 0-7, k 8-15),
// (n 8-15, k 0-7), (n 8-15, k 8-15) = {b0, b1} of n-tile 0, then of n-tile 1.
OPENWAM_HD int ldsm_b_row(int lane) { return ((lane >> 4) << 3) + (lane & 7); }
OPENWAM_HD int ldsm_b_chunk(int lane) { return (lane >> 3) & 1; }
// B operand of two n-tiles from a [k][n] tile (keys x head_dim, for dS K)
// with ldmatrix .trans, one k-step: matrices (k 0-7, n 0-7), (k 8-15, n 0-7),
// (k 0-7, n 8-15), (k 8-15, n 8-15) = {b0, b1} of n-tile 0, then n-tile 1.
OPENWAM_HD int ldsm_bt_row(int lane) { return (((lane >> 3) & 1) << 3) + (lane & 7); }
OPENWAM_HD int ldsm_bt_chunk(int lane) { return lane >> 4; }

// ---------------------------------------------------------------- work
// The repair kernel's work items are (head, tile) pairs, head-major:
// item = head * tiles_per_head + tile. A head with n affected rows has
// w = ceil(n / 64) tiles of work, the k-th holding its rows of ranks
// 64 k .. 64 k + 63 (in row order), placed at item k s of the head with
// s = tiles_per_head / w: spread over the head. Block b of G takes the
// contiguous run of items b n / G .. (b + 1) n / G - 1: runs of equal
// length, each holding its share of every head's work (one to three heads
// per block at the share table's shapes, more where heads are short: at
// least 5 at 64x32x32x200). The probe reads a run's logsumexp once; a head
// with rows is read again by its count walk (scan.cuh).
OPENWAM_HD int64_t item_head(int64_t item, int64_t tiles_per_head) { return item / tiles_per_head; }
OPENWAM_HD int64_t item_tile(int64_t item, int64_t tiles_per_head) { return item % tiles_per_head; }

// Within a head everything is 32-bit (the host checks that the sequence
// lengths fit in int32, so tiles_per_head and counts do), and a head's
// (b, h) is stepped, not divided out (HeadPos): 64-bit index math and
// divisions took about 370 of the 2,000 instructions a warp ran per head
// with one affected row (Nsight Compute, H200).
// Tiles of work of a head with `count` affected rows (no overflow near
// INT32_MAX), and the spacing s of their items in the head.
OPENWAM_HD int work_tiles(int count) { return count / kTileRows + (count % kTileRows != 0); }
OPENWAM_HD int work_stride(int n_work, int tiles_per_head) {
  return n_work > 0 ? tiles_per_head / n_work : 1;
}
// The first work tile k whose item k s lies at or after tile `first_tile`.
OPENWAM_HD int first_work(int first_tile, int stride) {
  return (first_tile + stride - 1) / stride;
}

// The work tiles begin <= j < end of a head with `count` affected rows whose
// items j s lie in its tiles first_tile .. end_tile - 1: those a block whose
// run holds these tiles of the head recomputes (repair_tiles; the tests
// check that every work tile falls to exactly one block). j s < end_tile
// exactly when j < first_work(end_tile, s).
struct WorkRange {
  int begin, end;
};
OPENWAM_HD WorkRange work_range(int count, int tiles_per_head, int first_tile, int end_tile) {
  const int n_work = work_tiles(count);
  const int stride = work_stride(n_work, tiles_per_head);
  const int end = cmin(n_work, first_work(end_tile, stride));
  return WorkRange{cmin(first_work(first_tile, stride), end), end};
}

// A head's batch entry b and head h (head = b * heads + h), stepped to the
// next head without a division: a block's run visits its heads in order.
struct HeadPos {
  int b, h;
};
OPENWAM_HD HeadPos head_pos(int64_t head, int64_t heads) {
  return HeadPos{static_cast<int>(head / heads), static_cast<int>(head % heads)};
}
OPENWAM_HD void next_head(HeadPos& pos, int heads) {
  if (++pos.h == heads) {
    pos.h = 0;
    ++pos.b;
  }
}

// The row walk reads a logsumexp [B, H, s_q] a float4 (4 rows) at a time
// when its rows are contiguous and every head starts 16-byte aligned
// (PyTorch's own when s_q is a multiple of 4); otherwise a float per row.
inline bool lse_vectorizable(const void* data, int64_t B, int64_t H, int64_t stride_b,
                             int64_t stride_h, int64_t stride_s) {
  return stride_s == 1 && reinterpret_cast<uintptr_t>(data) % 16 == 0 &&
         (B <= 1 || stride_b % 4 == 0) && (H <= 1 || stride_h % 4 == 0);
}

// Grid size of the repair kernel: at most one block per resident slot
// (`slots` = blocks per SM x SMs; a block walks its run of items). With
// clusters, `slots` counts resident clusters and the result is clusters.
inline int64_t tile_grid_size(int64_t n_items, int64_t slots) {
  return cmax<int64_t>(1, cmin(n_items, slots));
}

// ---------------------------------------------------------------- clusters
// On sm_90 the kernel is launched in clusters of kClusterBlocks blocks that
// walk one run of items together (twice a block's), taking its tiles in
// turn: the two blocks recompute neighbouring tiles of the same head at the
// same time, so each key block of K and V comes from DRAM once for both
// (every row at 16x24x704x704 D128: the repair alone 461 us against 526 us
// for blocks on their own runs, 1.532x against 1.616x of stock cuDNN in
// the share table; H200). Each block counts every head
// of the run that has rows (no row affected at 704x704, before probe_heads
// skipped such heads: 10.3 against 8.3 us).
//
// A long narrow tile is split between the cluster's blocks by keys
// (block r takes key blocks split_keys(...)), the partial dQ rows summed
// through distributed shared memory: one affected row per head at
// 4x24x4096x4032 (96 heads of 63 key blocks on 264 resident blocks) took
// 68.8 us against 83.2 us. Each block of a split tile pays the
// tile's fixed costs (its rows, their delta, the closing sums): at 704x704
// (11 key blocks, 384 heads) the split took 63.1 us against 56.6 us, so
// tiles shorter than kSplitMinKeyBlocks key blocks are not split.
constexpr int kClusterBlocks = 2;
constexpr int kSplitMinKeyBlocks = 24;

// Whether a tile is split across the cluster: the head's only tile of work
// (count <= kNarrowRows: every block of the cluster has its rows from the
// count walk, and no wide tile of the head holds one block while the other
// waits for it), at least kSplitMinKeyBlocks key blocks long. Centred keys
// (fp16) take one mean over the tile's first key block, which only one
// block would load: they keep whole tiles.
OPENWAM_HD bool split_tile(int cluster, bool center_keys, int count, int n_key_blocks) {
  return cluster > 1 && !center_keys && count <= kNarrowRows &&
         n_key_blocks >= kSplitMinKeyBlocks;
}

// Key blocks [begin, end) of block `rank` of a split tile of n key blocks.
struct KeyRange {
  int begin, end;
};
OPENWAM_HD KeyRange split_keys(int n_key_blocks, int rank, int cluster) {
  return KeyRange{n_key_blocks * rank / cluster, n_key_blocks * (rank + 1) / cluster};
}

// Off: on the H200 the cluster kernel wrote wrong dQ rows (bf16, head_dim
// width 128, max error up to 1.3x the largest |dQ|) whenever both blocks of a
// cluster recomputed tiles; plain grids are right on the same inputs. The CPU
// emulator, which runs a cluster's blocks as fibers, does not reproduce it, so
// every launch is a plain grid until the cause is found (tests/gpu/
// test_fuzz_gpu.py is the check to re-enable against).
constexpr bool kLaunchClusters = false;

// The launch's blocks per cluster: kClusterBlocks where the device runs
// clusters (sm_90 and newer, with the kernel built for it: `max_clusters` >
// 0) and they can pay: keys longer than one key block (shorter K and V stay
// in L2 between tiles anyway) and heads of two tiles or more (two blocks on
// one head's tiles) or keys long enough to split. Heads of one tile at
// 64x32x32x200 gained nothing and each block counted twice the heads: the
// repair alone with no affected row took 19.4 us against 10.4 (H200).
inline int launch_cluster(int64_t s_kv, int64_t tiles_per_head, int max_clusters) {
  const int64_t key_blocks = (s_kv + kKeyBlock - 1) / kKeyBlock;
  const bool pays = key_blocks > 1 && (tiles_per_head > 1 || key_blocks >= kSplitMinKeyBlocks);
  return pays && max_clusters > 0 ? kClusterBlocks : 1;
}

// The compiled head_dim widths: 64, 128 and 256 (0: over 256). A head_dim
// below its width is zero-filled in shared memory.
OPENWAM_HD int head_dim_width(int64_t head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : head_dim <= 256 ? 256 : 0;
}

// ---------------------------------------------------------------- smem
// Shared memory of the repair kernel (bytes), in this order: a small header
// (row indices, logsumexp, delta, key mean), `stages` pipeline stages of K,
// V (and the bias tile when there is a bias), then Q and dO unless they are
// staged through the last stage on their way into registers (head_dim <=
// 128; the prologue fills the other stages meanwhile).
struct TileSmem {
  // Row data, the key mean (fp16 tiles) and the run's state: under 2 KB.
  static constexpr int kHeaderBytes = 3072;
  int width;      // compiled head_dim width
  bool has_bias;
  int stages;     // 2 or 3

  // Bytes of one row's head_dim (a tile holds 64 of them, in 64-column
  // blocks: tile_offset); not a row pitch.
  OPENWAM_HD int row_bytes() const { return width * 2; }
  OPENWAM_HD int kv_tile_bytes() const { return kKeyBlock * row_bytes(); }
  OPENWAM_HD int q_tile_bytes() const { return kTileRows * row_bytes(); }
  OPENWAM_HD int bias_tile_bytes() const { return kTileRows * kBiasPitch * 2; }
  OPENWAM_HD bool q_in_registers() const { return width <= 128; }
  OPENWAM_HD int stage_bytes() const {
    return 2 * kv_tile_bytes() + (has_bias ? bias_tile_bytes() : 0);
  }
  OPENWAM_HD int stage(int s) const { return kHeaderBytes + s * stage_bytes(); }
  OPENWAM_HD int q_tile() const {
    return q_in_registers() ? stage(stages - 1) : stage(stages);
  }
  OPENWAM_HD int do_tile() const { return q_tile() + q_tile_bytes(); }
  OPENWAM_HD int total() const {
    return stage(stages) + (q_in_registers() ? 0 : 2 * q_tile_bytes());
  }
};

// Every tile starts at a multiple of 1024 bytes (the header, the K and V
// tiles and the bias tile are multiples of it): the 128-byte swizzle of
// tile_offset is then the wgmma descriptors' (bits 7-9 of a row's address =
// row % 8).
static_assert(TileSmem::kHeaderBytes % 1024 == 0 && kKeyBlock * kTileRowBytes % 1024 == 0 &&
                  kTileRows * kBiasPitch * 2 % 1024 == 0,
              "tiles 1024-byte aligned");

// Pipeline depth: 3 stages (two key blocks in flight while one is used)
// where `blocks_per_sm` blocks still fit in an SM's shared memory with them,
// else 2. A third stage matters most when few blocks stream long keys (one
// affected row per head).
inline int tile_stages(int width, bool has_bias, int blocks_per_sm, int smem_per_sm,
                       int reserved_per_block) {
  const TileSmem three{width, has_bias, 3};
  return blocks_per_sm * (three.total() + reserved_per_block) <= smem_per_sm ? 3 : 2;
}

}  // namespace repair
}  // namespace openwam

// Finding the rows of the dQ-row repair, in the repair kernel's blocks.
//
// A head's affected rows are those with a finite logsumexp below the
// threshold; their rank is their position among them in row order. The
// recompute takes them 64 ranks at a time (a head's k-th tile of work: ranks
// 64 k .. 64 k + 63).
//   - probe_heads: first, one pass over the logsumexp of the first
//     kProbeHeads (64) heads of a block's run: which of them have a row to
//     act on. The others of those are skipped; heads past the 64th are
//     always walked.
// A block walks a head's logsumexp in rounds of kScanThreads *
// kScanRowsPerThread rows, ranking the affected rows of a round with a
// block-wide prefix sum:
//   - count_head: one walk over the whole head. Gives the count; the head's
//     owner (the block that holds its tile 0; in a cluster, its first block)
//     also writes zeros to the dQ rows whose logsumexp is -inf (the row sees
//     no key: its output and gradient are 0; cuDNN may have left NaN
//     there) and adds the count to the telemetry counter; the blocks that
//     hold tile 0 gather the rows of its first tile of work (ranks 0..63),
//     so that they need no second walk for them.
//   - gather_rows: the rows of ranks lo .. hi - 1 into shared memory,
//     resuming where the previous tile's walk stopped (RowCursor).
// Nothing is kept between blocks or launches: no workspace, no barrier. On
// ordinary data a block reads the logsumexp of the heads its tiles belong to
// once (probe_heads), and that is the whole cost of the repair.
#pragma once

#include <cmath>
#include <cstdint>

#include "layout.cuh"
#ifndef OPENWAM_REPAIR_EMULATE  // the CPU emulation of the tests brings its own
#include "ptx.cuh"
#endif

// For the CPU emulation tests: they fail a misaligned vector load.
#ifndef OPENWAM_REPAIR_CHECK_ALIGNED
#define OPENWAM_REPAIR_CHECK_ALIGNED(ptr, bytes) ((void)0)
#endif

namespace openwam {
namespace repair {

struct ScanParams {
  const float* lse;
  int64_t lse_b, lse_h, lse_s;
  uint16_t* dq;  // bf16 or fp16 bits; only zeros are written here
  int64_t dq_b, dq_h, dq_s;
  int64_t heads, s_q;  // heads per batch entry (H), query rows
  int head_dim;
  bool dq_vec;  // dQ rows are 16-byte aligned: write zeros 8 elements at a time
  bool lse_vec;  // lse_vectorizable: the walk reads a float4 per thread
  float threshold;
  unsigned long long* repaired;  // telemetry counter, or nullptr
};

// Where a walk over a head's rows resumes: the first row of a round and the
// rank of the first affected row at or after it.
struct RowCursor {
  int64_t row = 0;
  int rank = 0;
};

__device__ __forceinline__ void zero_row(uint16_t* row, int head_dim, bool vec, int lane) {
  wait_for_grid_ahead();  // dQ: written by cuDNN's backward ahead of the repair
  if (vec) {
    uint4 zero;
    zero.x = zero.y = zero.z = zero.w = 0u;
    for (int c = lane; c < head_dim / 8; c += 32) {
      reinterpret_cast<uint4*>(row)[c] = zero;
    }
  } else {
    for (int e = lane; e < head_dim; e += 32) {
      row[e] = 0;
    }
  }
}

// The logsumexp row of the head at `pos`.
__device__ __forceinline__ const float* head_lse(const ScanParams& p, HeadPos pos) {
  return p.lse + pos.b * p.lse_b + pos.h * p.lse_h;
}

// A thread's kScanRowsPerThread consecutive rows of a head's logsumexp from
// `src`, the first `left` of them (`fill` past those): one float4 where the
// rows are contiguous and all there (lse_vec), else a load per row.
__device__ __forceinline__ void load_lse_rows(const ScanParams& p, const float* src, int left,
                                              float fill, float (&l)[kScanRowsPerThread]) {
  static_assert(kScanRowsPerThread == 4, "one float4 per thread");
  if (p.lse_vec && left == kScanRowsPerThread) {
    OPENWAM_REPAIR_CHECK_ALIGNED(src, 16);
    const float4 v = *reinterpret_cast<const float4*>(src);
    l[0] = v.x, l[1] = v.y, l[2] = v.z, l[3] = v.w;
  } else {
#pragma unroll
    for (int k = 0; k < kScanRowsPerThread; ++k) l[k] = k < left ? src[k * p.lse_s] : fill;
  }
}

// One walk over the head at `pos` from `cursor`, round by round, until the round
// in which rank `stop` is reached (or the head ends: stop = INT32_MAX). Rows
// of rank lo .. hi - 1 go to s_row[rank - lo] (query row) and
// s_lse2[rank - lo] (logsumexp * log2 e) when s_row is not nullptr; -inf
// rows get zeros when `zero_empty`.
// Returns the number of affected rows seen from the cursor on; leaves the
// cursor at the start of the last round walked, so that the next walk (ranks
// from `stop` on) reads that round again. All threads of the block call it, and
// get the same result; `warp_sums` is kScanThreads / 32 ints of shared
// memory.
__device__ __forceinline__ int walk_rows(const ScanParams& p, HeadPos pos, RowCursor& cursor,
                                         int lo, int hi, int stop, int* s_row,
                                         float* s_lse2, bool zero_empty, int* warp_sums) {
  constexpr int kWarps = kScanThreads / 32;
  constexpr int kRowsPerRound = kScanThreads * kScanRowsPerThread;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const float* lse = head_lse(p, pos);
  uint16_t* dq = p.dq + pos.b * p.dq_b + pos.h * p.dq_h;

  int seen = 0;  // affected rows from the cursor's rank on
  for (int64_t first = cursor.row; first < p.s_q; first += kRowsPerRound) {
    const int64_t row0 = first + static_cast<int64_t>(tid) * kScanRowsPerThread;
    const int left = static_cast<int>(cmax<int64_t>(
        0, cmin<int64_t>(kScanRowsPerThread, p.s_q - row0)));  // rows of mine below s_q
    float l[kScanRowsPerThread];
    load_lse_rows(p, lse + row0 * p.lse_s, left, 0.0f, l);
    bool low[kScanRowsPerThread], empty[kScanRowsPerThread];
    int mine = 0;
#pragma unroll
    for (int k = 0; k < kScanRowsPerThread; ++k) {
      const bool in = k < left;
      empty[k] = in && l[k] == -INFINITY;
      // NaN compares false: such a row is left alone.
      low[k] = in && l[k] < p.threshold && !empty[k];
      mine += low[k] ? 1 : 0;
    }
    // Block-wide exclusive prefix sum of `mine`: ranks follow row order.
    int incl = mine;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += y;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int rank = cursor.rank + seen + incl - mine;
    int round_total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int s = warp_sums[w];
      rank += w < warp ? s : 0;
      round_total += s;
    }
    if (s_row != nullptr) {
#pragma unroll
      for (int k = 0; k < kScanRowsPerThread; ++k) {
        if (low[k]) {
          if (rank >= lo && rank < hi) {
            s_row[rank - lo] = static_cast<int>(row0 + k);
            s_lse2[rank - lo] = l[k] * kLog2e;
          }
          ++rank;
        }
      }
    }
    if (zero_empty) {  // one warp per -inf row (coalesced)
#pragma unroll
      for (int k = 0; k < kScanRowsPerThread; ++k) {
        unsigned pending = __ballot_sync(0xffffffffu, empty[k]);
        while (pending != 0u) {
          const int src = __ffs(pending) - 1;
          pending &= pending - 1u;
          const int64_t row =
              first + static_cast<int64_t>(warp * 32 + src) * kScanRowsPerThread + k;
          zero_row(dq + row * p.dq_s, p.head_dim, p.dq_vec, lane);
        }
      }
    }
    __syncthreads();  // warp_sums is rewritten next round
    if (cursor.rank + seen + round_total >= stop) {  // rank `stop` lies in this round
      cursor.rank += seen;
      cursor.row = first;
      return seen + round_total;
    }
    seen += round_total;
  }
  cursor.rank += seen;
  cursor.row = p.s_q;
  return seen;
}

// The logsumexp of the `n_heads` heads from `pos` on into L2, a 128-byte
// line per thread and step (PyTorch's logsumexp rows are contiguous; other
// strides go without). A block walks its heads one after another, and
// after cuDNN's backward their logsumexp is no longer in L2: each walk but
// the first would wait a round trip to memory, the tile work of one head
// between them (one affected row per head: 3 heads a block at 32x24x360x64).
__device__ __forceinline__ void prefetch_lse(const ScanParams& p, HeadPos pos, int64_t n_heads) {
  if (p.lse_s != 1 || p.s_q == 0) return;
  for (int64_t k = 0; k < n_heads; ++k) {
    const float* lse = head_lse(p, pos);
    const uintptr_t start = reinterpret_cast<uintptr_t>(lse);
    const uintptr_t last = reinterpret_cast<uintptr_t>(lse + (p.s_q - 1));
    // Lines from the one holding the head's first row; addresses within the rows.
    for (uintptr_t line = (start & ~static_cast<uintptr_t>(127)) + threadIdx.x * 128u;
         line <= last; line += 128u * kScanThreads) {
      prefetch_l2(reinterpret_cast<const void*>(cmax(line, start)));
    }
    next_head(pos, static_cast<int>(p.heads));
  }
}

// Heads of a run that probe_heads tells apart; later ones count as flagged.
constexpr int kProbeHeads = 64;

// Which of the `n_heads` heads from `pos` on have a row to act on (a
// logsumexp below the threshold, -inf included; NaN is left alone, as in
// walk_rows): bit k for head k < kProbeHeads. One pass over their
// logsumexp, kBatch rounds' loads in flight per thread, then one barrier:
// with no affected row that is a block's whole work, where walking head
// after head (two barriers a round) took 8-13 us for the kernel (Nsight
// Compute, H200). With it (its first form, the
// repair alone against 77367cf on one machine), no affected row: 7.0 ->
// 5.6 us at 16x24x704x704, 6.1 -> 4.2 at 32x24x360x64, 12.6 -> 7.4 at
// 4x24x4096x4032, 10.5 -> 6.6 at 64x32x32x200; a head with rows pays its
// round trip before the walks (one row per head at 360x64: 19.6 -> 20.9).
// All threads of the block call it and get the same mask; `words` is
// kScanThreads / 32 uint64 of shared memory.
__device__ __forceinline__ uint64_t probe_heads(const ScanParams& p, HeadPos pos,
                                                int64_t n_heads, uint64_t* words) {
  constexpr int kRowsPerRound = kScanThreads * kScanRowsPerThread;
  constexpr int kBatch = 4;
  static_assert(kScanRowsPerThread == 4, "one float4 per thread and round");
  const int tid = threadIdx.x;
  const int n = static_cast<int>(cmin<int64_t>(n_heads, kProbeHeads));
  // The next (head, round) to load, stepped without divisions.
  int k = 0;
  int64_t row0 = static_cast<int64_t>(tid) * kScanRowsPerThread;
  const float* lse = head_lse(p, pos);
  uint64_t mask = 0;
  while (k < n) {
    float l[kBatch][kScanRowsPerThread];
    int head_of[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      head_of[u] = k;
      const int left = k < n ? static_cast<int>(cmax<int64_t>(
                                   0, cmin<int64_t>(kScanRowsPerThread, p.s_q - row0)))
                             : 0;
      load_lse_rows(p, lse + row0 * p.lse_s, left, INFINITY, l[u]);  // past s_q: no row
      // The next round, or the next head's first.
      row0 += kRowsPerRound;
      if (row0 - static_cast<int64_t>(tid) * kScanRowsPerThread >= p.s_q && k < n) {
        row0 = static_cast<int64_t>(tid) * kScanRowsPerThread;
        ++k;
        next_head(pos, static_cast<int>(p.heads));
        lse = head_lse(p, pos);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      bool low = false;
#pragma unroll
      for (int r = 0; r < kScanRowsPerThread; ++r) low = low || l[u][r] < p.threshold;
      if (low) mask |= uint64_t{1} << head_of[u];
    }
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) mask |= __shfl_xor_sync(0xffffffffu, mask, m);
  if ((tid & 31) == 0) words[tid >> 5] = mask;
  __syncthreads();
  uint64_t all = 0;
#pragma unroll
  for (int w = 0; w < kScanThreads / 32; ++w) all |= words[w];
  return all;  // `words` is not written again: no second barrier
}

// Whether head k of the probed run may have a row to act on: flagged in
// probe_heads's mask, or past the heads it tells apart.
__device__ __forceinline__ bool probed(uint64_t mask, int64_t k) {
  return k >= kProbeHeads || ((mask >> k) & 1u);
}

// The number of affected rows of the head at `pos`. With `gather`, the rows
// of ranks 0 .. kTileRows - 1 go into s_row / s_lse2; the owner also zeroes
// the -inf rows and counts the rows for the telemetry.
__device__ __forceinline__ int count_head(const ScanParams& p, HeadPos pos, bool gather,
                                          bool owner, int* s_row, float* s_lse2,
                                          int* warp_sums) {
  RowCursor start;
  const int count = walk_rows(p, pos, start, 0, kTileRows, INT32_MAX, gather ? s_row : nullptr,
                              s_lse2, owner, warp_sums);
  if (owner && threadIdx.x == 0 && count > 0 && p.repaired != nullptr) {
    atomicAdd(p.repaired, static_cast<unsigned long long>(count));
  }
  return count;
}

// The rows of ranks lo .. hi - 1 of the head at `pos` into s_row / s_lse2, from
// `cursor` (at or before rank lo).
__device__ __forceinline__ void gather_rows(const ScanParams& p, HeadPos pos, RowCursor& cursor,
                                            int lo, int hi, int* s_row, float* s_lse2,
                                            int* warp_sums) {
  walk_rows(p, pos, cursor, lo, hi, hi, s_row, s_lse2, false, warp_sums);
}

}  // namespace repair
}  // namespace openwam

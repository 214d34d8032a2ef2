// First kernel of the dQ-row repair: find the rows.
//
// One block per (batch, head) reads the head's logsumexp once and
//   - writes zeros to the dQ rows whose logsumexp is -inf (the row sees no
//     key: its output and gradient are 0; cuDNN may have left NaN there),
//   - lists the rows with a finite logsumexp below the threshold, in row
//     order, with their logsumexp (RowEntry), and stores how many in
//     counts[head] (written for every head, so the workspace needs no
//     clearing: no memset launch, nothing to reset for a CUDA graph),
//   - adds that number to the telemetry counter, when there is one.
// On ordinary data this is the whole cost of the repair: 4 bytes per query
// row read, one int per head written.
#pragma once

#include <cmath>
#include <cstdint>

#include "repair_dq_layout.cuh"
#ifndef OPENWAM_REPAIR_EMULATE  // the CPU emulation of the tests brings its own
#include "repair_dq_ptx.cuh"
#endif

namespace openwam {
namespace repair {

struct ScanParams {
  const float* lse;
  int64_t lse_b, lse_h, lse_s;
  uint16_t* dq;  // bf16 or fp16 bits; only zeros are written here
  int64_t dq_b, dq_h, dq_s;
  int64_t heads, s_q;
  int head_dim;
  bool dq_vec;  // dQ rows are 16-byte aligned: write zeros 8 elements at a time
  float threshold;
  int32_t* counts;               // [B * H]
  RowEntry* rows;                // [B * H, s_q]
  unsigned long long* repaired;  // telemetry counter, or nullptr
};

__device__ __forceinline__ void zero_row(uint16_t* row, int head_dim, bool vec, int lane) {
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

__device__ __forceinline__ void scan_head(const ScanParams& p) {
  constexpr int kWarps = kScanThreads / 32;
  constexpr int kRowsPerRound = kScanThreads * kScanRowsPerThread;
  int* warp_sums = reinterpret_cast<int*>(smem_base());  // [kWarps]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t head = blockIdx.x;
  const int64_t b = head / p.heads;
  const int64_t h = head % p.heads;
  const float* lse = p.lse + b * p.lse_b + h * p.lse_h;
  uint16_t* dq = p.dq + b * p.dq_b + h * p.dq_h;
  RowEntry* list = p.rows + head * p.s_q;

  int listed = 0;  // rows listed so far (the same in every thread)
  for (int64_t first = 0; first < p.s_q; first += kRowsPerRound) {
    const int64_t row0 = first + static_cast<int64_t>(tid) * kScanRowsPerThread;
    float l[kScanRowsPerThread];
    bool low[kScanRowsPerThread], empty[kScanRowsPerThread];
    int mine = 0;
#pragma unroll
    for (int k = 0; k < kScanRowsPerThread; ++k) {
      const bool in = row0 + k < p.s_q;
      l[k] = in ? lse[(row0 + k) * p.lse_s] : 0.0f;
      empty[k] = in && l[k] == -INFINITY;
      // NaN compares false: such a row is left alone.
      low[k] = in && l[k] < p.threshold && !empty[k];
      mine += low[k] ? 1 : 0;
    }
    // Block-wide exclusive prefix sum of `mine`: rows keep their order.
    int incl = mine;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += y;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int pos = listed + incl - mine;
    int round_total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int s = warp_sums[w];
      pos += w < warp ? s : 0;
      round_total += s;
    }
#pragma unroll
    for (int k = 0; k < kScanRowsPerThread; ++k) {
      if (low[k]) {
        RowEntry e;
        e.row = static_cast<int32_t>(row0 + k);
        e.lse = l[k];
        list[pos++] = e;
      }
    }
    listed += round_total;
    // Zero the -inf rows, one warp per row (coalesced).
#pragma unroll
    for (int k = 0; k < kScanRowsPerThread; ++k) {
      unsigned pending = __ballot_sync(0xffffffffu, empty[k]);
      while (pending != 0u) {
        const int src = __ffs(pending) - 1;
        pending &= pending - 1u;
        const int64_t row = first + static_cast<int64_t>(warp * 32 + src) * kScanRowsPerThread + k;
        zero_row(dq + row * p.dq_s, p.head_dim, p.dq_vec, lane);
      }
    }
    __syncthreads();  // warp_sums is rewritten next round
  }
  if (tid == 0) {
    p.counts[head] = listed;
    if (listed > 0 && p.repaired != nullptr) {
      atomicAdd(p.repaired, static_cast<unsigned long long>(listed));
    }
  }
}

__global__ void __launch_bounds__(kScanThreads) repair_scan_kernel(const ScanParams p) {
  scan_head(p);
}

}  // namespace repair
}  // namespace openwam

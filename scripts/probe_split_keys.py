"""Can a light kernel of its own repair one affected row per head within issue 12's
1.05x? Two prototypes after cuDNN's backward, against the landed repair and against
their own loads alone (BENCHMARKS.md, runs Q1-Q4).

The landed repair walks a head's keys in one block at the tiles' 255 registers
(2 blocks per SM at head_dim 128, so 704x704's 384 heads take two rounds);
the CUDA-core prototypes of runs N1-N3 (probe_row_stream.py) loaded keys into
registers, and their best at 704x704 head_dim 128 added 45 us where 1.05x
leaves 43 (a bare read of K and V after the backward: 38 us, L7). Both forms
here scan a head's logsumexp first, take at most 4 affected rows (a light
kernel would leave heads of more rows to the tiles), copy keys into shared
memory with cp.async and sum each row's dQ there: eight lanes per key, each
lane 16 (head_dim 128) or 8 dims, the dot products reduced over the eight
lanes, the keys' contributions over the warp.

- split: a head's keys cut into C chunks, one block each, C = min(8,
  ceil(s_kv / 64)) blocks in a thread-block cluster (split16: up to 16, a
  non-portable size); the head's rows scanned once per cluster (a share per
  block, the counts merged through distributed shared memory), each block
  loads its whole chunk at once and the partial rows are summed into the
  cluster's first block, which writes them. 360x64 is one block per head.
- pipe: one block per head, no cluster, the keys streamed through 4
  shared-memory stages of 32 keys (3 in flight while one is computed), 72 KB
  at head_dim 128: 3 blocks per SM, every head of 704x704 resident at once.
- controls: scan, pipe_scan (the scan alone: every head leaves after it) and
  read, pipe_read (the scan, then every block loads its keys whatever it
  found, and nothing else).
- reg (runs R1-R8, thirteenth session): pipe with the row's q and dO in
  registers (pipe re-read them from shared memory at every key: at head_dim
  128 four times the shared-memory wavefronts of the keys), one row a head
  (heads of more rows left alone, as a light kernel would leave them to the
  tiles); reg_early issues its first stages before the scan; reg_tileocc runs
  at the landed kernel's blocks per SM (2 at head_dim 128, 3 at 64: what a
  path inside that kernel's launch would get); reg_occ at 6 blocks per SM at
  head_dim 64 (at 128 reg_occ is reg: both have every head of the four cells
  resident at once); reg_pdl is reg_occ launched as the
  programmatic dependent of cuDNN's last kernel, as the op launches its
  repair.

Then, at 10% and every row (heads of more rows than a light kernel takes),
what the landed repair adds after the backward alone and after a light
kernel (--light: pipe's scan by default, or reg_occ, which leaves those heads
after its scan): a light kernel's cost where the tiles must still run; a
tail launch from the device adds about 3.7 us more than the second host
launch timed here (scripts/probe_tail_launch.cu).

No -inf rows, no causal mask, no centring (bf16 only, as probe_row_stream.py);
plain launches but reg_pdl (inside the op the repair's programmatic launch
saves 1.3-2.6 us more, M2).

    python scripts/probe_split_keys.py [--rounds 5] [--repeats 30] [--forms reg,reg_pdl]
        [--shares none,one_per_head] [--cells 704] [--layout bhsd]
        [--light reg_occ] [--tile-shares 0.1,all] [--no-tiles]

It prints, in paired rounds of device time, what each form adds to cuDNN's
backward, the repaired rows' accuracy against float64 (the landed repair and
every timed form that repairs) and whether every other dQ row is untouched. About two minutes on one
H200 (the kernels are built on the spot).
"""

from __future__ import annotations

from pathlib import Path

import torch

from leaf_cells import (  # puts benchmarks/ on the path
    ONE_ROW_OVER, leaf_cell, paired_added, probe_parser, start)
from probe_row_stream import THRESHOLD, affected_rows, worst_row_error

CELLS = ONE_ROW_OVER
# variant -> split_keys's (engine: 0 split_keys, 1 pipe_keys, 2 reg_keys, 3 reg_keys
# with its first stages issued before the scan, 4 reg_keys at the landed kernel's
# blocks per SM, 5 reg_keys at 6 blocks per SM at head_dim 64 (as 2 at 128), 6 reg_occ
# launched as the programmatic dependent of cuDNN's last kernel (as the op's repair);
# max_cluster: split's largest cluster;
# mode: 0 the scan alone, 1 the repair, 2 the scan and the loads alone)
FORMS = {"split": (0, 8, 1), "split16": (0, 16, 1), "pipe": (1, 0, 1), "pipe_scan": (1, 0, 0),
         "pipe_read": (1, 0, 2), "scan": (0, 8, 0), "read": (0, 8, 2), "reg": (2, 0, 1),
         "reg_early": (3, 0, 1), "reg_tileocc": (4, 0, 1), "reg_occ": (5, 0, 1),
         "reg_pdl": (6, 0, 1)}
VARIANTS = tuple(FORMS)
# The forms that write repaired rows (mode 1), whose accuracy is checked.
REPAIRS = tuple(name for name, (_, _, mode) in FORMS.items() if mode == 1)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include "probe_row_params.h"

namespace cg = cooperative_groups;

namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps, kMaxRows = 4, kLanesPerKey = 8, kScan = 4;
// pipe_keys and reg_keys as launched: kStreamStages shared-memory stages of
// kStreamKeys keys of K and V (their instantiation and their shared memory).
constexpr int kStreamKeys = 32, kStreamStages = 4;
enum Mode { kScanOnly = 0, kCompute = 1, kRead = 2 };
enum Engine { kEngineSplit = 0, kEnginePipe = 1, kEngineReg = 2, kEngineRegEarly = 3,
              kEngineRegTileOcc = 4, kEngineRegOcc = 5, kEngineRegPdl = 6 };

struct Params {
  const uint16_t *q, *k, *v, *o, *go, *bias;
  uint16_t* dq;
  const float* lse;
  int64_t q_b, q_h, q_s, k_b, k_h, k_s, v_b, v_h, v_s, o_b, o_h, o_s, go_b, go_h, go_s;
  int64_t dq_b, dq_h, dq_s, bias_b, bias_h, bias_s, bias_e, lse_b, lse_h, lse_s;
  int H, kv_group, s_q, s_kv, cluster, chunk;
  float scale, scale_log2, threshold;
  int mode;
};

__device__ __forceinline__ float bf(uint16_t x) {
  return __uint_as_float(static_cast<uint32_t>(x) << 16);
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}

// 8 bf16 (16 bytes) of shared memory as floats.
__device__ __forceinline__ void unpack8(const uint16_t* p, float* x) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// One pass of a block's logsumexp scan, rows i0 + u * kThreads + tid below
// `end`: every value loaded before any is tested (one round trip); the
// affected rows (below the threshold, not -inf) are counted in *count and
// the first kMaxRows of them listed in rows (shared memory).
template <int U>
__device__ __forceinline__ void scan_pass(const Params& p, const float* lse, int i0, int end,
                                          int tid, int lane, int* rows, int* count) {
  float l[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = i0 + u * kThreads + tid;
    l[u] = i < end ? lse[i * p.lse_s] : INFINITY;
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool hit = l[u] < p.threshold && l[u] != -INFINITY;
    const unsigned m = __ballot_sync(0xffffffffu, hit);
    if (m == 0u) continue;
    int base = 0;
    if (lane == 0) base = atomicAdd(count, __popc(m));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (hit) {
      const int slot = base + __popc(m & ((1u << lane) - 1u));
      if (slot < kMaxRows) rows[slot] = i0 + u * kThreads + tid;
    }
  }
}

// Warp `warp` takes an affected row: its q and dO as floats into shared
// memory (qs, gs), delta = dO . O and its logsumexp in base 2.
template <int D>
__device__ __forceinline__ void load_row(const Params& p, int b, int h, int row, int warp,
                                         int lane, const float* lse, float* qs, float* gs,
                                         float* deltas, float* lse2s) {
  const uint16_t* qr = p.q + b * p.q_b + h * p.q_h + row * p.q_s;
  const uint16_t* gr = p.go + b * p.go_b + h * p.go_h + row * p.go_s;
  const uint16_t* orow = p.o + b * p.o_b + h * p.o_h + row * p.o_s;
  float delta = 0.0f;
  for (int d = lane; d < D; d += 32) {
    const float g = bf(gr[d]);
    qs[warp * D + d] = bf(qr[d]);
    gs[warp * D + d] = g;
    delta += g * bf(orow[d]);
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) delta += __shfl_xor_sync(0xffffffffu, delta, m);
  if (lane == 0) {
    deltas[warp] = delta;
    lse2s[warp] = lse[row * p.lse_s] * 1.4426950408889634f;
  }
}

// Block (head bh, chunk rank) of a cluster of p.cluster blocks along x.
template <int D>
__global__ void __launch_bounds__(kThreads) split_keys(const Params p) {
  constexpr int DL = D / kLanesPerKey;  // dims per lane: 16 or 8 (one or two 16-byte pieces)
  constexpr int kPieces = D / 8;        // 16-byte pieces per key row
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* ks = reinterpret_cast<uint16_t*>(smem);           // [chunk][D]
  uint16_t* vs = ks + p.chunk * D;                              // [chunk][D]
  float* qs = reinterpret_cast<float*>(vs + p.chunk * D);       // [kMaxRows][D]
  float* gs = qs + kMaxRows * D;                                // [kMaxRows][D]
  float* wpart = gs + kMaxRows * D;                             // [kWarps][D]
  float* bpart = wpart + kWarps * D;                            // [kMaxRows][D]
  __shared__ int rows[kMaxRows];
  __shared__ float lse2s[kMaxRows], deltas[kMaxRows];
  __shared__ int count, count2;
  __shared__ int rows_final[kMaxRows];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rank = static_cast<int>(blockIdx.x) % p.cluster;
  const int bh = static_cast<int>(blockIdx.x) / p.cluster;
  const int b = bh / p.H, h = bh % p.H, hk = h / p.kv_group;
  const float* lse = p.lse + b * p.lse_b + h * p.lse_h;
  // The head's rows are scanned once per cluster: block `rank` takes its
  // share, every value of a pass loaded before any is tested (one round trip).
  const int per = (p.s_q + p.cluster - 1) / p.cluster;
  const int r0 = rank * per, r1 = min(p.s_q, r0 + per);
  if (tid == 0) count = 0;
  __syncthreads();
  for (int i0 = r0; i0 < r1; i0 += kThreads * kScan) {
    scan_pass<kScan>(p, lse, i0, r1, tid, lane, rows, &count);
  }
  cg::cluster_group cluster = cg::this_cluster();
  int n;
  if (p.cluster > 1) {
    cluster.sync();  // every block's count and rows published
    // The cluster's rows in rank order, the first kMaxRows of them.
    __shared__ int all_rows[kMaxRows];
    if (tid == 0) {
      int total = 0;
      for (int c = 0; c < p.cluster && total < kMaxRows; ++c) {
        const int nc = min(*cluster.map_shared_rank(&count, c), kMaxRows);
        const int* rc = cluster.map_shared_rank(rows, c);
        for (int x = 0; x < nc && total < kMaxRows; ++x) all_rows[total++] = rc[x];
      }
      count2 = total;
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");  // done reading the others
    __syncthreads();
    n = count2;
    if (tid < n) rows_final[tid] = all_rows[tid];
  } else {
    __syncthreads();
    n = min(count, kMaxRows);
    if (tid < n) rows_final[tid] = rows[tid];
  }
  __syncthreads();
  // Every block of a cluster has the same n, so all leave or none.
  if (p.mode == kScanOnly || (n == 0 && p.mode != kRead)) {
    if (p.cluster > 1) asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    return;
  }

  const int k0 = rank * p.chunk;
  const int nk = max(0, min(p.chunk, p.s_kv - k0));
  const uint16_t* k_head = p.k + b * p.k_b + hk * p.k_h;
  const uint16_t* v_head = p.v + b * p.v_b + hk * p.v_h;
  for (int idx = tid; idx < 2 * nk * kPieces; idx += kThreads) {
    const int t = idx / (nk * kPieces), rem = idx - t * nk * kPieces;
    const int j = rem / kPieces, piece = rem - j * kPieces;
    const uint16_t* src = t == 0 ? k_head + (k0 + j) * p.k_s : v_head + (k0 + j) * p.v_s;
    cp_async_16((t == 0 ? ks : vs) + j * D + piece * 8, src + piece * 8);
  }
  asm volatile("cp.async.commit_group;\n" ::);
  if (p.mode == kRead) {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    if (p.cluster > 1) asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    return;
  }
  // While the keys arrive: warp r takes row r's q, dO and delta = dO . O.
  if (warp < n) load_row<D>(p, b, h, rows_final[warp], warp, lane, lse, qs, gs, deltas, lse2s);
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();

  const int sub = lane & (kLanesPerKey - 1), slot = lane >> 3;  // 4 keys per warp a step
  for (int r = 0; r < n; ++r) {
    float q[DL], g[DL], acc[DL];
#pragma unroll
    for (int e = 0; e < DL; ++e) {
      const int d = (e / 8) * 64 + sub * 8 + (e % 8);  // 16-byte pieces, 128 bytes a quarter warp
      q[e] = qs[r * D + d];
      g[e] = gs[r * D + d];
      acc[e] = 0.0f;
    }
    const float lse2 = lse2s[r], delta = deltas[r];
    const uint16_t* bias_row = p.bias ? p.bias + b * p.bias_b + h * p.bias_h + rows_final[r] * p.bias_s
                                      : nullptr;
    for (int j = warp * 4 + slot; j - slot < nk; j += 4 * kWarps) {
      const bool valid = j < nk;
      const int jj = valid ? j : 0;
      float kf[DL], vf[DL];
#pragma unroll
      for (int e = 0; e < DL; e += 8) {
        unpack8(ks + jj * D + (e / 8) * 64 + sub * 8, kf + e);
        unpack8(vs + jj * D + (e / 8) * 64 + sub * 8, vf + e);
      }
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int e = 0; e < DL; ++e) { s += q[e] * kf[e]; dp += g[e] * vf[e]; }
#pragma unroll
      for (int m = 1; m < kLanesPerKey; m <<= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, m);
        dp += __shfl_xor_sync(0xffffffffu, dp, m);
      }
      float ds = 0.0f;
      if (valid) {
        const float bias_j = bias_row ? bf(bias_row[(k0 + j) * p.bias_e]) * 1.4426950408889634f : 0.0f;
        ds = exp2f(s * p.scale_log2 + bias_j - lse2) * (dp - delta);
      }
#pragma unroll
      for (int e = 0; e < DL; ++e) acc[e] += ds * kf[e];
    }
    // The warp's four key slots hold the same dims: sum them.
#pragma unroll
    for (int e = 0; e < DL; ++e) {
      acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], 8);
      acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], 16);
    }
    if (slot == 0) {
#pragma unroll
      for (int e = 0; e < DL; ++e) wpart[warp * D + (e / 8) * 64 + sub * 8 + (e % 8)] = acc[e];
    }
    __syncthreads();
    for (int d = tid; d < D; d += kThreads) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += wpart[w * D + d];
      bpart[r * D + d] = sum;
    }
    __syncthreads();
  }
  // The cluster's partial rows into its first block, which writes them.
  if (p.cluster > 1) {
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    cluster.sync();
  }
  if (rank == 0) {
    for (int x = tid; x < n * D; x += kThreads) {
      const int r = x / D, d = x - r * D;
      float sum = bpart[x];
      for (int c = 1; c < p.cluster; ++c) sum += cluster.map_shared_rank(bpart, c)[x];
      const __nv_bfloat16 y = __float2bfloat16(sum * p.scale);
      p.dq[b * p.dq_b + h * p.dq_h + rows_final[r] * p.dq_s + d] = *reinterpret_cast<const uint16_t*>(&y);
    }
  }
  if (p.cluster > 1) cluster.sync();  // the others' shared memory stays until it is read
}


// One block per head, no cluster: the head's keys streamed through kStages
// shared-memory stages of kKeys keys (cp.async, kStages - 1 in flight while
// one is computed), every affected row of the head (at most kMaxRows) summed
// in registers as the keys go by; 3 blocks per SM at head_dim 128 (72 KB), so
// that every head of 704x704 is resident at once.
template <int D, int kKeys, int kStages>
__global__ void __launch_bounds__(kThreads) pipe_keys(const Params p) {
  constexpr int DL = D / kLanesPerKey;
  constexpr int kPieces = D / 8;
  constexpr int kStage = kKeys * D;  // bf16 per tensor and stage
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* ks = reinterpret_cast<uint16_t*>(smem);        // [kStages][kKeys][D]
  uint16_t* vs = ks + kStages * kStage;                     // [kStages][kKeys][D]
  float* qs = reinterpret_cast<float*>(vs + kStages * kStage);  // [kMaxRows][D]
  float* gs = qs + kMaxRows * D;                            // [kMaxRows][D]
  float* wpart = gs + kMaxRows * D;                         // [kWarps][D]
  __shared__ int rows[kMaxRows];
  __shared__ float lse2s[kMaxRows], deltas[kMaxRows];
  __shared__ int count;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int bh = static_cast<int>(blockIdx.x);
  const int b = bh / p.H, h = bh % p.H, hk = h / p.kv_group;
  const float* lse = p.lse + b * p.lse_b + h * p.lse_h;
  if (tid == 0) count = 0;
  __syncthreads();
  // scan_pass<2 * kScan>, written out: through the helper nvcc 13.0 gives
  // pipe_keys<128> other sm_90a code than runs Q3-Q4 measured (the other
  // three kernels take the helpers with their code unchanged).
  for (int i0 = 0; i0 < p.s_q; i0 += kThreads * 2 * kScan) {
    float l[2 * kScan];
#pragma unroll
    for (int u = 0; u < 2 * kScan; ++u) {
      const int i = i0 + u * kThreads + tid;
      l[u] = i < p.s_q ? lse[i * p.lse_s] : INFINITY;
    }
#pragma unroll
    for (int u = 0; u < 2 * kScan; ++u) {
      const bool hit = l[u] < p.threshold && l[u] != -INFINITY;
      const unsigned m = __ballot_sync(0xffffffffu, hit);
      if (m == 0u) continue;
      int base = 0;
      if (lane == 0) base = atomicAdd(&count, __popc(m));
      base = __shfl_sync(0xffffffffu, base, 0);
      if (hit) {
        const int slot = base + __popc(m & ((1u << lane) - 1u));
        if (slot < kMaxRows) rows[slot] = i0 + u * kThreads + tid;
      }
    }
  }
  __syncthreads();
  const int n = min(count, kMaxRows);
  if (p.mode == kScanOnly || (n == 0 && p.mode != kRead)) return;

  const uint16_t* k_head = p.k + b * p.k_b + hk * p.k_h;
  const uint16_t* v_head = p.v + b * p.v_b + hk * p.v_h;
  const int n_blocks = (p.s_kv + kKeys - 1) / kKeys;
  auto issue = [&](int kb) {
    const int k0 = kb * kKeys, nk = min(kKeys, p.s_kv - k0);
    uint16_t* kd = ks + (kb % kStages) * kStage;
    uint16_t* vd = vs + (kb % kStages) * kStage;
    for (int idx = tid; idx < 2 * nk * kPieces; idx += kThreads) {
      const int t = idx / (nk * kPieces), rem = idx - t * nk * kPieces;
      const int j = rem / kPieces, piece = rem - j * kPieces;
      const uint16_t* src = t == 0 ? k_head + (k0 + j) * p.k_s : v_head + (k0 + j) * p.v_s;
      cp_async_16((t == 0 ? kd : vd) + j * D + piece * 8, src + piece * 8);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_blocks) issue(s);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  if (warp < n) load_row<D>(p, b, h, rows[warp], warp, lane, lse, qs, gs, deltas, lse2s);
  const int sub = lane & (kLanesPerKey - 1), slot = lane >> 3;
  float acc[kMaxRows][DL];
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r)
#pragma unroll
    for (int e = 0; e < DL; ++e) acc[r][e] = 0.0f;
  for (int kb = 0; kb < n_blocks; ++kb) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
    __syncthreads();  // stage kb landed for all; stage kb - 1 computed by all
    if (kb + kStages - 1 < n_blocks) issue(kb + kStages - 1);
    asm volatile("cp.async.commit_group;\n" ::);
    if (p.mode == kRead) continue;
    const uint16_t* kc = ks + (kb % kStages) * kStage;
    const uint16_t* vc = vs + (kb % kStages) * kStage;
    const int k0 = kb * kKeys;
#pragma unroll
    for (int t = 0; t < kKeys / (4 * kWarps); ++t) {
      const int j = t * 4 * kWarps + warp * 4 + slot;
      const bool valid = k0 + j < p.s_kv;
      float kf[DL], vf[DL];
#pragma unroll
      for (int e = 0; e < DL; e += 8) {
        unpack8(kc + j * D + (e / 8) * 64 + sub * 8, kf + e);
        unpack8(vc + j * D + (e / 8) * 64 + sub * 8, vf + e);
      }
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r >= n) break;
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int e = 0; e < DL; ++e) {
          const int d = (e / 8) * 64 + sub * 8 + (e % 8);
          s += qs[r * D + d] * kf[e];
          dp += gs[r * D + d] * vf[e];
        }
#pragma unroll
        for (int m = 1; m < kLanesPerKey; m <<= 1) {
          s += __shfl_xor_sync(0xffffffffu, s, m);
          dp += __shfl_xor_sync(0xffffffffu, dp, m);
        }
        float ds = 0.0f;
        if (valid) {
          const uint16_t* bias_row =
              p.bias ? p.bias + b * p.bias_b + h * p.bias_h + rows[r] * p.bias_s : nullptr;
          const float bias_j = bias_row ? bf(bias_row[(k0 + j) * p.bias_e]) * 1.4426950408889634f : 0.0f;
          ds = exp2f(s * p.scale_log2 + bias_j - lse2s[r]) * (dp - deltas[r]);
        }
#pragma unroll
        for (int e = 0; e < DL; ++e) acc[r][e] += ds * kf[e];
      }
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  if (p.mode == kRead) return;
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r >= n) break;
#pragma unroll
    for (int e = 0; e < DL; ++e) {
      acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], 8);
      acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], 16);
    }
    __syncthreads();  // wpart free
    if (slot == 0) {
#pragma unroll
      for (int e = 0; e < DL; ++e) wpart[warp * D + (e / 8) * 64 + sub * 8 + (e % 8)] = acc[r][e];
    }
    __syncthreads();
    for (int d = tid; d < D; d += kThreads) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += wpart[w * D + d];
      const __nv_bfloat16 y = __float2bfloat16(sum * p.scale);
      p.dq[b * p.dq_b + h * p.dq_h + rows[r] * p.dq_s + d] = *reinterpret_cast<const uint16_t*>(&y);
    }
  }
}

// pipe_keys with three changes (runs R1, R3-R8): the rows' q and dO in
// registers, where pipe re-reads them from shared memory at every key (at
// head_dim 128 four times the shared-memory wavefronts of the keys
// themselves, by arithmetic about 17 us of one SM's shared-memory pipe at
// 704x704, where pipe took 13 us over its loads alone); each thread's bias values of a stage loaded
// before the stage is waited for; and lanes of keys past s_kv take zero keys
// (no whole-stage restriction). kEarly issues the first kStages - 1 stages
// before the scan (a head without rows then waits for them and leaves: on
// ordinary data that is their bandwidth, 3 stages of 16 KB a head at head_dim
// 128). A
// head of more than R rows is left alone, as a light kernel would leave it to
// the tiles (runs R1-R4 took min(count, R) rows; with one row per head the
// same work; R5's first form repaired R rows of every head at 10% and every
// row, R6 leaves them).
template <int D, int kKeys, int kStages, int R, bool kEarly, int kMinBlocks = 3, bool kPdl = false>
__global__ void __launch_bounds__(kThreads, kMinBlocks) reg_keys(const Params p) {
  constexpr int DL = D / kLanesPerKey;
  constexpr int kPieces = D / 8;
  constexpr int kStage = kKeys * D;
  constexpr int kSteps = kKeys / (4 * kWarps);  // a warp's 4-key steps in a stage
  static_assert(R <= kMaxRows && R <= kWarps, "rows: listed by the scan, one warp each");
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* ks = reinterpret_cast<uint16_t*>(smem);            // [kStages][kKeys][D]
  uint16_t* vs = ks + kStages * kStage;                         // [kStages][kKeys][D]
  float* qs = reinterpret_cast<float*>(vs + kStages * kStage);  // [kMaxRows][D]
  float* gs = qs + kMaxRows * D;                                // [kMaxRows][D]
  float* wpart = gs + kMaxRows * D;                             // [kWarps][D]
  __shared__ int rows[kMaxRows];
  __shared__ float lse2s[kMaxRows], deltas[kMaxRows];
  __shared__ int count;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int bh = static_cast<int>(blockIdx.x);
  const int b = bh / p.H, h = bh % p.H, hk = h / p.kv_group;
  const float* lse = p.lse + b * p.lse_b + h * p.lse_h;
  const uint16_t* k_head = p.k + b * p.k_b + hk * p.k_h;
  const uint16_t* v_head = p.v + b * p.v_b + hk * p.v_h;
  const int n_blocks = (p.s_kv + kKeys - 1) / kKeys;
  auto issue = [&](int kb) {
    const int k0 = kb * kKeys, nk = min(kKeys, p.s_kv - k0);
    uint16_t* kd = ks + (kb % kStages) * kStage;
    uint16_t* vd = vs + (kb % kStages) * kStage;
    for (int idx = tid; idx < nk * kPieces; idx += kThreads) {
      const int j = idx / kPieces, piece = idx - j * kPieces;
      cp_async_16(kd + j * D + piece * 8, k_head + (k0 + j) * p.k_s + piece * 8);
      cp_async_16(vd + j * D + piece * 8, v_head + (k0 + j) * p.v_s + piece * 8);
    }
  };
  auto prologue = [&]() {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_blocks) issue(s);
      asm volatile("cp.async.commit_group;\n" ::);
    }
  };
  if (kEarly) prologue();
  if (tid == 0) count = 0;
  __syncthreads();
  for (int i0 = 0; i0 < p.s_q; i0 += kThreads * 2 * kScan) {
    scan_pass<2 * kScan>(p, lse, i0, p.s_q, tid, lane, rows, &count);
  }
  __syncthreads();
  const int n = count <= R ? count : 0;  // heads of more rows: left to the tiles
  if (n == 0) {
    if (kEarly) asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  if (!kEarly) prologue();
  if (warp < n) load_row<D>(p, b, h, rows[warp], warp, lane, lse, qs, gs, deltas, lse2s);
  __syncthreads();
  const int sub = lane & (kLanesPerKey - 1), slot = lane >> 3;
  float q[R][DL], g[R][DL], acc[R][DL], lse2[R], delta[R];
  const uint16_t* bias_row[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int e = 0; e < DL; ++e) {
      const int d = (e / 8) * 64 + sub * 8 + (e % 8);
      q[r][e] = r < n ? qs[r * D + d] : 0.0f;
      g[r][e] = r < n ? gs[r * D + d] : 0.0f;
      acc[r][e] = 0.0f;
    }
    lse2[r] = r < n ? lse2s[r] : 0.0f;
    delta[r] = r < n ? deltas[r] : 0.0f;
    bias_row[r] = p.bias && r < n ? p.bias + b * p.bias_b + h * p.bias_h + rows[r] * p.bias_s
                                  : nullptr;
  }
  for (int kb = 0; kb < n_blocks; ++kb) {
    const int k0 = kb * kKeys;
    float bias_j[R][kSteps];  // loaded before the wait: its round trip hides behind it
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < kSteps; ++t) {
        const int key = k0 + t * 4 * kWarps + warp * 4 + slot;
        bias_j[r][t] = bias_row[r] && key < p.s_kv
                           ? bf(bias_row[r][key * p.bias_e]) * 1.4426950408889634f : 0.0f;
      }
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
    __syncthreads();  // stage kb landed for all; stage kb - 1 computed by all
    if (kb + kStages - 1 < n_blocks) issue(kb + kStages - 1);
    asm volatile("cp.async.commit_group;\n" ::);
    const uint16_t* kc = ks + (kb % kStages) * kStage;
    const uint16_t* vc = vs + (kb % kStages) * kStage;
#pragma unroll
    for (int t = 0; t < kSteps; ++t) {
      const int j = t * 4 * kWarps + warp * 4 + slot;
      const bool valid = k0 + j < p.s_kv;
      float kf[DL], vf[DL];
#pragma unroll
      for (int e = 0; e < DL; e += 8) {
        unpack8(kc + j * D + (e / 8) * 64 + sub * 8, kf + e);
        unpack8(vc + j * D + (e / 8) * 64 + sub * 8, vf + e);
      }
#pragma unroll
      for (int e = 0; e < DL; ++e) {  // shared memory no copy wrote: zero keys
        kf[e] = valid ? kf[e] : 0.0f;
        vf[e] = valid ? vf[e] : 0.0f;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float s0 = 0.0f, s1 = 0.0f, dp0 = 0.0f, dp1 = 0.0f;  // two chains each
#pragma unroll
        for (int e = 0; e < DL; e += 2) {
          s0 += q[r][e] * kf[e];
          s1 += q[r][e + 1] * kf[e + 1];
          dp0 += g[r][e] * vf[e];
          dp1 += g[r][e + 1] * vf[e + 1];
        }
        float s = s0 + s1, dp = dp0 + dp1;
#pragma unroll
        for (int m = 1; m < kLanesPerKey; m <<= 1) {
          s += __shfl_xor_sync(0xffffffffu, s, m);
          dp += __shfl_xor_sync(0xffffffffu, dp, m);
        }
        const float ds = valid && r < n
                             ? exp2f(s * p.scale_log2 + bias_j[r][t] - lse2[r]) * (dp - delta[r])
                             : 0.0f;
#pragma unroll
        for (int e = 0; e < DL; ++e) acc[r][e] += ds * kf[e];
      }
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  // The closing sums below repeat pipe_keys' on purpose: with them in one
  // shared device function, ptxas gave pipe_keys<128> other sm_90a code
  // than the one measured in Q3-Q4 and R1 (checked, 2026-12-02), so each
  // kernel keeps the code that ran.
  // kPdl: launched as the programmatic dependent of cuDNN's last kernel, which
  // writes dQ: wait for it before the rows are written (as the landed repair).
  if (kPdl) asm volatile("griddepcontrol.wait;\n" ::: "memory");
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= n) break;
#pragma unroll
    for (int e = 0; e < DL; ++e) {
      acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], 8);
      acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], 16);
    }
    __syncthreads();  // wpart free
    if (slot == 0) {
#pragma unroll
      for (int e = 0; e < DL; ++e) wpart[warp * D + (e / 8) * 64 + sub * 8 + (e % 8)] = acc[r][e];
    }
    __syncthreads();
    for (int d = tid; d < D; d += kThreads) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += wpart[w * D + d];
      const __nv_bfloat16 y = __float2bfloat16(sum * p.scale);
      p.dq[b * p.dq_b + h * p.dq_h + rows[r] * p.dq_s + d] = *reinterpret_cast<const uint16_t*>(&y);
    }
  }
}

}  // namespace

// Sets the kernel's dynamic shared memory and launches it on the current
// stream, kThreads threads a block; `attr`, if given, is the launch's one
// attribute (a cluster size, or the programmatic launch).
template <class Kernel>
void launch(Kernel kernel, unsigned grid, size_t smem, const Params& p,
            const cudaLaunchAttribute* attr = nullptr) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute copy[1];
  if (attr != nullptr) {
    copy[0] = *attr;
    cfg.attrs = copy;
    cfg.numAttrs = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

// reg_keys' instantiation for an engine (kEngineReg .. kEngineRegPdl).
template <int D>
auto reg_kernel(int64_t engine) {
  constexpr int kKeys = kStreamKeys, kStages = kStreamStages, kRows = 1;
  // reg_occ: 6 blocks per SM at head_dim 64 (every head of 360x64 resident at
  // once); at 128 it is reg (3 blocks per SM, all 384 heads of 704x704 at once).
  constexpr int kOcc = D == 64 ? 6 : 3;
  switch (engine) {
    case kEngineRegEarly: return reg_keys<D, kKeys, kStages, kRows, true>;
    case kEngineRegOcc: return reg_keys<D, kKeys, kStages, kRows, false, kOcc>;
    // reg_occ as the programmatic dependent of the kernel ahead of it on the
    // stream (cuDNN's last), as the op launches the landed repair.
    case kEngineRegPdl: return reg_keys<D, kKeys, kStages, kRows, false, kOcc, true>;
    default: return reg_keys<D, kKeys, kStages, kRows, false>;  // reg, reg_tileocc
  }
}

void split_keys(at::Tensor dq, at::Tensor go, at::Tensor q, at::Tensor k, at::Tensor v,
                at::Tensor o, at::Tensor lse, c10::optional<at::Tensor> bias, double scale,
                double threshold, int64_t engine, int64_t max_cluster, int64_t mode) {
  Params p{};
  probe::fill_row_params(p, dq, go, q, k, v, o, lse, bias, scale, threshold);
  const int64_t D = q.size(3);
  p.mode = static_cast<int>(mode);
  const unsigned heads = static_cast<unsigned>(q.size(0) * q.size(1));
  // pipe_keys and reg_keys: their stages of K and V, and the rows.
  const size_t stage_smem = 2 * sizeof(uint16_t) * kStreamStages * kStreamKeys * D +
                            sizeof(float) * D * (2 * kMaxRows + kWarps);
  if (engine >= kEngineReg && engine <= kEngineRegPdl) {  // reg_keys: as pipe_keys, one row
    TORCH_CHECK(mode == kCompute, "reg_keys: the repair only");
    size_t rsmem = stage_smem;
    if (engine == kEngineRegTileOcc) {
      // The landed kernel's blocks per SM (kTileBlocksPerSm: 2 at head_dim
      // 128, 3 at 64), set by shared memory: what a light path inside that
      // kernel's launch would get.
      const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
      const size_t blocks = D == 128 ? 2 : 3;
      rsmem = std::max(rsmem, props->sharedMemPerMultiprocessor / blocks -
                                  props->reservedSharedMemPerBlock - 1024);
    }
    cudaLaunchAttribute programmatic{};
    programmatic.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    programmatic.val.programmaticStreamSerializationAllowed = 1;
    const cudaLaunchAttribute* attr = engine == kEngineRegPdl ? &programmatic : nullptr;
    if (D == 128) {
      launch(reg_kernel<128>(engine), heads, rsmem, p, attr);
    } else {
      launch(reg_kernel<64>(engine), heads, rsmem, p, attr);
    }
    return;
  }
  if (engine == kEnginePipe) {  // pipe_keys: a block per head
    // Its lanes past the keys of a last, partial stage would read shared
    // memory no copy wrote (a NaN there makes 0 * NaN): whole stages only.
    TORCH_CHECK(p.s_kv % kStreamKeys == 0, "pipe_keys: the key length must be a multiple of ",
                kStreamKeys);
    launch(D == 128 ? pipe_keys<128, kStreamKeys, kStreamStages>
                    : pipe_keys<64, kStreamKeys, kStreamStages>,
           heads, stage_smem, p);
    return;
  }
  TORCH_CHECK(engine == kEngineSplit, "unknown engine ", engine);
  p.cluster = static_cast<int>(std::min<int64_t>(max_cluster, (p.s_kv + 63) / 64));
  p.chunk = ((p.s_kv + p.cluster - 1) / p.cluster + 7) / 8 * 8;
  const size_t smem = 2 * sizeof(uint16_t) * p.chunk * D + sizeof(float) * D * (3 * kMaxRows + kWarps);
  auto kernel = D == 128 ? split_keys<128> : split_keys<64>;
  if (p.cluster > 8) {  // clusters of up to 16 blocks: H100 and H200, not portable
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = static_cast<unsigned>(p.cluster);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  launch(kernel, heads * static_cast<unsigned>(p.cluster), smem, p, &cluster);
}
"""


def extension():
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "probe_split_keys_ext",
        cpp_sources="void split_keys(at::Tensor dq, at::Tensor go, at::Tensor q, at::Tensor k, "
                    "at::Tensor v, at::Tensor o, at::Tensor lse, c10::optional<at::Tensor> bias, "
                    "double scale, double threshold, int64_t engine, int64_t max_cluster, "
                    "int64_t mode);",
        cuda_sources=SOURCE, functions=["split_keys"],
        extra_include_paths=[str(Path(__file__).resolve().parent)],
        extra_cuda_cflags=["-O3", "-Xptxas=-v"], verbose=True)


def run_form(ext, c, dq, name):
    """The variant `name` (FORMS) on cell c's dq, in place."""
    ext.split_keys(dq, c.go, c.q, c.k, c.v, c.out, c.lse, c.bias, c.scale, THRESHOLD,
                   *FORMS[name])


def accuracy(ext, c, names=REPAIRS):
    """The repaired rows of the landed repair and of the forms `names` against float64."""
    dq0, _, _ = c.backward()
    got = {"landed": dq0.clone(), **{name: dq0.clone() for name in names}}
    c.repair(got["landed"])
    for name in names:
        run_form(ext, c, got[name], name)
    torch.cuda.synchronize()
    low, picked, ref = affected_rows(c)
    untouched = all(torch.equal(x[~low], dq0[~low]) for x in got.values())
    errors = ", ".join(f"{n} {worst_row_error(x, picked, ref):.3e}" for n, x in got.items())
    bad = ", ".join(f"{n} {int((~x.isfinite()).sum())}" for n, x in got.items())
    return (f"  rows below threshold {int(low.sum())}; worst row error vs float64 over "
            f"{len(picked)} rows: {errors}; non-finite: {bad}; other rows untouched: {untouched}")


def parse_shares(text):
    """A comma-separated list of adversarial shares: none, one_per_head, all, or a
    fraction in (0, 1); ValueError on anything else."""
    shares = []
    for word in text.split(","):
        if word in ("none", "one_per_head", "all"):
            shares.append(word)
            continue
        share = float(word)  # ValueError for a word that is not a number
        if not 0.0 < share < 1.0:
            raise ValueError(f"share {word}: not in (0, 1)")
        shares.append(share)
    return shares


def cell_name(cell):
    """'SQxSKV:D' of a cell, which --cells matches a part of."""
    return f"{cell[2]}x{cell[3]}:{cell[5]}"


def parse_args(argv=None):
    ap = probe_parser(__doc__)
    ap.add_argument("--forms", default=",".join(VARIANTS),
                    help="the forms to time, comma-separated (default: all of FORMS)")
    ap.add_argument("--shares", default="none,one_per_head",
                    help="the shares of the first section (default: none,one_per_head)")
    ap.add_argument("--no-tiles", action="store_true",
                    help="skip the last section (10%% and every row after a light kernel)")
    ap.add_argument("--light", default="pipe_scan",
                    help="the light kernel of the last section, a form of FORMS (default "
                         "pipe_scan, the scan alone; reg_occ leaves heads of more than one "
                         "row after its scan)")
    ap.add_argument("--tile-shares", default="0.1,all",
                    help="the shares of the last section (default: 0.1,all)")
    ap.add_argument("--layout", default="bshd", choices=("bshd", "bhsd"),
                    help="storage of q, k, v and dO (default bshd, as the share table)")
    ap.add_argument("--cells", default="",
                    help="only the cells whose 'SQxSKV:D' contains this, e.g. 704 or "
                         "704x704:128 (default: all)")
    args = ap.parse_args(argv)
    args.forms = args.forms.split(",")
    unknown = sorted((set(args.forms) | {args.light}) - set(FORMS))
    if unknown:
        ap.error(f"unknown forms {unknown}; FORMS has {list(FORMS)}")
    try:
        args.shares = parse_shares(args.shares)
        args.tile_shares = parse_shares(args.tile_shares)
    except ValueError as e:
        ap.error(str(e))
    args.cells = [cell for cell in CELLS if args.cells in cell_name(cell)]
    if not args.cells:
        ap.error(f"--cells matches none of {[cell_name(c) for c in CELLS]}")
    return args


def main(argv=None):
    args = parse_args(argv)
    start("probe_split_keys.py")
    ext = extension()
    if args.layout != "bshd":
        print(f"layout {args.layout}", flush=True)
    for cell in args.cells:
        for share in args.shares:
            c = leaf_cell(cell, share, args.layout)

            def form(name):
                return c.then(lambda dq: run_form(ext, c, dq, name))

            steps = {"landed": c.repaired}
            steps.update({name: form(name) for name in args.forms})
            _, line = paired_added(cell, str(share), lambda _: c.backward(), steps, args.rounds,
                                   args.repeats)
            print(line, flush=True)
            if share != "none":
                print(accuracy(ext, c, [f for f in args.forms if f in REPAIRS]), flush=True)
    if args.no_tiles:
        return
    # Where a head has more rows than a light kernel takes, the tiles still run:
    # after the light kernel (--light: pipe's scan alone by default), then the
    # landed repair as a plain second launch; a tail launch from the device adds
    # about 3.7 us more (probe_tail_launch.cu).
    for cell in args.cells:
        for share in args.tile_shares:
            c = leaf_cell(cell, share, args.layout)

            def light_then_repair(dq):
                run_form(ext, c, dq, args.light)
                c.repair(dq)

            _, line = paired_added(cell, str(share), lambda _: c.backward(),
                                   {"landed": c.repaired, f"{args.light}+landed": c.then(light_then_repair)},
                                   args.rounds, args.repeats)
            print(line, flush=True)


if __name__ == "__main__":
    main()

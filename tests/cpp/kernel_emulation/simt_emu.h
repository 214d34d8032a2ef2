// A small CPU emulator of the CUDA features the dQ-repair kernels use, so
// that their real source runs (slowly) on a machine without a GPU.
//
// Every CUDA thread of a block is a fiber (ucontext) on one OS thread,
// scheduled round-robin; __syncthreads and the warp collectives (shuffles,
// ballots, ldmatrix, mma.sync) are barriers among the fibers. cp.async copies
// are deferred until the thread's cp.async.wait_group retires their group, so
// a missing wait shows up as stale data; with EMU_EAGER=1 they land at once
// instead, so a stage refilled before every warp is done with it shows up. Shared memory starts
// filled with 0xff bytes (NaN in bf16/fp16) so that unwritten reads show.
// Semantics follow the PTX ISA (ldmatrix, mma.m16n8k16 fragment layouts).
// wgmma (sm_90a) is a barrier of the whole block (one warpgroup): its
// shared-memory operand is read at issue, through the descriptor as the PTX
// ISA's canonical 128-byte-swizzled layouts define it, and read again when the
// wgmma.wait_group that retires it runs (shared memory overwritten while the
// op was in flight shows); its results land only at that wait (reading them
// earlier shows). A wgmma fails when no wgmma.fence came since the thread's
// last wait, or when it reads bytes a cp.async landed that the writing thread
// has not yet passed fence.proxy.async for.
// A thread-block cluster (sm_90) runs its blocks' fibers together:
// barrier.cluster.arrive / .wait is a barrier over all of them (a thread
// that arrives twice, waits without arriving or ends arrived fails), and
// mapa maps an address of this block's shared memory into another block's.
// Clusters run one after another, as single blocks do.
// OPENWAM_REPAIR_TRACE_TILE records each tile of work in emu::tile_trace and
// fills the shared memory past the header with 0xff again, so that any tile
// (not only a block's first) that reads rows it never loaded shows.
// OPENWAM_REPAIR_CHECK_ALIGNED fails a misaligned vector load.
#pragma once

#define OPENWAM_REPAIR_EMULATE 1

#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct uint4 {
  unsigned x, y, z, w;
};
struct float4 {
  float x, y, z, w;
};
struct EmuDim3 {
  unsigned x = 0, y = 0, z = 0;
};

namespace emu {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "emulator: %s\n", what);
  std::abort();
}

struct Copy {
  unsigned char* dst;
  const unsigned char* src;
  int bytes;
};

enum class Wait { kNone, kBlock, kWarp, kCluster };

// One thread's share of a wgmma: its accumulator and the values it gets
// when the wait retires the op.
struct WgmmaResult {
  float* d;
  std::vector<float> values;
  // Lane 0 of each warp only: the shared-memory operand (16 x n_cols) as
  // its warp read it at issue, checked again at that warp's wait.
  uint64_t desc = 0;
  bool trans_b = false;
  int n_cols = 0;
  std::vector<uint16_t> b_value;
};

struct Thread {
  ucontext_t ctx;
  std::vector<char> stack;
  EmuDim3 tid;
  int lane = 0, warp = 0;
  bool done = false;
  Wait wait = Wait::kNone;
  unsigned long wait_gen = 0;
  std::vector<Copy> open_group;
  std::vector<std::vector<Copy>> groups;
  std::vector<WgmmaResult> wgmma_open;
  std::vector<std::vector<WgmmaResult>> wgmma_groups;
  bool wgmma_fenced = false;        // a wgmma.fence since the last wait
  std::vector<uint32_t> unfenced;   // cp.async chunks landed, no fence.proxy.async yet
  bool cluster_arrived = false;     // arrived at the cluster barrier, not yet waited
  unsigned long cluster_phase = 0;  // the phase it arrived in
};

// What each thread hands to a wgmma (all must agree but on `a`).
struct WgmmaSlot {
  uint32_t a[4];
  uint64_t desc;
  int n_tiles;
  bool accumulate, trans_b;
};

// Asynchronous ops in commit groups (cp.async copies, wgmma): committing
// closes the thread's open group; a wait retires the oldest groups, op by
// op, until at most `pending` remain.
template <class Op>
inline void commit_group(std::vector<Op>& open, std::vector<std::vector<Op>>& groups) {
  groups.push_back(std::move(open));
  open.clear();
}
template <class Op, class Retire>
inline void retire_groups(std::vector<std::vector<Op>>& groups, int pending, Retire retire) {
  while (static_cast<int>(groups.size()) > pending) {
    for (const Op& op : groups.front()) retire(op);
    groups.erase(groups.begin());
  }
}

struct WarpState {
  int arrived = 0;
  unsigned long gen = 0;
  uint64_t slot[32][8];
  size_t wgmma_issued = 0;  // this warp's wgmma ops so far (Block::wgmma_log)
};

struct Stats {
  long ldsm = 0, ldsm_conflicts = 0, mma = 0, cp_async = 0, barriers = 0, wgmma = 0;
};
// The addresses prefetch_l2 was given, for the tests to check (a hint has
// no effect on results).
inline std::vector<const void*> l2_prefetches;

// The grid ahead of the kernel in its stream, when the kernel may start
// before it ends (a programmatic launch: cuDNN's backward, writing dQ). A
// test sets it to that grid's writes; they land at the first
// wait_for_grid_ahead of any thread, or when the test calls
// finish_grid_ahead after the launch. A thread that writes what the grid
// ahead writes, without waiting first, then has its write overwritten.
inline std::function<void()> grid_ahead;
inline void finish_grid_ahead() {
  if (grid_ahead) {
    const std::function<void()> writes = std::move(grid_ahead);
    grid_ahead = nullptr;
    writes();
  }
}

struct Block {
  EmuDim3 bid, gdim, bdim;
  std::vector<unsigned char> smem;
  std::vector<Thread> threads;
  std::vector<WarpState> warps;
  std::vector<WgmmaSlot> wgmma_slots;
  std::vector<WgmmaSlot> wgmma_log;  // each wgmma as its first warp issued it
  std::vector<uint8_t> unfenced;  // per shared-memory byte: landed by cp.async, not fenced
  int arrived = 0;
  unsigned long gen = 0;
  ucontext_t sched;
  std::function<void()> body;
};

inline Thread* cur = nullptr;
inline Block* blk = nullptr;

// The blocks of the cluster being run (consecutive block indices; one block
// without clusters) and its barrier.
struct Cluster {
  std::vector<Block*> blocks;
  int threads = 0, arrived = 0;
  unsigned long gen = 0;
};
inline Cluster* clu = nullptr;
inline Stats stats;
// cp.async copies land when issued instead of at the wait that retires them.
inline bool eager_copies = std::getenv("EMU_EAGER") != nullptr;
inline bool skew = std::getenv("EMU_SKEW") != nullptr;
inline uint32_t random_state = 12345u;
inline uint32_t next_random() {
  random_state = random_state * 1664525u + 1013904223u;
  return random_state >> 16;
}

inline void yield() { swapcontext(&cur->ctx, &blk->sched); }

inline bool runnable(const Thread& t) {
  switch (t.wait) {
    case Wait::kNone: return true;
    case Wait::kBlock: return blk->gen != t.wait_gen;
    case Wait::kWarp: return blk->warps[t.warp].gen != t.wait_gen;
    case Wait::kCluster: return clu->gen != t.wait_gen;
  }
  return false;
}

inline void block_sync() {
  ++stats.barriers;
  const unsigned long g = blk->gen;
  if (++blk->arrived == static_cast<int>(blk->threads.size())) {
    blk->arrived = 0;
    ++blk->gen;
    return;
  }
  cur->wait = Wait::kBlock;
  cur->wait_gen = g;
  yield();
  cur->wait = Wait::kNone;
}

inline void warp_sync() {
  WarpState& w = blk->warps[cur->warp];
  const unsigned long g = w.gen;
  if (++w.arrived == 32) {
    w.arrived = 0;
    ++w.gen;
    return;
  }
  cur->wait = Wait::kWarp;
  cur->wait_gen = g;
  yield();
  cur->wait = Wait::kNone;
}

// barrier.cluster.arrive / .wait: every thread of every block of the
// cluster arrives before a waiting thread goes on; a thread alternates them.
inline void cluster_arrive() {
  if (cur->cluster_arrived) fail("barrier.cluster.arrive twice without a wait");
  cur->cluster_arrived = true;
  cur->cluster_phase = clu->gen;
  if (++clu->arrived == clu->threads) {
    clu->arrived = 0;
    ++clu->gen;
  }
}

inline void cluster_wait() {
  if (!cur->cluster_arrived) fail("barrier.cluster.wait without an arrive");
  cur->cluster_arrived = false;
  if (clu->gen != cur->cluster_phase) return;
  cur->wait = Wait::kCluster;
  cur->wait_gen = cur->cluster_phase;
  yield();
  cur->wait = Wait::kNone;
}

inline uint64_t* my_slot() { return blk->warps[cur->warp].slot[cur->lane]; }
inline uint64_t* slot_of(int lane) { return blk->warps[cur->warp].slot[lane]; }

inline void trampoline() {
  blk->body();
  cur->done = true;
  for (const auto& g : cur->groups) {
    if (!g.empty()) fail("a thread ended with cp.async groups never waited for");
  }
  if (cur->cluster_arrived) fail("a thread ended arrived at a cluster barrier it never waited on");
  if (!cur->wgmma_open.empty() || !cur->wgmma_groups.empty())
    fail("a thread ended with wgmma ops never committed or waited for");
  swapcontext(&cur->ctx, &blk->sched);
}

// Runs `body` as every thread of the cluster of blocks first .. first + n - 1
// (threads x 1 x 1 each) with `smem_bytes` of dynamic shared memory each.
inline void run_cluster(unsigned first, unsigned n, EmuDim3 gdim, int threads, int smem_bytes,
                        const std::function<void()>& body) {
  if (threads % 32 != 0) fail("block size must be a multiple of 32");
  std::vector<Block> blocks(n);
  Cluster c;
  c.threads = static_cast<int>(n) * threads;
  for (unsigned r = 0; r < n; ++r) {
    Block& b = blocks[r];
    b.bid.x = first + r;
    b.gdim = gdim;
    b.bdim.x = threads;
    b.bdim.y = b.bdim.z = 1;
    b.smem.assign(smem_bytes, 0xff);
    b.unfenced.assign(smem_bytes, 0);
    b.threads.resize(threads);
    b.warps.resize((threads + 31) / 32);
    b.wgmma_slots.resize(threads);
    b.body = body;
    c.blocks.push_back(&b);
    for (int i = 0; i < threads; ++i) {
      Thread& t = b.threads[i];
      t.tid.x = i;
      t.lane = i % 32;
      t.warp = i / 32;
      t.stack.resize(256 * 1024);
      getcontext(&t.ctx);
      t.ctx.uc_stack.ss_sp = t.stack.data();
      t.ctx.uc_stack.ss_size = t.stack.size();
      t.ctx.uc_link = nullptr;
      makecontext(&t.ctx, trampoline, 0);
    }
  }
  Block* saved_blk = blk;
  Cluster* saved_clu = clu;
  clu = &c;
  for (;;) {
    bool all_done = true, any_runnable = false;
    for (Block& b : blocks) {
      blk = &b;
      for (Thread& t : b.threads) {
        if (t.done) continue;
        all_done = false;
        if (!runnable(t)) continue;
        any_runnable = true;
        // EMU_SKEW: runnable threads sit out a round at random, so that warps
        // drift apart as they do on hardware (exposes missing barriers); one
        // warp of each block (a different one from block to block) runs 4
        // times slower still, so that the others get far ahead of it between
        // barriers (a refill a barrier too late to guard still passed the
        // even drift).
        const unsigned rate = t.warp == static_cast<int>(b.bid.x % 4) ? 16u : 4u;
        if (skew && (next_random() % rate) != 0u) continue;
        cur = &t;
        swapcontext(&b.sched, &t.ctx);
      }
    }
    if (all_done) break;
    if (!any_runnable) fail("deadlock: every live thread waits at a barrier others never reach");
  }
  blk = saved_blk;
  clu = saved_clu;
  cur = nullptr;
}

// A grid of blocks in clusters of `cluster` consecutive blocks, one cluster
// after another.
inline void launch(unsigned grid, int threads, int smem_bytes, const std::function<void()>& body,
                   unsigned cluster = 1) {
  if (cluster == 0 || grid % cluster != 0) fail("the grid must be whole clusters");
  EmuDim3 g;
  g.x = grid;
  g.y = g.z = 1;
  for (unsigned i = 0; i < grid; i += cluster) run_cluster(i, cluster, g, threads, smem_bytes, body);
}

inline void check_smem(const void* p, int bytes, int align) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < blk->smem.data() || c + bytes > blk->smem.data() + blk->smem.size()) {
    fail("shared-memory access out of bounds");
  }
  if (reinterpret_cast<uintptr_t>(c) % align != 0) fail("misaligned shared-memory access");
}

// A cp.async chunk landed: generic-proxy bytes, unseen by wgmma until the
// writing thread's fence.proxy.async.
inline void landed(unsigned char* dst) {
  const auto off = static_cast<uint32_t>(dst - blk->smem.data());
  std::fill_n(blk->unfenced.begin() + off, 16, uint8_t{1});
  cur->unfenced.push_back(off);
}

}  // namespace emu

#define threadIdx (emu::cur->tid)
#define blockIdx (emu::blk->bid)
#define gridDim (emu::blk->gdim)
#define blockDim (emu::blk->bdim)

inline void __syncthreads() { emu::block_sync(); }

template <typename T>
inline T emu_exchange(T v, int src_lane, bool take) {
  static_assert(sizeof(T) <= 8, "scalar only");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  emu::my_slot()[0] = bits;
  emu::warp_sync();
  const uint64_t got = emu::slot_of(src_lane)[0];
  emu::warp_sync();
  if (!take) return v;
  T r;
  std::memcpy(&r, &got, sizeof(T));
  return r;
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  if (mask != 0xffffffffu) emu::fail("only full-warp shuffles are emulated");
  return emu_exchange(v, emu::cur->lane ^ lane_mask, true);
}

template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta) {
  if (mask != 0xffffffffu) emu::fail("only full-warp shuffles are emulated");
  const int lane = emu::cur->lane;
  const int src = lane >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane;
  return emu_exchange(v, src, true);
}

inline unsigned __ballot_sync(unsigned mask, bool pred) {
  if (mask != 0xffffffffu) emu::fail("only full-warp ballots are emulated");
  emu::my_slot()[0] = pred ? 1 : 0;
  emu::warp_sync();
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= static_cast<unsigned>(emu::slot_of(l)[0] & 1) << l;
  emu::warp_sync();
  return r;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }

inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p += v;
  return old;
}

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

// A vector load from global memory must be aligned to its size on the GPU;
// the CPU would read a misaligned one without complaint. Aborts the test
// binary (an emulated thread cannot unwind into Catch2).
#define OPENWAM_REPAIR_CHECK_ALIGNED(ptr, bytes)                                         \
  do {                                                                                 \
    if (reinterpret_cast<uintptr_t>(ptr) % (bytes) != 0) {                             \
      std::fprintf(stderr, "misaligned %d-byte global load at %s:%d\n", (bytes), __FILE__, \
                   __LINE__);                                                          \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)

namespace openwam {
namespace repair {

inline unsigned char* smem_base() { return emu::blk->smem.data(); }

// Shared-space addresses are offsets into the block's shared memory.
inline uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(static_cast<const unsigned char*>(p) - smem_base());
}

inline void cluster_arrive() { emu::cluster_arrive(); }
inline void cluster_wait() { emu::cluster_wait(); }

// mapa: the same offset in the shared memory of block `rank` of the cluster.
template <class T>
inline T* cluster_peer(T* p, int rank) {
  const auto* c = reinterpret_cast<const unsigned char*>(p);
  if (c < emu::blk->smem.data() || c >= emu::blk->smem.data() + emu::blk->smem.size())
    emu::fail("mapa of an address outside the block's shared memory");
  if (rank < 0 || rank >= static_cast<int>(emu::clu->blocks.size()))
    emu::fail("mapa to a rank outside the cluster");
  return reinterpret_cast<T*>(emu::clu->blocks[rank]->smem.data() + (c - emu::blk->smem.data()));
}

inline void cp_async_16(uint32_t dst_s, const void* src, int src_bytes) {
  unsigned char* dst = smem_base() + dst_s;
  emu::check_smem(dst, 16, 16);
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0) emu::fail("cp.async source not 16-byte aligned");
  if (src_bytes < 0 || src_bytes > 16) emu::fail("cp.async src-size out of 0..16");
  ++emu::stats.cp_async;
  if (emu::eager_copies) {  // land at once: shows a stage refilled while others still read it
    std::memcpy(dst, src, src_bytes);
    std::memset(dst + src_bytes, 0, 16 - src_bytes);
    emu::landed(dst);
    return;
  }
  emu::cur->open_group.push_back(
      {dst, static_cast<const unsigned char*>(src), src_bytes});
}

inline void prefetch_l2(const void* p) { emu::l2_prefetches.push_back(p); }

inline void wait_for_grid_ahead() { emu::finish_grid_ahead(); }

inline void cp_async_commit() { emu::commit_group(emu::cur->open_group, emu::cur->groups); }

template <int kPending>
inline void cp_async_wait() {
  emu::retire_groups(emu::cur->groups, kPending, [](const emu::Copy& c) {
    std::memcpy(c.dst, c.src, c.bytes);
    std::memset(c.dst + c.bytes, 0, 16 - c.bytes);
    emu::landed(c.dst);
  });
}

// ldmatrix .x4: lane l gives the row address for row l % 8 of matrix l / 8.
inline void emu_ldsm(uint32_t (&r)[4], uint32_t addr, bool trans) {
  const unsigned char* p = smem_base() + addr;
  emu::check_smem(p, 16, 16);
  ++emu::stats.ldsm;
  emu::my_slot()[0] = reinterpret_cast<uint64_t>(p);
  emu::warp_sync();
  const int lane = emu::cur->lane;
  if (lane == 0) {  // bank groups of each matrix's 8 rows must differ
    for (int m = 0; m < 4; ++m) {
      unsigned seen = 0;
      for (int i = 0; i < 8; ++i) {
        const unsigned group = (emu::slot_of(8 * m + i)[0] / 16) % 8;
        if (seen & (1u << group)) ++emu::stats.ldsm_conflicts;
        seen |= 1u << group;
      }
    }
  }
  for (int m = 0; m < 4; ++m) {
    uint16_t e[2];
    for (int k = 0; k < 2; ++k) {
      // Without .trans: row lane/4, columns 2 (lane%4) + k. With .trans:
      // row 2 (lane%4) + k, column lane/4.
      const int row = trans ? 2 * (lane % 4) + k : lane / 4;
      const int col = trans ? lane / 4 : 2 * (lane % 4) + k;
      const auto* addr = reinterpret_cast<const uint16_t*>(emu::slot_of(8 * m + row)[0]);
      e[k] = addr[col];
    }
    r[m] = e[0] | (static_cast<uint32_t>(e[1]) << 16);
  }
  emu::warp_sync();
}

inline void ldsm_x4(uint32_t (&r)[4], uint32_t addr) { emu_ldsm(r, addr, false); }
inline void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) { emu_ldsm(r, addr, true); }

// mma.m16n8k16 row.col with fp32 accumulators; `to_float` decodes a 16-bit
// element. Fragments (PTX ISA): A a0 (g, 2t..2t+1), a1 (g+8, ..), a2 (g,
// 2t+8..), a3 (g+8, 2t+8..); B b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g);
// C c0, c1 (g, 2t..), c2, c3 (g+8, 2t..), with g = lane/4, t = lane%4.
template <class ToFloat>
inline void emu_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                    ToFloat to_float) {
  ++emu::stats.mma;
  uint64_t* s = emu::my_slot();
  for (int i = 0; i < 4; ++i) s[i] = a[i];
  s[4] = b0;
  s[5] = b1;
  emu::warp_sync();
  auto a_elem = [&](int row, int k) {
    const int lane = (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    const uint32_t w = static_cast<uint32_t>(emu::slot_of(lane)[reg]);
    return to_float(static_cast<uint16_t>((k & 1) ? w >> 16 : w));
  };
  auto b_elem = [&](int k, int n) {
    const int lane = n * 4 + (k % 8) / 2;
    const int reg = 4 + (k >= 8 ? 1 : 0);
    const uint32_t w = static_cast<uint32_t>(emu::slot_of(lane)[reg]);
    return to_float(static_cast<uint16_t>((k & 1) ? w >> 16 : w));
  };
  const int lane = emu::cur->lane;
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = lane / 4 + (e >= 2 ? 8 : 0);
    const int col = 2 * (lane % 4) + (e & 1);
    float acc = d[e];
    for (int k = 0; k < 16; ++k) acc += a_elem(row, k) * b_elem(k, col);
    out[e] = acc;
  }
  emu::warp_sync();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

// ---------------------------------------------------------------- wgmma
// A shared-memory operand through its descriptor (PTX ISA, "Matrix
// Descriptor Format", 128-byte swizzle): element (k, n) of B, k < 16. K-major:
// 8-row groups of n `stride` apart, rows 128 bytes apart, k contiguous.
// MN-major: 64-column blocks of n `leading` apart, 8-row groups of k
// `stride` apart, rows 128 bytes apart, n contiguous. The swizzle XORs bits
// 4-6 of the address with bits 7-9. `at_issue`: the read of a wgmma being
// issued (its data must have passed fence.proxy.async), not the check at
// its retiring wait that the data is unchanged.
inline uint16_t wgmma_b_elem(uint64_t desc, bool trans_b, int k, int n, bool at_issue = true) {
  const uint32_t start = static_cast<uint32_t>(desc & 0x3fff) << 4;
  const uint32_t leading = static_cast<uint32_t>((desc >> 16) & 0x3fff) << 4;
  const uint32_t stride = static_cast<uint32_t>((desc >> 32) & 0x3fff) << 4;
  if ((desc >> 62) != 1) emu::fail("wgmma descriptor: not the 128-byte swizzle");
  if (((desc >> 49) & 7) != 0) emu::fail("wgmma descriptor: base offset");
  if ((start & 0x380) != 0) emu::fail("wgmma operand start not within 128 bytes of a 1024-byte atom");
  const uint32_t addr = trans_b ? start + (n / 64) * leading + (k / 8) * stride + (k % 8) * 128 +
                                      (n % 64) * 2
                                : start + (n / 8) * stride + (n % 8) * 128 + k * 2;
  const uint32_t swizzled = addr ^ (((addr >> 7) & 7) << 4);
  const unsigned char* p = smem_base() + swizzled;
  emu::check_smem(p, 2, 2);
  if (at_issue && emu::blk->unfenced[swizzled] != 0)
    emu::fail("wgmma reads cp.async data not yet passed through fence.proxy.async");
  uint16_t x;
  std::memcpy(&x, p, 2);
  return x;
}

// The values an in-flight wgmma leaves in `d` (an earlier op of a chain), or
// d's own.
inline const float* wgmma_pending(float* d) {
  for (auto it = emu::cur->wgmma_open.rbegin(); it != emu::cur->wgmma_open.rend(); ++it)
    if (it->d == d) return it->values.data();
  for (auto g = emu::cur->wgmma_groups.rbegin(); g != emu::cur->wgmma_groups.rend(); ++g)
    for (auto it = g->rbegin(); it != g->rend(); ++it)
      if (it->d == d) return it->values.data();
  return d;
}

// d (64 x 8 kN) (+)= A (64 x 16: mma.m16n8k16 A fragments, warp w rows
// 16 w..) * B (16 x 8 kN, shared memory through `desc`). Each warp computes
// and retires its own 16 rows, synchronized only within the warp, as
// `.sync.aligned` promises: another warp of the warpgroup may still be
// reading B after this one's wait returned (a stage refilled on one warp's
// wait alone fails at the other warps' waits). Every warp must issue the
// same sequence of wgmma (checked against the first warp's).
template <int kN, class ToFloat>
inline void emu_wgmma(float (&d)[kN][4], const uint32_t (&a)[4], uint64_t desc, bool accumulate,
                      bool trans_b, ToFloat to_float) {
  if (emu::blk->threads.size() != 128) emu::fail("wgmma: the block must be one warpgroup");
  if (!emu::cur->wgmma_fenced) emu::fail("wgmma without a wgmma.fence since the last wait");
  ++emu::stats.wgmma;
  emu::WgmmaSlot& mine = emu::blk->wgmma_slots[emu::cur->tid.x];
  std::memcpy(mine.a, a, sizeof mine.a);
  mine.desc = desc, mine.n_tiles = kN, mine.accumulate = accumulate, mine.trans_b = trans_b;
  emu::warp_sync();
  const int warp = emu::cur->warp, lane = emu::cur->lane;
  const emu::WgmmaSlot& first = emu::blk->wgmma_slots[32 * warp];
  auto same = [](const emu::WgmmaSlot& x, const emu::WgmmaSlot& y) {
    return x.desc == y.desc && x.n_tiles == y.n_tiles && x.accumulate == y.accumulate &&
           x.trans_b == y.trans_b;
  };
  if (!same(mine, first)) emu::fail("wgmma: the warp's threads disagree on the instruction");
  if (lane == 0) {
    std::vector<emu::WgmmaSlot>& log = emu::blk->wgmma_log;
    const size_t i = emu::blk->warps[warp].wgmma_issued++;
    if (i == log.size()) {
      log.push_back(first);
    } else if (!same(first, log[i])) {
      emu::fail("wgmma: the warpgroup's warps disagree on the instruction");
    }
  }
  auto a_elem = [&](int row, int k) {  // rows of this warp: its own threads' registers
    const int thread = (row / 16) * 32 + (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row % 16 >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    const uint32_t w = emu::blk->wgmma_slots[thread].a[reg];
    return to_float(static_cast<uint16_t>((k & 1) ? w >> 16 : w));
  };
  const float* base = wgmma_pending(&d[0][0]);
  std::vector<float> out(4 * kN);
  for (int j = 0; j < kN; ++j) {
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * warp + lane / 4 + (e >= 2 ? 8 : 0);
      const int col = 8 * j + 2 * (lane % 4) + (e & 1);
      float acc = accumulate ? base[4 * j + e] : 0.0f;
      for (int k = 0; k < 16; ++k)
        acc += a_elem(row, k) * to_float(wgmma_b_elem(desc, trans_b, k, col));
      out[4 * j + e] = acc;
    }
  }
  emu::WgmmaResult result{&d[0][0], std::move(out), desc, trans_b, 8 * kN, {}};
  if (lane == 0) {  // the operand as this warp read it, checked again at its wait
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < 8 * kN; ++n) result.b_value.push_back(wgmma_b_elem(desc, trans_b, k, n));
  }
  emu::warp_sync();  // every thread of the warp read the slots
  emu::cur->wgmma_open.push_back(std::move(result));
}

inline void wgmma_fence() { emu::cur->wgmma_fenced = true; }
template <int kN>
inline void wgmma_fence_operand(float (&)[kN][4]) {}
inline void fence_proxy_async() {
  for (const uint32_t off : emu::cur->unfenced)
    std::fill_n(emu::blk->unfenced.begin() + off, 16, uint8_t{0});
  emu::cur->unfenced.clear();
}

inline void wgmma_commit() { emu::commit_group(emu::cur->wgmma_open, emu::cur->wgmma_groups); }

template <int kPending>
inline void wgmma_wait() {
  emu::cur->wgmma_fenced = false;  // the registers are the program's again
  emu::retire_groups(emu::cur->wgmma_groups, kPending, [](const emu::WgmmaResult& r) {
    for (size_t i = 0; i < r.b_value.size(); ++i) {  // unchanged while in flight
      const int k = static_cast<int>(i) / r.n_cols, n = static_cast<int>(i) % r.n_cols;
      if (wgmma_b_elem(r.desc, r.trans_b, k, n, false) != r.b_value[i])
        emu::fail("shared memory read by a wgmma changed before the wait that retires it");
    }
    std::copy(r.values.begin(), r.values.end(), r.d);
  });
}

inline float bf16_to_float(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_float(uint16_t x) {
  _Float16 h;
  std::memcpy(&h, &x, 2);
  return static_cast<float>(h);
}

inline uint16_t float_to_f16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t x;
  std::memcpy(&x, &h, 2);
  return x;
}

struct Bf16 {
  static constexpr bool kCenterKeys = false;
  static float to_float(uint16_t x) { return bf16_to_float(x); }
  static uint16_t from_float(float x) { return float_to_bf16(x); }
  static uint32_t pack(float lo, float hi) {
    return float_to_bf16(lo) | (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
  }
  static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    emu_mma(d, a, b0, b1, bf16_to_float);
  }
  template <int kN, int kTransB>
  static void wgmma(float (&d)[kN][4], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    emu_wgmma<kN>(d, a, desc, accumulate != 0, kTransB != 0, bf16_to_float);
  }
};

struct Fp16 {
  static constexpr bool kCenterKeys = true;
  static float to_float(uint16_t x) { return f16_to_float(x); }
  static uint16_t from_float(float x) { return float_to_f16(x); }
  static uint32_t pack(float lo, float hi) {
    return float_to_f16(lo) | (static_cast<uint32_t>(float_to_f16(hi)) << 16);
  }
  static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    emu_mma(d, a, b0, b1, f16_to_float);
  }
  template <int kN, int kTransB>
  static void wgmma(float (&d)[kN][4], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    emu_wgmma<kN>(d, a, desc, accumulate != 0, kTransB != 0, f16_to_float);
  }
};

inline float fast_exp2(float x) { return std::exp2(x); }

}  // namespace repair
}  // namespace openwam

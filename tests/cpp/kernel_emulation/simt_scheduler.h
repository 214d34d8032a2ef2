// The emulator's threads and how they run: the CUDA keywords and vector
// types as plain C++, each CUDA thread's fiber and the state it carries
// (its cp.async and wgmma commit groups included, which the later pieces
// fill), the round-robin scheduler (EMU_SKEW: warps drifting apart),
// __syncthreads, the warp barrier the collectives use, the cluster barrier
// (a thread that arrives twice, waits without arriving or ends arrived
// fails), and the launch of a grid as clusters of blocks.
#pragma once

#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <utility>
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

}  // namespace emu

#define threadIdx (emu::cur->tid)
#define blockIdx (emu::blk->bid)
#define gridDim (emu::blk->gdim)
#define blockDim (emu::blk->bdim)

inline void __syncthreads() { emu::block_sync(); }

inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p += v;
  return old;
}

namespace openwam {
namespace repair {

inline void cluster_arrive() { emu::cluster_arrive(); }
inline void cluster_wait() { emu::cluster_wait(); }

}  // namespace repair
}  // namespace openwam

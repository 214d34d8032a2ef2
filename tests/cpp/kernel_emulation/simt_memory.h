// Memory as the kernels see it: shared-space addresses and their bounds,
// mapa into another block of the cluster, cp.async copies (deferred to the
// wait that retires their group, or landed at once with EMU_EAGER) and
// fence.proxy.async, which hands what they landed to wgmma; on the global
// side, the L2 prefetch hint, the grid ahead of a programmatic launch and the
// vector loads' alignment check (OPENWAM_REPAIR_CHECK_ALIGNED).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "simt_scheduler.h"

namespace emu {

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

// cp.async copies land when issued instead of at the wait that retires them.
inline bool eager_copies = std::getenv("EMU_EAGER") != nullptr;

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

inline void fence_proxy_async() {
  for (const uint32_t off : emu::cur->unfenced)
    std::fill_n(emu::blk->unfenced.begin() + off, 16, uint8_t{0});
  emu::cur->unfenced.clear();
}

}  // namespace repair
}  // namespace openwam

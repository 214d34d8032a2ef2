// The PTX instructions of the dQ-row repair kernels, behind small functions.
//
// The kernels use only these (plus warp shuffles, ballots and barriers), so
// the CPU emulation in the tests swaps in its own versions of exactly this
// list. Needs sm_80 or newer (cp.async, bf16 mma.sync); older targets get a
// trap, never a silent wrong answer.
#pragma once

#include <cstdint>

namespace openwam {
namespace repair {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define OPENWAM_REPAIR_SM80 1
#else
#define OPENWAM_REPAIR_SM80 0
#endif

// The block's dynamic shared memory (one declaration for every kernel).
// 1024-byte aligned: the tiles' 128-byte swizzle is the wgmma descriptors'
// only when bits 7-9 of a tile's address are 0 (layout.cuh).
__device__ __forceinline__ unsigned char* smem_base() {
  extern __shared__ __align__(1024) unsigned char openwam_repair_smem[];
  return openwam_repair_smem;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------- cp.async
// 16 bytes global -> shared (`dst` a shared-space address, smem_u32); only
// the first `src_bytes` (0..16) are read, the rest zero-filled. `src` must be
// a valid address even when src_bytes is 0. .cg: through L2 only (each chunk
// is read once per block).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
#if OPENWAM_REPAIR_SM80
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
#else
  __trap();
#endif
}

// A hint: bring the 128-byte line holding `p` into L2 (no register, no
// shared memory, nothing to wait for). Callers pass addresses inside their
// tensors.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

__device__ __forceinline__ void cp_async_commit() {
#if OPENWAM_REPAIR_SM80
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most `kPending` committed groups of this thread are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if OPENWAM_REPAIR_SM80
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// ---------------------------------------------------------------- clusters
// The blocks of a thread-block cluster (sm_90) that share a split tile
// (layout.cuh, split_tile): a barrier across them, and the
// address of a shared-memory location of this block in another block of the
// cluster (a generic address into distributed shared memory).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define OPENWAM_REPAIR_SM90 1
#else
#define OPENWAM_REPAIR_SM90 0
#endif

// Every thread of every block of the cluster arrives, then waits; a thread
// alternates the two. Arrive releases this thread's earlier writes (shared
// memory of any block of the cluster), wait acquires the others'.
__device__ __forceinline__ void cluster_arrive() {
#if OPENWAM_REPAIR_SM90
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if OPENWAM_REPAIR_SM90
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

template <class T>
__device__ __forceinline__ T* cluster_peer(T* p, int rank) {
#if OPENWAM_REPAIR_SM90
  uint64_t r;
  asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(r) : "l"(p), "r"(rank));
  return reinterpret_cast<T*>(r);
#else
  __trap();
  return p;
#endif
}

// ------------------------------------------------- programmatic launch
// The kernel may be launched before the kernel ahead of it in the stream
// (cuDNN's backward, whose last kernel writes dQ) has finished
// (launch_repair_width: programmatic stream serialization, sm_90). Every
// input the repair reads was written before that backward began; dQ is the
// one tensor it shares with it. So a thread waits here, for the grid ahead
// to complete and its writes to be visible, before its first write to dQ.
// Without a programmatic launch (or before sm_90) the wait returns at once.
__device__ __forceinline__ void wait_for_grid_ahead() {
#if OPENWAM_REPAIR_SM90
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------- ldmatrix
// `addr` is a shared-space address (smem_u32): 32-bit address arithmetic
// keeps the many ldmatrix addresses of a tile in half the registers.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
#if OPENWAM_REPAIR_SM80
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#else
  __trap();
#endif
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
#if OPENWAM_REPAIR_SM80
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#else
  __trap();
#endif
}

// ---------------------------------------------------------------- wgmma
// Hopper's warpgroup MMA (sm_90a only: the kernels built for other targets
// keep mma.sync). The 4 warps of a repair block are one warpgroup; A comes
// from registers (the mma.m16n8k16 A fragments of each warp's 16 rows, which
// is wgmma's register layout for m64k16), B from a shared-memory tile through
// a descriptor (gmma_desc), D is fp32 in the mma.m16n8 C layout per warp and
// n-tile. Every call is asynchronous: D may be read only after wgmma_wait.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define OPENWAM_REPAIR_WGMMA 1
#else
#define OPENWAM_REPAIR_WGMMA 0
#endif

// Registers written by ordinary instructions (accumulators, A fragments)
// are ordered before the wgmma that reads them.
__device__ __forceinline__ void wgmma_fence() {
#if OPENWAM_REPAIR_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if OPENWAM_REPAIR_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

// Wait until at most kPending committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if OPENWAM_REPAIR_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#else
  __trap();
#endif
}

// Keeps the compiler from moving reads or writes of an accumulator across
// the wgmma calls and waits around it (CUTLASS's warpgroup_fence_operand).
template <int kN>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[kN][4]) {
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
  }
}

// Shared memory written through the generic proxy (cp.async, st.shared) is
// made visible to wgmma's reads, which go through the async proxy: each
// writing thread, after its writes landed and before the barrier.
__device__ __forceinline__ void fence_proxy_async() {
#if OPENWAM_REPAIR_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// d (64 x N, fp32) (+)= a (64 x 16, registers) * B (16 x N at `desc`), for
// N = 32, 64, 128. B is K-major (kTransB 0: K or V as the B of Q K^T and
// dO V^T, rows of the tile = n) or MN-major (kTransB 1: K as the B of dS K,
// rows of the tile = k). TYPE: bf16 or f16.
#define OPENWAM_WGMMA_N32(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " {" \
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, " \
      "{%16,%17,%18,%19}, %20, p, 1, 1, %22;\n}\n" \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), \
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate), \
        "n"(kTransB))
#define OPENWAM_WGMMA_N64(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {" \
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"   \
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
      "{%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n" \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), \
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate), \
        "n"(kTransB))
#define OPENWAM_WGMMA_N128(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {" \
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"   \
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"   \
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"   \
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, " \
      "{%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n" \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), \
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), \
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), \
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate), \
        "n"(kTransB))

// The element type's wgmma: d (64 x 8 kN) (+)= a * B; Bf16::wgmma, ...
#if OPENWAM_REPAIR_WGMMA
#define OPENWAM_WGMMA_METHOD(TYPE)                                                        \
  template <int kN, int kTransB>                                                         \
  __device__ __forceinline__ static void wgmma(float(&d)[kN][4], const uint32_t(&a)[4],  \
                                               uint64_t desc, int accumulate) {          \
    static_assert(kN == 4 || kN == 8 || kN == 16, "wgmma n: 32, 64 or 128");             \
    if constexpr (kN == 4) {                                                             \
      OPENWAM_WGMMA_N32(TYPE);                                                           \
    } else if constexpr (kN == 8) {                                                      \
      OPENWAM_WGMMA_N64(TYPE);                                                           \
    } else {                                                                             \
      OPENWAM_WGMMA_N128(TYPE);                                                          \
    }                                                                                    \
  }
#else
#define OPENWAM_WGMMA_METHOD(TYPE)                                                        \
  template <int kN, int kTransB>                                                         \
  __device__ __forceinline__ static void wgmma(float(&)[kN][4], const uint32_t(&)[4],    \
                                               uint64_t, int) {                          \
    __trap();                                                                            \
  }
#endif

// ---------------------------------------------------------------- elements
// 16-bit storage with fp32 arithmetic. bf16 and fp16 differ only in these
// conversions and in the mma instruction. Raw uint16_t everywhere, so none of
// the __CUDA_NO_HALF*_ macros that PyTorch's build defines get in the way.
struct Bf16 {
  // See Fp16::kCenterKeys: bf16 keeps the plain dS K.
  static constexpr bool kCenterKeys = false;
  __device__ __forceinline__ static float to_float(uint16_t x) {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);
  }
  // Round to nearest even; `lo` goes to the low half (the lower column).
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    uint32_t r = 0;
#if OPENWAM_REPAIR_SM80
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
    __trap();
#endif
    return r;
  }
  __device__ __forceinline__ static uint16_t from_float(float x) {
    uint16_t r = 0;
#if OPENWAM_REPAIR_SM80
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
#else
    __trap();
#endif
    return r;
  }
  // d += a * b, m16n8k16, fp32 accumulators.
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
#if OPENWAM_REPAIR_SM80
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
  }
  OPENWAM_WGMMA_METHOD("bf16")
};

struct Fp16 {
  // dQ as if the keys were centred (tile.cuh, "Centred keys"):
  // fp16's own rounding is 8x finer than bf16's, so the amplified dS errors
  // stand out against fp16 stock kernels.
  static constexpr bool kCenterKeys = true;
  __device__ __forceinline__ static float to_float(uint16_t x) {
    float r;
    asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }\n" : "=f"(r) : "h"(x));
    return r;
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  __device__ __forceinline__ static uint16_t from_float(float x) {
    uint16_t r;
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
    return r;
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
#if OPENWAM_REPAIR_SM80
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
  }
  OPENWAM_WGMMA_METHOD("f16")
};

// 2^x, about 2 ulp; ex2(-inf) = +0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace repair
}  // namespace openwam

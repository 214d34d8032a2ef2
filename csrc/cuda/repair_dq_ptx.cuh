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
__device__ __forceinline__ unsigned char* smem_base() {
  extern __shared__ __align__(128) unsigned char openwam_repair_smem[];
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
};

struct Fp16 {
  // dQ as if the keys were centred (repair_dq_tile.cuh, "Centred keys"):
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
};

// 2^x, about 2 ulp; ex2(-inf) = +0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace repair
}  // namespace openwam

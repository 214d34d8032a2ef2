// A small CPU emulator of the CUDA features the dQ-repair kernels use, so
// that their real source runs (slowly) on a machine without a GPU. The tests
// include this header, first (ahead of the kernels' source), never a piece:
// the kernels read OPENWAM_REPAIR_EMULATE to leave out the PTX it stands in for.
//
// Every CUDA thread of a block is a fiber (ucontext) on one OS thread,
// scheduled round-robin; __syncthreads and the warp collectives (shuffles,
// ballots, ldmatrix, mma.sync, wgmma) are barriers among the fibers. cp.async
// copies are deferred until the thread's cp.async.wait_group retires their
// group, so a missing wait shows up as stale data; with EMU_EAGER=1 they land
// at once instead, so a stage refilled before every warp is done with it
// shows up. Shared memory starts filled with 0xff bytes (NaN in bf16/fp16) so
// that unwritten reads show. Semantics follow the PTX ISA (ldmatrix,
// mma.m16n8k16 fragment layouts, wgmma descriptors). A thread-block cluster
// (sm_90) runs its blocks' fibers together; clusters run one after another,
// as single blocks do.
//
// The pieces, in order, each on the ones before it:
//   simt_scheduler.h   fibers, scheduler, barriers, block and cluster launch
//   simt_memory.h      shared memory, mapa, cp.async, fence.proxy.async,
//                      the L2 prefetch hint, the grid ahead, aligned loads
//   simt_warp.h        shuffles, ballots, ldmatrix, mma.sync
//   simt_wgmma.h       wgmma and its descriptors
//   simt_elements.h    bf16 / fp16 and the Bf16 / Fp16 traits
//   simt_tile_trace.h  OPENWAM_REPAIR_TRACE_TILE's record of tiles of work
#pragma once

#define OPENWAM_REPAIR_EMULATE 1

#include "simt_scheduler.h"
#include "simt_memory.h"
#include "simt_warp.h"
#include "simt_wgmma.h"
#include "simt_elements.h"
#include "simt_tile_trace.h"

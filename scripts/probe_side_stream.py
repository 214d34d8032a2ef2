"""How much of the dQ repair a second stream would hide behind cuDNN's
backward: the measurement behind BENCHMARKS.md's run J1 (issue 12's one
affected row per head).

The repair needs only q, k, v, out, dO and the logsumexp, all ready before
cuDNN's backward starts, so it could run beside it and leave a scatter of
its rows into dQ for after. This probe times, in paired rounds (device time
with the host kept ahead, benchmarks/timing.py), cuDNN's backward alone
(the op's leaf op with plan none), the backward then the repair on one
stream (the landed plan), and the repair on a side stream beside the
backward, launched before it or after it, its rows written to a scratch
dQ. It prints the time each adds to the backward, median [min..max] over
the rounds. The scatter the side stream would need after the backward is
not in these figures. `read_kv` is the backward then a plain read of all
of K and V (torch.sum of each): the DRAM traffic that a repair of one
affected row in every head cannot avoid, after a backward that leaves
other data in L2 (BENCHMARKS.md, run L5). With --floor, `read_fast` is the
same read as one kernel of 16-byte loads (built on the spot, as
--host-cost's), the other variants left out but `sequential` and
`read_kv`, one affected row per head only (run L7).

--host-cost prints instead what such a plan would add to the host's time
per backward (BENCHMARKS.md's run J6): a fork and a join (two event
records, two stream waits), a second kernel launch, and a small zeroed
workspace, each timed in C++ (an extension built on the spot) over 200
calls while a sleep kernel holds the GPU, so that nothing waits for it.

    python scripts/probe_side_stream.py [--rounds 5] [--repeats 30]
    python scripts/probe_side_stream.py --host-cost [--rounds 5]
    python scripts/probe_side_stream.py --floor [--rounds 5]

About a minute on one H200; CUDA only (--host-cost also nvcc and ninja).
"""

from __future__ import annotations

import torch

from leaf_cells import (  # puts benchmarks/ on the path
    ONE_ROW_OVER, leaf_cell, paired_added, probe_parser, start)

# issue 12's shapes with one affected row per head above 1.05x (run I4).
CELLS = ONE_ROW_OVER
VARIANTS = ("sequential", "side_first", "bwd_first", "read_kv")


def probe_cell(side, cell, share, rounds, repeats, variants=VARIANTS, ext=None):
    c = leaf_cell(cell, share)
    scratch = torch.zeros_like(c.q)

    def beside(first):
        def run(_):
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            if first == "side":
                with torch.cuda.stream(side):
                    c.repair(scratch)
            grads = c.backward()
            if first == "backward":
                with torch.cuda.stream(side):
                    c.repair(scratch)
            main.wait_stream(side)
            return grads
        return run

    def read_kv(_):
        grads = c.backward()
        return grads, c.k.sum(), c.v.sum()

    def read_fast(_):
        grads = c.backward()
        return grads, ext.read_bytes(c.k, c.v)

    steps = {"sequential": c.repaired, "side_first": beside("side"),
             "bwd_first": beside("backward"), "read_kv": read_kv, "read_fast": read_fast}
    _, line = paired_added(cell, share, lambda _: c.backward(),
                           {n: steps[n] for n in variants}, rounds, repeats)
    return line


EXTENSION_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <chrono>

__global__ void tiny_kernel(int* p) {
  if (p != nullptr && threadIdx.x == 0 && blockIdx.x == 0) p[0] = 0;
}

using Clock = std::chrono::steady_clock;

static double us_per_call(Clock::time_point a, Clock::time_point b, int n) {
  return std::chrono::duration<double, std::micro>(b - a).count() / n;
}

// Host us per call of: a fork and a join; a launch (the repair kernel's
// grid size at head_dim 128); a 4 KiB workspace with its header zeroed.
std::vector<double> host_cost(int n) {
  const cudaStream_t main = at::cuda::getCurrentCUDAStream();
  const cudaStream_t side = at::cuda::getStreamFromPool();
  cudaEvent_t fork, join;
  cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
  cudaEventCreateWithFlags(&join, cudaEventDisableTiming);
  std::vector<double> out;
  auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    cudaEventRecord(fork, main);
    cudaStreamWaitEvent(side, fork, 0);
    cudaEventRecord(join, side);
    cudaStreamWaitEvent(main, join, 0);
  }
  out.push_back(us_per_call(t0, Clock::now(), n));
  t0 = Clock::now();
  for (int i = 0; i < n; ++i) tiny_kernel<<<264, 128, 0, main>>>(nullptr);
  out.push_back(us_per_call(t0, Clock::now(), n));
  t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    at::Tensor w = at::empty({4096}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
    cudaMemsetAsync(w.data_ptr(), 0, 64, main);
  }
  out.push_back(us_per_call(t0, Clock::now(), n));
  cudaEventDestroy(fork);
  cudaEventDestroy(join);
  return out;
}

// Every 16 bytes of p[0 .. n) read once, grid-stride, 4 loads in flight per
// thread, folded into x.
__device__ void read_all(const uint4* p, int64_t n, unsigned& x) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * step < n; i += 4 * step) {
    const uint4 v0 = p[i], v1 = p[i + step], v2 = p[i + 2 * step], v3 = p[i + 3 * step];
    x ^= v0.x ^ v0.y ^ v0.z ^ v0.w ^ v1.x ^ v1.y ^ v1.z ^ v1.w;
    x ^= v2.x ^ v2.y ^ v2.z ^ v2.w ^ v3.x ^ v3.y ^ v3.z ^ v3.w;
  }
  for (; i < n; i += step) x ^= p[i].x ^ p[i].y ^ p[i].z ^ p[i].w;
}

// a and b read once; the XOR kept so that the loads stay (written only if
// it is one given value).
__global__ void read_kernel(const uint4* a, int64_t na, const uint4* b, int64_t nb, unsigned* out) {
  unsigned x = 0;
  read_all(a, na, x);
  read_all(b, nb, x);
  if (x == 0x9e3779b9u) out[blockIdx.x] = x;
}

// The storage under a and b (dense views, 16-byte multiples), read once.
at::Tensor read_bytes(at::Tensor a, at::Tensor b) {
  const auto bytes = [](const at::Tensor& t) { return t.numel() * t.element_size(); };
  TORCH_CHECK(bytes(a) % 16 == 0 && bytes(b) % 16 == 0, "read_bytes: 16-byte multiples");
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  at::Tensor out = at::empty({4 * sms}, a.options().dtype(at::kInt));
  read_kernel<<<4 * sms, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint4*>(a.data_ptr()), bytes(a) / 16,
      static_cast<const uint4*>(b.data_ptr()), bytes(b) / 16,
      reinterpret_cast<unsigned*>(out.data_ptr()));
  return out;
}
"""


def extension():
    from torch.utils.cpp_extension import load_inline

    return load_inline("probe_side_stream_ext",
                       cpp_sources="std::vector<double> host_cost(int n);\n"
                                   "at::Tensor read_bytes(at::Tensor a, at::Tensor b);",
                       cuda_sources=EXTENSION_SOURCE, functions=["host_cost", "read_bytes"])


def host_cost(rounds):
    ext = extension()
    for r in range(rounds + 1):  # round 0 warms the allocator and the launch path up
        torch.cuda._sleep(int(2e9))  # about a second: the 600 calls never wait for the GPU
        fork_join, launch, workspace = ext.host_cost(200)
        torch.cuda.synchronize()
        if r > 0:
            print(f"round {r}: fork and join {fork_join:.2f} us, a second launch {launch:.2f} us, "
                  f"a zeroed workspace {workspace:.2f} us", flush=True)


def main():
    ap = probe_parser(__doc__)
    ap.add_argument("--host-cost", action="store_true",
                    help="the host time a side-stream plan would add per backward, instead")
    ap.add_argument("--floor", action="store_true",
                    help="one row per head: the repair against plain reads of K and V only")
    args = ap.parse_args()
    start("probe_side_stream.py", need_openwam=not args.host_cost)  # --host-cost: CUDA only
    if args.host_cost:
        host_cost(args.rounds)
        return
    side = torch.cuda.Stream()
    if args.floor:
        ext = extension()
        for cell in CELLS:
            print(probe_cell(side, cell, "one_per_head", args.rounds, args.repeats,
                             ("sequential", "read_kv", "read_fast"), ext), flush=True)
        return
    for cell in CELLS:
        for share in ("none", "one_per_head"):
            print(probe_cell(side, cell, share, args.rounds, args.repeats), flush=True)


if __name__ == "__main__":
    main()

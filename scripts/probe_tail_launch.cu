// Can the repair keep one host launch and still run two kernels? A probe of
// CUDA dynamic parallelism's tail launch (CUDA 12+, sm_90), for issue 12.
//
// The repair's one kernel holds both the few-row path and the tensor-core
// tiles, so the few-row path runs at the tiles' 255 registers (2 blocks per
// SM), and every measured way of adding a faster few-row path to that kernel
// slowed its tiles (BENCHMARKS.md, runs N6, P1-P4); a second host launch
// costs 4-6 us of host time per backward (J6), over issue 11's budget. A
// kernel may instead launch the tiles itself, from the device, only when a
// head needs them: cudaStreamTailLaunch runs the child after the parent grid
// in the parent's stream order, and the host launches one kernel.
//
// Measured here (device time per call from CUDA events over many calls; host
// time per launch while a sleep kernel keeps the GPU busy):
//   light            a small grid that reads a flag (the probe's stand-in)
//   light+host       light, then a second host launch (the child)
//   tail(off)        light with a tail launch in its code, not taken
//   tail(on)         light whose thread 0 of block 0 tail-launches the child
//   pdl+tail(on)     the same, launched as a programmatic dependent of the
//                    kernel before it (as the repair is: cudaLaunchKernelEx,
//                    programmatic stream serialization, griddepcontrol.wait)
//   graph            tail(on) captured in a CUDA graph and replayed: the child
//                    runs once per replayed call (a counter says)
//   cluster child    a child as the repair's tiles would be launched from the
//                    device: a compile-time cluster of 2 (__cluster_dims__:
//                    a device launch takes no launch attributes), 100 KB of
//                    dynamic shared memory (the attribute set from the host),
//                    each block reading its peer's shared memory (added in
//                    the thirteenth session; built here, not yet run)
// The counts are checked: the program exits 1 when the child ran where it
// should not or did not run where it should (run Q1 ran a first form that
// printed one total over all three modes).
//
//   nvcc -O3 -arch=sm_90a -rdc=true scripts/probe_tail_launch.cu -lcudadevrt \
//        -o build/probe_tail_launch && build/probe_tail_launch
// (-ewp in place of -rdc=true builds it too: the form the extension would
// take, since -rdc=true serializes the tiles' wgmma; BENCHMARKS.md, the
// thirteenth session's build facts.)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                 \
                   cudaGetErrorString(e_));                                          \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

__global__ void child(unsigned* counter, const float* data, int n) {
  // Touch some data so that the child is a real grid, and count its runs.
  float s = 0.0f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) s += data[i];
  if (s == 12345.0f) counter[1] = 1;  // never: keeps the loads
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(counter, 1u);
}

__global__ void light(const int* flag, const float* data, int n, unsigned* counter, int child_grid,
                      int wait_dependency) {
  if (wait_dependency) asm volatile("griddepcontrol.wait;" ::: "memory");
  float s = 0.0f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) s += data[i];
  if (s == 12345.0f) counter[1] = 1;
  if (child_grid > 0 && blockIdx.x == 0 && threadIdx.x == 0 && *flag != 0) {
    child<<<child_grid, 256, 0, cudaStreamTailLaunch>>>(counter, data, n);
  }
}

// The repair's cluster kernel as a device launch would run it: clusters of 2
// fixed at compile time, a large dynamic shared memory. counter[2] counts
// blocks whose peer's shared memory did not hold the peer's rank, counter[3]
// the blocks that ran, counter[4] the largest cluster size a block saw.
constexpr int kClusterSmem = 100 * 1024;
__global__ void __cluster_dims__(2, 1, 1) cluster_child(unsigned* counter) {
  extern __shared__ unsigned smem[];
  unsigned rank = 0, size = 0;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
  if (threadIdx.x == 0) smem[kClusterSmem / 4 - 1] = rank;  // the last word of it
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (threadIdx.x == 0) {
    const unsigned peer = rank ^ 1u;
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(&smem[kClusterSmem / 4 - 1]));
    unsigned remote = 0, got = 0;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(peer));
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(got) : "r"(remote) : "memory");
    if (size != 2 || got != peer) atomicAdd(counter + 2, 1u);
    atomicAdd(counter + 3, 1u);
    atomicMax(counter + 4, size);
  }
  // Neither block leaves while its peer may still read its shared memory.
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__global__ void launch_cluster_child(unsigned* counter, int grid) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    cluster_child<<<grid, 128, kClusterSmem, cudaStreamTailLaunch>>>(counter);
  }
}

__global__ void busy(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

__global__ void before(float* x, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] += 1.0f;
}

struct Bufs {
  int* flag;
  float* data;
  unsigned* counter;
  float* scratch;
  int n, scratch_n;
};

enum Mode { kLight, kLightHost, kTailOff, kTailOn, kPdlTailOn };
const char* kNames[] = {"light", "light+host", "tail(off)", "tail(on)", "pdl+tail(on)"};

void launch(Mode m, const Bufs& b, int grid, int child_grid, cudaStream_t s, int* flag_on, int* flag_off) {
  switch (m) {
    case kLight:
      light<<<grid, 256, 0, s>>>(flag_off, b.data, b.n, b.counter, 0, 0);
      break;
    case kLightHost:
      light<<<grid, 256, 0, s>>>(flag_off, b.data, b.n, b.counter, 0, 0);
      child<<<child_grid, 256, 0, s>>>(b.counter, b.data, b.n);
      break;
    case kTailOff:
      light<<<grid, 256, 0, s>>>(flag_off, b.data, b.n, b.counter, child_grid, 0);
      break;
    case kTailOn:
      light<<<grid, 256, 0, s>>>(flag_on, b.data, b.n, b.counter, child_grid, 0);
      break;
    case kPdlTailOn: {
      before<<<132, 256, 0, s>>>(b.scratch, b.scratch_n);
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(grid);
      cfg.blockDim = dim3(256);
      cfg.stream = s;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      const int* f = flag_on;
      CHECK(cudaLaunchKernelEx(&cfg, light, f, (const float*)b.data, b.n, b.counter, child_grid, 1));
      break;
    }
  }
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int rt = 0, drv = 0;
  CHECK(cudaRuntimeGetVersion(&rt));
  CHECK(cudaDriverGetVersion(&drv));
  std::printf("device %s, %d SMs, runtime %d, driver %d\n", prop.name, sms, rt, drv);

  Bufs b{};
  b.n = 1 << 16;  // 256 KB read by each grid: small, as the repair's scan
  b.scratch_n = 1 << 22;
  CHECK(cudaMalloc(&b.flag, 2 * sizeof(int)));
  CHECK(cudaMalloc(&b.data, b.n * sizeof(float)));
  CHECK(cudaMalloc(&b.counter, 2 * sizeof(unsigned)));
  CHECK(cudaMalloc(&b.scratch, b.scratch_n * sizeof(float)));
  CHECK(cudaMemset(b.data, 0, b.n * sizeof(float)));
  CHECK(cudaMemset(b.scratch, 0, b.scratch_n * sizeof(float)));
  const int one = 1;
  CHECK(cudaMemset(b.flag, 0, 2 * sizeof(int)));
  CHECK(cudaMemcpy(b.flag, &one, sizeof(int), cudaMemcpyHostToDevice));
  int* flag_on = b.flag;
  int* flag_off = b.flag + 1;
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const int grid = 2 * sms, child_grid = 2 * sms;
  const int calls = 200, rounds = 7;

  // ---- device time per call, paired rounds (modes interleaved per round)
  std::printf("\ndevice time per call (us), %d calls a round, %d rounds: median [min..max]\n", calls,
              rounds);
  std::vector<std::vector<float>> t(5);
  for (int r = 0; r < rounds; ++r) {
    for (int mi = 0; mi < 5; ++mi) {
      const Mode m = static_cast<Mode>(mi);
      for (int w = 0; w < 20; ++w) launch(m, b, grid, child_grid, s, flag_on, flag_off);
      CHECK(cudaEventRecord(e0, s));
      for (int c = 0; c < calls; ++c) launch(m, b, grid, child_grid, s, flag_on, flag_off);
      CHECK(cudaEventRecord(e1, s));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      t[mi].push_back(ms * 1e3f / calls);
    }
  }
  CHECK(cudaGetLastError());
  for (int mi = 0; mi < 5; ++mi) {
    std::vector<float> v = t[mi];
    std::sort(v.begin(), v.end());
    std::printf("  %-14s %7.2f [%.2f..%.2f]\n", kNames[mi], v[v.size() / 2], v.front(), v.back());
  }
  // The pdl mode includes `before`: time it alone for the difference.
  {
    std::vector<float> v;
    for (int r = 0; r < rounds; ++r) {
      CHECK(cudaEventRecord(e0, s));
      for (int c = 0; c < calls; ++c) before<<<132, 256, 0, s>>>(b.scratch, b.scratch_n);
      CHECK(cudaEventRecord(e1, s));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      v.push_back(ms * 1e3f / calls);
    }
    std::sort(v.begin(), v.end());
    std::printf("  %-14s %7.2f [%.2f..%.2f]  (pdl+tail(on) includes it)\n", "before alone",
                v[v.size() / 2], v.front(), v.back());
  }

  // ---- the child runs exactly once per call with the flag on, never with it off
  int failures = 0;
  {
    CHECK(cudaMemset(b.counter, 0, 2 * sizeof(unsigned)));
    const Mode modes[] = {kTailOn, kTailOff, kPdlTailOn};
    const unsigned expect[] = {10, 10, 20};  // the count after each mode's 10 calls
    std::printf("\n");
    for (int mi = 0; mi < 3; ++mi) {
      for (int c = 0; c < 10; ++c) launch(modes[mi], b, grid, child_grid, s, flag_on, flag_off);
      CHECK(cudaStreamSynchronize(s));
      unsigned got = 0;
      CHECK(cudaMemcpy(&got, b.counter, sizeof(unsigned), cudaMemcpyDeviceToHost));
      failures += got != expect[mi];
      std::printf("child runs after 10 more %s calls: %u (expect %u)\n", kNames[modes[mi]], got,
                  expect[mi]);
    }
  }

  // ---- a CUDA graph of tail(on) calls
  {
    const int captured = 10;
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CHECK(cudaMemset(b.counter, 0, 2 * sizeof(unsigned)));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int c = 0; c < captured; ++c) launch(kTailOn, b, grid, child_grid, s, flag_on, flag_off);
    for (int c = 0; c < captured; ++c) launch(kPdlTailOn, b, grid, child_grid, s, flag_on, flag_off);
    const cudaError_t end = cudaStreamEndCapture(s, &g);
    if (end != cudaSuccess) {
      ++failures;
      std::printf("graph: capture failed: %s\n", cudaGetErrorString(end));
    } else {
      const cudaError_t inst = cudaGraphInstantiate(&ge, g, 0);
      if (inst != cudaSuccess) {
        ++failures;
        std::printf("graph: instantiate failed: %s\n", cudaGetErrorString(inst));
      } else {
        for (int r = 0; r < 3; ++r) CHECK(cudaGraphLaunch(ge, s));
        CHECK(cudaStreamSynchronize(s));
        unsigned got = 0;
        CHECK(cudaMemcpy(&got, b.counter, sizeof(unsigned), cudaMemcpyDeviceToHost));
        failures += got != static_cast<unsigned>(6 * captured);
        std::printf("graph: %d captured calls (half pdl) replayed 3 times: child ran %u times "
                    "(expect %d)\n", 2 * captured, got, 6 * captured);
        CHECK(cudaGraphExecDestroy(ge));
      }
      CHECK(cudaGraphDestroy(g));
    }
  }

  // ---- the tiles' cluster kernel launched from the device
  {
    CHECK(cudaFuncSetAttribute(cluster_child, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kClusterSmem));
    unsigned* cc = nullptr;
    CHECK(cudaMalloc(&cc, 5 * sizeof(unsigned)));
    CHECK(cudaMemset(cc, 0, 5 * sizeof(unsigned)));
    const int cgrid = 2 * sms;  // clusters of 2: an even grid
    for (int c = 0; c < 10; ++c) launch_cluster_child<<<1, 32, 0, s>>>(cc, cgrid);
    const cudaError_t e = cudaStreamSynchronize(s);
    unsigned got[5] = {};
    if (e == cudaSuccess) CHECK(cudaMemcpy(got, cc, sizeof(got), cudaMemcpyDeviceToHost));
    const bool ok = e == cudaSuccess && got[2] == 0 && got[3] == 10u * cgrid && got[4] == 2;
    failures += !ok;
    std::printf("cluster child from the device: %s; blocks run %u (expect %u), cluster size %u "
                "(expect 2), blocks that missed their peer's shared memory %u (expect 0)\n",
                cudaGetErrorString(e), got[3], 10u * cgrid, got[4], got[2]);
    if (e == cudaSuccess) CHECK(cudaFree(cc));
  }

  // ---- host time per launch while the GPU is busy (the host never waits)
  std::printf("\nhost time per call (us), %d calls a round behind a sleep kernel, %d rounds\n",
              calls, rounds);
  const Mode host_modes[] = {kLight, kLightHost, kTailOff, kTailOn};
  std::vector<std::vector<double>> h(4);
  for (int r = 0; r < rounds; ++r) {
    for (int mi = 0; mi < 4; ++mi) {
      busy<<<1, 1, 0, s>>>(2000000000LL);  // about a second at 1.98 GHz
      const auto h0 = std::chrono::steady_clock::now();
      for (int c = 0; c < calls; ++c) launch(host_modes[mi], b, grid, child_grid, s, flag_on, flag_off);
      const auto h1 = std::chrono::steady_clock::now();
      h[mi].push_back(std::chrono::duration<double, std::micro>(h1 - h0).count() / calls);
      CHECK(cudaStreamSynchronize(s));
    }
  }
  for (int mi = 0; mi < 4; ++mi) {
    std::vector<double> v = h[mi];
    std::sort(v.begin(), v.end());
    std::printf("  %-14s %7.2f [%.2f..%.2f]\n", kNames[host_modes[mi]], v[v.size() / 2], v.front(),
                v.back());
  }
  CHECK(cudaGetLastError());
  std::printf("\n%s\n", failures == 0 ? "ok" : "FAILED: the child's runs (above)");
  return failures == 0 ? 0 : 1;
}

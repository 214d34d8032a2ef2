// Can a kernel launched from a stream launch, from the device, a graph whose
// kernel node the host built from the host's kernel handle, with parameters
// the launching kernel sets (a device-updatable node)? That route keeps the
// launched kernel's SASS: its address is never taken in device code, which
// is what costs a kernel launched from the device its uniform datapath
// (benchmarks/results/ptxas_2026-12-02_t0_device_launch_address_taken.txt).
//
// Build (this machine or the device):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -ewp \
//        scripts/probe_device_graph.cu -o build/probe_device_graph -lcudadevrt
// Run on the GPU: build/probe_device_graph
// Modes: eager (the launcher launched into a stream), captured (the launcher
// captured into a host graph and replayed), then the device time of each
// against the child launched from the host.
// H200, driver of CUDA 13.0, 2026-12-02 (run T3,
// benchmarks/results/probe_device_graph_2026-12-02_h200_t3.txt): the eager
// launcher is refused at launch ("operation not supported"): only a kernel
// running inside a graph may launch a device graph. Captured, a device
// graph's tail launch waits for the whole launching graph: the second
// launcher of a replay rewrote the node and its launch of the same graph was
// refused (invalid argument), so the child ran once a replay with the second
// launcher's value (600 = 3 x 200). The first timing line is void: its eager
// launches were refused.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::printf("FAIL %s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

struct Params {
  int* out;
  int value;
  int pad[30];  // a parameter block of 136 bytes, set from the device as one
};

// The child: each block adds value to out[blockIdx.x].
__global__ void child(const Params p) { if (threadIdx.x == 0) atomicAdd(p.out + blockIdx.x, p.value); }

// The launcher: sets the child's parameters and grid, launches its graph
// after this grid (tail launch); status[0] gets the first error.
__global__ void launcher(cudaGraphExec_t exec, cudaGraphDeviceNode_t node, Params p,
                         unsigned grid, int* status) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  cudaError_t e = cudaGraphKernelNodeSetParam(node, 0, &p, sizeof(p));
  if (e == cudaSuccess) e = cudaGraphKernelNodeSetGridDim(node, dim3(grid));
  if (e == cudaSuccess) e = cudaGraphLaunch(exec, cudaStreamGraphTailLaunch);
  if (status[0] == 0 && e != cudaSuccess) status[0] = static_cast<int>(e);
}

// The launcher's stand-in without the launch, for the host-launched form.
__global__ void plain(int* status) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && status[0] < 0) status[0] = 0;
}

int main() {
  int* out = nullptr;
  int* status = nullptr;
  CHECK(cudaMalloc(&out, 1024 * sizeof(int)));
  CHECK(cudaMalloc(&status, sizeof(int)));
  CHECK(cudaMemset(out, 0, 1024 * sizeof(int)));
  CHECK(cudaMemset(status, 0, sizeof(int)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // The child's graph: one device-updatable kernel node.
  cudaGraph_t graph;
  CHECK(cudaGraphCreate(&graph, 0));
  Params init{out, 0, {}};
  void* args[] = {&init};
  cudaKernelNodeParams kp{};
  kp.func = reinterpret_cast<void*>(child);
  kp.gridDim = dim3(1);
  kp.blockDim = dim3(128);
  kp.kernelParams = args;
  cudaGraphNode_t node;
  CHECK(cudaGraphAddKernelNode(&node, graph, nullptr, 0, &kp));
  cudaLaunchAttributeValue v{};
  v.deviceUpdatableKernelNode.deviceUpdatable = 1;
  CHECK(cudaGraphKernelNodeSetAttribute(node, cudaLaunchAttributeDeviceUpdatableKernelNode, &v));
  CHECK(cudaGraphKernelNodeGetAttribute(node, cudaLaunchAttributeDeviceUpdatableKernelNode, &v));
  cudaGraphDeviceNode_t dev_node = v.deviceUpdatableKernelNode.devNode;
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagDeviceLaunch));
  CHECK(cudaGraphUpload(exec, stream));
  CHECK(cudaStreamSynchronize(stream));

  // 1. Eager: launcher in the stream, 10 calls, grid 3, value i + 1.
  for (int i = 0; i < 10; ++i) {
    Params p{out, i + 1, {}};
    launcher<<<4, 32, 0, stream>>>(exec, dev_node, p, 3u, status);
    const cudaError_t launched = cudaGetLastError();
    if (launched != cudaSuccess) {
      std::printf("eager: launching the launcher into a stream: %s\n", cudaGetErrorString(launched));
      break;
    }
  }
  CHECK(cudaStreamSynchronize(stream));
  int st = 0, host_out[4] = {};
  CHECK(cudaMemcpy(&st, status, sizeof(int), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(host_out, out, sizeof(host_out), cudaMemcpyDeviceToHost));
  std::printf("eager: status %d (%s), out %d %d %d %d (expected 55 55 55 0)\n", st,
              cudaGetErrorString(static_cast<cudaError_t>(st)), host_out[0], host_out[1],
              host_out[2], host_out[3]);

  // 2. Captured: the launcher captured twice into a host graph, replayed 3 times.
  CHECK(cudaMemset(out, 0, 1024 * sizeof(int)));
  CHECK(cudaMemset(status, 0, sizeof(int)));
  cudaGraph_t host_graph;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < 2; ++i) {
    Params p{out, 100 * (i + 1), {}};
    launcher<<<4, 32, 0, stream>>>(exec, dev_node, p, 2u, status);
  }
  const cudaError_t end = cudaStreamEndCapture(stream, &host_graph);
  if (end != cudaSuccess) {
    std::printf("captured: capture failed: %s\n", cudaGetErrorString(end));
  } else {
    cudaGraphExec_t host_exec;
    const cudaError_t inst = cudaGraphInstantiate(&host_exec, host_graph, 0);
    if (inst != cudaSuccess) {
      std::printf("captured: instantiate failed: %s\n", cudaGetErrorString(inst));
    } else {
      for (int r = 0; r < 3; ++r) CHECK(cudaGraphLaunch(host_exec, stream));
      CHECK(cudaStreamSynchronize(stream));
      CHECK(cudaMemcpy(&st, status, sizeof(int), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(host_out, out, sizeof(host_out), cudaMemcpyDeviceToHost));
      std::printf("captured: status %d (%s), out %d %d %d (expected 900 900 0)\n", st,
                  cudaGetErrorString(static_cast<cudaError_t>(st)), host_out[0], host_out[1],
                  host_out[2]);
    }
  }

  // 3. Device time per call: the launcher and its device graph, against a
  // plain kernel and the child launched from the host, 200 calls each after a
  // warm-up round. Where the launcher's launch is refused (eager, above) the
  // first form's loop stops at once and its line is void.
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int mode = 0; mode < 2; ++mode) {
    for (int rep = 0; rep < 2; ++rep) {
      CHECK(cudaEventRecord(a, stream));
      for (int i = 0; i < 200; ++i) {
        Params p{out, 1, {}};
        if (mode == 0) {
          launcher<<<264, 128, 0, stream>>>(exec, dev_node, p, 264u, status);
          if (cudaGetLastError() != cudaSuccess) break;
        } else {
          plain<<<264, 128, 0, stream>>>(status);
          child<<<264, 128, 0, stream>>>(p);
        }
      }
      CHECK(cudaEventRecord(b, stream));
      CHECK(cudaEventSynchronize(b));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      if (rep == 1) {
        std::printf("%s: %.2f us per call\n",
                    mode == 0 ? "launcher, then the child's graph from the device (264 blocks each)"
                              : "a plain kernel, then the child from the host (264 blocks each)",
                    1000.f * ms / 200);
      }
    }
  }
  CHECK(cudaMemcpy(&st, status, sizeof(int), cudaMemcpyDeviceToHost));
  std::printf("status after timing: %d (%s)\n", st, cudaGetErrorString(static_cast<cudaError_t>(st)));
  return 0;
}

// openwam::_repair_dq_, the repair as an op of its own (tests, opcheck), and
// the repair's telemetry counter (repair_counter.h). The cuDNN path's backward
// calls the repair directly (cudnn_path_kernels.cpp).
#include "repair_dq.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <mutex>
#include <vector>

#include "reference_attention.h"
#include "repair_counter.h"

#ifdef OPENWAM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#endif

namespace openwam {
namespace {

void repair_dq_cpu(at::Tensor& grad_query, const at::Tensor& grad_out,
                   const at::Tensor& query, const at::Tensor& key,
                   const at::Tensor& value, const at::Tensor& out,
                   const at::Tensor& logsumexp, const std::optional<at::Tensor>& bias,
                   bool is_causal, double scale) {
  reference_repair_dq(grad_query, grad_out, query, key, value, out, logsumexp,
                      bias.value_or(at::Tensor()), is_causal, scale);
}

void repair_dq_meta(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const std::optional<at::Tensor>&, bool, double) {}

#ifdef OPENWAM_WITH_CUDA
void repair_dq_cuda(at::Tensor& grad_query, const at::Tensor& grad_out,
                    const at::Tensor& query, const at::Tensor& key,
                    const at::Tensor& value, const at::Tensor& out,
                    const at::Tensor& logsumexp, const std::optional<at::Tensor>& bias,
                    bool is_causal, double scale) {
  repair_dq_rows(grad_query, grad_out, query, key, value, out, logsumexp,
                 bias.value_or(at::Tensor()), is_causal, scale, /*repaired_rows=*/nullptr,
                 /*behind_backward=*/false);
}

// One int64 per device, for the life of the process (a captured kernel holds
// its address). Straight from cudaMalloc, not from PyTorch's caching
// allocator: a first repair during torch.compile's CUDA-graph warm-up
// (mode="reduce-overhead") would take the block from the graph's private
// pool, which then refuses to record ("tensor(s) in the cudagraph pool not
// tracked as outputs"; found on the H200).
struct Counters {
  std::mutex mutex;
  std::vector<int64_t*> by_device;
};

Counters& counters() {
  static Counters* c = new Counters();  // never destroyed: kernels may hold the address
  return *c;
}
#endif

}  // namespace

int64_t* repaired_rows_counter(const c10::Device& device) {
#ifdef OPENWAM_WITH_CUDA
  TORCH_INTERNAL_ASSERT(device.is_cuda());
  Counters& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  const auto index = static_cast<size_t>(device.index());
  if (c.by_device.size() <= index) {
    c.by_device.resize(index + 1, nullptr);
  }
  int64_t*& counter = c.by_device[index];
  if (counter == nullptr) {
    const c10::cuda::CUDAGuard guard(device);
    if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
      return nullptr;
    }
    // Once per device and process: the zero is in place before any kernel
    // on any stream can read it.
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index());
    // Another thread may be capturing a CUDA graph in the global mode, which
    // forbids cudaMalloc and synchronisation on every thread: these touch no
    // captured stream (PyTorch's caching allocator does the same). Not
    // covered: a capture on a blocking stream of the user's while this
    // thread's current stream is the legacy default stream, which
    // synchronises with it (PyTorch's own streams are non-blocking).
    const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    void* p = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&p, sizeof(int64_t)));
    C10_CUDA_CHECK(cudaMemsetAsync(p, 0, sizeof(int64_t), stream));
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    counter = static_cast<int64_t*>(p);
  }
  return counter;
#else
  (void)device;
  return nullptr;
#endif
}

int64_t read_repaired_rows(bool reset) {
  int64_t total = 0;
#ifdef OPENWAM_WITH_CUDA
  Counters& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  for (size_t index = 0; index < c.by_device.size(); ++index) {
    int64_t* counter = c.by_device[index];
    if (counter == nullptr) continue;
    // On the device's current stream, after every repair queued there.
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(index));
    int64_t value = 0;
    C10_CUDA_CHECK(cudaMemcpyAsync(&value, counter, sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    if (reset) {
      C10_CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof(int64_t), stream));
    }
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    total += value;
  }
#else
  (void)reset;
#endif
  return total;
}

}  // namespace openwam

TORCH_LIBRARY_IMPL(openwam, CPU, m) {
  m.impl("_repair_dq_", &openwam::repair_dq_cpu);
}
TORCH_LIBRARY_IMPL(openwam, Meta, m) {
  m.impl("_repair_dq_", &openwam::repair_dq_meta);
}
#ifdef OPENWAM_WITH_CUDA
TORCH_LIBRARY_IMPL(openwam, CUDA, m) {
  m.impl("_repair_dq_", &openwam::repair_dq_cuda);
}
#endif

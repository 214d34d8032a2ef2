#include "full_lengths.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <mutex>
#include <unordered_map>

#include "lengths_table.h"
#include "stats.h"

namespace openwam::frontend {
namespace {

// One slab per device: 1 MiB holds 16,384 configurations at batch 8, 1,024
// at batch 128. A configuration beyond it writes its lengths per call.
constexpr int64_t kSlabInts = (int64_t{1} << 20) / sizeof(int32_t);

__global__ void fill_lengths(int32_t* lengths, int64_t row, int32_t s_q, int32_t s_kv) {
  for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
    lengths[i] = s_q;
    lengths[row + i] = s_kv;
  }
}

void write(int32_t* lengths, int64_t row, int64_t s_q, int64_t s_kv, cudaStream_t stream) {
  fill_lengths<<<1, 128, 0, stream>>>(lengths, row, static_cast<int32_t>(s_q),
                                      static_cast<int32_t>(s_kv));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

struct DeviceTable {
  LengthsTable table{kSlabInts};
  int32_t* slab = nullptr;  // cudaMalloc'd at the first write, never freed
  bool unavailable = false;  // the slab could not be allocated
};

struct Tables {
  std::mutex mutex;
  std::unordered_map<int, DeviceTable> devices;
};

Tables& tables() {
  static auto* t = new Tables();  // never destroyed, like the slabs
  return *t;
}

// Another thread may be capturing in the global mode, which forbids the
// calls below: they touch no capturing stream, so relaxed mode is safe (as in
// PyTorch's caching allocator).
using RelaxedCapture = c10::cuda::CUDAStreamCaptureModeGuard;

bool has_run(const LengthsBlock& b) {
  const RelaxedCapture relaxed{cudaStreamCaptureModeRelaxed};
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(b.written));
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: clear it, as c10's CUDAEvent::query does
    return false;
  }
  C10_CUDA_CHECK(status);
  return true;
}

// The block's lengths from the table, or nullptr where this call writes its own.
const int32_t* from_table(int device, int64_t row, int64_t s_q, int64_t s_kv,
                          cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  Tables& t = tables();
  std::lock_guard<std::mutex> lock(t.mutex);
  DeviceTable& d = t.devices[device];
  if (d.unavailable) return nullptr;
  const LengthsKey key{row, s_q, s_kv};
  auto [use, block] = d.table.lookup(key, stream, capturing, &has_run);
  if (use == LengthsUse::kPerCall) return nullptr;
  if (use == LengthsUse::kWrite) {
    const RelaxedCapture relaxed{cudaStreamCaptureModeRelaxed};
    if (d.slab == nullptr) {
      if (cudaMalloc(&d.slab, kSlabInts * sizeof(int32_t)) != cudaSuccess) {
        (void)cudaGetLastError();  // out of memory outside PyTorch's cache: per call
        d.slab = nullptr;
        d.unavailable = true;
        return nullptr;
      }
    }
    try {
      cudaEvent_t written = nullptr;
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&written, cudaEventDisableTiming));
      block->written = written;
      write(d.slab + block->offset, row, s_q, s_kv, stream);
      C10_CUDA_CHECK(cudaEventRecord(written, stream));
    } catch (...) {
      d.table.drop(key);  // never read a block whose write was not enqueued
      throw;
    }
  }
  return d.slab + block->offset;
}

}  // namespace

FullLengths full_lengths(const at::Tensor& query, int64_t s_q, int64_t s_kv) {
  const int64_t row = (query.size(0) + 3) / 4 * 4;  // row 1 starts 16-byte aligned
  const int device = query.device().index();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device).stream();
  FullLengths l;
  const int32_t* lengths = from_table(device, row, s_q, s_kv, stream);
  if (lengths == nullptr) {
    l.per_call = at::empty({2, row}, query.options().dtype(at::kInt));
    write(l.per_call.data_ptr<int32_t>(), row, s_q, s_kv, stream);
    stats().lengths_written_per_call++;
    lengths = l.per_call.data_ptr<int32_t>();
  }
  l.q = lengths;
  l.kv = lengths + row;
  return l;
}

}  // namespace openwam::frontend

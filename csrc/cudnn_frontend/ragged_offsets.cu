#include "ragged_offsets.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

namespace openwam::frontend {
namespace {

struct RowStrides {
  int64_t s[kRaggedTensors];
};

__global__ void fill_ragged(const int32_t* cu_q, const int32_t* cu_k, int64_t batch,
                            int64_t bucket, RowStrides strides, int64_t* offsets,
                            int64_t offsets_pitch, int32_t* lengths, int64_t lengths_pitch) {
  for (int64_t i = threadIdx.x; i <= bucket; i += blockDim.x) {
    const int64_t b = i < batch ? i : batch;  // empty sequences start at the end
    const int64_t start_q = cu_q[b], start_k = cu_k[b];
    for (int t = 0; t < kRaggedTensors; ++t) {
      const bool keys = t == kRowsK || t == kRowsV || t == kRowsGradKv;
      offsets[t * offsets_pitch + i] = (keys ? start_k : start_q) * strides.s[t];
    }
    if (i < bucket) {
      lengths[i] = i < batch ? cu_q[i + 1] - cu_q[i] : 0;
      lengths[lengths_pitch + i] = i < batch ? cu_k[i + 1] - cu_k[i] : 0;
    }
  }
}

// A packed tensor whose rows (laid out by cu_rows) are zeroed where the
// sequence's other side (cu_partner) is empty; blockIdx.z picks the tensor.
struct Unattended {
  uint16_t* rows;
  int64_t row_elems;
  const int32_t* cu_rows;
  const int32_t* cu_partner;
};
struct UnattendedSet {
  Unattended t[3];
};

__global__ void zero_unattended(UnattendedSet set) {
  const Unattended& t = set.t[blockIdx.z];
  const int64_t b = blockIdx.x;
  if (t.cu_partner[b + 1] != t.cu_partner[b]) {
    return;
  }
  const int64_t first = t.cu_rows[b] * t.row_elems, end = t.cu_rows[b + 1] * t.row_elems;
  for (int64_t i = first + blockIdx.y * blockDim.x + threadIdx.x; i < end;
       i += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    t.rows[i] = 0;
  }
}

Unattended unattended(at::Tensor& packed, const at::Tensor& cu_rows,
                      const at::Tensor& cu_partner) {
  TORCH_INTERNAL_ASSERT(packed.is_contiguous() && packed.element_size() == 2);
  return {static_cast<uint16_t*>(packed.data_ptr()), packed.size(1) * packed.size(2),
          cu_rows.data_ptr<int32_t>(), cu_partner.data_ptr<int32_t>()};
}

// One launch over `count` tensors; none where both sides share one
// cu_seqlens (then no side is empty without the other).
void launch(const UnattendedSet& set, int count, const at::Tensor& cu_q, const at::Tensor& cu_k,
            int64_t batch) {
  if (batch == 0 || cu_q.data_ptr() == cu_k.data_ptr()) {
    return;
  }
  const dim3 grid(static_cast<unsigned>(batch), 8, static_cast<unsigned>(count));
  zero_unattended<<<grid, 256, 0, at::cuda::getCurrentCUDAStream(cu_q.device().index())>>>(set);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void zero_rows_without_keys(at::Tensor& out, const at::Tensor& cu_q, const at::Tensor& cu_k,
                            int64_t batch) {
  UnattendedSet set{};
  set.t[0] = unattended(out, cu_q, cu_k);
  launch(set, 1, cu_q, cu_k, batch);
}

void zero_unattended_grads(at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                           const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t batch) {
  UnattendedSet set{};
  set.t[0] = unattended(dq, cu_q, cu_k);
  set.t[1] = unattended(dk, cu_k, cu_q);
  set.t[2] = unattended(dv, cu_k, cu_q);
  launch(set, 3, cu_q, cu_k, batch);
}

void* RaggedOffsets::offsets_of(RaggedTensor t) const {
  return static_cast<int64_t*>(offsets.data_ptr()) + t * offsets.size(1);
}
void* RaggedOffsets::lengths_q() const { return lengths.data_ptr(); }
void* RaggedOffsets::lengths_kv() const {
  return static_cast<int32_t*>(lengths.data_ptr()) + lengths.size(1);
}

RaggedOffsets ragged_offsets(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                             int64_t batch, int64_t bucket,
                             const std::array<int64_t, kRaggedTensors>& row_strides) {
  TORCH_INTERNAL_ASSERT(cu_seqlens_q.scalar_type() == at::kInt &&
                        cu_seqlens_k.scalar_type() == at::kInt &&
                        cu_seqlens_q.is_contiguous() && cu_seqlens_k.is_contiguous() &&
                        bucket >= batch);
  const auto options = cu_seqlens_q.options();
  RaggedOffsets r;
  r.offsets = at::empty({kRaggedTensors, (bucket + 2) / 2 * 2}, options.dtype(at::kLong));
  r.lengths = at::empty({2, (bucket + 3) / 4 * 4}, options.dtype(at::kInt));
  RowStrides strides;
  for (int t = 0; t < kRaggedTensors; ++t) {
    strides.s[t] = row_strides[t];
  }
  fill_ragged<<<1, 256, 0, at::cuda::getCurrentCUDAStream(cu_seqlens_q.device().index())>>>(
      cu_seqlens_q.data_ptr<int32_t>(), cu_seqlens_k.data_ptr<int32_t>(), batch, bucket,
      strides, r.offsets.data_ptr<int64_t>(), r.offsets.size(1), r.lengths.data_ptr<int32_t>(),
      r.lengths.size(1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return r;
}

}  // namespace openwam::frontend

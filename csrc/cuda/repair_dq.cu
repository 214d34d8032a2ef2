// CUDA kernel of openwam::_repair_dq_ (see repair_dq.h for the why).
//
// One thread per query row reads logsumexp; a warp whose 32 rows hold one
// below the threshold recomputes each such row in fp32, the lanes splitting
// head_dim (lane l holds elements l, l + 32, ...), keys walked in groups of
// kKeysInFlight to keep several loads in flight. Nothing synchronises with the
// host, so the op is capturable in a CUDA graph.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>

#include "../repair_dq.h"

namespace openwam {
namespace {

constexpr int kRowsPerBlock = 128;
constexpr int kWarp = 32;
constexpr int kKeysInFlight = 4;

struct Strides4 {
  int64_t b, h, s, e;
};

Strides4 strides_of(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

template <typename scalar_t>
struct RepairParams {
  const scalar_t* q;
  const scalar_t* k;
  const scalar_t* v;
  const scalar_t* o;
  const scalar_t* go;
  const float* lse;
  const scalar_t* bias;  // nullptr: no bias
  scalar_t* dq;
  Strides4 sq, sk, sv, so, sgo, sdq, sbias, slse;
  int64_t batch, heads, heads_per_kv, s_q, s_kv, head_dim;
  float scale;
  float threshold;
  bool causal;
};

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// Lane `lane` holds elements lane + 32 * t of a head_dim-long row.
template <typename scalar_t, int kPerLane>
__device__ __forceinline__ void load_row(const scalar_t* row, int64_t head_dim,
                                         int lane, float (&dst)[kPerLane]) {
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    const int64_t e = lane + kWarp * t;
    dst[t] = e < head_dim ? static_cast<float>(row[e]) : 0.0f;
  }
}

template <typename scalar_t, int kPerLane>
__device__ void repair_row(const RepairParams<scalar_t>& p, int64_t row, int lane) {
  const int64_t i = row % p.s_q;
  const int64_t h = (row / p.s_q) % p.heads;
  const int64_t b = row / (p.s_q * p.heads);
  const int64_t hk = h / p.heads_per_kv;
  const float lse = p.lse[b * p.slse.b + h * p.slse.h + i * p.slse.s];
  scalar_t* dq_row = p.dq + b * p.sdq.b + h * p.sdq.h + i * p.sdq.s;

  float acc[kPerLane];
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) acc[t] = 0.0f;

  // lse = -inf: every key is masked; the row's output and gradient are 0.
  if (lse != -INFINITY) {
    float q[kPerLane], go[kPerLane], o[kPerLane];
    load_row<scalar_t, kPerLane>(p.q + b * p.sq.b + h * p.sq.h + i * p.sq.s, p.head_dim, lane, q);
    load_row<scalar_t, kPerLane>(p.go + b * p.sgo.b + h * p.sgo.h + i * p.sgo.s, p.head_dim, lane, go);
    load_row<scalar_t, kPerLane>(p.o + b * p.so.b + h * p.so.h + i * p.so.s, p.head_dim, lane, o);
    float d_partial = 0.0f;
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) d_partial += go[t] * o[t];
    const float delta = warp_sum(d_partial);  // dO_i . o_i

    const scalar_t* k_base = p.k + b * p.sk.b + hk * p.sk.h;
    const scalar_t* v_base = p.v + b * p.sv.b + hk * p.sv.h;
    const scalar_t* bias_row =
        p.bias == nullptr ? nullptr : p.bias + b * p.sbias.b + h * p.sbias.h + i * p.sbias.s;
    // Top-left causal alignment, as F.sdpa's is_causal: key j <= row i.
    const int64_t end = p.causal ? min(p.s_kv, i + 1) : p.s_kv;

    for (int64_t j0 = 0; j0 < end; j0 += kKeysInFlight) {
      float kk[kKeysInFlight][kPerLane], vv[kKeysInFlight][kPerLane];
      float s_part[kKeysInFlight], dp_part[kKeysInFlight], bias_j[kKeysInFlight];
#pragma unroll
      for (int u = 0; u < kKeysInFlight; ++u) {
        const int64_t j = j0 + u;
        const bool valid = j < end;
        bias_j[u] = !valid ? -INFINITY
                           : (bias_row == nullptr ? 0.0f
                                                  : static_cast<float>(bias_row[j * p.sbias.e]));
        const bool live = valid && bias_j[u] != -INFINITY;
#pragma unroll
        for (int t = 0; t < kPerLane; ++t) {
          const int64_t e = lane + kWarp * t;
          const bool in = live && e < p.head_dim;
          kk[u][t] = in ? static_cast<float>(k_base[j * p.sk.s + e]) : 0.0f;
          vv[u][t] = in ? static_cast<float>(v_base[j * p.sv.s + e]) : 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < kKeysInFlight; ++u) {
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int t = 0; t < kPerLane; ++t) {
          s += q[t] * kk[u][t];
          dp += go[t] * vv[u][t];
        }
        s_part[u] = s;
        dp_part[u] = dp;
      }
#pragma unroll
      for (int u = 0; u < kKeysInFlight; ++u) {
        const float s = warp_sum(s_part[u]);
        const float dp = warp_sum(dp_part[u]);
        if (bias_j[u] == -INFINITY) continue;  // masked or past the end
        const float prob = __expf(s * p.scale + bias_j[u] - lse);
        const float ds = prob * (dp - delta);
#pragma unroll
        for (int t = 0; t < kPerLane; ++t) acc[t] += ds * kk[u][t];
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    const int64_t e = lane + kWarp * t;
    if (e < p.head_dim) dq_row[e * p.sdq.e] = static_cast<scalar_t>(acc[t] * p.scale);
  }
}

template <typename scalar_t, int kPerLane>
__global__ void __launch_bounds__(kRowsPerBlock)
    repair_dq_kernel(const RepairParams<scalar_t> p) {
  const int64_t rows = p.batch * p.heads * p.s_q;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x;
  const int lane = threadIdx.x % kWarp;
  bool flagged = false;
  if (row < rows) {
    const int64_t i = row % p.s_q;
    const int64_t h = (row / p.s_q) % p.heads;
    const int64_t b = row / (p.s_q * p.heads);
    flagged = p.lse[b * p.slse.b + h * p.slse.h + i * p.slse.s] < p.threshold;
  }
  unsigned pending = __ballot_sync(0xffffffffu, flagged);
  const int64_t warp_first_row = row - lane;
  while (pending != 0u) {
    const int src = __ffs(pending) - 1;
    pending &= pending - 1u;
    repair_row<scalar_t, kPerLane>(p, warp_first_row + src, lane);
  }
}

template <typename scalar_t>
void launch(const RepairParams<scalar_t>& p, int64_t rows, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  const int per_lane = static_cast<int>((p.head_dim + kWarp - 1) / kWarp);
  switch (per_lane) {
#define OPENWAM_REPAIR_CASE(N) \
  case N: repair_dq_kernel<scalar_t, N><<<grid, kRowsPerBlock, 0, stream>>>(p); break;
    OPENWAM_REPAIR_CASE(1)
    OPENWAM_REPAIR_CASE(2)
    OPENWAM_REPAIR_CASE(3)
    OPENWAM_REPAIR_CASE(4)
    OPENWAM_REPAIR_CASE(5)
    OPENWAM_REPAIR_CASE(6)
    OPENWAM_REPAIR_CASE(7)
    OPENWAM_REPAIR_CASE(8)
#undef OPENWAM_REPAIR_CASE
    default:
      TORCH_INTERNAL_ASSERT(false, "repair_dq: head_dim ", p.head_dim, " over 256");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void repair_typed(at::Tensor& grad_query, const at::Tensor& grad_out,
                  const at::Tensor& query, const at::Tensor& key,
                  const at::Tensor& value, const at::Tensor& out,
                  const at::Tensor& logsumexp, const at::Tensor& bias,
                  bool is_causal, double scale) {
  RepairParams<scalar_t> p{};
  p.q = query.const_data_ptr<scalar_t>();
  p.k = key.const_data_ptr<scalar_t>();
  p.v = value.const_data_ptr<scalar_t>();
  p.o = out.const_data_ptr<scalar_t>();
  p.go = grad_out.const_data_ptr<scalar_t>();
  p.lse = logsumexp.const_data_ptr<float>();
  p.bias = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
  p.dq = grad_query.mutable_data_ptr<scalar_t>();
  p.sq = strides_of(query);
  p.sk = strides_of(key);
  p.sv = strides_of(value);
  p.so = strides_of(out);
  p.sgo = strides_of(grad_out);
  p.sdq = strides_of(grad_query);
  p.sbias = bias.defined() ? strides_of(bias) : Strides4{0, 0, 0, 0};
  p.slse = {logsumexp.stride(0), logsumexp.stride(1), logsumexp.stride(2), 0};
  p.batch = query.size(0);
  p.heads = query.size(1);
  p.heads_per_kv = query.size(1) / key.size(1);
  p.s_q = query.size(2);
  p.s_kv = key.size(2);
  p.head_dim = query.size(3);
  p.scale = static_cast<float>(scale);
  p.threshold = kRepairLseThreshold;
  p.causal = is_causal;
  launch<scalar_t>(p, p.batch * p.heads * p.s_q,
                   at::cuda::getCurrentCUDAStream(query.device().index()));
}

void repair_dq_cuda(at::Tensor& grad_query, const at::Tensor& grad_out,
                    const at::Tensor& query, const at::Tensor& key,
                    const at::Tensor& value, const at::Tensor& out,
                    const at::Tensor& logsumexp,
                    const std::optional<at::Tensor>& attn_bias, bool is_causal,
                    double scale) {
  constexpr const char* kOp = "openwam::_repair_dq_";
  const at::Tensor* tensors[] = {&grad_query, &grad_out, &query, &key, &value, &out};
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->dim() == 4 && t->is_cuda() && t->scalar_type() == query.scalar_type(),
                kOp, ": expected 4-D CUDA tensors of query's dtype");
  }
  TORCH_CHECK(query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16,
              kOp, ": expected float16 or bfloat16, got ", query.scalar_type());
  TORCH_CHECK(logsumexp.scalar_type() == at::kFloat && logsumexp.dim() >= 3, kOp,
              ": logsumexp must be float32 [B, H, L(, 1)], got ", logsumexp.scalar_type(),
              " ", logsumexp.sizes());
  const int64_t batch = query.size(0), heads = query.size(1), s_q = query.size(2);
  const int64_t head_dim = query.size(3), s_kv = key.size(2);
  TORCH_CHECK(head_dim <= 256 && value.size(3) == head_dim, kOp,
              ": head_dim must be <= 256 and equal for query and value");
  TORCH_CHECK(key.size(1) > 0 && heads % key.size(1) == 0, kOp,
              ": query heads must be a multiple of key heads");
  if (grad_query.numel() == 0) return;

  const c10::cuda::CUDAGuard device_guard(query.device());
  at::Tensor bias;
  if (attn_bias.has_value() && attn_bias->defined()) {
    TORCH_CHECK(attn_bias->scalar_type() == query.scalar_type(), kOp,
                ": attn_bias must have query's dtype");
    bias = attn_bias->expand({batch, heads, s_q, s_kv});
  }
  AT_DISPATCH_SWITCH(query.scalar_type(), kOp,
      AT_DISPATCH_CASE(at::kHalf, [&] {
        repair_typed<scalar_t>(grad_query, grad_out, query, key, value, out,
                               logsumexp, bias, is_causal, scale);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        repair_typed<scalar_t>(grad_query, grad_out, query, key, value, out,
                               logsumexp, bias, is_causal, scale);
      }));
}

}  // namespace
}  // namespace openwam

TORCH_LIBRARY_IMPL(openwam, CUDA, m) {
  m.impl("_repair_dq_", &openwam::repair_dq_cuda);
}

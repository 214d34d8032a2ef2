// Host side of the dQ-row repair (repair_dq.h): checks, and the one launch
// of repair_dq_rows (openwam::_repair_dq_ calls it: csrc/repair_dq.cpp).
//
// repair_kernel (launch.cuh, instantiated in kernel_{bf16,fp16}.cu) is
// a persistent grid whose blocks (on
// sm_90, clusters of two blocks: launch_cluster) each take a run of (head,
// tile) items: the block probes the logsumexp of the run's heads, then for
// each head with rows, zeros the -inf rows (the head's owner), counts the rows
// below the threshold (scan.cuh), then recomputes those of its
// tiles, 64 rows at a time, on tensor cores (tile.cuh). Which rows
// need work is known only on the GPU; the host never waits for it, so the op
// stays capturable in a CUDA graph. No workspace: nothing is allocated,
// nothing cleared.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>

#include "../../repair_dq.h"
#include "layout.cuh"
#include "launch.cuh"

namespace openwam {
namespace {

using repair::RowStrides;
using repair::TileParams;

constexpr const char* kOp = "openwam::repair_dq_rows";

// Strides of dims 0..2 are multiples of `elements` (size-1 dims, whose
// stride is never used, excepted) and the data starts `elements * 2`-byte
// aligned: rows can be moved in chunks of that many 16-bit elements.
bool rows_aligned(const void* data, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                  int64_t elements) {
  if (reinterpret_cast<uintptr_t>(data) % (elements * 2) != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (sizes[d] > 1 && strides[d] % elements != 0) return false;
  }
  return true;
}

bool rows_aligned(const at::Tensor& t, int64_t elements) {
  return rows_aligned(t.const_data_ptr(), t.sizes(), t.strides(), elements);
}

RowStrides row_strides(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2)};
}

const uint16_t* bits(const at::Tensor& t) {
  return static_cast<const uint16_t*>(t.const_data_ptr());
}

void check_inputs(const at::Tensor& grad_query, const at::Tensor& grad_out,
                  const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& out, const at::Tensor& logsumexp, const at::Tensor& bias) {
  TORCH_CHECK(query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16, kOp,
              ": expected float16 or bfloat16 query, got ", query.scalar_type());
  const std::pair<const char*, const at::Tensor*> tensors[] = {
      {"grad_query", &grad_query}, {"grad_out", &grad_out}, {"query", &query},
      {"key", &key},               {"value", &value},       {"out", &out}};
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(t->dim() == 4, kOp, ": ", name, " must be 4-D [B, H, S, D], got ", t->dim(),
                "-D");
    TORCH_CHECK(t->is_cuda() && t->device() == query.device(), kOp, ": ", name,
                " must be on ", query.device(), ", got ", t->device());
    TORCH_CHECK(t->scalar_type() == query.scalar_type(), kOp, ": ", name, " must be ",
                query.scalar_type(), " like query, got ", t->scalar_type());
    TORCH_CHECK(t->stride(3) == 1 || t->size(3) <= 1, kOp, ": ", name,
                " must have a contiguous last dimension, got stride ", t->stride(3));
  }
  const int64_t B = query.size(0), H = query.size(1), s_q = query.size(2), D = value.size(3);
  TORCH_CHECK(D % 8 == 0 && D <= 256, kOp, ": head_dim must be a multiple of 8 up to 256, got ",
              D);
  TORCH_CHECK(query.size(3) == D && key.size(3) == D, kOp,
              ": query, key and value must share head_dim (", D, "), got ", query.size(3),
              " and ", key.size(3));
  TORCH_CHECK(grad_query.sizes() == query.sizes() && grad_out.sizes() == query.sizes() &&
                  out.sizes() == query.sizes(),
              kOp, ": grad_query, grad_out and out must have query's shape ", query.sizes());
  TORCH_CHECK(key.size(0) == B && value.sizes() == key.sizes(), kOp,
              ": key and value must be [", B, ", Hkv, S_kv, ", D, "], got ", key.sizes(), " and ",
              value.sizes());
  TORCH_CHECK(key.size(1) > 0 && H % key.size(1) == 0, kOp,
              ": query heads must be a multiple of key heads, got ", H, " and ", key.size(1));
  TORCH_CHECK(key.size(2) <= std::numeric_limits<int32_t>::max() &&
                  s_q <= std::numeric_limits<int32_t>::max(),
              kOp, ": sequence lengths must fit in int32");
  TORCH_CHECK(logsumexp.scalar_type() == at::kFloat && logsumexp.is_cuda() &&
                  logsumexp.device() == query.device() &&
                  (logsumexp.dim() == 3 || (logsumexp.dim() == 4 && logsumexp.size(3) == 1)) &&
                  logsumexp.size(0) == B && logsumexp.size(1) == H && logsumexp.size(2) == s_q,
              kOp, ": logsumexp must be float32 [", B, ", ", H, ", ", s_q, "(, 1)] on ",
              query.device(), ", got ", logsumexp.scalar_type(), " ", logsumexp.sizes(), " on ",
              logsumexp.device());
  if (bias.defined()) {
    TORCH_CHECK(bias.scalar_type() == query.scalar_type() && bias.device() == query.device(),
                kOp, ": attn_bias must be additive, ", query.scalar_type(), " on ",
                query.device(), ", got ", bias.scalar_type(), " on ", bias.device());
    TORCH_CHECK(bias.dim() == 4, kOp, ": attn_bias must be 4-D, got ", bias.dim(), "-D");
  }
}

}  // namespace

void repair_dq_rows(at::Tensor& grad_query, const at::Tensor& grad_out, const at::Tensor& query,
                    const at::Tensor& key, const at::Tensor& value, const at::Tensor& out,
                    const at::Tensor& logsumexp, const at::Tensor& bias, bool is_causal,
                    double scale, int64_t* repaired_rows, bool behind_backward) {
  check_inputs(grad_query, grad_out, query, key, value, out, logsumexp, bias);
  const int64_t B = query.size(0), H = query.size(1), s_q = query.size(2);
  const int64_t s_kv = key.size(2);
  const int head_dim = static_cast<int>(value.size(3));
  if (grad_query.numel() == 0) return;
  const int64_t heads = B * H;
  TORCH_CHECK(heads <= std::numeric_limits<int32_t>::max(), kOp, ": B * H must fit in int32");

  const c10::cuda::CUDAGuard device_guard(query.device());
  const int device = query.device().index();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device);

  repair::ScanParams sp{};
  sp.lse = logsumexp.const_data_ptr<float>();
  sp.lse_b = logsumexp.stride(0);
  sp.lse_h = logsumexp.stride(1);
  sp.lse_s = logsumexp.stride(2);
  sp.dq = static_cast<uint16_t*>(grad_query.mutable_data_ptr());
  sp.dq_b = grad_query.stride(0);
  sp.dq_h = grad_query.stride(1);
  sp.dq_s = grad_query.stride(2);
  sp.heads = H;
  sp.s_q = s_q;
  sp.head_dim = head_dim;
  sp.dq_vec = rows_aligned(grad_query, 8);
  sp.lse_vec = repair::lse_vectorizable(sp.lse, B, H, sp.lse_b, sp.lse_h, sp.lse_s);
  sp.threshold = kRepairLseThreshold;
  sp.repaired = reinterpret_cast<unsigned long long*>(repaired_rows);
  TileParams tp{};
  tp.q = bits(query);
  tp.k = bits(key);
  tp.v = bits(value);
  tp.o = bits(out);
  tp.go = bits(grad_out);
  tp.dq = static_cast<uint16_t*>(grad_query.mutable_data_ptr());
  tp.q_st = row_strides(query);
  tp.k_st = row_strides(key);
  tp.v_st = row_strides(value);
  tp.o_st = row_strides(out);
  tp.go_st = row_strides(grad_out);
  tp.dq_st = row_strides(grad_query);
  if (bias.defined()) {
    // The bias over [B, H, s_q, s_kv]: its broadcast axes (size 1) get
    // stride 0, the key axis included; what bias.expand() would give,
    // without making the view.
    const int64_t full[4] = {B, H, s_q, s_kv};
    int64_t strides[4];
    for (int d = 0; d < 4; ++d) {
      TORCH_CHECK(bias.size(d) == 1 || bias.size(d) == full[d], kOp, ": attn_bias ",
                  bias.sizes(), " does not broadcast to [", B, ", ", H, ", ", s_q, ", ", s_kv,
                  "]");
      strides[d] = bias.size(d) == 1 ? 0 : bias.stride(d);
    }
    tp.bias = bits(bias);
    tp.bias_b = strides[0];
    tp.bias_h = strides[1];
    tp.bias_s = strides[2];
    tp.bias_e = strides[3];
    tp.bias_vec = (strides[3] == 1 || s_kv <= 1) && rows_aligned(tp.bias, full, strides, 8);
  }
  tp.heads = H;
  tp.kv_group = H / key.size(1);
  tp.s_q = s_q;
  tp.s_kv = static_cast<int>(s_kv);
  tp.head_dim = head_dim;
  tp.tiles_per_head = (s_q + repair::kTileRows - 1) / repair::kTileRows;
  tp.n_items = heads * tp.tiles_per_head;
  tp.scale = static_cast<float>(scale);
  tp.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  tp.causal = is_causal;
  tp.vec = rows_aligned(query, 8) && rows_aligned(key, 8) && rows_aligned(value, 8) &&
           rows_aligned(out, 8) && rows_aligned(grad_out, 8);
  tp.dq_pair = rows_aligned(grad_query, 2);
  if (query.scalar_type() == at::kBFloat16) {
    repair::launch_repair_bf16(sp, tp, device, stream, behind_backward);
  } else {
    repair::launch_repair_fp16(sp, tp, device, stream, behind_backward);
  }
}

}  // namespace openwam

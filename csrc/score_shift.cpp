#include "score_shift.h"

#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "cudnn_frontend/stats.h"

namespace openwam {
namespace {

void check_shift_inputs(const at::Tensor& bias, const at::Tensor& logsumexp) {
  TORCH_INTERNAL_ASSERT(bias.dim() == 4 && logsumexp.dim() == 4 && logsumexp.size(3) == 1);
  TORCH_INTERNAL_ASSERT(logsumexp.scalar_type() == at::kFloat && logsumexp.is_contiguous());
  TORCH_INTERNAL_ASSERT(bias.device() == logsumexp.device());
  for (int64_t d = 0; d < 3; ++d) {
    TORCH_INTERNAL_ASSERT(bias.size(d) == 1 || bias.size(d) == logsumexp.size(d),
                          "shift_scores: the bias must broadcast to the logsumexp's rows");
  }
}

// The reference: one bias row at a time, as the CUDA kernel runs one per warp
// or block, raised into `out` (the bias itself in place). With lse_out null,
// the restore from `shifts`.
template <typename T>
void shift_cpu(const at::Tensor& bias, const at::Tensor& out, const at::Tensor& logsumexp,
               float* lse_out, float* shifts, const ShiftRows& r, ShiftLimits limits) {
  const T* b = bias.const_data_ptr<T>();
  T* o = out.data_ptr<T>();
  const bool in_place = b == o;
  const float* lse = logsumexp.const_data_ptr<float>();
  for (int64_t g = 0; g < r.groups(); ++g) {
    int64_t gb, gh, gl;
    r.row_of(g, gb, gh, gl);
    const auto entry = [&](int64_t e) { return r.lse_index(gb, gh, gl, e); };
    float c = 0.0f, sign = -1.0f;
    if (lse_out != nullptr) {
      float min_lse = std::numeric_limits<float>::infinity();
      for (int64_t e = 0; e < r.entries(); ++e) {
        const float x = lse[entry(e)];
        if (std::isfinite(x)) {
          min_lse = std::min(min_lse, x);
        }
      }
      c = shift_of(min_lse, limits);
      if (shifts != nullptr) {
        shifts[g] = c;
      }
      sign = 1.0f;
      for (int64_t e = 0; e < r.entries(); ++e) {
        const int64_t i = entry(e);
        lse_out[i] = shifted_lse(lse[i], c);
      }
    } else {
      c = shifts[g];
    }
    if (c == 0.0f && in_place) {
      continue;
    }
    const int64_t first = r.bias_offset(gb, gh, gl);
    for (int64_t j = 0; j < r.keys; ++j) {
      const int64_t i = first + j * r.key_stride;
      const float x = static_cast<float>(b[i]);
      o[i] = std::isfinite(x) ? static_cast<T>(x + sign * c) : b[i];
    }
  }
}

// The shift (lse_out given) or the restore (lse_out null), on checked rows.
void run(const at::Tensor& bias, const at::Tensor& out, const at::Tensor& logsumexp,
         float* lse_out, float* shifts, const ShiftRows& rows) {
  // A row no logsumexp entry reads (no query rows or heads) keeps c = 0; a
  // copy still writes it.
  if (rows.groups() == 0 || (rows.entries() == 0 && bias.is_same(out))) {
    return;
  }
#ifdef OPENWAM_WITH_CUDA
  if (bias.is_cuda()) {
    launch_score_shift(bias, out, logsumexp, lse_out, shifts, rows);
    return;
  }
#endif
  const ShiftLimits limits = shift_limits(bias.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bias.scalar_type(), "shift_scores", [&] {
    shift_cpu<scalar_t>(bias, out, logsumexp, lse_out, shifts, rows, limits);
  });
}

}  // namespace

ShiftRows shift_rows(const at::Tensor& bias, const at::Tensor& logsumexp) {
  ShiftRows r{};
  r.batch = logsumexp.size(0);
  r.heads = logsumexp.size(1);
  r.rows = logsumexp.size(2);
  for (int64_t d = 0; d < 3; ++d) {
    // A stride-0 axis is one row in memory: every logsumexp reading it
    // decides its c together.
    r.broadcast[d] = bias.size(d) == 1 || bias.stride(d) == 0;
    r.strides[d] = r.broadcast[d] ? 0 : bias.stride(d);
  }
  r.keys = bias.size(3);
  r.key_stride = bias.stride(3);
  // Axes of one index neither broadcast nor break a run.
  const int64_t sizes[3] = {r.batch, r.heads, r.rows};
  bool seen_broadcast = false;
  r.contiguous = true;
  for (int64_t d = 0; d < 3; ++d) {
    if (sizes[d] == 1) {
      continue;
    }
    if (r.broadcast[d]) {
      seen_broadcast = true;
    } else if (seen_broadcast) {
      r.contiguous = false;
    }
  }
  return r;
}

ShiftLimits shift_limits(at::ScalarType dtype) {
  if (dtype == at::kHalf) {
    return {0.0f, 32768.0f};
  }
  return {-32.0f, std::ldexp(1.0f, 126)};
}

ShiftedScores shift_scores(const at::Tensor& bias, const at::Tensor& logsumexp, BiasWrite write) {
  check_shift_inputs(bias, logsumexp);
  ShiftedScores s;
  s.rows = shift_rows(bias, logsumexp);
  const int64_t n = logsumexp.numel(), groups = s.rows.groups();
  if (write == BiasWrite::kAuto) {
    const bool small = groups * s.rows.keys * bias.element_size() <= n * int64_t{sizeof(float)};
    write = small ? BiasWrite::kCopy : BiasWrite::kInPlace;
  }
  const bool in_place = write == BiasWrite::kInPlace;
  // One allocation, sized to the logsumexp in place (a view through the
  // dispatcher costs host time on every shifted backward); in place, each
  // row's c follows its entries.
  s.logsumexp = at::empty({n + (in_place ? groups : 0)}, logsumexp.options());
  s.logsumexp.unsafeGetTensorImpl()->set_sizes_contiguous(logsumexp.sizes());
  if (in_place) {
    s.shifts = s.logsumexp.data_ptr<float>() + n;
  } else {
    s.bias = at::empty_strided(bias.sizes(), bias.strides(), bias.options());
  }
  run(bias, in_place ? bias : s.bias, logsumexp, s.logsumexp.data_ptr<float>(), s.shifts, s.rows);
  return s;
}

bool shifts_in_forward(const Plan& plan, const std::optional<at::Tensor>& bias,
                       const c10::SymInt& s_kv, bool compute_log_sumexp) {
  if (!plan.shift_scores || plan.pad_query_backward || plan.pads_keys() || !compute_log_sumexp ||
      !bias.has_value() || bias->dim() != 4) {
    return false;
  }
  return bias->sym_size(2) == 1 && bias->sym_size(3) == s_kv && bias->sym_stride(3) == 1;
}

at::Tensor shift_scores_in_forward(const at::Tensor& bias, const at::Tensor& logsumexp) {
  check_shift_inputs(bias, logsumexp);  // the forward's own logsumexp: contiguous
  const ShiftRows rows = shift_rows(bias, logsumexp);
  at::Tensor raised = at::empty_strided(bias.sizes(), bias.strides(), bias.options());
  run(bias, raised, logsumexp, logsumexp.data_ptr<float>(), nullptr, rows);
  if (bias.is_cuda()) {
    frontend::stats().score_shift_backwards++;
  }
  return raised;
}

void unshift_scores(const at::Tensor& bias, const ShiftedScores& shifted) {
  if (shifted.shifts != nullptr) {
    run(bias, bias, shifted.logsumexp, nullptr, shifted.shifts, shifted.rows);
  }
}

ScopedScoreShift::ScopedScoreShift(bool on, const at::Tensor& bias, const at::Tensor& logsumexp)
    : given_bias_(bias), given_lse_(logsumexp) {
  if (!on) {
    return;
  }
  TORCH_CHECK(bias.defined(), "openwam::_cudnn_sdpa_backward: the plan shift_scores is for "
              "calls with a bias (a bool mask's), got none");
  // The shift writes each bias row once: axes of stride 0 broadcast (one row
  // for all their indices, as a bias expanded along the queries), but a
  // key of stride 0 would be raised once per key.
  TORCH_CHECK(bias.dim() == 4 && (bias.stride(3) == 1 || bias.size(3) <= 1),
              "openwam::_cudnn_sdpa_backward: the plan shift_scores needs a 4-D bias with "
              "contiguous keys (a bool mask's, as openwam::sdpa makes it), got sizes ",
              bias.sizes(), " and strides ", bias.strides());
  shifted_ = shift_scores(bias, logsumexp.contiguous());
}

void ScopedScoreShift::ran() const {
  if (shifted_.logsumexp.defined() && given_bias_.is_cuda()) {
    frontend::stats().score_shift_backwards++;
  }
}

ScopedScoreShift::~ScopedScoreShift() {
  if (shifted_.shifts == nullptr) {
    return;
  }
  try {
    unshift_scores(given_bias_, shifted_);
  } catch (const std::exception& e) {
    // A destructor may not throw; a failed launch leaves CUDA's error set, and
    // the next call raises it.
    TORCH_WARN("openwam: restoring the bias after a shifted backward failed: ", e.what());
  }
}

}  // namespace openwam

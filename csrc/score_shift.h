// The score shift: the key-tail fix of a backward whose bias comes from a
// bool mask (the plan shift_scores).
//
// Why: cuDNN's SDPA backward on sm90 (< 9.26, cudnn-frontend #160) scores the
// key rows past s_kv in its last 128-key tile 0 instead of -inf. Their
// probability is then exp(0 - lse), which overflows for a logsumexp below
// -88.7, and inf * 0 (the zero K rows) is NaN in dQ. A softmax does not
// change when every score of its row moves by one constant c: with the bias
// raised by c and the logsumexp by c, the backward computes the same
// gradients, and exp(0 - lse - c) <= 1 once lse + c >= 0. A bool mask's bias
// holds 0 and -inf only, so 0 + c is exact for a power of two and -inf stays
// -inf. Stock's own graph then runs the backward at stock's cost, where the
// other fix, cuDNN's padding mask, is its slow corner with a bias (1.10x-1.23x
// stock's fwd+bwd, docs/performance.md). Measured on an H100 (cuDNN 9.19.0,
// ATen's wrappers, probe on branch probe/score-shift): 0 non-finite gradients
// where stock had up to 852,480, batch 1 with one query row included, dQ
// errors within the efficient backend's but one (1.08x it), dK and dV errors at or
// below stock's. In the op: 1.003x-1.044x stock's fwd+bwd at 704x704 with a
// bool mask and none to every row affected (H100, docs/performance.md).
//
// Where the bias broadcasts over the query rows (a key mask [B, 1, 1, S]: one
// row per batch element, read by every head and query), the forward shifts:
// its logsumexp in place (the op's own output) and a raised copy of the bias,
// which the backward reads instead of the bias, on stock's graph and with no
// kernel of its own. The backward's host time is then stock's (one launch and
// an allocation, about 4 us on an H100, moved into the forward, which had
// 14 us to spare), and the shifted logsumexp takes the place of the
// logsumexp: no second one held. The copy is 1/L of the bias a [B, 1, L, S]
// mask would give. A bias with query rows is shifted at the backward: a raised
// copy where it takes no more bytes than the shifted logsumexp, else in place,
// restored after the backward, so that no second copy of it is held (peak
// memory stays stock's; under torch.compile one bias can serve every layer);
// the cost is a second kernel launch. The restore is exact for 0 and -inf.
//
// The bias is shared by the query heads, and by the batch or the query rows
// where it broadcasts, so c is one per bias row: a power of two that lifts
// every finite logsumexp reading that row to >= 0, or 0 where none is below
// the dtype's limit (ShiftLimits; ordinary rows: stock's graph is right
// there, and runs on exactly stock's inputs). A row that sees no key
// (logsumexp -inf) reads the largest float instead, so its probabilities, and
// its gradients, are 0.
//
// The backward mutates a bias its op takes as read-only: every reader of it
// (the forward, this backward) runs on the same stream, and the restore is
// exact, so nothing outside the call sees the shift. A bias that is not the
// op's own bool-mask bias (a direct call of the leaf op with this plan) must
// hold 0 and -inf only too; the restore of other values rounds.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <optional>

#include <cfloat>
#include <cmath>

#include "plan.h"

namespace openwam {

// Which bias rows a dtype shifts, and how far it can. Rows whose smallest
// finite logsumexp is at least `below` keep c = 0; c is at most `cap`.
// - bfloat16 (and float): below -32, where exp(0 - lse) <= e^32 stays far from
//   float's and bfloat16's overflow at e^88.7; cap 2^126.
// - float16: below 0. cuDNN's backward rounds dS to the inputs' dtype for its
//   dQ product, and exp(0 - lse) passes fp16's largest value, 65504, from a
//   logsumexp of -11.1 on (not measured: the GPU sweeps drew -88 and below).
//   cap 2^15, fp16's largest power of two: a row below -32768 stays below 0.
struct ShiftLimits {
  float below, cap;
};
ShiftLimits shift_limits(at::ScalarType dtype);

// The bias's rows as the shift sees them: the logsumexp's sizes, and whether
// each of the bias's first three axes broadcasts.
struct ShiftRows {
  int64_t batch, heads, rows;       // the logsumexp's B, H, L
  bool broadcast[3];                // the bias's B, H, L axes
  int64_t strides[3];               // the bias's strides along them
  int64_t keys, key_stride;         // S and its stride
  // Whether the broadcast axes (of more than one index) all follow the
  // others: bias row g's entries are then logsumexp[g * entries() + e], one
  // contiguous run (a key mask's heads x rows), which the kernel reads in
  // vectors of registers.
  bool contiguous;
  // How many bias rows there are, and how many logsumexp entries read each.
  C10_HOST_DEVICE int64_t groups() const {
    return (broadcast[0] ? 1 : batch) * (broadcast[1] ? 1 : heads) * (broadcast[2] ? 1 : rows);
  }
  C10_HOST_DEVICE int64_t entries() const {
    return (broadcast[0] ? batch : 1) * (broadcast[1] ? heads : 1) * (broadcast[2] ? rows : 1);
  }
  // Bias row g's (batch, head, row) along the axes that do not broadcast.
  C10_HOST_DEVICE void row_of(int64_t g, int64_t& gb, int64_t& gh, int64_t& gl) const {
    const int64_t nh = broadcast[1] ? 1 : heads, nl = broadcast[2] ? 1 : rows;
    gl = g % nl;
    gh = (g / nl) % nh;
    gb = g / (nl * nh);
  }
  // The logsumexp index of entry e of bias row (gb, gh, gl): e runs over the
  // axes that broadcast, the query row fastest.
  C10_HOST_DEVICE int64_t lse_index(int64_t gb, int64_t gh, int64_t gl, int64_t e) const {
    const int64_t el = broadcast[2] ? e % rows : gl;
    const int64_t rest = broadcast[2] ? e / rows : e;
    const int64_t eh = broadcast[1] ? rest % heads : gh;
    const int64_t eb = broadcast[1] ? rest / heads : rest;
    return ((broadcast[0] ? eb : gb) * heads + eh) * rows + el;
  }
  // The first element of bias row (gb, gh, gl).
  C10_HOST_DEVICE int64_t bias_offset(int64_t gb, int64_t gh, int64_t gl) const {
    return gb * strides[0] + gh * strides[1] + gl * strides[2];
  }
};
ShiftRows shift_rows(const at::Tensor& bias, const at::Tensor& logsumexp);

// Where the shifted bias goes: a copy (no restore, a second bias in memory)
// or the given bias (restored after). kAuto: a copy where it takes no more
// bytes than the shifted logsumexp.
enum class BiasWrite { kAuto, kInPlace, kCopy };

// What a shift leaves: the logsumexp the shifted backward reads; the raised
// copy of the bias, or, where the bias was raised in place, each bias row's c
// for the restore (in the logsumexp's allocation, after its entries); the
// rows, for the restore.
struct ShiftedScores {
  at::Tensor logsumexp;     // [B, H, L, 1] float32, contiguous
  at::Tensor bias;          // the raised copy; undefined where raised in place
  float* shifts = nullptr;  // in place: one c per bias row, for the restore
  ShiftRows rows{};
};

// `bias` ([B|1, H|1, L|1, S] in the inputs' dtype; its finite entries 0, as
// a bool mask's) raised by each row's c, in place or into a copy of its sizes
// and strides (`write`). The logsumexp it returns is `logsumexp` ([B, H, L, 1]
// float32, contiguous) plus its row's c, the largest float where it is -inf.
// Axes of `bias` of size 1 or stride 0 broadcast: c is then one for every row
// reading it.
ShiftedScores shift_scores(const at::Tensor& bias, const at::Tensor& logsumexp,
                           BiasWrite write = BiasWrite::kAuto);

// Whether the forward of a call shifts (its training forward, plan
// shift_scores without the one-row backward, which reads no logsumexp, and
// without padded keys, whose backward reads another bias): a
// 4-D bias whose query axis has size 1 and whose keys are `s_kv`, contiguous.
// Shared by the forward's kernels, its Meta kernel and the autograd node,
// which then hands the raised bias to the backward and drops shift_scores
// from its plan. Any other bias is shifted at the backward. The shift is
// idempotent (every shifted row's logsumexp is >= 0, which no limit shifts
// again): a backward given shifted scores and the plan still is right.
bool shifts_in_forward(const Plan& plan, const std::optional<at::Tensor>& bias,
                       const c10::SymInt& s_kv, bool compute_log_sumexp);

// The forward's shift: `logsumexp` ([B, H, L, 1] float32, contiguous; the
// forward's own) raised in place by each bias row's c, and the raised copy of
// `bias` returned (its sizes and strides).
at::Tensor shift_scores_in_forward(const at::Tensor& bias, const at::Tensor& logsumexp);

// `bias` back to what it held before the shift that gave `shifted`, where
// that shift raised it in place: each row's c taken off again (exact for
// entries 0 and -inf). A no-op after a copy.
void unshift_scores(const at::Tensor& bias, const ShiftedScores& shifted);

// c for a bias row whose smallest finite logsumexp is `min_lse` (+inf when
// none is finite): the power of two above -min_lse (frexpf and ldexpf, exact
// where exp2f need not be), at least 1 (exact in fp16) and at most the cap.
C10_HOST_DEVICE inline float shift_of(float min_lse, ShiftLimits limits) {
  if (!(min_lse < limits.below)) {  // none below, or none finite (+inf)
    return 0.0f;
  }
  int e = 0;
  frexpf(-min_lse, &e);  // -min_lse < 2^e
  const float c = ldexpf(1.0f, e < 0 ? 0 : (e > 126 ? 126 : e));  // 2^127 and up: the cap
  return c < limits.cap ? c : limits.cap;
}

// A logsumexp entry `x` on its row's shifted scores: x + c, the largest float
// for a row that sees no key (x = -inf), so that its probabilities are 0. The
// CPU reference and the kernels write it through this one function.
C10_HOST_DEVICE inline float shifted_lse(float x, float c) {
  return x == -INFINITY ? FLT_MAX : x + c;
}

// shift_scores for one scope, where `on`: a bias raised in place is restored
// when the scope ends, by an exception too.
class ScopedScoreShift {
 public:
  ScopedScoreShift(bool on, const at::Tensor& bias, const at::Tensor& logsumexp);
  ~ScopedScoreShift();
  ScopedScoreShift(const ScopedScoreShift&) = delete;
  ScopedScoreShift& operator=(const ScopedScoreShift&) = delete;
  // What the backward reads: the shifted logsumexp and bias where `on`, the
  // given ones otherwise.
  const at::Tensor& logsumexp() const {
    return shifted_.logsumexp.defined() ? shifted_.logsumexp : given_lse_;
  }
  const at::Tensor& bias() const { return shifted_.bias.defined() ? shifted_.bias : given_bias_; }
  // The backward ran on the shifted scores: counted in frontend_stats() (CUDA).
  void ran() const;

 private:
  at::Tensor given_bias_, given_lse_;
  ShiftedScores shifted_;
};

#ifdef OPENWAM_WITH_CUDA
// The CUDA kernels (csrc/cuda/score_shift.cu). The shift (lse_out given):
// `bias` raised into `bias_out` (the same tensor in place, else its copy), the
// shifted logsumexp into `lse_out`, each row's c into `shifts` where not null.
// The restore (lse_out null): `bias` lowered by `shifts`.
void launch_score_shift(const at::Tensor& bias, const at::Tensor& bias_out,
                        const at::Tensor& logsumexp, float* lse_out, float* shifts,
                        const ShiftRows& rows);
#endif

}  // namespace openwam

// Accuracy of the repaired fp16 rows against float64, on the inputs that
// need the repair: every key shares a large component (openwam_sdpa's
// adversarial builder: 30 / sqrt(D) per element, plus 0.5 N(0, 1)), and the
// listed query rows point against it (logits near -110, lse near -103).
// sum_j dS_ij = 0 in exact arithmetic, so any error of dS (rounded to fp16
// for the mma; delta taken from the fp16 output) reaches dQ multiplied by
// that shared component. test_repair_kernels.cpp cannot see this: its
// reference (repair_case.h) rounds dS like the kernel and its error is
// relative to the size of the summed terms. Here the reference is exact
// (float64 o, P and dS) and the error is in fp16 ulps of the row's largest dQ. head_dim 96: a padded
// width (128), keys 146: a partial third key block; head 0 lists 64 rows (a
// wide tile), head 1 eight (a narrow tile: four warps' partial sums).
#include "simt_emu.h"  // first: it stands in for the CUDA features

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "cuda/repair/layout.cuh"
#include "cuda/repair/run.cuh"
#include "scan_params.h"

using namespace openwam::repair;

namespace {

constexpr int kHeads = 2, kSq = 64, kSkv = 146, kD = 96;
constexpr double kEps16 = 1.0 / 1024;  // torch.finfo(torch.float16).eps

double h2d(uint16_t x) { return f16_to_float(x); }

// [kHeads][rows][kD], contiguous.
struct Half3 {
  int rows;
  std::vector<uint16_t> v;
  explicit Half3(int r) : rows(r), v(static_cast<size_t>(kHeads) * r * kD) {}
  uint16_t& at(int h, int i, int d) { return v[(static_cast<size_t>(h) * rows + i) * kD + d]; }
  double get(int h, int i, int d) const { return h2d(v[(static_cast<size_t>(h) * rows + i) * kD + d]); }
  RowStrides strides() const { return RowStrides{0, static_cast<int64_t>(rows) * kD, kD}; }
};

// The worst row error, in kEps16 x max|dQ_ref| of the row, of the emulated
// fp16 tile kernel over the listed rows.
// wgmma: the wide tile (head 0) on the wgmma path of an sm_90a build.
double worst_row_error(bool wgmma) {
  std::mt19937 rng(20261130);
  std::normal_distribution<double> normal;
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  const double u = 1.0 / std::sqrt(static_cast<double>(kD));
  const double amplitude = 30.0, target = -110.0, magnitude = -target / (amplitude * scale);
  Half3 q(kSq), k(kSkv), v(kSkv), o(kSq), go(kSq), dq(kSq);
  for (int h = 0; h < kHeads; ++h) {
    for (int j = 0; j < kSkv; ++j) {
      for (int d = 0; d < kD; ++d) {
        k.at(h, j, d) = float_to_f16(static_cast<float>(0.5 * normal(rng) + amplitude * u));
        v.at(h, j, d) = float_to_f16(static_cast<float>(normal(rng)));
      }
    }
    for (int i = 0; i < kSq; ++i) {
      for (int d = 0; d < kD; ++d) {
        q.at(h, i, d) = float_to_f16(static_cast<float>(-magnitude * u + 0.05 * normal(rng)));
        go.at(h, i, d) = float_to_f16(static_cast<float>(normal(rng)));
      }
    }
  }

  // float64 forward and backward; the kernel gets lse in fp32 and o in fp16.
  std::vector<float> lse(kHeads * kSq);
  std::vector<double> ref(static_cast<size_t>(kHeads) * kSq * kD, 0.0);
  for (int h = 0; h < kHeads; ++h) {
    for (int i = 0; i < kSq; ++i) {
      std::vector<double> s(kSkv), dp(kSkv), out(kD, 0.0);
      double mx = -INFINITY;
      for (int j = 0; j < kSkv; ++j) {
        double qk = 0, gv = 0;
        for (int d = 0; d < kD; ++d) {
          qk += q.get(h, i, d) * k.get(h, j, d);
          gv += go.get(h, i, d) * v.get(h, j, d);
        }
        s[j] = qk * scale;
        dp[j] = gv;
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (int j = 0; j < kSkv; ++j) sum += std::exp(s[j] - mx);
      const double l = mx + std::log(sum);
      lse[h * kSq + i] = static_cast<float>(l);
      double delta = 0;
      for (int j = 0; j < kSkv; ++j) {
        const double p = std::exp(s[j] - l);
        for (int d = 0; d < kD; ++d) out[d] += p * v.get(h, j, d);
      }
      for (int d = 0; d < kD; ++d) {
        o.at(h, i, d) = float_to_f16(static_cast<float>(out[d]));
        delta += go.get(h, i, d) * out[d];
      }
      for (int j = 0; j < kSkv; ++j) {
        const double ds = std::exp(s[j] - l) * (dp[j] - delta);
        for (int d = 0; d < kD; ++d) ref[(static_cast<size_t>(h) * kSq + i) * kD + d] += ds * k.get(h, j, d) * scale;
      }
    }
  }

  // The rows to recompute: all 64 rows of head 0, rows 0..7 of head 1 (a
  // narrow tile); the other rows of head 1 get an ordinary logsumexp, which
  // the kernel leaves alone.
  const int listed[kHeads] = {kSq, 8};
  std::vector<float> lse_given(lse.begin(), lse.end());
  for (int i = listed[1]; i < kSq; ++i) lse_given[kSq + i] = 0.0f;
  unsigned long long counter = 0;
  const ScanParams sp =
      scan_params(lse_given.data(), 1, kHeads, kSq, dq.v.data(), dq.strides(), kD, true,
                  &counter);

  TileParams tp{};
  tp.q = q.v.data(), tp.k = k.v.data(), tp.v = v.v.data(), tp.o = o.v.data(), tp.go = go.v.data();
  tp.dq = dq.v.data();
  tp.q_st = q.strides(), tp.k_st = k.strides(), tp.v_st = v.strides(), tp.o_st = o.strides();
  tp.go_st = go.strides(), tp.dq_st = dq.strides();
  tp.heads = kHeads;
  tp.kv_group = 1;
  tp.s_q = kSq;
  tp.s_kv = kSkv;
  tp.head_dim = kD;
  tp.tiles_per_head = 1;
  tp.n_items = kHeads;
  tp.stages = 3;
  tp.scale = static_cast<float>(scale);
  tp.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  tp.vec = true;
  tp.dq_pair = true;
  constexpr int kWidth = 128;
  static_assert(kWidth == 128 && kD < kWidth, "head_dim 96 runs padded in the 128 kernel");
  emu::launch(kHeads, kTileThreads, TileSmem{kWidth, false, tp.stages}.total(),
              [&] {
                if (wgmma) {
                  repair_tiles<Fp16, kWidth, true, false>(sp, tp);
                } else {
                  repair_tiles<Fp16, kWidth, false, false>(sp, tp);
                }
              });
  REQUIRE(counter == static_cast<unsigned long long>(listed[0] + listed[1]));

  double worst = 0;
  for (int h = 0; h < kHeads; ++h) {
    for (int i = 0; i < listed[h]; ++i) {
      double err = 0, mag = 0;
      for (int d = 0; d < kD; ++d) {
        const double r = ref[(static_cast<size_t>(h) * kSq + i) * kD + d];
        err = std::max(err, std::fabs(dq.get(h, i, d) - r));
        mag = std::max(mag, std::fabs(r));
      }
      worst = std::max(worst, err / (kEps16 * mag));
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("repair fp16 rows with a shared key component, against float64", "[repair][emulated]") {
  // Rounding dQ to fp16 alone costs up to 0.5 (in eps x the row's max|dQ|).
  // The rest is the error of sum_j dS times |k_j - m| (spread 0.5 per
  // element) instead of |k_j| (3.1). Measured: 0.67 with the centred keys,
  // 2.86 with the plain dS K (FlashAttention-2's arithmetic, which stays
  // exact only where P is recomputed bit for bit like its own forward's);
  // the plain kernel is within 0.62 of a float64 model of its arithmetic,
  // so nothing else (head_dim 96's padding included) adds error. 1.5 leaves
  // room for tensor cores that accumulate S less exactly than this emulator
  // and still fails the plain product. On the H200 sweep's fp16 rows (|dQ|
  // ~0.5) one unit is ~5e-4.
  for (const bool wgmma : {false, true}) {
    const double worst = worst_row_error(wgmma);
    INFO((wgmma ? "wgmma" : "mma.sync") << ": worst row error " << worst
                                        << " x eps x max|dQ_ref|");
    CHECK(worst < 1.5);
  }
}

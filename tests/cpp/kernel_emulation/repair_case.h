// The emulated kernels' test harness: run_case builds a case's inputs (a
// float64 forward for the logsumexp and output, dQ with sentinels), runs the
// dQ-row repair's kernels (csrc/cuda/repair/{scan,run,tile}*.cuh, their real
// source) through simt_emu.h behind a grid that writes dQ late, and checks
// against a float64 reference: rows below the threshold recomputed, -inf
// rows zeroed, other rows bit-identical, the telemetry count, no bank
// conflict in any ldmatrix, the L2 prefetches, the path (wgmma or mma.sync)
// and the cp.async count; each tile of work recomputed exactly once
// (check_tile_trace, on OPENWAM_REPAIR_TRACE_TILE's record).
#pragma once

#include "simt_emu.h"  // first: it stands in for the CUDA features

#include <catch2/catch.hpp>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/repair/layout.cuh"
#include "cuda/repair/scan.cuh"
#include "cuda/repair/run.cuh"
#include "emu_support.h"
#include "scan_params.h"

namespace emu_test {

// The tiles of work an emulated launch recomputed (emu::tile_trace) against
// the heads' affected rows: each tile j of a head's work_tiles(count) once,
// with min(64, count - 64 j) rows, by a block of the cluster whose run holds
// its item (`grid` clusters of `cluster` blocks); a tile split across the
// cluster (parts[head] blocks, the head's only tile) once by each of its
// blocks. (A tile recomputed twice writes the same values: dQ cannot show it.)
inline void check_tile_trace(const std::vector<emu::TileRecord>& trace,
                             const std::vector<int64_t>& affected, int64_t tiles, int64_t grid,
                             int cluster, const std::vector<int>& parts) {
  const int64_t heads = static_cast<int64_t>(affected.size()), n_items = heads * tiles;
  std::vector<std::vector<int>> times(heads);  // [head][j]: how often tile j was recomputed
  for (int64_t head = 0; head < heads; ++head) times[head].assign(work_tiles(affected[head]), 0);
  std::vector<int64_t> recorded(heads, 0);
  long stray = 0, wrong_rows = 0, wrong_block = 0, wrong_parts = 0;
  std::vector<unsigned> split_ranks(heads, 0u);  // [head]: ranks that took a share of its tile
  for (const emu::TileRecord& t : trace) {
    if (t.head < 0 || t.head >= heads) {
      ++stray;
      continue;
    }
    ++recorded[t.head];
    const int64_t count = affected[t.head], n_work = work_tiles(count);
    if (t.work < 0 || t.work >= n_work) {
      ++stray;
      continue;
    }
    ++times[t.head][t.work];
    wrong_rows += t.n_rows != std::min<int64_t>(kTileRows, count - t.work * kTileRows);
    wrong_parts += t.parts != parts[t.head];
    if (t.parts > 1) split_ranks[t.head] |= 1u << (t.block % cluster);
    const int64_t item = t.head * tiles + t.work * work_stride(n_work, tiles);
    const int64_t unit = t.block / cluster;
    wrong_block += item < unit * n_items / grid || item >= (unit + 1) * n_items / grid;
  }
  EXPECT(wrong_parts == 0, "%ld tiles split other than the rule says", wrong_parts);
  EXPECT(stray == 0, "%ld tiles recomputed outside a head's tiles of work", stray);
  EXPECT(wrong_rows == 0, "%ld tiles recomputed with a wrong number of rows", wrong_rows);
  EXPECT(wrong_block == 0, "%ld tiles recomputed by a block whose run lacks their item",
         wrong_block);
  for (int64_t head = 0; head < heads; ++head) {
    const int n = parts[head];
    const auto once = std::count(times[head].begin(), times[head].end(), n);
    EXPECT(recorded[head] == n * work_tiles(affected[head]) &&
               once == static_cast<long>(times[head].size()),
           "head %" PRId64 ", %" PRId64 " rows: %" PRId64 " tiles recomputed, %ld of its %zu %d times",
           head, affected[head], recorded[head], static_cast<long>(once), times[head].size(), n);
    if (n > 1)
      EXPECT(split_ranks[head] == (1u << n) - 1u, "head %" PRId64 ": split among ranks %x", head,
             split_ranks[head]);
  }
}

// wgmma: wide tiles at head_dim width 64 and 128 on the wgmma path (what an
// sm_90a build runs), else mma.sync.
template <class Elt>
void run_case(const Case<Elt>& c, bool wgmma) {
  constexpr bool kFp16 = std::is_same_v<Elt, Fp16>;
  std::mt19937 rng(std::hash<std::string>()(c.name) & 0xffff);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uni;
  const int B = c.B, H = c.H, Hkv = c.Hkv, SQ = c.s_q, SK = c.s_kv, D = c.D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const double amp = 3.0, target = -70.0, key_noise = 0.2;
  Tensor4 q = make_tensor(B, H, SQ, D, c.layout), k = make_keys(B, Hkv, SK, D, c.layout, kFp16),
          v = make_keys(B, Hkv, SK, D, c.layout, kFp16), o = make_tensor(B, H, SQ, D, c.layout),
          go = make_tensor(B, H, SQ, D, c.layout), dq = make_tensor(B, H, SQ, D, c.layout);
  const double u = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<char> adversarial(static_cast<size_t>(B) * H * SQ, 0);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hkv; ++h) {
      for (int j = 0; j < SK; ++j) {
        for (int d = 0; d < D; ++d) {
          const double shared = j == c.hot_key ? 0.9 * amp * u : amp * u;
          k.at(b, h, j, d) = from_d(key_noise * normal(rng) + shared, kFp16);
          v.at(b, h, j, d) = from_d(normal(rng), kFp16);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const int one = static_cast<int>(uni(rng) * SQ);
      std::vector<char> picked(SQ, 0);  // rows_per_head: the first of a random order
      if (c.rows_per_head > 0) {
        std::vector<int> order(SQ);
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        for (int r = 0; r < std::min(c.rows_per_head, SQ); ++r) picked[order[r]] = 1;
      }
      for (int i = 0; i < SQ; ++i) {
        const bool adv = (c.rows_per_head > 0 ? picked[i] != 0
                          : c.share < 0        ? i == one
                                               : uni(rng) < c.share) &&
                         i >= c.first_affected;
        adversarial[(static_cast<size_t>(b) * H + h) * SQ + i] = adv;
        const double m = -target / (amp * scale);
        for (int d = 0; d < D; ++d) {
          const double val = adv ? -m * u + 0.05 * normal(rng) : normal(rng);
          q.at(b, h, i, d) = from_d(val, kFp16);
          go.at(b, h, i, d) = from_d(normal(rng), kFp16);
        }
      }
    }
  }
  // Bias, as the op gets it after expand: [B, H, SQ, SK] with stride 0 on
  // broadcast axes, additive, -inf where hidden.
  std::vector<uint16_t> bias_store;
  int64_t bs[4] = {0, 0, 0, 0};
  const bool has_bias = c.bias != Case<Elt>::kNoBias;
  if (has_bias) {
    int64_t shape[4] = {B, H, SQ, SK};
    if (c.bias == Case<Elt>::kKeyPad) shape[1] = shape[2] = 1;
    if (c.bias == Case<Elt>::kRows) shape[0] = shape[1] = 1;
    bs[3] = 1;
    bs[2] = shape[3];
    bs[1] = shape[2] * bs[2];
    bs[0] = shape[1] * bs[1];
    bias_store.assign(shape[0] * shape[1] * shape[2] * shape[3], 0);
    for (int64_t i = 0; i < shape[0] * shape[1] * shape[2] * shape[3]; ++i) {
      const bool hidden = uni(rng) < 0.2;
      bias_store[i] = from_d(hidden ? -INFINITY : 0.5 * normal(rng), kFp16);
    }
    for (int r = 0; r < c.masked_rows && c.bias != Case<Elt>::kKeyPad; ++r) {
      const int row = (7 * r + 3) % SQ;
      for (int64_t b = 0; b < shape[0]; ++b)
        for (int64_t h = 0; h < shape[1]; ++h)
          for (int j = 0; j < SK; ++j)
            bias_store[b * bs[0] + h * bs[1] + row * bs[2] + j] = from_d(-INFINITY, kFp16);
    }
    for (int d = 0; d < 4; ++d)
      if (shape[d] == 1) bs[d] = 0;
  }
  auto bias_at = [&](int b, int h, int i, int j) -> double {
    if (!has_bias) return 0.0;
    return to_d(bias_store[b * bs[0] + h * bs[1] + i * bs[2] + j * bs[3]], kFp16);
  };
  const int group = H / Hkv;

  // Forward in float64: lse (float32 as cuDNN gives it) and out (rounded).
  std::vector<float> lse(static_cast<size_t>(B) * H * SQ);
  std::vector<double> logit(SK);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < SQ; ++i) {
        double mx = -INFINITY;
        for (int j = 0; j < SK; ++j) {
          double s = 0;
          for (int d = 0; d < D; ++d)
            s += to_d(q.at(b, h, i, d), kFp16) * to_d(k.at(b, h / group, j, d), kFp16);
          s = s * scale + bias_at(b, h, i, j);
          if (c.causal && j > i) s = -INFINITY;
          logit[j] = s;
          mx = std::max(mx, s);
        }
        double l = -INFINITY;
        if (mx > -INFINITY) {
          double sum = 0;
          for (int j = 0; j < SK; ++j) sum += std::exp(logit[j] - mx);
          l = mx + std::log(sum);
        }
        lse[(static_cast<size_t>(b) * H + h) * SQ + i] = static_cast<float>(l);
        for (int d = 0; d < D; ++d) {
          double acc = 0;
          if (l > -INFINITY)
            for (int j = 0; j < SK; ++j)
              acc += std::exp(logit[j] - l) * to_d(v.at(b, h / group, j, d), kFp16);
          o.at(b, h, i, d) = from_d(acc, kFp16);
        }
      }
    }
  }
  if (c.nan_lse_row) lse[1] = NAN;

  // dQ before the repair: finite sentinels in rows to keep, NaN where the
  // kernel must write (rows to recompute and -inf rows).
  std::vector<char> kind(lse.size());  // 0 keep, 1 recompute, 2 zero
  long expected_count = 0;
  std::vector<int64_t> affected(static_cast<size_t>(B) * H, 0);  // rows to recompute, per head
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < SQ; ++i) {
        const float l = lse[(static_cast<size_t>(b) * H + h) * SQ + i];
        const char kd = l == -INFINITY ? 2 : (l < kTestLseThreshold ? 1 : 0);
        kind[(static_cast<size_t>(b) * H + h) * SQ + i] = kd;
        expected_count += kd == 1;
        affected[static_cast<size_t>(b) * H + h] += kd == 1;
        for (int d = 0; d < D; ++d)
          dq.at(b, h, i, d) = kd == 0 ? from_d(normal(rng), kFp16) : from_d(NAN, kFp16);
      }
    }
  }
  const Tensor4 dq_before = dq;

  // ---- the kernels, parameters as repair/repair_dq.cu sets them
  const int64_t heads = static_cast<int64_t>(B) * H;
  unsigned long long counter = 5;
  auto st = [](const Tensor4& t) { return RowStrides{t.stride[0], t.stride[1], t.stride[2]}; };
  const ScanParams sp =
      scan_params(lse.data(), B, H, SQ, dq.data(), st(dq), D, aligned_rows(dq, 8), &counter);

  TileParams tp{};
  tp.q = q.data(), tp.k = k.data(), tp.v = v.data(), tp.o = o.data(), tp.go = go.data();
  tp.dq = dq.data();
  tp.q_st = st(q), tp.k_st = st(k), tp.v_st = st(v), tp.o_st = st(o), tp.go_st = st(go),
  tp.dq_st = st(dq);
  if (has_bias) {
    tp.bias = bias_store.data();
    tp.bias_b = bs[0], tp.bias_h = bs[1], tp.bias_s = bs[2], tp.bias_e = bs[3];
    bool aligned = reinterpret_cast<uintptr_t>(tp.bias) % 16 == 0;
    for (int d = 0; d < 3; ++d) aligned = aligned && bs[d] % 8 == 0;
    tp.bias_vec = bs[3] == 1 && aligned;
  }
  tp.heads = H;
  tp.kv_group = group;
  tp.s_q = SQ;
  tp.s_kv = SK;
  tp.head_dim = D;
  tp.tiles_per_head = (SQ + kTileRows - 1) / kTileRows;
  tp.n_items = heads * tp.tiles_per_head;
  tp.scale = static_cast<float>(scale);
  tp.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  tp.causal = c.causal;
  tp.vec = aligned_rows(q, 8) && aligned_rows(k, 8) && aligned_rows(v, 8) &&
           aligned_rows(o, 8) && aligned_rows(go, 8);
  tp.dq_pair = aligned_rows(dq, 2);
  const int width = head_dim_width(D);
  tp.stages = c.stages != 0 ? c.stages
                            : tile_stages(width, has_bias, blocks_per_sm(width), kH200SmemPerSm,
                                          kH200Reserved);
  // Fewer blocks than heads where the case has few slots: a block's run then
  // spans heads, and heads span blocks.
  const int64_t units = tile_grid_size(tp.n_items, c.slots);
  const int64_t grid = units * c.cluster;
  const int smem = TileSmem{width, has_bias, tp.stages}.total();
  INFO("width " << width << ", stages " << tp.stages << ", grid " << grid << ", vec " << tp.vec
                << ", bias_vec " << tp.bias_vec << ", rows to recompute " << expected_count);
  const emu::Stats before = emu::stats;
  auto run = [&](auto cluster) {
    constexpr bool kCluster = decltype(cluster)::value;
    if (width == 64 && wgmma) repair_tiles<Elt, 64, true, kCluster>(sp, tp);
    if (width == 64 && !wgmma) repair_tiles<Elt, 64, false, kCluster>(sp, tp);
    if (width == 128 && wgmma) repair_tiles<Elt, 128, true, kCluster>(sp, tp);
    if (width == 128 && !wgmma) repair_tiles<Elt, 128, false, kCluster>(sp, tp);
    if (width == 256) repair_tiles<Elt, 256, false, kCluster>(sp, tp);
  };
  auto body = [&] {
    if (c.cluster > 1) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  };
  emu::tile_trace.clear();
  emu::l2_prefetches.clear();
  // Launched behind cuDNN's backward, the kernel may start before that
  // backward has written dQ: until its first wait, dQ holds what was there
  // before (7.0 everywhere here), and a write to dQ made before the wait is
  // lost to the backward's (dq_before: NaN in the rows to write).
  std::fill(dq.storage.begin(), dq.storage.end(), from_d(7.0, kFp16));
  emu::grid_ahead = [&] { std::copy(dq_before.storage.begin(), dq_before.storage.end(),
                                    dq.storage.begin()); };
  emu::launch(static_cast<unsigned>(grid), kTileThreads, smem, body,
              static_cast<unsigned>(c.cluster));
  emu::finish_grid_ahead();
  // L2 prefetches: every 128-byte line of the logsumexp (each block its
  // run's heads, ahead of the walks), at addresses inside it.
  {
    const auto lo = reinterpret_cast<uintptr_t>(lse.data());
    const uintptr_t hi = lo + lse.size() * sizeof(float);
    std::set<uintptr_t> lines;
    long outside = 0;
    for (const void* a : emu::l2_prefetches) {
      const auto x = reinterpret_cast<uintptr_t>(a);
      outside += x < lo || x >= hi;
      lines.insert(x & ~uintptr_t{127});
    }
    long missing = 0;
    for (uintptr_t line = lo & ~uintptr_t{127}; line < hi; line += 128)
      missing += lines.count(line) == 0;
    EXPECT(outside == 0 && missing == 0,
           "L2 prefetch of the logsumexp: %ld addresses outside it, %ld of its lines missing",
           outside, missing);
  }
  if (c.rows_per_head > 0 && c.masked_rows == 0) {  // the case holds the work it names
    for (size_t head = 0; head < affected.size(); ++head)
      EXPECT(affected[head] == c.rows_per_head, "head %zu: %" PRId64 " rows to recompute", head,
             affected[head]);
  }
  // Split tiles, by the rule stated here: a cluster, bf16, the head's only
  // tile narrow, and kSplitMinKeyBlocks key blocks or more below its last
  // row's limit.
  std::vector<int> parts(affected.size(), 1);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const size_t head = static_cast<size_t>(b) * H + h;
      int last = -1;
      for (int i = 0; i < SQ; ++i)
        if (kind[head * SQ + i] == 1) last = i;
      const int keys = c.causal ? std::min(SK, last + 1) : SK;
      if (c.cluster > 1 && !kFp16 && affected[head] > 0 && affected[head] <= kNarrowRows &&
          (keys + kKeyBlock - 1) / kKeyBlock >= kSplitMinKeyBlocks)
        parts[head] = c.cluster;
    }
  }
  check_tile_trace(emu::tile_trace, affected, tp.tiles_per_head, units, c.cluster, parts);
  // The path under test ran: wgmma for the key blocks of every wide tile (in
  // parts of 8 kNT keys, each 2 x head_dim / 16 wgmma for Q K^T and dO V^T
  // and kNT / 2 for dS K), mma.sync for everything else.
  const bool any_wide =
      std::any_of(emu::tile_trace.begin(), emu::tile_trace.end(),
                  [](const emu::TileRecord& t) { return t.n_rows > kNarrowRows; });
  const long wgmma_ran = emu::stats.wgmma - before.wgmma;
  if (wgmma && width <= 128 && any_wide) {
    constexpr int kNT = TileShape<64>::kWgmmaNT;  // keys / 8 per warpgroup_scores_to_ds
    EXPECT(wgmma_ran > 0 &&
               wgmma_ran % ((kKeyBlock / (8 * kNT)) * (2 * (width / 16) + kNT / 2)) == 0,
           "%ld wgmma: not whole key blocks of wide tiles", wgmma_ran);
  } else {
    EXPECT(wgmma_ran == 0, "%ld wgmma off the wgmma path", wgmma_ran);
  }
  // Each head counted once, by the block that holds its tile 0.
  EXPECT(static_cast<long>(counter) == 5 + expected_count, "counter %llu, expected 5 + %ld",
        counter, expected_count);
  EXPECT(emu::stats.ldsm_conflicts == before.ldsm_conflicts, "ldmatrix bank conflicts");
  // Each tile moves tile_rows_loaded rows of Q, dO and the bias, and every
  // key block of K and V: one affected row per head moves 16 rows, not 64.
  // Exact where every tile sees every key.
  if (tp.vec && (!has_bias || tp.bias_vec) && !c.causal) {
    const int64_t key_blocks = (SK + kKeyBlock - 1) / kKeyBlock;
    long expected_copies = 0;
    for (const emu::TileRecord& t : emu::tile_trace) {
      const int used = tile_rows_loaded(t.n_rows);
      // A split tile's blocks each load their share of the key blocks.
      const int64_t share = t.parts > 1 ? key_blocks * (t.block % t.parts + 1) / t.parts -
                                              key_blocks * (t.block % t.parts) / t.parts
                                        : key_blocks;
      expected_copies += 2L * used * (width / 8) +
                         share * (2L * kKeyBlock * (width / 8) +
                                  (has_bias ? used * (kKeyBlock / 8) : 0));
    }
    EXPECT(static_cast<long>(emu::stats.cp_async - before.cp_async) == expected_copies,
          "%ld cp.async, expected %ld", static_cast<long>(emu::stats.cp_async - before.cp_async),
          expected_copies);
  }

  // ---- check against float64 (dS rounded to the element type, as the
  // kernel feeds it to the tensor cores)
  double worst = 0;
  long kept_bad = 0, zero_bad = 0, nonfinite = 0;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < SQ; ++i) {
        const size_t r = (static_cast<size_t>(b) * H + h) * SQ + i;
        if (kind[r] == 0) {
          for (int d = 0; d < D; ++d) kept_bad += dq.at(b, h, i, d) != dq_before.at(b, h, i, d);
          continue;
        }
        if (kind[r] == 2) {
          for (int d = 0; d < D; ++d) zero_bad += dq.at(b, h, i, d) != 0;
          continue;
        }
        const double l = lse[r];
        double delta = 0;
        for (int d = 0; d < D; ++d) delta += to_d(go.at(b, h, i, d), kFp16) * to_d(o.at(b, h, i, d), kFp16);
        std::vector<double> ref(D, 0.0), mag(D, 0.0);
        const int end = c.causal ? std::min(SK, i + 1) : SK;
        for (int j = 0; j < end; ++j) {
          double s = 0, dp = 0;
          for (int d = 0; d < D; ++d) {
            s += to_d(q.at(b, h, i, d), kFp16) * to_d(k.at(b, h / group, j, d), kFp16);
            dp += to_d(go.at(b, h, i, d), kFp16) * to_d(v.at(b, h / group, j, d), kFp16);
          }
          const double pr = std::exp(s * scale + bias_at(b, h, i, j) - l);
          const double ds = to_d(from_d(pr * (dp - delta), kFp16), kFp16);
          for (int d = 0; d < D; ++d) {
            const double kd = to_d(k.at(b, h / group, j, d), kFp16);
            ref[d] += ds * kd;
            mag[d] += pr * (std::fabs(dp) + std::fabs(delta)) * std::fabs(kd);
          }
        }
        // Errors relative to the size of the terms summed (rows whose dQ
        // cancels to ~0, e.g. a causal row 0, have no meaningful relative
        // error of their own).
        double mx = 0, err = 0;
        for (int d = 0; d < D; ++d) {
          const double got = to_d(dq.at(b, h, i, d), kFp16);
          if (!std::isfinite(got)) ++nonfinite;
          mx = std::max(mx, std::fabs(mag[d] * scale));
          err = std::max(err, std::fabs(got - ref[d] * scale));
        }
        worst = std::max(worst, err / std::max(mx, 1e-20));
      }
    }
  }
  EXPECT(nonfinite == 0, "%ld non-finite repaired elements", nonfinite);
  EXPECT(worst < 4e-3, "relative error %.3e", worst);
  EXPECT(kept_bad == 0, "%ld elements of rows to keep changed", kept_bad);
  EXPECT(zero_bad == 0, "%ld elements of -inf rows not zero", zero_bad);
}

}  // namespace emu_test

// The dQ-row repair's kernels (csrc/cuda/repair/{scan,tile}*.cuh), their
// real source, run on the CPU through simt_emu.h and checked against a
// float64 reference: rows below the threshold recomputed, -inf rows zeroed,
// other rows bit-identical, the telemetry count, no bank conflict in any
// ldmatrix. Each case runs twice: with cp.async data landing at its wait
// (shows a missing wait) and landing at once with warps drifting apart
// (shows a stage refilled before every warp is done with it); each tile of
// work recomputed exactly once (OPENWAM_REPAIR_TRACE_TILE). The index math
// alone: test_repair_layout.cpp; the row walk alone: test_repair_row_walk.cpp.
// No GPU, no libtorch needed.

#include "simt_emu.h"  // first: it stands in for the CUDA features

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cinttypes>
#include <numeric>
#include <random>
#include <set>
#include <string>

#include "cuda/repair/layout.cuh"
#include "cuda/repair/scan.cuh"
#include "cuda/repair/run.cuh"
#include "emu_support.h"
#include "scan_params.h"

using namespace openwam::repair;
using namespace emu_test;

namespace {

// The tiles of work an emulated launch recomputed (emu::tile_trace) against
// the heads' affected rows: each tile j of a head's work_tiles(count) once,
// with min(64, count - 64 j) rows, by a block of the cluster whose run holds
// its item (`grid` clusters of `cluster` blocks); a tile split across the
// cluster (parts[head] blocks, the head's only tile) once by each of its
// blocks. (A tile recomputed twice writes the same values: dQ cannot show it.)
void check_tile_trace(const std::vector<emu::TileRecord>& trace,
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

}  // namespace

TEST_CASE("repair kernels emulated on the CPU", "[repair][emulated]") {
  std::vector<Case<Bf16>> bf;
  std::vector<Case<Fp16>> fp;
  {
    Case<Bf16> c;
    c.name = "bf16 d64 all rows 70x130";
    bf.push_back(c);
    c.name = "bf16 d64 share 0.3 causal bias full masked rows";
    c.share = 0.3, c.causal = true, c.bias = Case<Bf16>::kFull, c.masked_rows = 3;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d64 share 0.5 70x300 (idle warps, 5 key blocks)";
    c.share = 0.5, c.s_kv = 300;
    bf.push_back(c);
    c.name = "bf16 d64 share 0.5 70x300, 2 stages";
    c.stages = 2;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d128 one per head 40x300, 3 stages";
    c.D = 128, c.s_q = 40, c.s_kv = 300, c.share = -1;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d40 one per head keypad bias bshd";
    c.D = 40, c.share = -1, c.bias = Case<Bf16>::kKeyPad, c.layout = Layout::kBshd;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d128 gqa s_kv 64 share 0.5 row bias";
    c.D = 128, c.H = 4, c.Hkv = 2, c.s_q = 40, c.s_kv = 64, c.share = 0.5;
    c.bias = Case<Bf16>::kRows, c.masked_rows = 2, c.nan_lse_row = true;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d72 padded rows s_kv 77 full bias";
    c.D = 72, c.s_q = 33, c.s_kv = 77, c.share = 1.0, c.layout = Layout::kPadded;
    c.bias = Case<Bf16>::kFull;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d256 all rows 20x70 causal";
    c.D = 256, c.s_q = 20, c.s_kv = 70, c.causal = true, c.H = 1, c.Hkv = 1;
    bf.push_back(c);
    c.name = "bf16 d256 all rows 20x70";
    c.causal = false;
    bf.push_back(c);
    c.name = "bf16 d128 all rows 20x70 causal";
    c.D = 128, c.causal = true;
    bf.push_back(c);
    // Key blocks wholly below a tile's first row need no mask (the unmasked
    // scores_to_probs). Rows from 62 on: the tiles start at rows 62, 126 and
    // 190; the first two one key short of a key block's end (an off-by-one
    // in the test unmasks the diagonal key, and key 63 holds most of the
    // weight of the rows that see it). s_kv 190 and 250: the last key block
    // ends 2 and 6 keys early, where some threads of the loader (8 and 16
    // rows apart at head_dim 128 and 64) still have every row but the last.
    c = Case<Bf16>();
    c.name = "bf16 d128 rows 62.. of 200x190 causal full bias: unmasked blocks, then masked";
    c.D = 128, c.s_q = 200, c.s_kv = 190, c.share = 1.0, c.causal = true, c.H = 1, c.Hkv = 1;
    c.first_affected = 62, c.hot_key = 63;
    c.bias = Case<Bf16>::kFull;
    bf.push_back(c);
    c.name = "bf16 d64 one row per head 200x250 causal: narrow, unmasked blocks below the row";
    c.D = 64, c.s_kv = 250, c.share = -1, c.bias = Case<Bf16>::kNoBias, c.H = 4, c.Hkv = 4;
    c.first_affected = 0, c.hot_key = -1;
    bf.push_back(c);
    // The same edge on a narrow tile's 16-key parts: rows 78..89, the first
    // row's diagonal one key short of a part's end (keys 64..79), key 79 hot.
    c = Case<Bf16>();
    c.name = "bf16 d64 rows 78..89 of 90x250 causal: narrow, diagonal one key short of a part";
    c.D = 64, c.s_q = 90, c.s_kv = 250, c.share = 1.0, c.causal = true, c.H = 1, c.Hkv = 1;
    c.first_affected = 78, c.hot_key = 79;
    bf.push_back(c);
    // s_kv one key short of a 32- and a 16-key part (191): a part holding
    // s_kv left unmasked would put P = 2^101 on a zero key (fp16 below).
    c = Case<Bf16>();
    c.name = "bf16 d64 all rows 70x191: s_kv one key short of a part";
    c.s_kv = 191;
    bf.push_back(c);
    c.name = "bf16 d128 one row per head 40x191: narrow, s_kv one key short of a part";
    c.D = 128, c.s_q = 40, c.share = -1;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d64 many empty items, grid 1";
    c.B = 2, c.H = 3, c.Hkv = 1, c.s_q = 1400, c.s_kv = 40, c.share = -1, c.slots = 1;
    bf.push_back(c);
    // Runs of items that start and end inside heads: a block resumes a head at
    // its tile 3 (finding ranks 192.. from row 0), and only the block that
    // holds tile 0 zeroes the -inf rows and counts the head.
    c = Case<Bf16>();
    c.name = "bf16 d64 all rows 300x40, runs across heads";
    c.H = 3, c.Hkv = 3, c.s_q = 300, c.s_kv = 40, c.share = 1.0, c.slots = 4;
    bf.push_back(c);
    // Ranks that straddle the 512-row rounds of the row walk, resumed by the
    // next tile and by the next block's run; about 6 tiles of work per head,
    // every third of its 18 items.
    c.name = "bf16 d64 share 0.3 1100x40 row bias masked rows, runs across rounds";
    c.H = 2, c.Hkv = 2, c.s_q = 1100, c.share = 0.3, c.slots = 5;
    c.bias = Case<Bf16>::kRows, c.masked_rows = 5;
    bf.push_back(c);
    // Every row of a head affected: 1024 rows are exactly two 512-row rounds
    // of the row walk (the 64-row tiles end on a round's last row), 1030
    // spill 6 rows into a third.
    c = Case<Bf16>();
    c.name = "bf16 d64 all rows 1024x40, two full walk rounds";
    c.H = 1, c.Hkv = 1, c.s_q = 1024, c.s_kv = 40, c.share = 1.0, c.slots = 5;
    bf.push_back(c);
    c.name = "bf16 d64 all rows 1030x40, a third walk round of 6 rows";
    c.s_q = 1030;
    bf.push_back(c);
    // One tile per head and several heads per block's run: heads with and
    // without their one row, each counted and recomputed by its own block.
    c = Case<Bf16>();
    c.name = "bf16 d64 share 0.5 s_q 1, 10 heads on 3 blocks";
    c.B = 2, c.H = 5, c.Hkv = 5, c.s_q = 1, c.s_kv = 40, c.share = 0.5, c.slots = 3;
    bf.push_back(c);
    c.name = "bf16 d64 gqa share 0.3 s_q 20, 6 heads on 2 blocks";
    c.B = 1, c.H = 6, c.Hkv = 3, c.s_q = 20, c.share = 0.3, c.slots = 2;
    bf.push_back(c);
    // 7 tiles per head and a number of tiles of work that does not divide
    // it: 3 (150 rows) at tiles 0, 2, 4 of a head, runs of 4 and 5 items.
    c = Case<Bf16>();
    c.name = "bf16 d64 448x40, 150 rows per head: 3 tiles of work of 7";
    c.H = 2, c.Hkv = 2, c.s_q = 448, c.s_kv = 40, c.rows_per_head = 150, c.slots = 3;
    bf.push_back(c);
    // Narrow tiles (16 rows of Q, dO and bias loaded) at the other widths,
    // with and without vector loads, and after a wide tile in the same block.
    c = Case<Bf16>();
    c.name = "bf16 d256 40x150, one row per head, full bias, causal: narrow, Q from smem";
    c.D = 256, c.s_q = 40, c.s_kv = 150, c.share = -1, c.bias = Case<Bf16>::kFull, c.causal = true;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d256 40x150, 10 rows per head, padded rows: narrow, element loads";
    c.D = 256, c.s_q = 40, c.s_kv = 150, c.rows_per_head = 10, c.layout = Layout::kPadded;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d8 40x100, one row per head, row bias: narrow, one column tile";
    c.D = 8, c.s_q = 40, c.s_kv = 100, c.share = -1, c.bias = Case<Bf16>::kRows;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d72 200x100, 70 rows per head, one block, full bias: wide then narrow";
    c.D = 72, c.s_q = 200, c.s_kv = 100, c.rows_per_head = 70, c.slots = 1;
    c.bias = Case<Bf16>::kFull;
    bf.push_back(c);
    // Clusters of two blocks (sm_90): a head's only tile, narrow and at
    // least kSplitMinKeyBlocks (24) key blocks long, split between them by
    // keys (25 key blocks: 12 and 13); every other tile to one block in
    // turn. Runs across heads (3 heads on 2 clusters), causal rows whose
    // keys end one key block short of a split and right at it, 2 stages (the
    // sums land in the pipeline's second stage), head_dim 256 (Q and dO from
    // shared memory), a full bias, and runs mixing split and whole tiles.
    c = Case<Bf16>();
    c.name = "bf16 d128 one row per head 40x1540, clusters of 2: split 12 + 13 key blocks";
    c.D = 128, c.H = 3, c.Hkv = 3, c.s_q = 40, c.s_kv = 1540, c.share = -1, c.slots = 2;
    c.cluster = 2;
    bf.push_back(c);
    c.name = "bf16 d128 one row per head 40x1540, clusters of 2, 2 stages";
    c.stages = 2;
    bf.push_back(c);
    c.name = "bf16 d128 one row per head 40x300, clusters of 2: 5 key blocks, in turn";
    c.s_kv = 300, c.stages = 0;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d64 rows 1460..1469 of 1470x1470 causal, clusters of 2: 23 key blocks, whole";
    c.H = 2, c.Hkv = 2, c.s_q = 1470, c.s_kv = 1470, c.causal = true, c.share = 1.0;
    c.first_affected = 1460, c.slots = 2, c.cluster = 2;
    bf.push_back(c);
    c.name = "bf16 d64 rows 1526..1535 of 1536x1536 causal, clusters of 2: 24 key blocks, split";
    c.s_q = 1536, c.s_kv = 1536, c.first_affected = 1526;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d72 padded 200x100, 10 rows per head, full bias, clusters of 2: in turn";
    c.D = 72, c.s_q = 200, c.s_kv = 100, c.rows_per_head = 10, c.layout = Layout::kPadded;
    c.bias = Case<Bf16>::kFull, c.slots = 1, c.cluster = 2;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d256 40x1540, one row per head, full bias, clusters of 2: split, Q from smem";
    c.D = 256, c.s_q = 40, c.s_kv = 1540, c.share = -1, c.bias = Case<Bf16>::kFull;
    c.H = 2, c.Hkv = 2, c.slots = 1, c.cluster = 2;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d64 share 0.05 300x1540, clusters of 2: split and whole tiles in a run";
    c.H = 5, c.Hkv = 5, c.s_q = 300, c.s_kv = 1540, c.share = 0.05, c.slots = 3, c.cluster = 2;
    c.bias = Case<Bf16>::kRows, c.masked_rows = 2;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d64 448x40, 150 rows per head, clusters of 2: whole tiles in turn";
    c.H = 2, c.Hkv = 2, c.s_q = 448, c.s_kv = 40, c.rows_per_head = 150, c.slots = 2;
    c.cluster = 2;
    bf.push_back(c);
    Case<Fp16> f;
    // 2 tiles of work (100 rows) at tiles 0 and 3, runs of 3 and 4 items.
    f.name = "fp16 d64 448x40, 100 rows per head: 2 tiles of work of 7";
    f.H = 2, f.Hkv = 2, f.s_q = 448, f.s_kv = 40, f.rows_per_head = 100, f.slots = 4;
    fp.push_back(f);
    // fp16 centres the keys, so a key past s_kv left unmasked (P = 2^101 on a
    // zero key) enters dS's sum and overflows (bf16 cannot show it).
    f = Case<Fp16>();
    f.name = "fp16 d64 all rows 70x191: s_kv one key short of a part";
    f.s_kv = 191;
    fp.push_back(f);
    f.name = "fp16 d64 one row per head 40x191: narrow, s_kv one key short of a part";
    f.s_q = 40, f.share = -1;
    fp.push_back(f);
    f = Case<Fp16>();
    f.name = "fp16 d128 share 0.4 130x100";
    f.D = 128, f.s_q = 130, f.s_kv = 100, f.share = 0.4;
    fp.push_back(f);
    f.name = "fp16 d64 bshd key bias one per head";
    f.D = 64, f.s_q = 50, f.s_kv = 200, f.share = -1, f.layout = Layout::kBshd;
    f.bias = Case<Fp16>::kKeyPad;
    fp.push_back(f);
    // Narrow fp16 tiles (centred keys) at widths 256 and 128, element loads.
    f = Case<Fp16>();
    f.name = "fp16 d256 40x150, one row per head, full bias: narrow";
    f.D = 256, f.s_q = 40, f.s_kv = 150, f.share = -1, f.bias = Case<Fp16>::kFull;
    fp.push_back(f);
    f = Case<Fp16>();
    f.name = "fp16 d72 60x130, 5 rows per head, padded, full bias, 2 stages: narrow";
    f.D = 72, f.s_q = 60, f.s_kv = 130, f.rows_per_head = 5, f.layout = Layout::kPadded;
    f.bias = Case<Fp16>::kFull, f.stages = 2;
    fp.push_back(f);
    f = Case<Fp16>();
    f.name = "fp16 d120 80x70, 16 rows per head, one block: narrow at its largest";
    f.D = 120, f.s_q = 80, f.s_kv = 70, f.rows_per_head = 16, f.slots = 1;
    fp.push_back(f);
    // Centred keys take one mean: fp16 tiles are never split, and a cluster
    // takes them in turn.
    f = Case<Fp16>();
    f.name = "fp16 d64 one row per head 50x1540, clusters of 2: whole tiles in turn";
    f.H = 3, f.Hkv = 3, f.s_q = 50, f.s_kv = 1540, f.share = -1, f.slots = 2, f.cluster = 2;
    fp.push_back(f);
  }
  for (const bool drift : {false, true}) {
    emu::eager_copies = emu::skew = drift;
    auto run_all = [&](const auto& cases) {
      for (const auto& c : cases) {
        for (const bool wgmma : {false, true}) {
          if (wgmma && head_dim_width(c.D) > 128) continue;  // head_dim 256 has no wgmma path
          DYNAMIC_SECTION(c.name << (wgmma ? ", wgmma" : "")
                                 << (drift ? ", eager copies, warps drifting" : "")) {
            run_case(c, wgmma);
          }
        }
      }
    };
    run_all(bf);
    run_all(fp);
  }
  emu::eager_copies = emu::skew = false;
}

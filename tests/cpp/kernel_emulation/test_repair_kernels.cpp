// The dQ-row repair's kernels (csrc/cuda/repair/{scan,tile}*.cuh), their
// real source, run on the CPU through simt_emu.h and checked against a
// float64 reference: rows below the threshold recomputed, -inf rows zeroed,
// other rows bit-identical, the telemetry count, no bank conflict in any
// ldmatrix. Each case runs twice: with cp.async data landing at its wait
// (shows a missing wait) and landing at once with warps drifting apart
// (shows a stage refilled before every warp is done with it); each tile of
// work recomputed exactly once (OPENWAM_REPAIR_TRACE_TILE). Also the pure
// index math of repair/layout.cuh (every tile of work to exactly one
// block, over all small grids), and the row walk of repair/scan.cuh alone.
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
#include "cuda/repair/tile.cuh"
#include "scan_params.h"

using namespace openwam::repair;

namespace {

// CHECK with a printf-style message, shown when it fails.
#define EXPECT(cond, ...)                                 \
  do {                                                    \
    char expect_msg_[256];                                \
    std::snprintf(expect_msg_, sizeof expect_msg_, __VA_ARGS__); \
    INFO(expect_msg_);                                    \
    CHECK((cond));                                        \
  } while (0)

// ---------------------------------------------------------------- tensors
enum class Layout { kBhsd, kBshd, kPadded };  // kPadded: rows D+3 apart, base off by 1

struct Tensor4 {
  std::vector<uint16_t> storage;
  int64_t size[4];
  int64_t stride[4];
  int64_t offset = 0;
  uint16_t* data() { return storage.data() + offset; }
  const uint16_t* data() const { return storage.data() + offset; }
  uint16_t& at(int64_t a, int64_t b, int64_t c, int64_t d) {
    return data()[a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3]];
  }
  uint16_t at(int64_t a, int64_t b, int64_t c, int64_t d) const {
    return data()[a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3]];
  }
};

Tensor4 make_tensor(int64_t B, int64_t H, int64_t S, int64_t D, Layout layout) {
  Tensor4 t;
  t.size[0] = B, t.size[1] = H, t.size[2] = S, t.size[3] = D;
  if (layout == Layout::kBhsd) {
    t.stride[3] = 1, t.stride[2] = D, t.stride[1] = S * D, t.stride[0] = H * S * D;
    t.storage.assign(B * H * S * D, 0);
  } else if (layout == Layout::kBshd) {
    t.stride[3] = 1, t.stride[1] = D, t.stride[2] = H * D, t.stride[0] = S * H * D;
    t.storage.assign(B * H * S * D, 0);
  } else {
    const int64_t row = D + 3;
    t.stride[3] = 1, t.stride[2] = row, t.stride[1] = S * row, t.stride[0] = H * S * row;
    t.offset = 1;
    t.storage.assign(B * H * S * row + 1, 0);
  }
  return t;
}

// K or V: the first S keys of a tensor of S + kGuardKeys, whose keys past S
// are NaN, so that a kernel reading a key past s_kv (the loader must
// zero-fill those) puts 0 * NaN into dS K and a NaN into dQ.
constexpr int kGuardKeys = 64;
Tensor4 make_keys(int64_t B, int64_t H, int64_t S, int64_t D, Layout layout, bool fp16) {
  Tensor4 t = make_tensor(B, H, S + kGuardKeys, D, layout);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = S; j < S + kGuardKeys; ++j)
        for (int64_t d = 0; d < D; ++d) t.at(b, h, j, d) = fp16 ? 0x7e00 : 0x7fc0;
  t.size[2] = S;
  return t;
}

// 16-byte aligned storage: std::vector<uint16_t> gives 16 on glibc, but be sure.
bool aligned_rows(const Tensor4& t, int64_t elements) {
  if (reinterpret_cast<uintptr_t>(t.data()) % (elements * 2) != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.size[d] > 1 && t.stride[d] % elements != 0) return false;
  }
  return true;
}

template <class Elt>
struct Case {
  std::string name;
  int B = 1, H = 2, Hkv = 2, s_q = 70, s_kv = 130, D = 64;
  bool causal = false;
  enum { kNoBias, kKeyPad, kRows, kFull } bias = kNoBias;
  Layout layout = Layout::kBhsd;
  double share = 1.0;        // of rows made adversarial; < 0: one per head
  int rows_per_head = 0;     // > 0: exactly this many adversarial rows per head (share unused)
  int first_affected = 0;    // rows below this are ordinary
  int hot_key = -1;          // >= 0: this key's logits are 10% less negative (P ~ 1000x)
  int slots = 5;             // resident blocks the grid size assumes
  int masked_rows = 0;       // rows with every key hidden (needs a row bias)
  bool nan_lse_row = false;  // one row gets lse NaN: must stay untouched
  int stages = 0;            // 0: as on an H200 (tile_stages)
  int cluster = 1;           // blocks per cluster (kClusterBlocks: split tiles)
};

// H200: 228 KB of shared memory per SM, 1 KB reserved per block.
constexpr int kH200SmemPerSm = 233472, kH200Reserved = 1024;
int blocks_per_sm(int width) { return width <= 64 ? 3 : width <= 128 ? 2 : 1; }

double to_d(uint16_t x, bool fp16) {
  return fp16 ? f16_to_float(x) : bf16_to_float(x);
}
uint16_t from_d(double x, bool fp16) {
  return fp16 ? float_to_f16(static_cast<float>(x)) : float_to_bf16(static_cast<float>(x));
}

// ---------------------------------------------------------------- work placement
// Block b's run of items as repair_tiles walks it: visit(head, work) for each
// head the run reaches, `work` the tiles of work of the head that the block
// recomputes; count_of(head): the head's affected rows.
template <class CountOf, class Visit>
void walk_run(int64_t b, int64_t grid, int64_t n_items, int64_t tiles, CountOf count_of,
              Visit visit) {
  const int64_t end = (b + 1) * n_items / grid;
  for (int64_t item = b * n_items / grid; item < end;) {
    const int64_t head = item_head(item, tiles), first_tile = item_tile(item, tiles);
    const int64_t end_tile = std::min(tiles, first_tile + (end - item));
    visit(head, work_range(count_of(head), tiles, first_tile, end_tile));
    item = head * tiles + end_tile;
  }
}

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

// ---------------------------------------------------------------- layout
void layout_checks() {
  // The swizzle is a bijection within each row, and a warp's 8 ldmatrix rows
  // (8 consecutive rows, one chunk column) hit 8 different bank groups.
  for (int row = 0; row < 64; ++row) {
    unsigned seen = 0;
    for (int c = 0; c < 8; ++c) seen |= 1u << ((tile_offset<8>(row, c) / 16) % 8);
    EXPECT(seen == 0xffu, "row %d", row);
  }
  for (int c = 0; c < 16; ++c) {
    unsigned seen = 0;
    for (int row = 8; row < 16; ++row) seen |= 1u << ((tile_offset<16>(row, c) / 16) % 8);
    EXPECT(seen == 0xffu, "chunk %d", c);
  }
  // The bias tile: lanes (g, t) read row g, columns 2t, 2t+1: 32 banks.
  unsigned banks = 0;
  for (int lane = 0; lane < 32; ++lane)
    banks |= 1u << (((frag_row(lane, 0) * kBiasPitch + frag_col(lane, 0)) * 2 / 4) % 32);
  EXPECT(banks == 0xffffffffu, "bias tile banks %x", banks);
  // The grid: one block per slot at most, and the runs of items cover every
  // item once, in runs whose lengths differ by at most one.
  EXPECT(tile_grid_size(5, 264) == 5, "small");
  EXPECT(tile_grid_size(6144, 264) == 264, "%" PRId64, tile_grid_size(6144, 264));
  EXPECT(tile_grid_size(0, 264) == 1, "empty");
  for (const int64_t n : {1L, 7L, 4224L, 6144L}) {
    const int64_t g = tile_grid_size(n, 264);
    int64_t covered = 0, shortest = n, longest = 0;
    for (int64_t b = 0; b < g; ++b) {
      const int64_t len = (b + 1) * n / g - b * n / g;
      EXPECT(b * n / g == covered, "run %" PRId64 " starts at %" PRId64, b, b * n / g);
      covered += len;
      shortest = std::min(shortest, len);
      longest = std::max(longest, len);
    }
    EXPECT(covered == n && longest - shortest <= 1, "n %" PRId64, n);
  }
  // Where the work lands: per block, the tiles of work its run holds (the
  // kernel's own placement functions), for the benchmark's shapes and
  // shares on an H200's slots. No block gets more than one tile above the
  // even share; with each head's work at its first items instead, a block
  // got 7 at 4096x4032 and 10% of rows (the even share is 3).
  struct Grid { int64_t heads, s_q, slots; };
  for (const Grid g : {Grid{384, 704, 264}, Grid{768, 360, 264}, Grid{96, 4096, 264},
                       Grid{96, 4096, 396}, Grid{384, 704, 396}}) {
    const int64_t tiles = (g.s_q + kTileRows - 1) / kTileRows, n = g.heads * tiles;
    const int64_t grid = tile_grid_size(n, g.slots);
    for (const int64_t count : {int64_t{1}, g.s_q / 10, g.s_q}) {
      int64_t most = 0, total = 0;
      for (int64_t b = 0; b < grid; ++b) {
        int64_t load = 0;
        walk_run(b, grid, n, tiles, [&](int64_t) { return count; },
                 [&](int64_t, WorkRange work) { load += work.end - work.begin; });
        most = std::max(most, load);
        total += load;
      }
      EXPECT(total == g.heads * work_tiles(count), "every tile of work once: %" PRId64, total);
      EXPECT(most <= (total + grid - 1) / grid + 1, "%" PRId64 " heads x %" PRId64
             " rows, %" PRId64 " affected: a block holds %" PRId64 " of %" PRId64 " tiles",
             g.heads, g.s_q, count, most, total);
    }
  }
  // The split ldmatrix offsets equal the swizzled ones for every row whose
  // last 3 bits are the lane's.
  for (int lane = 0; lane < 32; ++lane)
    for (int bit = 0; bit < 2; ++bit)
      for (int step = 0; step < 16; ++step)
        for (int base = 0; base < 64; base += 8) {
          const int row = base + (lane & 7);
          EXPECT(row * kTileRowBytes + lane_chunk_offset(lane, bit, step % 4) + step_offset(step) ==
                    tile_offset<32>(row, 2 * step + bit),
                "lane %d bit %d step %d", lane, bit, step);
        }
  // wgmma descriptors: the fields where the PTX ISA puts them, and
  // gmma_desc_at equal to gmma_desc at every 16-byte start of 227 KB of
  // shared memory plus every offset a kernel adds, for both operand kinds.
  EXPECT(gmma_desc(0x1230, 16, 1024) == ((0x123ull) | (1ull << 16) | (64ull << 32) | (1ull << 62)),
         "descriptor fields %llx", static_cast<unsigned long long>(gmma_desc(0x1230, 16, 1024)));
  {
    long bad = 0;
    for (uint32_t start = 0; start + 4 * kColumnBlockBytes <= 227 * 1024; start += 16) {
      for (uint32_t off = 0; off < 4 * kColumnBlockBytes; off += 16) {
        bad += gmma_desc_at(start >> 4, off, 16, kGmmaGroupBytes) !=
               gmma_desc(start + off, 16, kGmmaGroupBytes);
        bad += gmma_desc_at(start >> 4, off, kColumnBlockBytes, kGmmaGroupBytes) !=
               gmma_desc(start + off, kColumnBlockBytes, kGmmaGroupBytes);
      }
    }
    EXPECT(bad == 0, "%ld descriptors differ", bad);
  }
  EXPECT(tile_stages(128, false, 2, kH200SmemPerSm, kH200Reserved) == 3, "128 no bias");
  EXPECT(tile_stages(128, true, 2, kH200SmemPerSm, kH200Reserved) == 2, "128 bias");
  EXPECT(tile_stages(64, false, 3, kH200SmemPerSm, kH200Reserved) == 3, "64 no bias");
  EXPECT(tile_stages(64, true, 3, kH200SmemPerSm, kH200Reserved) == 2, "64 bias");
  EXPECT(tile_stages(256, false, 1, kH200SmemPerSm, kH200Reserved) == 2, "256");
  EXPECT((TileSmem{256, true, 2}.total() <= 227 * 1024), "256 fits");
  EXPECT(head_dim_width(8) == 64 && head_dim_width(72) == 128 && head_dim_width(256) == 256 &&
            head_dim_width(264) == 0,
        "widths");
  // The 32-bit work count at the int32 limit (count + 63 would overflow).
  EXPECT(work_tiles(0) == 0 && work_tiles(1) == 1 && work_tiles(64) == 1 && work_tiles(65) == 2 &&
             work_tiles(INT32_MAX) == INT32_MAX / kTileRows + 1,
         "work_tiles");
  // HeadPos stepped head by head equals the division, across batch entries.
  for (const int heads : {1, 3, 24}) {
    HeadPos pos = head_pos(0, heads);
    long bad = 0;
    for (int64_t head = 0; head < 5 * heads; ++head, next_head(pos, heads)) {
      const HeadPos want = head_pos(head, heads);
      bad += pos.b != want.b || pos.h != want.h || want.b * heads + want.h != head;
    }
    EXPECT(bad == 0, "%d heads: %ld steps off", heads, bad);
  }
  // Float4 logsumexp rows: contiguous rows, every head 16-byte aligned; a
  // size-1 axis's stride does not matter.
  alignas(16) static float lse[64];
  EXPECT(lse_vectorizable(lse, 2, 3, 12, 4, 1), "aligned heads");
  EXPECT(!lse_vectorizable(lse, 2, 3, 15, 5, 1), "heads 5 rows apart");
  EXPECT(lse_vectorizable(lse, 1, 1, 5, 5, 1), "one head, any strides");
  EXPECT(!lse_vectorizable(lse, 1, 2, 5, 6, 1), "two heads 6 rows apart");
  EXPECT(!lse_vectorizable(lse + 1, 1, 1, 4, 4, 1), "misaligned start");
  EXPECT(!lse_vectorizable(lse, 1, 1, 4, 4, 2), "strided rows");
  // Clusters: where keys are longer than one key block and the device has
  // them; a split's key ranges cover the tile's key blocks once, in order,
  // each block at least one; only the head's only, narrow, long tile, bf16.
  // Clusters where they can pay: two tiles a head or keys to split, keys
  // longer than one key block, and a device that has them.
  EXPECT(launch_cluster(704, 11, 132) == kClusterBlocks, "704x704");
  EXPECT(launch_cluster(65, 2, 132) == kClusterBlocks, "65 keys, two tiles a head");
  EXPECT(launch_cluster(64, 6, 132) == 1, "one key block (360x64)");
  EXPECT(launch_cluster(200, 1, 132) == 1, "one tile a head, short keys (32x200)");
  EXPECT(launch_cluster(64 * kSplitMinKeyBlocks, 1, 132) == kClusterBlocks, "keys to split");
  EXPECT(launch_cluster(4032, 63, 0) == 1, "no clusters on the device");
  for (int n = kSplitMinKeyBlocks; n < 70; ++n) {
    int next = 0;
    for (int r = 0; r < kClusterBlocks; ++r) {
      const KeyRange k = split_keys(n, r, kClusterBlocks);
      EXPECT(k.begin == next && k.end > k.begin, "n %d rank %d: [%d, %d)", n, r, k.begin, k.end);
      next = k.end;
    }
    EXPECT(next == n, "n %d: the ranges end at %d", n, next);
  }
  EXPECT(split_tile(2, false, 1, kSplitMinKeyBlocks), "one row, long keys");
  EXPECT(split_tile(2, false, kNarrowRows, 63), "a full narrow tile");
  EXPECT(!split_tile(2, false, kNarrowRows + 1, 63), "a wide tile");
  EXPECT(!split_tile(2, false, 1, kSplitMinKeyBlocks - 1), "short keys");
  EXPECT(!split_tile(2, true, 1, 63), "centred keys");
  EXPECT(!split_tile(1, false, 1, 63), "no cluster");
}

// work_range, which picks the tiles of work a block recomputes, against a
// brute-force loop over j; then whole launches of the index math: for heads
// of 1..40 tiles, 1..5 heads and every grid size up to one block per item,
// every tile of work of every head falls to exactly one block. Counts: 0 and
// both ends of each 64-row band (the range depends on count only through
// work_tiles), every band, the heads of a launch in different bands.
void work_placement_checks() {
  constexpr int64_t kMaxTiles = 40, kMaxHeads = 5;
  auto band_ends = [](int64_t w) {
    return w == 0 ? std::vector<int64_t>{0} : std::vector<int64_t>{64 * w - 63, 64 * w};
  };
  for (int64_t tiles = 1; tiles <= kMaxTiles; ++tiles) {
    long bad = 0;
    char first_bad[160] = "";
    for (int64_t n_work = 0; n_work <= tiles; ++n_work) {
      const int64_t stride = work_stride(n_work, tiles);
      for (const int64_t count : band_ends(n_work)) {
        for (int64_t first = 0; first <= tiles; ++first) {
          for (int64_t end = first; end <= tiles; ++end) {
            int64_t lo = 0, hi = 0;  // the j with first <= j stride < end: lo .. hi - 1
            for (int64_t j = 0; j < n_work; ++j) {
              if (j * stride < first || j * stride >= end) continue;
              if (hi == 0) lo = j;
              hi = j + 1;
            }
            const WorkRange work = work_range(count, tiles, first, end);
            const bool ok = hi > 0 ? work.begin == lo && work.end == hi : work.begin == work.end;
            if (!ok && bad++ == 0) {
              std::snprintf(first_bad, sizeof first_bad,
                            "count %" PRId64 ", tiles [%" PRId64 ", %" PRId64 "): j [%" PRId64
                            ", %" PRId64 "), brute force [%" PRId64 ", %" PRId64 ")",
                            count, first, end, work.begin, work.end, lo, hi);
            }
          }
        }
      }
    }
    EXPECT(bad == 0, "%" PRId64 " tiles per head, %ld ranges wrong, first %s", tiles, bad,
           first_bad);
  }

  for (int64_t tiles = 1; tiles <= kMaxTiles; ++tiles) {
    for (int64_t heads = 1; heads <= kMaxHeads; ++heads) {
      const int64_t n_items = heads * tiles;
      long bad = 0;
      char first_bad[160] = "";
      std::vector<int64_t> count(heads);
      std::vector<int> times(n_items);  // [head * tiles + j]: blocks that recomputed tile j
      for (int64_t band = 0; band <= tiles; ++band) {
        for (int64_t head = 0; head < heads; ++head) {
          const int64_t w = (band + head) % (tiles + 1);
          count[head] = band_ends(w)[(band + head) % band_ends(w).size()];
        }
        for (int64_t grid = 1; grid <= n_items; ++grid) {
          std::fill(times.begin(), times.end(), 0);
          for (int64_t b = 0; b < grid; ++b) {
            walk_run(b, grid, n_items, tiles, [&](int64_t head) { return count[head]; },
                     [&](int64_t head, WorkRange work) {
                       const int64_t stride = work_stride(work_tiles(count[head]), tiles);
                       for (int64_t j = work.begin; j < work.end; ++j) {
                         ++times[head * tiles + j];
                         const int64_t item = head * tiles + j * stride;
                         if ((item < b * n_items / grid || item >= (b + 1) * n_items / grid) &&
                             bad++ == 0) {
                           std::snprintf(first_bad, sizeof first_bad,
                                         "block %" PRId64 " of %" PRId64 " recomputes head %"
                                         PRId64 " tile %" PRId64 " at item %" PRId64,
                                         b, grid, head, j, item);
                         }
                       }
                     });
          }
          for (int64_t head = 0; head < heads; ++head) {
            for (int64_t j = 0; j < tiles; ++j) {
              const int want = j < work_tiles(count[head]) ? 1 : 0;
              if (times[head * tiles + j] != want && bad++ == 0) {
                std::snprintf(first_bad, sizeof first_bad,
                              "grid %" PRId64 ": head %" PRId64 " (%" PRId64 " rows) tile %" PRId64
                              " recomputed %d times",
                              grid, head, count[head], j, times[head * tiles + j]);
              }
            }
          }
        }
      }
      EXPECT(bad == 0, "%" PRId64 " heads of %" PRId64 " tiles: %ld wrong, first %s", heads,
             tiles, bad, first_bad);
    }
  }
}

// ---------------------------------------------------------------- row walk
// walk_rows (repair/scan.cuh) alone, in one emulated block, on a synthetic
// logsumexp of 3 heads x 1300 rows (walk rounds of 512: two full, one of
// 276): head 0 with affected rows at the round edges and at random, and
// among them -inf rows, NaN rows (left alone), +inf rows and rows exactly at
// the threshold (not affected); head 1 with none but -inf rows at the round
// edges; head 2 with every row affected. Each head's logsumexp is followed by
// 5 floats of padding (read as rows, they would add affected rows), each dQ
// row by padding elements (zero_row must not write past head_dim).
enum class RowKind { kOrdinary, kAffected, kEmpty, kNan, kAtThreshold, kPosInf };

enum class WalkOp {
  kCount,       // walk_rows over the whole head, zero_empty off
  kGather,      // walk_rows for ranks lo .. hi - 1 into shared memory
  kOwnerCount,  // count_head as the head's owner: zeroes -inf rows, adds to the counter,
                // gathers ranks 0 .. 63
  kOtherCount,  // count_head as another block: counts, writes nothing
};

struct WalkCall {
  WalkOp op;
  int64_t head;
  bool fresh;  // kGather: from row 0 (a block starting on the head), else resumed
  int lo, hi;
};

struct WalkResult {
  std::vector<std::array<int64_t, 3>> by_thread;  // returned count, cursor.row, cursor.rank
  RowCursor before;                               // thread 0's cursor when called
  std::vector<int> row;                           // s_row after the call
  std::vector<float> lse2;
  std::vector<uint16_t> dq;  // after a kOwnerCount
};

void walk_checks(int head_dim, bool dq_vec) {
  // A head's logsumexp at a pitch that keeps its rows 16-byte aligned (read
  // a float4 at a time, the last 2 rows one by one) or not.
  const int64_t kHeads = 3, kRows = 1302, kLsePitch = dq_vec ? 1304 : 1307;
  constexpr int kRound = kScanThreads * kScanRowsPerThread;
  constexpr int kSlots = kTileRows + 8;  // the most ranks per call, then a guard
  constexpr int kRowSentinel = -7;
  const int64_t dq_pitch = dq_vec ? head_dim + 8 : head_dim + 3;
  REQUIRE(kRows / kRound == 2);

  std::mt19937 rng(4242);
  std::uniform_real_distribution<float> ordinary(-39.5f, 8.0f);
  const float affected_values[] = {-70.0f, std::nextafter(kTestLseThreshold, -INFINITY), -1e30f,
                                   -45.5f};
  std::vector<std::vector<RowKind>> kind(kHeads, std::vector<RowKind>(kRows, RowKind::kOrdinary));
  for (const int r : {0, 1, 3, 127, 128, 511, 512, 513, 1023, 1024, 1299})
    kind[0][r] = RowKind::kAffected;
  for (const int r : {2, 600, 1298}) kind[0][r] = RowKind::kEmpty;
  for (const int r : {5, 1025}) kind[0][r] = RowKind::kNan;
  for (const int r : {6, 700, 1297}) kind[0][r] = RowKind::kAtThreshold;
  kind[0][7] = RowKind::kPosInf;
  for (int r = 0; r < kRows; ++r) {
    if (kind[0][r] == RowKind::kOrdinary && rng() % 10 < 3) kind[0][r] = RowKind::kAffected;
  }
  for (const int r : {0, 511, 512, 1299}) kind[1][r] = RowKind::kEmpty;
  kind[1][100] = RowKind::kNan;
  std::fill(kind[2].begin(), kind[2].end(), RowKind::kAffected);

  std::vector<float> lse(kHeads * kLsePitch, -70.0f);  // the padding: affected, if read
  std::vector<std::vector<int>> affected(kHeads);       // per head, in row order
  for (int64_t h = 0; h < kHeads; ++h) {
    for (int r = 0; r < kRows; ++r) {
      float& l = lse[h * kLsePitch + r];
      switch (kind[h][r]) {
        case RowKind::kOrdinary: l = ordinary(rng); break;
        case RowKind::kAffected:
          l = affected_values[affected[h].size() % 4];
          affected[h].push_back(r);
          break;
        case RowKind::kEmpty: l = -INFINITY; break;
        case RowKind::kNan: l = NAN; break;
        case RowKind::kAtThreshold: l = kTestLseThreshold; break;
        case RowKind::kPosInf: l = INFINITY; break;
      }
    }
  }
  // affected rows of head h before row r
  auto affected_before = [&](int64_t h, int64_t r) {
    return static_cast<int>(std::lower_bound(affected[h].begin(), affected[h].end(), r) -
                            affected[h].begin());
  };

  std::vector<uint16_t> dq(kHeads * kRows * dq_pitch + 8);
  uint16_t* dq_data = dq.data() + (reinterpret_cast<uintptr_t>(dq.data()) % 16) / 2;
  REQUIRE(reinterpret_cast<uintptr_t>(dq_data) % 16 == 0);
  for (int64_t e = 0; e < kHeads * kRows * dq_pitch; ++e) dq_data[e] = 0x3c00;  // 1.0 in fp16
  const std::vector<uint16_t> dq_initial(dq_data, dq_data + kHeads * kRows * dq_pitch);
  unsigned long long counter = 0;
  ScanParams sp = scan_params(lse.data(), 1, kHeads, kRows, dq_data,
                              RowStrides{0, kRows * dq_pitch, dq_pitch}, head_dim, dq_vec,
                              &counter);
  sp.lse_b = kHeads * kLsePitch, sp.lse_h = kLsePitch;
  sp.lse_vec = lse_vectorizable(lse.data(), 1, kHeads, sp.lse_b, sp.lse_h, sp.lse_s);
  REQUIRE(sp.lse_vec == dq_vec);  // both ways of reading the logsumexp

  // Counts; then per head the ranks in chunks of 64 from rank 0 (a block's
  // run from the head's first tile), of 64 from rank 192 (a run resuming the
  // head at its tile 3, from row 0), of 37 (chunks straddling the rounds
  // elsewhere); last the owners' counts.
  std::vector<WalkCall> calls;
  for (int64_t h = 0; h < kHeads; ++h) calls.push_back({WalkOp::kCount, h, true, 0, INT32_MAX});
  for (int64_t h = 0; h < kHeads; ++h) {
    const int count = static_cast<int>(affected[h].size());
    for (const auto& [start, chunk] : {std::pair{0, 64}, std::pair{192, 64}, std::pair{0, 37}}) {
      for (int lo = start; lo < count; lo += chunk)
        calls.push_back({WalkOp::kGather, h, lo == start, lo, std::min(count, lo + chunk)});
    }
  }
  for (int64_t h = 0; h < kHeads; ++h) calls.push_back({WalkOp::kOtherCount, h, true, 0, 0});
  for (int64_t h = 0; h < kHeads; ++h) {
    const int count = static_cast<int>(affected[h].size());
    calls.push_back({WalkOp::kOwnerCount, h, true, 0, std::min(count, kTileRows)});
  }

  std::vector<WalkResult> results(calls.size());
  for (WalkResult& r : results) r.by_thread.resize(kScanThreads);
  std::vector<uint16_t> dq_before_owners;
  emu::launch(1, kScanThreads, 1024, [&] {
    int* s_row = reinterpret_cast<int*>(smem_base());
    float* s_lse2 = reinterpret_cast<float*>(s_row + kSlots);
    int* warp_sums = reinterpret_cast<int*>(s_lse2 + kSlots);
    const int tid = threadIdx.x;
    RowCursor cursor;
    for (size_t i = 0; i < calls.size(); ++i) {
      const WalkCall& call = calls[i];
      WalkResult& res = results[i];
      if (tid < kSlots) s_row[tid] = kRowSentinel, s_lse2[tid] = NAN;
      if (tid == 0 && call.op == WalkOp::kOwnerCount && dq_before_owners.empty())
        dq_before_owners.assign(dq_data, dq_data + dq_initial.size());
      __syncthreads();
      if (call.op != WalkOp::kGather || call.fresh) cursor = RowCursor{};
      if (tid == 0) res.before = cursor;
      int n = 0;
      const HeadPos pos = head_pos(call.head, sp.heads);
      if (call.op == WalkOp::kCount)
        n = walk_rows(sp, pos, cursor, 0, INT32_MAX, INT32_MAX, nullptr, nullptr, false,
                      warp_sums);
      if (call.op == WalkOp::kGather)
        n = walk_rows(sp, pos, cursor, call.lo, call.hi, call.hi, s_row, s_lse2, false,
                      warp_sums);
      if (call.op == WalkOp::kOwnerCount || call.op == WalkOp::kOtherCount) {
        const bool owner = call.op == WalkOp::kOwnerCount;
        n = count_head(sp, pos, owner, owner, s_row, s_lse2, warp_sums);
      }
      res.by_thread[tid] = {n, cursor.row, cursor.rank};
      __syncthreads();
      if (tid == 0) {
        res.row.assign(s_row, s_row + kSlots);
        res.lse2.assign(s_lse2, s_lse2 + kSlots);
        if (call.op == WalkOp::kOwnerCount) res.dq.assign(dq_data, dq_data + dq_initial.size());
      }
      __syncthreads();
    }
  });

  // dQ as it must be once the owners of heads 0 .. last have zeroed their -inf rows.
  auto dq_zeroed_through = [&](int64_t last) {
    std::vector<uint16_t> want = dq_initial;
    for (int64_t h = 0; h <= last; ++h)
      for (int r = 0; r < kRows; ++r)
        if (kind[h][r] == RowKind::kEmpty)
          std::fill_n(want.begin() + (h * kRows + r) * dq_pitch, head_dim, uint16_t{0});
    return want;
  };
  auto differing = [](const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
    long n = 0;
    for (size_t e = 0; e < a.size(); ++e) n += a[e] != b[e];
    return n;
  };
  const long written = differing(dq_before_owners, dq_initial);
  EXPECT(written == 0, "%ld dQ elements written by walks without zero_empty", written);

  for (size_t i = 0; i < calls.size(); ++i) {
    const WalkCall& call = calls[i];
    const WalkResult& res = results[i];
    const int64_t h = call.head;
    const int count = static_cast<int>(affected[h].size());
    const auto& got = res.by_thread[0];
    const char* op = call.op == WalkOp::kCount        ? "count"
                     : call.op == WalkOp::kGather     ? "gather"
                     : call.op == WalkOp::kOtherCount ? "other block's count"
                                                      : "owner count";
    INFO("call " << i << ": " << op << " head " << h << " ranks [" << call.lo << ", " << call.hi
                 << ")" << (call.fresh ? " from row 0" : " resumed") << ", head_dim " << head_dim);
    long differ = 0;
    for (const auto& t : res.by_thread) differ += t != got;
    EXPECT(differ == 0, "%ld threads got another result than thread 0", differ);
    if (call.op == WalkOp::kOwnerCount || call.op == WalkOp::kOtherCount) {
      EXPECT(got[0] == count, "count %" PRId64 ", want %d", got[0], count);
    }
    if (call.op == WalkOp::kOwnerCount) {
      const long wrong = differing(res.dq, dq_zeroed_through(h));
      EXPECT(wrong == 0, "%ld dQ elements other than those of the -inf rows zeroed", wrong);
    }
    if (call.op == WalkOp::kCount || call.op == WalkOp::kGather) {
      // The round where rank hi is reached, from the cursor it started at:
      // where the walk stops and the next one resumes.
      int64_t stop = res.before.row;
      while (stop < kRows &&
             affected_before(h, std::min<int64_t>(kRows, stop + kRound)) < call.hi)
        stop += kRound;
      stop = std::min<int64_t>(stop, kRows);
      const int seen =
          affected_before(h, std::min<int64_t>(kRows, stop + kRound)) - res.before.rank;
      EXPECT(got[0] == seen && got[1] == stop && got[2] == affected_before(h, stop),
             "returned %" PRId64 " (want %d), cursor at row %" PRId64 " rank %" PRId64
             " (want %" PRId64 ", %d)",
             got[0], seen, got[1], got[2], stop, affected_before(h, stop));
    }
    if (call.op == WalkOp::kCount) {
      EXPECT(got[0] == count && got[1] == kRows, "count %" PRId64 ", want %d", got[0], count);
      continue;
    }
    // Gathered: ranks lo .. hi - 1 (an owner's count: 0 .. min(count, 64) - 1;
    // another block's: none).
    long wrong_rows = 0, wrong_lse2 = 0, past_hi = 0;
    for (int s = 0; s < kSlots; ++s) {
      if (s < call.hi - call.lo) {
        const int row = affected[h][call.lo + s];
        wrong_rows += res.row[s] != row;
        wrong_lse2 += !(res.lse2[s] == lse[h * kLsePitch + row] * kLog2e);
      } else {
        past_hi += res.row[s] != kRowSentinel || !std::isnan(res.lse2[s]);
      }
    }
    EXPECT(wrong_rows == 0 && wrong_lse2 == 0 && past_hi == 0,
           "%ld rows wrong, %ld lse2 wrong, %ld slots past hi - lo written", wrong_rows,
           wrong_lse2, past_hi);
  }
  const size_t total = affected[0].size() + affected[1].size() + affected[2].size();
  EXPECT(counter == total, "counter %llu, want %zu", counter, total);
}

}  // namespace

TEST_CASE("repair layout: swizzle ldmatrix offsets fragments grid stages", "[repair]") {
  layout_checks();
}

TEST_CASE("repair work placement: each tile of work to exactly one block", "[repair]") {
  work_placement_checks();
}

TEST_CASE("repair row walk emulated on the CPU: ranks, resumed cursors, -inf rows",
          "[repair][emulated]") {
  SECTION("head_dim 64, 16-byte dQ rows") { walk_checks(64, true); }
  SECTION("head_dim 20, scalar dQ stores") { walk_checks(20, false); }
}

// probe_heads alone, in one emulated block: 2 x 37 heads of s_q rows, each
// head's logsumexp followed by padding rows below the threshold (read as
// rows, they would flag the head). Heads by k % 5: ordinary rows with NaN,
// +inf and at-threshold rows among them (not flagged); one affected row at
// a random place; one -inf row, the head's last; every row affected; no row
// at all of interest but the padding. Windows of the run from several first
// heads, across the batch boundary and past kProbeHeads.
void probe_checks(int s_q, int pad) {
  constexpr int B = 2, H = 37;
  const int pitch = s_q + pad;
  std::vector<float> lse(static_cast<size_t>(B) * H * pitch + 4, 0.0f);
  std::mt19937 rng(s_q * 7 + pad);
  std::vector<bool> want(B * H, false);
  for (int head = 0; head < B * H; ++head) {
    float* l = lse.data() + static_cast<size_t>(head) * pitch;
    for (int i = 0; i < pitch; ++i) l[i] = i < s_q ? -1.0f - static_cast<float>(i % 7) : -100.0f;
    switch (head % 5) {
      case 0:
        l[rng() % s_q] = NAN;
        l[rng() % s_q] = INFINITY;
        l[rng() % s_q] = kTestLseThreshold;
        break;
      case 1: l[rng() % s_q] = -100.0f, want[head] = true; break;
      case 2: l[s_q - 1] = -INFINITY, want[head] = true; break;
      case 3:
        for (int i = 0; i < s_q; ++i) l[i] = -90.0f;
        want[head] = true;
        break;
      default: break;
    }
  }
  ScanParams sp = scan_params(lse.data(), B, H, s_q, nullptr, RowStrides{0, 0, 0}, 8, false,
                              nullptr);
  sp.lse_b = static_cast<int64_t>(H) * pitch;
  sp.lse_h = pitch;
  sp.lse_vec = lse_vectorizable(sp.lse, B, H, sp.lse_b, sp.lse_h, sp.lse_s);
  for (const auto& [first, n] : std::vector<std::pair<int, int>>{
           {0, 74}, {5, 3}, {33, 10}, {1, 1}, {70, 4}}) {
    std::vector<uint64_t> masks(kScanThreads, 0);
    emu::launch(1, kScanThreads, 1024, [&] {
      auto* words = reinterpret_cast<uint64_t*>(smem_base());
      masks[threadIdx.x] = probe_heads(sp, head_pos(first, H), n, words);
    });
    long wrong = 0;
    for (int k = 0; k < n; ++k) wrong += probed(masks[0], k) != (k >= kProbeHeads || want[first + k]);
    EXPECT(std::count(masks.begin(), masks.end(), masks[0]) == kScanThreads,
           "heads %d..%d: the threads' masks differ", first, first + n - 1);
    EXPECT(wrong == 0, "s_q %d, pad %d, vec %d, heads %d..%d: %ld heads probed wrong", s_q, pad,
           sp.lse_vec, first, first + n - 1, wrong);
  }
}

TEST_CASE("repair head probe emulated on the CPU: which heads of a run have rows",
          "[repair][emulated]") {
  SECTION("130 rows, float4 loads") { probe_checks(130, 6); }
  SECTION("1300 rows (3 rounds), float loads") { probe_checks(1300, 5); }
  SECTION("2052 rows (5 rounds: a batch of 4 and one), float4 loads") { probe_checks(2052, 4); }
}

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

// The dQ-row repair's kernels (csrc/cuda/repair_dq_{scan,tile}*.cuh), their
// real source, run on the CPU through simt_emu.h and checked against a
// float64 reference: rows below the threshold recomputed, -inf rows zeroed,
// other rows bit-identical, the telemetry count, no bank conflict in any
// ldmatrix. Each case runs twice: with cp.async data landing at its wait
// (shows a missing wait) and landing at once with warps drifting apart
// (shows a stage refilled before every warp is done with it). Also the pure
// index math of repair_dq_layout.cuh. No GPU, no libtorch needed.
#include "simt_emu.h"  // first: it stands in for the CUDA features

#include <catch2/catch.hpp>

#include <algorithm>
#include <cinttypes>
#include <random>
#include <string>

#include "cuda/repair_dq_layout.cuh"
#include "cuda/repair_dq_scan.cuh"
#include "cuda/repair_dq_tile.cuh"

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
  int slots = 5;             // resident blocks the grid size assumes
  int masked_rows = 0;       // rows with every key hidden (needs a row bias)
  bool nan_lse_row = false;  // one row gets lse NaN: must stay untouched
  int stages = 0;            // 0: as on an H200 (tile_stages)
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

template <class Elt>
void run_case(const Case<Elt>& c) {
  constexpr bool kFp16 = std::is_same_v<Elt, Fp16>;
  std::mt19937 rng(std::hash<std::string>()(c.name) & 0xffff);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uni;
  const int B = c.B, H = c.H, Hkv = c.Hkv, SQ = c.s_q, SK = c.s_kv, D = c.D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const double amp = 3.0, target = -70.0, key_noise = 0.2;
  Tensor4 q = make_tensor(B, H, SQ, D, c.layout), k = make_tensor(B, Hkv, SK, D, c.layout),
          v = make_tensor(B, Hkv, SK, D, c.layout), o = make_tensor(B, H, SQ, D, c.layout),
          go = make_tensor(B, H, SQ, D, c.layout), dq = make_tensor(B, H, SQ, D, c.layout);
  const double u = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<char> adversarial(static_cast<size_t>(B) * H * SQ, 0);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hkv; ++h) {
      for (int j = 0; j < SK; ++j) {
        for (int d = 0; d < D; ++d) {
          k.at(b, h, j, d) = from_d(key_noise * normal(rng) + amp * u, kFp16);
          v.at(b, h, j, d) = from_d(normal(rng), kFp16);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const int one = static_cast<int>(uni(rng) * SQ);
      for (int i = 0; i < SQ; ++i) {
        const bool adv = c.share < 0 ? i == one : uni(rng) < c.share;
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
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < SQ; ++i) {
        const float l = lse[(static_cast<size_t>(b) * H + h) * SQ + i];
        const char kd = l == -INFINITY ? 2 : (l < -40.0f ? 1 : 0);
        kind[(static_cast<size_t>(b) * H + h) * SQ + i] = kd;
        expected_count += kd == 1;
        for (int d = 0; d < D; ++d)
          dq.at(b, h, i, d) = kd == 0 ? from_d(normal(rng), kFp16) : from_d(NAN, kFp16);
      }
    }
  }
  const Tensor4 dq_before = dq;

  // ---- the kernels, parameters as repair_dq.cu sets them
  const int64_t heads = static_cast<int64_t>(B) * H;
  unsigned long long counter = 5;
  ScanParams sp{};
  sp.lse = lse.data();
  sp.lse_b = static_cast<int64_t>(H) * SQ;
  sp.lse_h = SQ;
  sp.lse_s = 1;
  sp.dq = dq.data();
  sp.dq_b = dq.stride[0], sp.dq_h = dq.stride[1], sp.dq_s = dq.stride[2];
  sp.heads = H;
  sp.s_q = SQ;
  sp.head_dim = D;
  sp.dq_vec = aligned_rows(dq, 8);
  sp.threshold = -40.0f;
  sp.repaired = &counter;

  TileParams tp{};
  tp.q = q.data(), tp.k = k.data(), tp.v = v.data(), tp.o = o.data(), tp.go = go.data();
  tp.dq = dq.data();
  auto st = [](const Tensor4& t) { return RowStrides{t.stride[0], t.stride[1], t.stride[2]}; };
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
  const int64_t grid = tile_grid_size(tp.n_items, c.slots);
  const int smem = TileSmem{width, has_bias, tp.stages}.total();
  INFO("width " << width << ", stages " << tp.stages << ", grid " << grid << ", vec " << tp.vec
                << ", bias_vec " << tp.bias_vec << ", rows to recompute " << expected_count);
  const emu::Stats before = emu::stats;
  auto body = [&] {
    if (width == 64) repair_tiles<Elt, 64>(sp, tp);
    if (width == 128) repair_tiles<Elt, 128>(sp, tp);
    if (width == 256) repair_tiles<Elt, 256>(sp, tp);
  };
  emu::launch(static_cast<unsigned>(grid), kTileThreads, smem, body);
  // Each head counted once, by the block that holds its tile 0.
  EXPECT(static_cast<long>(counter) == 5 + expected_count, "counter %llu, expected 5 + %ld",
        counter, expected_count);
  EXPECT(emu::stats.ldsm_conflicts == before.ldsm_conflicts, "ldmatrix bank conflicts");

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
        const int64_t end = (b + 1) * n / grid;
        for (int64_t item = b * n / grid; item < end;) {
          const int64_t head = item_head(item, tiles), first = item_tile(item, tiles);
          const int64_t end_tile = std::min(tiles, first + (end - item));
          const int64_t n_work = work_tiles(count), stride = work_stride(n_work, tiles);
          for (int64_t j = first_work(first, stride); j < n_work && j * stride < end_tile; ++j) {
            ++load;
          }
          item = head * tiles + end_tile;
        }
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
          EXPECT(row * 32 * 16 + lane_chunk_offset(lane, bit, step % 4) + step_offset(step) ==
                    tile_offset<32>(row, 2 * step + bit),
                "lane %d bit %d step %d", lane, bit, step);
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
}

}  // namespace

TEST_CASE("repair layout: swizzle ldmatrix offsets fragments grid stages", "[repair]") {
  layout_checks();
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
    Case<Fp16> f;
    f.name = "fp16 d128 share 0.4 130x100";
    f.D = 128, f.s_q = 130, f.s_kv = 100, f.share = 0.4;
    fp.push_back(f);
    f.name = "fp16 d64 bshd key bias one per head";
    f.D = 64, f.s_q = 50, f.s_kv = 200, f.share = -1, f.layout = Layout::kBshd;
    f.bias = Case<Fp16>::kKeyPad;
    fp.push_back(f);
  }
  for (const bool drift : {false, true}) {
    emu::eager_copies = emu::skew = drift;
    for (const auto& c : bf) {
      DYNAMIC_SECTION(c.name << (drift ? ", eager copies, warps drifting" : "")) { run_case(c); }
    }
    for (const auto& c : fp) {
      DYNAMIC_SECTION(c.name << (drift ? ", eager copies, warps drifting" : "")) { run_case(c); }
    }
  }
  emu::eager_copies = emu::skew = false;
}

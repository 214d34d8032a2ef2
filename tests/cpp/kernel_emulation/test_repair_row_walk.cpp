// The row walk of the dQ-row repair (csrc/cuda/repair/scan.cuh) alone, in
// one emulated block: ranks, resumed cursors, -inf rows, and which heads of
// a run have rows (probe_heads). No GPU, no libtorch.

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
#include "emu_support.h"
#include "scan_params.h"

using namespace openwam::repair;
using namespace emu_test;

namespace {

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

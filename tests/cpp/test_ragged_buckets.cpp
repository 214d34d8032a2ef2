// The buckets of sdpa_varlen's ragged graphs (csrc/cudnn_frontend/
// ragged_buckets.h): every dimension rounds up to a power of two, never below
// the real one, so that a run of batches with varying sequence counts and
// lengths builds few graphs. Plain C++: built in CPU builds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <tuple>

#include <catch2/catch.hpp>

#include "cudnn_frontend/ragged_buckets.h"

using openwam::frontend::bucket_up;
using openwam::frontend::bucketed;
using openwam::frontend::call_dims;
using openwam::frontend::kRaggedMinSequence;
using openwam::frontend::RaggedDims;

TEST_CASE("ragged buckets: the next power of two, from a floor", "[frontend]") {
  CHECK(bucket_up(1, 1) == 1);
  CHECK(bucket_up(3, 1) == 4);
  CHECK(bucket_up(4, 1) == 4);
  CHECK(bucket_up(5, 1) == 8);
  CHECK(bucket_up(0, 64) == 64);
  CHECK(bucket_up(64, 64) == 64);
  CHECK(bucket_up(65, 64) == 128);
  CHECK(bucket_up(12244, 64) == 16384);
  CHECK(bucket_up(int64_t{1} << 40, 64) == int64_t{1} << 40);
}

TEST_CASE("ragged buckets: each dimension covers the real one", "[frontend]") {
  const RaggedDims d = bucketed({20, 1210, 1210, 8192, 8192});
  CHECK(d == RaggedDims{32, 2048, 2048, 8192, 8192});
  const RaggedDims one = bucketed({1, 1, 1, 1, 1});
  CHECK(one == RaggedDims{1, kRaggedMinSequence, kRaggedMinSequence, kRaggedMinSequence,
                          kRaggedMinSequence});
}

TEST_CASE("ragged buckets: a max_seqlen above the total counts as the total", "[frontend]") {
  // As bucketed where max_seqlen bounds the longest sequence...
  CHECK(call_dims(3, 100, 90, 269, 250) == bucketed({3, 100, 90, 269, 250}));
  // ...and never past the total, up to int64's range (2^62 + 1 had looped for
  // good in bucket_up; found in review).
  CHECK(call_dims(3, 5000, (int64_t{1} << 62) + 1, 269, 250) ==
        bucketed({3, 269, 250, 269, 250}));
  CHECK(call_dims(1, INT64_MAX, INT64_MAX, 1, 1) == bucketed({1, 1, 1, 1, 1}));
}

TEST_CASE("ragged buckets: 200 lognormal batches meet few configurations", "[frontend]") {
  // The training run: about 8,192 real tokens per batch, lengths
  // lognormal (mu = ln 512, sigma = 0.9) clipped to [16, 4096].
  std::mt19937 rng(7);
  std::lognormal_distribution<double> length(std::log(512.0), 0.9);
  std::set<std::tuple<int64_t, int64_t, int64_t>> configurations;
  for (int step = 0; step < 200; ++step) {
    int64_t total = 0, longest = 0, batch = 0;
    while (total < 8192) {
      const int64_t n = std::clamp<int64_t>(static_cast<int64_t>(length(rng)), 16, 4096);
      total += n;
      longest = std::max(longest, n);
      ++batch;
    }
    const RaggedDims d = bucketed({batch, longest, longest, total, total});
    CHECK(d.batch >= batch);
    CHECK(d.s_q >= longest);
    CHECK(d.total_q >= total);
    configurations.insert({d.batch, d.s_q, d.total_q});
  }
  CAPTURE(configurations.size());
  CHECK(configurations.size() <= 12);
}

// The table of the padding mask's full lengths (csrc/cudnn_frontend/
// lengths_table.h): a configuration is written once, on the stream that first
// needs it; another stream reads it only once its write has run; nothing is
// written or waited for inside a capture; a full table hands calls back to
// per-call writes. Plain C++: built in CPU builds.
#include <catch2/catch.hpp>

#include "cudnn_frontend/lengths_table.h"

using openwam::frontend::LengthsBlock;
using openwam::frontend::LengthsKey;
using openwam::frontend::LengthsTable;
using openwam::frontend::LengthsUse;

namespace {

int stream_a = 0, stream_b = 0;  // stream identities: only their addresses count
const void* const kA = &stream_a;
const void* const kB = &stream_b;

// has_run() stand-ins, counting how often the table asks.
struct Answer {
  bool ran;
  int* asked;
  bool operator()(const LengthsBlock&) const {
    ++*asked;
    return ran;
  }
};

}  // namespace

TEST_CASE("lengths table: written once, then read on its stream", "[frontend]") {
  LengthsTable table(1024);
  int asked = 0;
  const LengthsKey key{8, 360, 64};
  auto [use, block] = table.lookup(key, kA, false, Answer{false, &asked});
  CHECK(use == LengthsUse::kWrite);
  REQUIRE(block != nullptr);
  CHECK(block->offset == 0);
  CHECK(table.used() == 16);  // s_q and s_kv rows of 8
  for (int i = 0; i < 3; ++i) {
    auto [again, same] = table.lookup(key, kA, false, Answer{false, &asked});
    CHECK(again == LengthsUse::kRead);
    CHECK(same == block);
  }
  CHECK(asked == 0);  // its own stream is ordered after the write: no query
  CHECK(table.used() == 16);
}

TEST_CASE("lengths table: another stream reads once the write has run", "[frontend]") {
  LengthsTable table(1024);
  int asked = 0;
  const LengthsKey key{4, 32, 64};
  table.lookup(key, kA, false, Answer{false, &asked});
  auto [pending, none] = table.lookup(key, kB, false, Answer{false, &asked});
  CHECK(pending == LengthsUse::kPerCall);
  CHECK(none == nullptr);
  CHECK(asked == 1);
  auto [ran, block] = table.lookup(key, kB, false, Answer{true, &asked});
  CHECK(ran == LengthsUse::kRead);
  REQUIRE(block != nullptr);
  CHECK(block->done);
  CHECK(asked == 2);
  // Known done: no further queries, from any stream.
  auto [later, _] = table.lookup(key, kB, false, Answer{false, &asked});
  CHECK(later == LengthsUse::kRead);
  CHECK(asked == 2);
}

TEST_CASE("lengths table: nothing written inside a capture", "[frontend]") {
  LengthsTable table(1024);
  int asked = 0;
  const LengthsKey key{4, 100, 192};
  auto [fresh, none] = table.lookup(key, kA, true, Answer{true, &asked});
  CHECK(fresh == LengthsUse::kPerCall);  // a write captured would run only at replay
  CHECK(none == nullptr);
  CHECK(table.used() == 0);
  table.lookup(key, kA, false, Answer{true, &asked});  // written outside the capture
  auto [own, block] = table.lookup(key, kA, true, Answer{true, &asked});
  CHECK(own == LengthsUse::kRead);  // enqueued on this stream before the capture
  CHECK(block != nullptr);
  CHECK(asked == 0);
  // A capture on another stream (torch.cuda.graph's own) reads it once its
  // write has run, and writes its own while it has not.
  auto [pending, none2] = table.lookup(key, kB, true, Answer{false, &asked});
  CHECK(pending == LengthsUse::kPerCall);
  CHECK(none2 == nullptr);
  auto [ran, same] = table.lookup(key, kB, true, Answer{true, &asked});
  CHECK(ran == LengthsUse::kRead);
  CHECK(same == block);
  CHECK(asked == 2);
}

TEST_CASE("lengths table: configurations get blocks of their own until it is full",
          "[frontend]") {
  LengthsTable table(40);
  int asked = 0;
  auto [u1, b1] = table.lookup({8, 1, 1}, kA, false, Answer{true, &asked});
  auto [u2, b2] = table.lookup({8, 1, 2}, kA, false, Answer{true, &asked});
  CHECK(u1 == LengthsUse::kWrite);
  CHECK(u2 == LengthsUse::kWrite);
  REQUIRE(b1 != nullptr);
  REQUIRE(b2 != nullptr);
  CHECK(b1->offset == 0);
  CHECK(b2->offset == 16);  // no overlap
  CHECK(table.used() == 32);
  auto [full, none] = table.lookup({8, 2, 1}, kA, false, Answer{true, &asked});
  CHECK(full == LengthsUse::kPerCall);  // 16 more do not fit in 40
  CHECK(none == nullptr);
  auto [small, b3] = table.lookup({4, 2, 1}, kA, false, Answer{true, &asked});
  CHECK(small == LengthsUse::kWrite);  // 8 do
  REQUIRE(b3 != nullptr);
  CHECK(b3->offset == 32);
  CHECK(table.used() == 40);
  // A dropped block (its write failed) is never read; its space stays used.
  table.drop({4, 2, 1});
  auto [refused, none2] = table.lookup({4, 2, 1}, kA, false, Answer{true, &asked});
  CHECK(refused == LengthsUse::kPerCall);
  CHECK(none2 == nullptr);
}

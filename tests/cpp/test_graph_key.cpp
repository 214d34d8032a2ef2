// The cuDNN frontend's graph key (csrc/cudnn_frontend/graph_key.h): a cached
// graph is reused only for a key equal in every fact that changes the graph,
// so every field must change equality and the hash; describe() is what the
// fallback warning and frontend_stats() show. Plain C++: built in CPU builds.
#include <functional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "cudnn_frontend/graph_key.h"

using openwam::frontend::Layout;
using openwam::frontend::Pass;
using openwam::frontend::SdpaGraphKey;
using openwam::frontend::SdpaGraphKeyHash;

namespace {

Layout contiguous(int64_t b, int64_t h, int64_t s, int64_t d) {
  return Layout{{b, h, s, d}, {h * s * d, s * d, d, 1}};
}

// A backward key as the engine builds one: every layout present.
SdpaGraphKey backward_key() {
  SdpaGraphKey key;
  key.device = 0;
  key.bf16 = true;
  key.pass = Pass::kBackward;
  key.q = contiguous(2, 8, 200, 64);
  key.k = contiguous(2, 8, 300, 64);
  key.v = contiguous(2, 8, 300, 64);
  key.o = contiguous(2, 8, 200, 64);
  key.grad_out = key.o;
  key.dq = key.q;
  key.dk = key.k;
  key.dv = key.v;
  key.bias = Layout{{2, 1, 200, 300}, {60000, 0, 300, 1}};
  key.padding_mask = true;
  return key;
}

using Change = std::pair<std::string, std::function<void(SdpaGraphKey&)>>;

// One change per field, and per element of every layout's sizes and strides.
std::vector<Change> every_change() {
  std::vector<Change> changes = {
      {"device", [](SdpaGraphKey& k) { k.device = 1; }},
      {"dtype", [](SdpaGraphKey& k) { k.bf16 = !k.bf16; }},
      {"pass: training forward", [](SdpaGraphKey& k) { k.pass = Pass::kTraining; }},
      {"pass: inference forward", [](SdpaGraphKey& k) { k.pass = Pass::kInference; }},
      {"is_causal", [](SdpaGraphKey& k) { k.is_causal = !k.is_causal; }},
      {"padding_mask", [](SdpaGraphKey& k) { k.padding_mask = !k.padding_mask; }},
      {"dropout_p", [](SdpaGraphKey& k) { k.dropout_p = 0.1; }},
      {"bias absent", [](SdpaGraphKey& k) { k.bias = Layout{}; }},
      {"ragged", [](SdpaGraphKey& k) { k.ragged = !k.ragged; }},
      {"max_total_q", [](SdpaGraphKey& k) { k.max_total_q += 64; }},
      {"max_total_kv", [](SdpaGraphKey& k) { k.max_total_kv += 64; }},
  };
  const std::pair<const char*, Layout SdpaGraphKey::*> layouts[] = {
      {"q", &SdpaGraphKey::q},   {"k", &SdpaGraphKey::k},   {"v", &SdpaGraphKey::v},
      {"o", &SdpaGraphKey::o},   {"grad_out", &SdpaGraphKey::grad_out},
      {"dq", &SdpaGraphKey::dq}, {"dk", &SdpaGraphKey::dk}, {"dv", &SdpaGraphKey::dv},
      {"bias", &SdpaGraphKey::bias}};
  for (const auto& [name, member] : layouts) {
    for (int i = 0; i < 4; ++i) {
      const std::string at = std::string(name) + "[" + std::to_string(i) + "]";
      changes.emplace_back(at + ".size", [member = member, i](SdpaGraphKey& k) {
        (k.*member).sizes[i] += 1;
      });
      changes.emplace_back(at + ".stride", [member = member, i](SdpaGraphKey& k) {
        (k.*member).strides[i] += 1;
      });
    }
  }
  return changes;
}

}  // namespace

TEST_CASE("graph key: equal keys, equal hashes", "[frontend]") {
  const SdpaGraphKey a = backward_key();
  const SdpaGraphKey b = backward_key();
  CHECK(a == b);
  CHECK_FALSE(a != b);
  CHECK(a.hash() == b.hash());
  CHECK(SdpaGraphKeyHash{}(a) == a.hash());
  CHECK(SdpaGraphKey{} == SdpaGraphKey{});
  CHECK(SdpaGraphKey{}.hash() == SdpaGraphKey{}.hash());
}

TEST_CASE("graph key: every field changes the key and its hash", "[frontend]") {
  const SdpaGraphKey base = backward_key();
  std::unordered_set<SdpaGraphKey, SdpaGraphKeyHash> keys{base};
  std::unordered_set<size_t> hashes{base.hash()};
  const std::vector<Change> changes = every_change();
  REQUIRE(changes.size() == 11 + 9 * 4 * 2);
  for (const auto& [name, change] : changes) {
    CAPTURE(name);
    SdpaGraphKey changed = base;
    change(changed);
    CHECK(changed != base);
    CHECK_FALSE(changed == base);
    CHECK(changed.hash() != base.hash());
    keys.insert(changed);
    hashes.insert(changed.hash());
  }
  // No two changes give the same key, nor (for these) the same hash.
  CHECK(keys.size() == changes.size() + 1);
  CHECK(hashes.size() == changes.size() + 1);
}

TEST_CASE("graph key: a layout counts where it stands", "[frontend]") {
  // The same layouts under other roles are another graph.
  const SdpaGraphKey base = backward_key();
  SdpaGraphKey swapped = base;
  std::swap(swapped.q, swapped.k);
  CHECK(swapped != base);
  CHECK(swapped.hash() != base.hash());
  swapped = base;
  std::swap(swapped.dq, swapped.dk);
  CHECK(swapped != base);
  // Sizes and strides are not interchangeable.
  SdpaGraphKey a, b;
  a.q = Layout{{2, 4, 6, 8}, {8, 6, 4, 2}};
  b.q = Layout{{8, 6, 4, 2}, {2, 4, 6, 8}};
  CHECK(a != b);
  CHECK(a.hash() != b.hash());
}

TEST_CASE("graph key: a layout is present when it has a batch", "[frontend]") {
  CHECK_FALSE(Layout{}.present());
  CHECK(contiguous(1, 1, 1, 8).present());
  CHECK(Layout{} == Layout{});
  CHECK(contiguous(2, 8, 200, 64) != contiguous(2, 8, 200, 128));
}

TEST_CASE("graph key: the passes' names", "[frontend]") {
  CHECK(std::string(openwam::frontend::to_string(Pass::kInference)) == "forward (inference)");
  CHECK(std::string(openwam::frontend::to_string(Pass::kTraining)) == "forward");
  CHECK(std::string(openwam::frontend::to_string(Pass::kBackward)) == "backward");
}

TEST_CASE("graph key: describe() names the graph for a message", "[frontend]") {
  SdpaGraphKey key = backward_key();
  key.is_causal = true;
  CHECK(key.describe() ==
        "backward graph, bf16, q [2, 8, 200, 64] strides [102400, 12800, 64, 1], "
        "k [2, 8, 300, 64] strides [153600, 19200, 64, 1], "
        "v [2, 8, 300, 64] strides [153600, 19200, 64, 1], "
        "bias [2, 1, 200, 300] strides [60000, 0, 300, 1], causal, padding mask");

  // An inference forward without bias, causal mask or padding mask names
  // none of them; dropout is named with its probability.
  SdpaGraphKey fwd;
  fwd.pass = Pass::kInference;
  fwd.q = contiguous(1, 2, 3, 16);
  fwd.k = contiguous(1, 2, 5, 16);
  fwd.v = contiguous(1, 2, 5, 32);
  CHECK(fwd.describe() ==
        "forward (inference) graph, fp16, q [1, 2, 3, 16] strides [96, 48, 16, 1], "
        "k [1, 2, 5, 16] strides [160, 80, 16, 1], v [1, 2, 5, 32] strides [320, 160, 32, 1]");
  fwd.pass = Pass::kTraining;
  fwd.dropout_p = 0.25;
  CHECK(fwd.describe() ==
        "forward graph, fp16, q [1, 2, 3, 16] strides [96, 48, 16, 1], "
        "k [1, 2, 5, 16] strides [160, 80, 16, 1], v [1, 2, 5, 32] strides [320, 160, 32, 1], "
        "dropout 0.25");
  // A ragged backward names its dQ accumulator's bucket.
  SdpaGraphKey ragged = fwd;
  ragged.pass = Pass::kBackward;
  ragged.dropout_p = 0.0;
  ragged.ragged = true;
  ragged.max_total_q = 4096;
  ragged.max_total_kv = 8192;
  CHECK(ragged.describe() ==
        "backward graph, fp16, q [1, 2, 3, 16] strides [96, 48, 16, 1], "
        "k [1, 2, 5, 16] strides [160, 80, 16, 1], v [1, 2, 5, 32] strides [320, 160, 32, 1], "
        "ragged (max total 4096/8192)");
}

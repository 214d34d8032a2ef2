// The cuDNN frontend's graph cache (csrc/cudnn_frontend/graph_cache.h): least
// recently used out first, at most `capacity` graphs, a value replaced in
// place, clear(). An evicted or replaced graph must be released (it holds
// cuDNN plans). Plain C++: built in CPU builds.
#include <algorithm>
#include <memory>
#include <string>

#include <catch2/catch.hpp>

#include "cudnn_frontend/graph_cache.h"
#include "cudnn_frontend/graph_key.h"

using openwam::frontend::LruCache;

namespace {

using Cache = LruCache<std::string, int, std::hash<std::string>>;

// find() as a value: -1 when absent.
int value_of(Cache& cache, const std::string& key) {
  const int* v = cache.find(key);
  return v == nullptr ? -1 : *v;
}

}  // namespace

TEST_CASE("graph cache: find and insert", "[frontend]") {
  Cache cache(4);
  CHECK(cache.capacity() == 4);
  CHECK(cache.size() == 0);
  CHECK(cache.find("a") == nullptr);
  int& a = cache.insert("a", 1);
  CHECK(a == 1);
  CHECK(cache.size() == 1);
  REQUIRE(cache.find("a") != nullptr);
  CHECK(cache.find("a") == &a);  // the stored value, not a copy
  CHECK(*cache.find("a") == 1);
  *cache.find("a") = 7;
  CHECK(value_of(cache, "a") == 7);
  CHECK(cache.find("b") == nullptr);
  CHECK(cache.size() == 1);  // a miss inserts nothing
}

TEST_CASE("graph cache: the least recently used goes first", "[frontend]") {
  Cache cache(3);
  cache.insert("a", 1);
  cache.insert("b", 2);
  cache.insert("c", 3);
  REQUIRE(cache.size() == 3);
  // Insertion order alone: "a" is the oldest.
  cache.insert("d", 4);
  CHECK(cache.size() == 3);
  CHECK(cache.find("a") == nullptr);
  // A hit makes a key the most recent: "b" was the oldest, now "c" is.
  CHECK(value_of(cache, "b") == 2);
  cache.insert("e", 5);
  CHECK(cache.find("c") == nullptr);
  CHECK(value_of(cache, "b") == 2);
  CHECK(value_of(cache, "d") == 4);
  CHECK(value_of(cache, "e") == 5);
  // A miss changes no order: "b", "d", "e" were touched in that order.
  CHECK(cache.find("zz") == nullptr);
  cache.insert("f", 6);
  CHECK(cache.find("b") == nullptr);
  CHECK(value_of(cache, "d") == 4);
  CHECK(value_of(cache, "e") == 5);
  CHECK(value_of(cache, "f") == 6);
  CHECK(cache.size() == 3);
}

TEST_CASE("graph cache: never more than its capacity", "[frontend]") {
  for (std::size_t capacity : {1u, 2u, 5u, 64u}) {
    CAPTURE(capacity);
    Cache cache(capacity);
    for (int i = 0; i < 200; ++i) {
      cache.insert(std::to_string(i), i);
      CHECK(cache.size() == std::min<std::size_t>(i + 1, capacity));
    }
    // The last `capacity` inserted remain, and only they.
    for (int i = 0; i < 200; ++i) {
      CAPTURE(i);
      CHECK((cache.find(std::to_string(i)) != nullptr) ==
            (i >= 200 - static_cast<int>(capacity)));
    }
  }
}

TEST_CASE("graph cache: a capacity of 0 holds one graph", "[frontend]") {
  Cache cache(0);
  CHECK(cache.capacity() == 1);
  cache.insert("a", 1);
  CHECK(value_of(cache, "a") == 1);
  cache.insert("b", 2);
  CHECK(cache.size() == 1);
  CHECK(cache.find("a") == nullptr);
  CHECK(value_of(cache, "b") == 2);
}

TEST_CASE("graph cache: inserting a present key replaces its value", "[frontend]") {
  Cache cache(2);
  cache.insert("a", 1);
  cache.insert("b", 2);
  int& a = cache.insert("a", 10);
  CHECK(a == 10);
  CHECK(cache.size() == 2);  // replaced, nothing evicted
  // The replaced key became the most recent: "b" goes first.
  cache.insert("c", 3);
  CHECK(cache.find("b") == nullptr);
  CHECK(value_of(cache, "a") == 10);
  CHECK(value_of(cache, "c") == 3);
}

TEST_CASE("graph cache: clear empties it and keeps its capacity", "[frontend]") {
  Cache cache(3);
  cache.insert("a", 1);
  cache.insert("b", 2);
  cache.clear();
  CHECK(cache.size() == 0);
  CHECK(cache.capacity() == 3);
  CHECK(cache.find("a") == nullptr);
  CHECK(cache.find("b") == nullptr);
  // Usable again, to its full capacity.
  cache.insert("b", 5);
  cache.insert("c", 6);
  cache.insert("d", 7);
  CHECK(cache.size() == 3);
  CHECK(value_of(cache, "b") == 5);
  cache.clear();
  cache.clear();
  CHECK(cache.size() == 0);
}

TEST_CASE("graph cache: evicted, replaced and cleared graphs are released", "[frontend]") {
  // The engine's entries hold shared_ptrs to built graphs.
  LruCache<int, std::shared_ptr<int>, std::hash<int>> cache(2);
  std::weak_ptr<int> first, replaced, kept, cleared;
  {
    auto p1 = std::make_shared<int>(1), p2 = std::make_shared<int>(2);
    first = p1;
    replaced = p2;
    cache.insert(1, std::move(p1));
    cache.insert(2, std::move(p2));
  }
  CHECK_FALSE(first.expired());
  auto p3 = std::make_shared<int>(3);
  kept = p3;
  cache.insert(2, std::move(p3));  // replaces 2's value
  CHECK(replaced.expired());
  CHECK_FALSE(kept.expired());
  cache.insert(3, std::make_shared<int>(4));  // evicts 1
  CHECK(first.expired());
  CHECK_FALSE(kept.expired());
  cleared = *cache.find(3);
  cache.clear();
  CHECK(kept.expired());
  CHECK(cleared.expired());
}

TEST_CASE("graph cache: keyed by the graph key, move-only values", "[frontend]") {
  using openwam::frontend::SdpaGraphKey;
  LruCache<SdpaGraphKey, std::unique_ptr<int>, openwam::frontend::SdpaGraphKeyHash> cache(2);
  SdpaGraphKey a, b, c;
  a.q = {{1, 1, 4, 8}, {32, 32, 8, 1}};
  b = a;
  b.padding_mask = true;
  c = a;
  c.is_causal = true;
  cache.insert(a, std::make_unique<int>(1));
  cache.insert(b, std::make_unique<int>(2));
  REQUIRE(cache.find(a) != nullptr);
  CHECK(**cache.find(a) == 1);
  REQUIRE(cache.find(b) != nullptr);
  CHECK(**cache.find(b) == 2);
  cache.insert(c, std::make_unique<int>(3));  // "a" is the least recent
  CHECK(cache.find(a) == nullptr);
  CHECK(cache.find(b) != nullptr);
  CHECK(cache.find(c) != nullptr);
}


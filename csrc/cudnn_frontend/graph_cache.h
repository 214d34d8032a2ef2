// A bounded cache of built graphs, least recently used out first. A training
// run whose shapes vary (a new sequence length per batch) would otherwise keep
// every graph it ever built. Not synchronised: its owner holds a mutex.
// Plain C++: the CPU tests check it.
#pragma once

#include <cstddef>
#include <list>
#include <unordered_map>
#include <utility>

namespace openwam::frontend {

template <typename Key, typename Value, typename Hash>
class LruCache {
 public:
  explicit LruCache(std::size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}

  // The value, now the most recently used; nullptr when absent.
  Value* find(const Key& key) {
    auto it = index_.find(key);
    if (it == index_.end()) {
      return nullptr;
    }
    items_.splice(items_.begin(), items_, it->second);
    return &it->second->second;
  }

  // Inserts or replaces; evicts the least recently used past the capacity.
  Value& insert(const Key& key, Value value) {
    auto it = index_.find(key);
    if (it != index_.end()) {
      it->second->second = std::move(value);
      items_.splice(items_.begin(), items_, it->second);
      return it->second->second;
    }
    items_.emplace_front(key, std::move(value));
    index_.emplace(key, items_.begin());
    while (items_.size() > capacity_) {
      index_.erase(items_.back().first);
      items_.pop_back();
    }
    return items_.front().second;
  }

  std::size_t size() const { return items_.size(); }
  std::size_t capacity() const { return capacity_; }
  void clear() {
    index_.clear();
    items_.clear();
  }

 private:
  using Item = std::pair<Key, Value>;
  std::size_t capacity_;
  std::list<Item> items_;  // most recently used first
  std::unordered_map<Key, typename std::list<Item>::iterator, Hash> index_;
};

}  // namespace openwam::frontend

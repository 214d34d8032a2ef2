// Where the padding mask's full lengths live on a device. Used as the fix,
// cuDNN's padding mask reads seq_len_q/kv from device memory, every entry
// equal to the tensor's s_q or s_kv. Written per call, they cost each fixed
// backward an allocation and a kernel launch: +3.7 to +4.9 us of host time
// over stock's backward (H200, torch 2.11.0+cu130, bench_sdpa.py host).
// This table keeps one block per (batch, s_q, s_kv) in a slab of the device,
// written once on the stream that first needs it and never freed: a captured
// CUDA graph keeps the block's address. Plain C++ bookkeeping, checked by the
// CPU tests; full_lengths.cu does the CUDA.
#pragma once

#include <cstdint>
#include <functional>
#include <unordered_map>
#include <utility>

namespace openwam::frontend {

struct LengthsKey {
  int64_t row = 0;  // entries per length: the batch, rounded up to 4
  int64_t s_q = 0;
  int64_t s_kv = 0;
  bool operator==(const LengthsKey& o) const {
    return row == o.row && s_q == o.s_q && s_kv == o.s_kv;
  }
};

struct LengthsKeyHash {
  size_t operator()(const LengthsKey& k) const {
    const std::hash<int64_t> h;
    return (h(k.row) * 31 + h(k.s_q)) * 31 + h(k.s_kv);
  }
};

// A block: 2 x row int32 at `offset` (in int32) of the slab, s_q then s_kv.
struct LengthsBlock {
  int64_t offset = 0;
  const void* stream = nullptr;  // the stream its write was enqueued on
  void* written = nullptr;       // an event recorded after that write
  bool done = false;             // the write is known to have run
};

// What a call does for its lengths.
enum class LengthsUse {
  kRead,     // the block is written, or its write is ordered before this call
  kWrite,    // a new block: write it on this stream now, then read it
  kPerCall,  // write a tensor of this call's own instead
};

class LengthsTable {
 public:
  explicit LengthsTable(int64_t capacity) : capacity_(capacity) {}

  // The block for `key` on `stream` and what to do with it. A block written
  // on another stream is read once `has_run(block)` says its write ran (a
  // query, never a wait). Inside a capture no block is written: the write
  // would run only at replay, so such a call writes its own.
  template <typename HasRun>
  std::pair<LengthsUse, LengthsBlock*> lookup(const LengthsKey& key, const void* stream,
                                              bool capturing, HasRun has_run) {
    auto it = blocks_.find(key);
    if (it != blocks_.end()) {
      LengthsBlock& b = it->second;
      if (!b.done && b.stream != stream && has_run(b)) {
        b.done = true;
      }
      if (b.done || b.stream == stream) {
        return {LengthsUse::kRead, &b};
      }
      return {LengthsUse::kPerCall, nullptr};
    }
    const int64_t size = 2 * key.row;
    if (capturing || size > capacity_ - used_) {
      return {LengthsUse::kPerCall, nullptr};
    }
    LengthsBlock& b = blocks_.emplace(key, LengthsBlock{used_, stream}).first->second;
    used_ += size;
    return {LengthsUse::kWrite, &b};
  }

  // Forgets a block whose write could not be enqueued (its space stays used).
  void drop(const LengthsKey& key) { blocks_.erase(key); }

  int64_t used() const { return used_; }

 private:
  int64_t capacity_;
  int64_t used_ = 0;
  std::unordered_map<LengthsKey, LengthsBlock, LengthsKeyHash> blocks_;
};

}  // namespace openwam::frontend

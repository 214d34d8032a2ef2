// The dimensions of a ragged (packed) cuDNN graph, bucketed. A graph's batch,
// longest sequence and total token counts are part of what cuDNN builds; a
// training run whose batches differ in sequence count and lengths would build
// a graph per step. Rounded up to powers of two, a run meets a handful of
// configurations: the extra sequences are empty (length 0, their offsets at
// the end of the buffer) and the kernels skip tiles past each sequence's true
// length (the padding mask), so a bucket costs grid slots, not attention.
// Plain C++: the CPU tests check it.
#pragma once

#include <cstdint>

namespace openwam::frontend {

// The smallest power of two >= max(n, floor).
constexpr int64_t bucket_up(int64_t n, int64_t floor) {
  int64_t b = 1;
  while (b < n || b < floor) {
    b *= 2;
  }
  return b;
}

// cuDNN's attention tiles are 64 or 128 rows: sequence buckets start at 64,
// and the backward's dQ accumulator is sized in multiples of 64 rows.
constexpr int64_t kRaggedMinSequence = 64;

struct RaggedDims {
  int64_t batch = 0;     // sequences
  int64_t s_q = 0;       // the longest query sequence
  int64_t s_kv = 0;      // the longest key sequence
  int64_t total_q = 0;   // packed query rows
  int64_t total_kv = 0;  // packed key rows

  bool operator==(const RaggedDims& o) const {
    return batch == o.batch && s_q == o.s_q && s_kv == o.s_kv && total_q == o.total_q &&
           total_kv == o.total_kv;
  }
};

constexpr RaggedDims bucketed(const RaggedDims& d) {
  return {bucket_up(d.batch, 1), bucket_up(d.s_q, kRaggedMinSequence),
          bucket_up(d.s_kv, kRaggedMinSequence), bucket_up(d.total_q, kRaggedMinSequence),
          bucket_up(d.total_kv, kRaggedMinSequence)};
}

// A call's graph dims: its sequences, max_seqlen_q/k and the packed totals,
// bucketed. No sequence is longer than its side's total, so a max_seqlen
// above it (a bound the caller rounded up; the op takes any int64) counts as
// the total: the graph is no larger than the buffers, and bucket_up never
// meets a length past 2^62, where doubling would overflow (found in review:
// max_seqlen 2^62 + 1 looped for good).
constexpr RaggedDims call_dims(int64_t sequences, int64_t max_q, int64_t max_k,
                               int64_t total_q, int64_t total_kv) {
  return bucketed({sequences, max_q < total_q ? max_q : total_q,
                   max_k < total_kv ? max_k : total_kv, total_q, total_kv});
}

}  // namespace openwam::frontend

// The cuDNN SDPA graphs themselves: one forward (with or without the
// logsumexp) and one backward per SdpaGraphKey, built, validated and planned
// with the cuDNN frontend's graph API. Only sdpa_graphs.cpp includes the
// frontend's headers; the rest of the op sees a built graph as BuiltGraph.
#pragma once

#include <cudnn.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

#include "graph_key.h"

namespace openwam::frontend {

// The uids that tensors are bound by when a graph runs.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,     // the logsumexp, float32 [B, H, L, 1]
  kBias,
  kScale,     // float32, by value
  kSeed,      // int64 dropout seed and offset on the device
  kOffset,
  kGradOut,
  kGradQ,
  kGradK,
  kGradV,
  kSeqLenQ,   // int32 [B, 1, 1, 1]: the padding mask's lengths
  kSeqLenKv,
  // The ragged layout: int64 [B + 1, 1, 1, 1] element offsets of each
  // sequence's first row in a packed buffer (grad_out shares the output's).
  kRaggedQ,
  kRaggedK,
  kRaggedV,
  kRaggedO,
  kRaggedStats,
  kRaggedGradQ,
  kRaggedGradKv,
};

class BuiltGraph {
 public:
  virtual ~BuiltGraph() = default;
  virtual int64_t workspace_size() const = 0;
  // Runs the graph on the handle's stream; "" or what went wrong.
  virtual std::string execute(cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack,
                              void* workspace) const = 0;
};

// The graph for `key`, built and planned; nullptr with the frontend's reason
// in `why_not` when cuDNN cannot run it (unsupported, no engine, a failed
// plan build). May take a second: callers cache the result.
std::shared_ptr<const BuiltGraph> build_graph(const SdpaGraphKey& key, cudnnHandle_t handle,
                                              std::string& why_not);

}  // namespace openwam::frontend

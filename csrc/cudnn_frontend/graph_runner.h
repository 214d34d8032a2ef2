// The graphs both engines run (sdpa_engine.h dense, ragged_engine.h packed):
// each is validated and built once per configuration (graph_key.h) and kept
// in a bounded cache shared by every thread (the backward runs on autograd's
// device thread); it runs on the current stream, on ATen's cuDNN handle for
// this device and thread, with its workspace from PyTorch's caching
// allocator. No host synchronisation: capturable in a CUDA graph.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "graph_key.h"
#include "sdpa_graphs.h"

namespace openwam::frontend {

// The graph for `key`: cached, built now, or nullptr with the reason in
// `why_not` (a failure is cached too, and listed by build_failures()).
std::shared_ptr<const BuiltGraph> graph_for(const SdpaGraphKey& key, std::string& why_not);

// The forward graph for `fwd`; with `prepare_backward` (a training forward)
// the backward graph `bwd` is built now too. Where either cannot be built,
// the other is recorded unbuildable as well, so that a configuration's two
// passes take one engine (and dropout one pattern): nullptr, with the reason
// in `why_not`.
std::shared_ptr<const BuiltGraph> forward_graph(const SdpaGraphKey& fwd, const SdpaGraphKey& bwd,
                                                bool prepare_backward, std::string& why_not);

// The attention scale cuDNN takes by value: `scale` or 1/sqrt(head_dim).
float scale_value(std::optional<double> scale, const at::Tensor& query);

// The variant-pack entries every forward graph binds: Q, K, V, O and the
// scale, which cuDNN reads by value at execution (`scale` must outlive it).
std::unordered_map<int64_t, void*> forward_pack(const at::Tensor& query, const at::Tensor& key,
                                                const at::Tensor& value, const at::Tensor& out,
                                                float* scale);

// Runs a built graph on the current stream; raises with `key`'s description
// when cuDNN refuses to execute it.
void run(const BuiltGraph& graph, std::unordered_map<int64_t, void*>& pack,
         const SdpaGraphKey& key);

// The configurations whose graph could not be built in this process, as
// "<configuration>: <reason>", oldest first, the first 64 (explain() and the
// doctor; stats().graph_build_failures counts them all).
std::vector<std::string> build_failures();

// Drops every cached graph (tests that count builds start from a clean cache).
void clear_graph_cache();

}  // namespace openwam::frontend

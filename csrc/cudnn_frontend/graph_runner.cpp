#include "graph_runner.h"

#include <ATen/cudnn/Handle.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <algorithm>
#include <mutex>

#include "../attention_scale.h"
#include "graph_cache.h"
#include "stats.h"

namespace openwam::frontend {
namespace {

// Enough for every shape a long training run with varying lengths meets in a
// while; an evicted graph is rebuilt in tens of milliseconds (cuDNN keeps the
// compiled kernels).
constexpr size_t kGraphCacheCapacity = 1024;

// A built graph, or why none can be built for its key.
struct Entry {
  std::shared_ptr<const BuiltGraph> graph;
  std::string why_not;
};

struct GraphCache {
  std::mutex mutex;
  LruCache<SdpaGraphKey, Entry, SdpaGraphKeyHash> cache{kGraphCacheCapacity};
  std::vector<std::string> failures;  // configurations that did not build, oldest first
};

// Failures listed at most: a family of unbuildable shapes (a new sequence
// length each step) would grow the list, and its search under the lock, for
// good. frontend_stats()'s graph_build_failures counts every one.
constexpr size_t kMaxListedFailures = 64;

GraphCache& graph_cache() {
  // Never destroyed: graphs hold cuDNN objects, which must not be freed after
  // the CUDA context is gone at process exit.
  static auto* cache = new GraphCache();
  return *cache;
}

// Marks `key` as unbuildable: its partner graph failed, and both passes must
// run on one engine. It replaces whatever the key held.
void record_failure(const SdpaGraphKey& key, const std::string& why_not) {
  GraphCache& c = graph_cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.cache.insert(key, Entry{nullptr, why_not});
}

}  // namespace

std::shared_ptr<const BuiltGraph> graph_for(const SdpaGraphKey& key, std::string& why_not) {
  GraphCache& c = graph_cache();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (Entry* e = c.cache.find(key)) {
      why_not = e->why_not;
      return e->graph;
    }
  }
  // Built outside the lock: a build takes up to a second, and another thread
  // building the same key at the same time only costs a duplicate build.
  Entry e;
  {
    // A configuration met first inside a CUDA-graph capture (or while another
    // thread captures in the global mode) builds there: cuDNN's build touches
    // no capturing stream, so relaxed mode lets its allocations and module
    // loads through, as in full_lengths.cu and PyTorch's caching allocator.
    const c10::cuda::CUDAStreamCaptureModeGuard relaxed{cudaStreamCaptureModeRelaxed};
    e.graph = build_graph(key, at::native::getCudnnHandle(), e.why_not);
  }
  auto& s = stats();
  if (e.graph == nullptr) {
    s.graph_build_failures++;
  } else if (key.ragged) {
    s.ragged_graphs_built++;
  } else if (key.pass == Pass::kBackward) {
    s.backward_graphs_built++;
  } else {
    s.forward_graphs_built++;
  }
  std::lock_guard<std::mutex> lock(c.mutex);
  if (e.graph == nullptr) {
    std::string failure = key.describe() + ": " + e.why_not;
    if (c.failures.size() < kMaxListedFailures &&
        std::find(c.failures.begin(), c.failures.end(), failure) == c.failures.end()) {
      c.failures.push_back(std::move(failure));
    }
  }
  if (Entry* raced = c.cache.find(key)) {
    // Another thread built the same key meanwhile: keep its entry.
    why_not = raced->why_not;
    return raced->graph;
  }
  const size_t before = c.cache.size();
  c.cache.insert(key, e);
  if (c.cache.size() == before) {
    s.graph_cache_evictions++;
  }
  why_not = e.why_not;
  return e.graph;
}

std::shared_ptr<const BuiltGraph> forward_graph(const SdpaGraphKey& fwd, const SdpaGraphKey& bwd,
                                                bool prepare_backward, std::string& why_not) {
  std::shared_ptr<const BuiltGraph> graph = graph_for(fwd, why_not);
  if (graph == nullptr) {
    // A dense backward with dropout must replay the pattern its forward's
    // engine drew: after a forward that ran on ATen, its backward key is
    // marked, whatever it held, so that the backward runs on ATen too. Also
    // after an inference forward: reentrant checkpointing's recomputation
    // must draw the first run's pattern. Nothing else is marked. Without
    // dropout the gradients are a function of the saved tensors whichever
    // engine made them; a ragged forward with dropout that cannot build
    // raises (varlen_kernels.cpp). And a backward key may be shared by several
    // forwards (the ragged backward takes contiguous copies of strided views):
    // a marker would take a built graph from a pending backward, or fail a
    // forward that builds (found in review).
    if (!fwd.ragged && fwd.dropout_p > 0.0) {
      record_failure(bwd, why_not);
    }
    return nullptr;
  }
  if (prepare_backward && graph_for(bwd, why_not) == nullptr) {
    record_failure(fwd, why_not);
    return nullptr;
  }
  return graph;
}

float scale_value(std::optional<double> scale, const at::Tensor& query) {
  return static_cast<float>(softmax_scale(scale, query));
}

std::unordered_map<int64_t, void*> forward_pack(const at::Tensor& query, const at::Tensor& key,
                                                const at::Tensor& value, const at::Tensor& out,
                                                float* scale) {
  return {{kQ, query.data_ptr()}, {kK, key.data_ptr()}, {kV, value.data_ptr()},
          {kO, out.data_ptr()},   {kScale, scale}};
}

// The workspace comes from the caching allocator, stream-ordered: freed after
// the launch, reused in order.
void run(const BuiltGraph& graph, std::unordered_map<int64_t, void*>& pack,
         const SdpaGraphKey& key) {
  auto workspace = c10::cuda::CUDACachingAllocator::get()->allocate(
      static_cast<size_t>(graph.workspace_size()));
  const std::string error = graph.execute(at::native::getCudnnHandle(), pack, workspace.get());
  TORCH_CHECK(error.empty(), "openwam::sdpa: cuDNN could not run its ", key.describe(), ": ",
              error);
}

std::vector<std::string> build_failures() {
  GraphCache& c = graph_cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.failures;
}

void clear_graph_cache() {
  GraphCache& c = graph_cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.cache.clear();
}

}  // namespace openwam::frontend

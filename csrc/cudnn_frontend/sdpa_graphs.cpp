#include "sdpa_graphs.h"

#include <cudnn_frontend.h>

#include <exception>
#include <mutex>
#include <vector>

namespace openwam::frontend {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

std::vector<int64_t> vec(const std::array<int64_t, 4>& a) { return {a.begin(), a.end()}; }

TensorPtr input(fe::graph::Graph& g, Uid uid, const char* name, const Layout& l) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_uid(uid)
                      .set_name(name)
                      .set_dim(vec(l.sizes))
                      .set_stride(vec(l.strides)));
}

TensorPtr scalar_input(fe::graph::Graph& g, Uid uid, const char* name, fe::DataType_t type,
                       bool by_value) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_uid(uid)
                      .set_name(name)
                      .set_dim({1, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_is_pass_by_value(by_value)
                      .set_data_type(type));
}

TensorPtr lengths(fe::graph::Graph& g, Uid uid, const char* name, int64_t batch) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_uid(uid)
                      .set_name(name)
                      .set_dim({batch, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}

void output(const TensorPtr& t, Uid uid, const Layout& l) {
  t->set_output(true).set_uid(uid).set_dim(vec(l.sizes)).set_stride(vec(l.strides));
}

// The ragged layout: each packed tensor reads its sequences' offsets from a
// tensor of its own (uid), bound at execution.
void ragged(fe::graph::Graph& g, const TensorPtr& t, Uid uid, int64_t batch) {
  t->set_ragged_offset(g.tensor(fe::graph::Tensor_attributes()
                                    .set_uid(uid)
                                    .set_name("ragged_offset")
                                    .set_dim({batch + 1, 1, 1, 1})
                                    .set_stride({1, 1, 1, 1})
                                    .set_data_type(fe::DataType_t::INT64)));
}

// The options both passes share: scale, mask, dropout, padding mask.
template <typename Attributes>
void common_options(fe::graph::Graph& g, const SdpaGraphKey& key, Attributes& a) {
  a.set_attn_scale(scalar_input(g, kScale, "attn_scale", fe::DataType_t::FLOAT, true));
  a.set_causal_mask(key.is_causal);  // top-left, as F.sdpa's is_causal
  if (key.bias.present()) {
    a.set_bias(input(g, kBias, "bias", key.bias));
  }
  if (key.dropout_p > 0.0) {
    a.set_dropout(static_cast<float>(key.dropout_p),
                  scalar_input(g, kSeed, "dropout_seed", fe::DataType_t::INT64, false),
                  scalar_input(g, kOffset, "dropout_offset", fe::DataType_t::INT64, false));
  }
  if (key.padding_mask || key.ragged) {
    // Dense: lengths equal to the full sizes, so nothing is masked, but the
    // kernels then bound the last key tile by s_kv, which is what removes
    // the backward defects (cudnn-frontend #160 and #1072). Ragged: each
    // sequence's true lengths.
    a.set_padding_mask(true)
        .set_seq_len_q(lengths(g, kSeqLenQ, "seq_len_q", key.q.sizes[0]))
        .set_seq_len_kv(lengths(g, kSeqLenKv, "seq_len_kv", key.q.sizes[0]));
  }
}

std::shared_ptr<fe::graph::Graph> describe_graph(const SdpaGraphKey& key) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(key.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const TensorPtr q = input(*g, kQ, "q", key.q);
  const TensorPtr k = input(*g, kK, "k", key.k);
  const TensorPtr v = input(*g, kV, "v", key.v);
  const int64_t b = key.q.sizes[0], h = key.q.sizes[1], s_q = key.q.sizes[2];
  // float32 [B, H, S, 1]; ragged: packed [total_q, H, 1].
  const Layout stats = key.ragged ? Layout{{b, h, s_q, 1}, {s_q * h, 1, h, 1}}
                                  : Layout{{b, h, s_q, 1}, {h * s_q, s_q, 1, 1}};
  if (key.ragged) {
    ragged(*g, q, kRaggedQ, b);
    ragged(*g, k, kRaggedK, b);
    ragged(*g, v, kRaggedV, b);
  }
  if (key.pass == Pass::kBackward) {
    fe::graph::SDPA_backward_attributes a;
    a.set_name("openwam_sdpa_backward");
    common_options(*g, key, a);
    const TensorPtr o = input(*g, kO, "o", key.o);
    const TensorPtr go = input(*g, kGradOut, "grad_out", key.grad_out);
    const TensorPtr lse = input(*g, kStats, "stats", stats);
    lse->set_data_type(fe::DataType_t::FLOAT);
    if (key.ragged) {
      ragged(*g, o, kRaggedO, b);
      go->set_ragged_offset(o->get_ragged_offset());
      ragged(*g, lse, kRaggedStats, b);
      a.set_max_total_seq_len_q(key.max_total_q).set_max_total_seq_len_kv(key.max_total_kv);
    }
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, go, lse, a);
    output(dq, kGradQ, key.dq);
    output(dk, kGradK, key.dk);
    output(dv, kGradV, key.dv);
    if (key.ragged) {
      ragged(*g, dq, kRaggedGradQ, b);
      ragged(*g, dk, kRaggedGradKv, b);
      dv->set_ragged_offset(dk->get_ragged_offset());
    }
  } else {
    fe::graph::SDPA_attributes a;
    a.set_name("openwam_sdpa_forward");
    a.set_generate_stats(key.pass == Pass::kTraining);
    common_options(*g, key, a);
    auto [o, lse] = g->sdpa(q, k, v, a);
    output(o, kO, key.o);
    if (key.ragged) {
      ragged(*g, o, kRaggedO, b);
    }
    if (key.pass == Pass::kTraining) {
      output(lse, kStats, stats);
      lse->set_data_type(fe::DataType_t::FLOAT);
      if (key.ragged) {
        ragged(*g, lse, kRaggedStats, b);
      }
    }
  }
  return g;
}

class FrontendGraph final : public BuiltGraph {
 public:
  FrontendGraph(std::shared_ptr<fe::graph::Graph> g, int64_t workspace)
      : graph_(std::move(g)), workspace_(workspace) {}
  int64_t workspace_size() const override { return workspace_; }
  // One thread at a time per graph: the cache shares a plan between threads
  // (a training forward builds the backward that autograd's device thread
  // runs), and cuDNN does not promise that an execution plan is thread safe
  // across all engines (PyTorch's MHA.cpp keeps thread-local caches for the
  // same reason). Execution only enqueues work, so the lock is short.
  std::string execute(cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack,
                      void* workspace) const override {
    const std::lock_guard<std::mutex> lock(mutex_);
    auto status = graph_->execute(handle, pack, workspace);
    return status.is_good() ? std::string() : status.get_message();
  }

 private:
  std::shared_ptr<fe::graph::Graph> graph_;
  int64_t workspace_;
  mutable std::mutex mutex_;
};

// One attempt with the given heuristics; nullptr, with the failing step in
// why_not, when a step fails.
std::shared_ptr<const BuiltGraph> try_build(const SdpaGraphKey& key, cudnnHandle_t handle,
                                            const std::vector<fe::HeurMode_t>& modes,
                                            std::string& why_not) {
  try {
    auto g = describe_graph(key);
    // Each step's error says which step failed; the first failure ends it.
    const auto step = [&why_not](const char* name, fe::error_t status) {
      if (status.is_good()) return true;
      why_not = std::string(name) + ": " + status.get_message();
      return false;
    };
    int64_t workspace = 0;
    if (step("validate", g->validate()) &&
        step("build_operation_graph", g->build_operation_graph(handle)) &&
        step("create_execution_plans", g->create_execution_plans(modes)) &&
        step("check_support", g->check_support(handle)) &&
        step("build_plans", g->build_plans(handle)) &&
        step("get_workspace_size", g->get_workspace_size(workspace))) {
      return std::make_shared<FrontendGraph>(std::move(g), workspace);
    }
  } catch (const std::exception& e) {
    why_not = std::string("the frontend threw: ") + e.what();
  }
  return nullptr;
}

}  // namespace

std::shared_ptr<const BuiltGraph> build_graph(const SdpaGraphKey& key, cudnnHandle_t handle,
                                              std::string& why_not) {
  // Heuristics A alone first, as ATen's cuDNN attention asks: where A offers a
  // plan that builds, it is the plan the list {A, FALLBACK} would build (its
  // first), and querying FALLBACK too added 0.3-2.8 ms to each build (H200,
  // cuDNN 9.19.0; a build takes 40-85 ms). FALLBACK only where A's fail.
  if (auto graph = try_build(key, handle, {fe::HeurMode_t::A}, why_not)) {
    return graph;
  }
  return try_build(key, handle, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}, why_not);
}

}  // namespace openwam::frontend

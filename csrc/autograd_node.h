// Making and re-owning an autograd node across torch releases: torch 2.11
// holds nodes in std::shared_ptr, later releases in c10::intrusive_ptr.
// Shared by the autograd nodes of the cuDNN path (cudnn_path.cpp) and of
// sdpa_varlen (varlen_autograd.cpp).
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <functional>
#include <memory>

namespace openwam {

using NodePtr = decltype(torch::autograd::Edge::function);

// Templates on N so that only the matching branch is compiled.
template <typename Ptr, typename N>
struct NodeOwnership;
template <typename N>
struct NodeOwnership<std::shared_ptr<torch::autograd::Node>, N> {
  template <typename T>
  static NodePtr make() { return std::make_shared<T>(); }
  static NodePtr self(N* node) { return node->shared_from_this(); }
};
template <typename N>
struct NodeOwnership<c10::intrusive_ptr<torch::autograd::Node>, N> {
  template <typename T>
  static NodePtr make() { return c10::make_intrusive<T>(); }
  static NodePtr self(N* node) {
    return c10::intrusive_ptr<torch::autograd::Node>::reclaim_copy(node);
  }
};
using Ownership = NodeOwnership<NodePtr, torch::autograd::Node>;

// Compiled autograd (torch._dynamo.compiled_autograd) traces a backward built
// by an eager forward: it collects each node's saved tensors and constants
// (compiled_args), then runs the node's apply() with its saved variables
// swapped for proxies. Both nodes' apply() call only dispatcher ops with
// Meta kernels, so the trace records the backward op itself. Without these
// two overrides compiled autograd raised "compiled_args not implemented".
template <typename... Saved>
torch::autograd::variable_list apply_with_swapped(
    const std::function<torch::autograd::variable_list()>& apply,
    torch::dynamo::autograd::SwapSavedVariables& swap, Saved&... saved) {
  (swap.before(saved), ...);
  torch::autograd::variable_list result = apply();
  (swap.after(saved), ...);
  return result;
}

}  // namespace openwam

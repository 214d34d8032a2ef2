#include "repair_dq.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace openwam {

void repair_dq_(at::Tensor& grad_query, const at::Tensor& grad_out,
                const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& value, const at::Tensor& out,
                const at::Tensor& logsumexp, const at::Tensor& bias,
                bool is_causal, double scale) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("openwam::_repair_dq_", "")
          .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const std::optional<at::Tensor>&,
                      bool, double)>();
  std::optional<at::Tensor> bias_opt;
  if (bias.defined()) {
    bias_opt = bias;
  }
  op.call(grad_query, grad_out, query, key, value, out, logsumexp, bias_opt,
          is_causal, scale);
}

namespace {

// Shape-only kernel for FakeTensor / torch.compile tracing: the op mutates
// grad_query in place and returns nothing.
void repair_dq_meta(at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const std::optional<at::Tensor>&, bool,
                    double) {}

}  // namespace
}  // namespace openwam

TORCH_LIBRARY_IMPL(openwam, Meta, m) {
  m.impl("_repair_dq_", &openwam::repair_dq_meta);
}

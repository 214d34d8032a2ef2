// The Python extension openwam_sdpa._C: importing it loads the op library
// (TORCH_LIBRARY registrations) and exposes what Python needs beyond the ops:
// build facts for the version check, the dispatch decision for explain(), and
// the guard table for the doctor.
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/extension.h>
#include <torch/version.h>

#include "../dispatch.h"
#include "../guards.h"
#include "../sdpa_inputs.h"
#include "../settings.h"

namespace py = pybind11;

namespace {

py::dict build_info() {
  py::dict info;
  info["torch_version"] = TORCH_VERSION;
#ifdef OPENWAM_WITH_CUDA
  info["with_cuda"] = true;
#else
  info["with_cuda"] = false;
#endif
  const auto& hooks = at::detail::getCUDAHooks();
  info["cudnn_compiled"] = hooks.hasCuDNN() ? hooks.versionCuDNN() : 0L;
  info["cudnn_runtime"] = openwam::runtime_cudnn_version();
  return info;
}

py::dict explain(const at::Tensor& query, const at::Tensor& key,
                 const at::Tensor& value,
                 const std::optional<at::Tensor>& attn_mask, double dropout_p,
                 bool is_causal, std::optional<double> scale, bool enable_gqa) {
  const openwam::SdpaInputs in{query, key, value, attn_mask, dropout_p,
                               is_causal, scale, enable_gqa};
  openwam::validate_inputs(in);
  const openwam::Settings settings = openwam::current_settings();
  const openwam::Decision d = openwam::decide(in, settings);
  py::dict out;
  out["backend"] = d.use_cudnn ? "cudnn" : "pytorch";
  out["pytorch_choice"] = d.pytorch_choice;
  out["plan"] = openwam::to_string(d.plan);
  out["rule"] = d.rule == nullptr ? "" : d.rule->name;
  out["reason"] = d.reason;
  out["differentiated"] = in.differentiated();
  out["cudnn_excluded_from_fallback"] = d.exclude_cudnn;
  out["setting_cudnn"] = openwam::to_string(settings.cudnn);
  out["setting_pad"] = openwam::to_string(settings.pad);
  out["cudnn_runtime"] = openwam::runtime_cudnn_version();
  return out;
}

py::list guard_rules() {
  py::list rules;
  for (const auto& r : openwam::guard_rules()) {
    py::dict d;
    d["name"] = r.name;
    d["versions"] = r.versions;
    d["defect"] = r.defect;
    d["action"] = r.action;
    d["source"] = r.source;
    rules.append(d);
  }
  return rules;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "openwam_sdpa C++ extension: registers torch.ops.openwam.*";
  m.def("build_info", &build_info,
        "Versions this extension was built against and the loaded cuDNN.");
  m.def("explain", &explain, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("attn_mask") = py::none(), py::arg("dropout_p") = 0.0,
        py::arg("is_causal") = false, py::arg("scale") = py::none(),
        py::arg("enable_gqa") = false,
        "The backend and fix plan openwam::sdpa would use for this call.");
  m.def("guard_rules", &guard_rules, "The guard table of known cuDNN defects.");
  m.def("key_tail_defect", &openwam::key_tail_defect, py::arg("cudnn_version"),
        py::arg("s_kv"), py::arg("head_dim"), py::arg("is_causal") = false,
        "Whether the guard table marks this cuDNN version and key length as "
        "hit by the key-tail dQ NaN defect.");
}

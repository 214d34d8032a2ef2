// The Python extension openwam_sdpa._C: importing it loads the op library
// (TORCH_LIBRARY registrations) and exposes what Python needs beyond the ops:
// a fast entry into openwam::sdpa, the decision for explain(), the settings,
// the cuDNN frontend's telemetry, build facts for the version check and the
// guard table for the doctor.
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>
#include <torch/version.h>

#ifdef OPENWAM_WITH_CUDNN_FRONTEND
#include <cudnn_frontend_version.h>

#include "../cudnn_frontend/graph_runner.h"
#endif

#include "../cudnn_attention.h"
#include "../decision.h"
#include "../guards.h"
#include "../row_copy.h"
#include "../ops.h"
#include "../cudnn_frontend/stats.h"
#include "../sdpa_call.h"
#include "../settings.h"

namespace py = pybind11;

namespace {

// openwam::sdpa for plain tensors outside torch.compile (ops.py decides when):
// one pybind call into the dispatcher, the GIL released and warnings and
// errors translated the way PyTorch's own bindings do it. torch.ops' generic
// Python entry costs a few microseconds more per call, which a short attention
// call does not hide.
at::Tensor sdpa(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                const std::optional<at::Tensor>& attn_mask, double dropout_p,
                bool is_causal, std::optional<double> scale, bool enable_gqa) {
  HANDLE_TH_ERRORS
  py::gil_scoped_release no_gil;
  return openwam::ops::sdpa().call(query, key, value, attn_mask, dropout_p, is_causal,
                                   scale, enable_gqa);
  END_HANDLE_TH_ERRORS_PYBIND
}

py::dict settings_dict(const openwam::Settings& s) {
  py::dict d;
  d["cudnn"] = openwam::to_string(s.cudnn);
  d["pad"] = openwam::to_string(s.pad);
  d["check_finite"] = s.check_finite;
  d["frontend"] = s.frontend;
  return d;
}

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
  info["newest_known_cudnn"] = openwam::kNewestKnownCudnn;
#ifdef OPENWAM_WITH_CUDNN_FRONTEND
  info["cudnn_frontend"] = std::to_string(CUDNN_FRONTEND_MAJOR_VERSION) + "." +
                           std::to_string(CUDNN_FRONTEND_MINOR_VERSION) + "." +
                           std::to_string(CUDNN_FRONTEND_PATCH_VERSION);
#else
  info["cudnn_frontend"] = py::none();
#endif
  return info;
}

// Which cuDNN the cuDNN path runs: the op's own graphs where it was built
// with the frontend, which fall back to ATen's cuDNN attention for a
// configuration whose graph cannot be built (warned, and listed by
// frontend_stats()).
const char* engine_of(const openwam::Decision& d) {
  if (d.route != openwam::Route::kCudnn) return "";
#ifdef OPENWAM_WITH_CUDNN_FRONTEND
  return openwam::current_settings().frontend ? "cudnn_frontend" : "aten_cudnn";
#else
  return "aten_cudnn";
#endif
}

py::dict frontend_stats(bool reset) {
  auto& s = openwam::frontend::stats();
  py::dict d;
  const auto read = [reset](std::atomic<int64_t>& counter) {
    return reset ? counter.exchange(0) : counter.load();
  };
  d["forward_graphs_built"] = read(s.forward_graphs_built);
  d["backward_graphs_built"] = read(s.backward_graphs_built);
  d["ragged_graphs_built"] = read(s.ragged_graphs_built);
  d["graph_build_failures"] = read(s.graph_build_failures);
  d["graph_cache_evictions"] = read(s.graph_cache_evictions);
  d["aten_fallback_calls"] = read(s.aten_fallback_calls);
  d["padding_mask_backwards"] = read(s.padding_mask_backwards);
  d["lengths_written_per_call"] = read(s.lengths_written_per_call);
  d["score_shift_backwards"] = read(s.score_shift_backwards);
  py::list failures;
#ifdef OPENWAM_WITH_CUDNN_FRONTEND
  for (const auto& f : openwam::frontend::build_failures()) failures.append(f);
#endif
  d["failed_configurations"] = failures;
  return d;
}

py::dict explain(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                 const std::optional<at::Tensor>& attn_mask, double dropout_p,
                 bool is_causal, std::optional<double> scale, bool enable_gqa) {
  const openwam::SdpaCall call{query, key, value, attn_mask, dropout_p,
                               is_causal, scale, enable_gqa};
  openwam::check_call(call);
  const openwam::Settings settings = openwam::current_settings();
  const openwam::Decision d = openwam::decide(call, settings);
  py::dict out;
  out["route"] = openwam::to_string(d.route);
  out["backend"] = d.route == openwam::Route::kCudnn ? "cudnn" : "pytorch";
  out["pytorch_choice"] = d.pytorch_choice;
  out["plan"] = d.plan.to_string();
  out["engine"] = engine_of(d);
  out["rule"] = d.rule == nullptr ? "" : d.rule->name;
  out["reason"] = d.reason;
  out["differentiated"] = call.differentiated();
  out["settings"] = settings_dict(settings);
  out["cudnn_runtime"] = openwam::runtime_cudnn_version();
  return out;
}

py::list guard_rules() {
  py::list rules;
  for (const auto& r : openwam::guard_rules()) {
    py::dict d;
    d["name"] = r.name;
    d["versions"] = r.versions_text;
    d["first_version"] = r.versions.first;
    d["end_version"] = r.versions.end;  // exclusive
    d["measured_first_version"] = r.measured.first;
    d["measured_end_version"] = r.measured.end;  // exclusive; equal: nothing measured
    d["layout"] = openwam::ragged_layout_rule(r) ? "ragged" : "dense";
    d["defect"] = r.defect;
    d["action"] = r.action;
    d["source"] = r.source;
    rules.append(d);
  }
  return rules;
}

// The names of every guard rule whose versions hold `cudnn_version` and whose
// condition the call's shape meets, in table order: what the table says of a
// differentiated cuDNN call on a cuDNN that need not be loaded here (explain's
// answer for the cuDNN a torch ships, on a machine without a GPU).
py::dict guard_hits(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const std::optional<at::Tensor>& attn_mask, double dropout_p,
                    bool is_causal, std::optional<double> scale, bool enable_gqa,
                    long cudnn_version) {
  const openwam::SdpaCall call{query, key, value, attn_mask, dropout_p,
                               is_causal, scale, enable_gqa};
  py::dict hits;
  py::list names;
  // Only a call that runs the training forward takes a plan (with dropout
  // too, without gradients: SdpaCall::takes_training_forward says why).
  hits["planned"] = call.takes_training_forward();
  hits["rules"] = names;
  // What the cuDNN path refuses (fp32, head_dim 100, dropout with one query
  // row...) goes to PyTorch on a GPU, with no plan and no rule.
  const char* rejected = openwam::cudnn_rejects(call);
  hits["cudnn_rejects"] = rejected != nullptr ? py::object(py::str(rejected)) : py::none();
  if (!call.takes_training_forward() || rejected != nullptr) {
    return hits;
  }
  for (const openwam::GuardRule* rule :
       openwam::rules_covering(openwam::shape_of(call), cudnn_version)) {
    names.append(rule->name);
  }
  return hits;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "openwam_sdpa C++ extension: registers torch.ops.openwam.*";
  m.def("sdpa", &sdpa, "openwam::sdpa for plain tensors (see ops.py).");
  m.def("build_info", &build_info,
        "Versions this extension was built against and the loaded cuDNN.");
  m.def("explain", &explain, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("attn_mask") = py::none(), py::arg("dropout_p") = 0.0,
        py::arg("is_causal") = false, py::arg("scale") = py::none(),
        py::arg("enable_gqa") = false,
        "The route and fix plan openwam::sdpa would use for this call.");
  m.def("guard_rules", &guard_rules, "The guard table of known cuDNN defects.");
  m.def("guard_hits", &guard_hits, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("attn_mask"), py::arg("dropout_p"), py::arg("is_causal"), py::arg("scale"),
        py::arg("enable_gqa"), py::arg("cudnn_version"),
        "{'planned': whether the call takes a fix plan (with gradients or dropout), "
        "'cudnn_rejects': why the cuDNN path cannot take it (None if it can), "
        "'rules': the guard rules that then cover it on this cuDNN version}.");
  m.def("key_tail_defect", &openwam::key_tail_defect, py::arg("cudnn_version"),
        py::arg("s_kv"), py::arg("head_dim"), py::arg("is_causal") = false,
        "Whether the guard table marks this cuDNN version and key length as "
        "hit by the key-tail dQ NaN defect.");
  m.def("settings", [] { return settings_dict(openwam::current_settings()); },
        "The settings in force (read from the environment once, cached).");
  m.def("reload_settings", [] { return settings_dict(openwam::reload_settings()); },
        "Re-read the OPENWAM_SDPA_* environment variables.");
  m.def("frontend_stats", &frontend_stats, py::arg("reset") = false,
        "Counters of the cuDNN frontend path (host only: never synchronises).");
  m.def("clear_graph_cache", [] {
#ifdef OPENWAM_WITH_CUDNN_FRONTEND
    openwam::frontend::clear_graph_cache();
#endif
  }, "Drop every cached cuDNN graph (the next call of each shape builds anew).");
  m.def("_copy_along",
        [](const at::Tensor& dst, const at::Tensor& src, int64_t dim, double fill) {
          return openwam::copy_along(dst, src, dim, fill);
        },
        py::arg("dst"), py::arg("src"), py::arg("dim"), py::arg("fill"),
        "For tests: the K/V shim's padded copy (row_copy.h), dst written in place; "
        "whether its kernel took the copy.");
}

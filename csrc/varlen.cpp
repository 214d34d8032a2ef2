// openwam::sdpa_varlen: its schemas, its argument checks and its entry point.
// The entry point is CompositeImplicitAutograd, like openwam::sdpa: it runs
// above autograd and, under torch.compile, is traced through, so that what
// lands in a graph is the engine it chose (the leaf op openwam::_sdpa_varlen,
// or the block-diagonal fallback's ATen ops), never the choice.
#include "varlen.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "guards.h"
#include "ops.h"
#include "varlen_backend.h"
#include "varlen_ops.h"

namespace openwam {

bool VarlenCall::differentiated() const {
  return at::GradMode::is_enabled() &&
         (query.requires_grad() || key.requires_grad() || value.requires_grad());
}

bool same_elements(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_same(b)) return true;
  // Two views of the same elements (e.g. a transformers batch's
  // cu_seq_lens_q and cu_seq_lens_k moved to the GPU as one tensor).
  return a.has_storage() && b.has_storage() && a.storage().is_alias_of(b.storage()) &&
         a.sym_storage_offset() == b.sym_storage_offset() && a.sym_sizes() == b.sym_sizes() &&
         a.sym_strides() == b.sym_strides();
}

bool VarlenCall::same_lengths() const { return same_elements(cu_seqlens_q, cu_seqlens_k); }

void check_varlen_arguments(const VarlenCall& c) {
  const at::Tensor& q = c.query;
  const at::Tensor& k = c.key;
  const at::Tensor& v = c.value;
  const char* op = "openwam::sdpa_varlen: ";
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"query", &q},
                                {"key", &k}, {"value", &v}}) {
    TORCH_CHECK(t->layout() == at::kStrided && !t->is_nested(), op, name,
                " must be a dense strided tensor");
    TORCH_CHECK(t->dim() == 3, op, name,
                " must be 3-D [total, heads, head_dim] (flash-attn's varlen layout), got ",
                t->dim(), "-D");
  }
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), op,
              "query must be a floating-point tensor, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
              "query, key and value must have the same dtype, got query ", q.scalar_type(),
              ", key ", k.scalar_type(), ", value ", v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), op,
              "query, key and value must be on the same device, got query ", q.device(),
              ", key ", k.device(), ", value ", v.device());
  TORCH_CHECK(k.sym_size(0) == v.sym_size(0), op,
              "key and value must have the same total length, got ", k.sym_size(0), " and ",
              v.sym_size(0));
  TORCH_CHECK(k.sym_size(1) == v.sym_size(1), op,
              "key and value must have the same number of heads, got ", k.sym_size(1),
              " and ", v.sym_size(1));
  TORCH_CHECK(k.sym_size(2) == q.sym_size(2), op, "key must have the same head_dim as query (",
              q.sym_size(2), "), got ", k.sym_size(2));
  const c10::SymInt& h = q.sym_size(1);
  const c10::SymInt& h_kv = k.sym_size(1);
  TORCH_CHECK(h_kv > 0, op, "key and value must have at least one head");
  // (with enable_gqa, 0 query heads had passed as a multiple of the key's
  // and the CPU reference divided by them: SIGFPE)
  TORCH_CHECK(h > 0, op, "query must have at least one head");
  if (c.enable_gqa) {
    TORCH_CHECK(h % h_kv == 0, op,
                "with enable_gqa=True the query's heads must be a multiple of the key's, got ",
                h, " query heads and ", h_kv, " key/value heads");
  } else {
    TORCH_CHECK(h == h_kv, op, "query has ", h, " heads and key/value ", h_kv,
                "; pass enable_gqa=True for grouped-query attention");
  }
  for (const auto& [name, cu] :
       {std::pair<const char*, const at::Tensor*>{"cu_seqlens_q", &c.cu_seqlens_q},
        {"cu_seqlens_k", &c.cu_seqlens_k}}) {
    TORCH_CHECK(cu->scalar_type() == at::kInt, op, name,
                " must be int32 (flash-attn's convention), got ", cu->scalar_type());
    TORCH_CHECK(cu->dim() == 1, op, name, " must be 1-D [batch + 1], got ", cu->dim(), "-D");
    TORCH_CHECK(cu->sym_size(0) >= 1, op, name,
                " must hold at least one offset (batch + 1 values), got none");
    TORCH_CHECK(cu->device() == q.device(), op, name, " must be on the query's device (",
                q.device(), "), got ", cu->device());
  }
  TORCH_CHECK(c.cu_seqlens_q.sym_size(0) == c.cu_seqlens_k.sym_size(0), op,
              "cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got ",
              c.cu_seqlens_q.sym_size(0), " and ", c.cu_seqlens_k.sym_size(0));
  // A runtime assert, not a guard, where a traced max_seqlen is read from the
  // data (cu_seqlens.diff().max().item() under torch.compile).
  TORCH_SYM_CHECK(c.max_seqlen_q.sym_ge(0).sym_and(c.max_seqlen_k.sym_ge(0)), op,
                  "max_seqlen_q and max_seqlen_k must not be negative, got ", c.max_seqlen_q,
                  " and ", c.max_seqlen_k);
  TORCH_CHECK(c.dropout_p >= 0.0 && c.dropout_p < 1.0, op,
              "dropout_p must be in [0, 1), got ", c.dropout_p);
  if (c.is_causal && c.same_lengths()) {
    TORCH_CHECK(q.sym_size(0) == k.sym_size(0), op,
                "cu_seqlens_q and cu_seqlens_k are one tensor but query and key differ in "
                "total length (", q.sym_size(0), " and ", k.sym_size(0), ")");
  }
}

void check_varlen_lengths(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                          int64_t total_q, int64_t total_k, int64_t max_seqlen_q,
                          int64_t max_seqlen_k) {
  TORCH_INTERNAL_ASSERT(cu_seqlens_q.device().is_cpu() && cu_seqlens_k.device().is_cpu());
  const char* op = "openwam::sdpa_varlen: ";
  for (const auto& [name, cu, total, max_len] :
       {std::tuple<const char*, const at::Tensor*, int64_t, int64_t>{
            "cu_seqlens_q", &cu_seqlens_q, total_q, max_seqlen_q},
        {"cu_seqlens_k", &cu_seqlens_k, total_k, max_seqlen_k}}) {
    const at::Tensor values = cu->contiguous();
    const int32_t* p = values.data_ptr<int32_t>();
    const int64_t n = values.numel();
    TORCH_CHECK(p[0] == 0, op, name, "[0] must be 0, got ", p[0]);
    for (int64_t i = 1; i < n; ++i) {
      TORCH_CHECK(p[i] >= p[i - 1], op, name, " must not decrease, got ", p[i - 1], " then ",
                  p[i], " at ", i);
      TORCH_CHECK(p[i] - p[i - 1] <= max_len, op, "sequence ", i - 1, " has ",
                  p[i] - p[i - 1], " tokens by ", name, ", more than the max_seqlen given (",
                  max_len, ")");
    }
    TORCH_CHECK(p[n - 1] == total, op, name, "[-1] must be the total length (", total,
                "), got ", p[n - 1]);
  }
}

namespace {

// The packed batch as one sequence with a block-diagonal (and, with
// is_causal, per-sequence top-left causal) mask, through openwam::sdpa:
// what neither fused engine serves (fp32 on CUDA, head_dim over 256, causal
// calls with distinct cu_seqlens). O(total_q * total_k) memory. A query row
// that sees no key (its sequence has no keys) gets zero output and zero
// gradient, as F.sdpa gives a sequence without keys.
at::Tensor block_diagonal(const VarlenCall& c) {
  if (c.query.sym_numel() == 0 || c.key.sym_numel() == 0) {
    // No query or no key at all: zero output (F.sdpa over no keys), still
    // connected to the inputs so that their gradients are zeros, not absent.
    // Each input's part is a sum over none of its elements: exactly 0, where
    // its whole sum times 0 was NaN once the sum overflowed (fp16) or an
    // input held inf.
    // (narrow, not flatten: torch 2.13's DTensor loops forever flattening an
    // empty tensor)
    const auto zero = [](const at::Tensor& t) { return t.narrow(0, 0, 0).sum(); };
    const at::Tensor none = zero(c.query) + zero(c.key) + zero(c.value);
    return at::zeros_symint({c.query.sym_size(0), c.query.sym_size(1), c.value.sym_size(2)},
                            c.query.options()) + none.to(c.query.scalar_type());
  }
  const auto index = c.cu_seqlens_q.options().dtype(at::kLong);
  const auto segments = [&](const at::Tensor& cu, const c10::SymInt& total) {
    const at::Tensor pos = at::arange(c10::Scalar(total), index);
    const at::Tensor seq = at::searchsorted(cu, pos.to(at::kInt), /*out_int32=*/false,
                                            /*right=*/true) - 1;
    return std::make_pair(seq, pos - cu.to(at::kLong).index_select(0, seq.clamp_min(0)));
  };
  const auto [seq_q, pos_q] = segments(c.cu_seqlens_q, c.query.sym_size(0));
  const auto [seq_k, pos_k] = segments(c.cu_seqlens_k, c.key.sym_size(0));
  at::Tensor mask = seq_q.unsqueeze(1).eq(seq_k.unsqueeze(0));
  if (c.is_causal) {
    mask = mask.logical_and(pos_k.unsqueeze(0).le(pos_q.unsqueeze(1)));
  }
  const at::Tensor keyless = mask.any(1).logical_not();
  // Keyless rows see every key instead: finite scores, so no NaN reaches the
  // backward; their output (and with it their gradient) is zeroed below.
  mask = mask.logical_or(keyless.unsqueeze(1));
  const auto as_bhsd = [](const at::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); };
  at::Tensor out = ops::sdpa().call(as_bhsd(c.query), as_bhsd(c.key), as_bhsd(c.value),
                                    mask.unsqueeze(0).unsqueeze(0), c.dropout_p,
                                    /*is_causal=*/false, c.scale, c.enable_gqa);
  out = out.squeeze(0).transpose(0, 1);
  return out.masked_fill(keyless.view({-1, 1, 1}), 0);
}

// Whether the offsets can be read here: plain CPU tensors of a call with
// concrete sizes (not fake or functional tensors a tracer holds).
bool offsets_on_host(const VarlenCall& c) {
  const c10::DispatchKeySet traced({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
  for (const at::Tensor* cu : {&c.cu_seqlens_q, &c.cu_seqlens_k}) {
    if (!cu->device().is_cpu() || cu->key_set().has_any(traced)) {
      return false;
    }
  }
  return !c.query.sym_size(0).is_symbolic() && !c.key.sym_size(0).is_symbolic() &&
         !c.max_seqlen_q.is_symbolic() && !c.max_seqlen_k.is_symbolic();
}

// Under a tracer on the CPU (torch.compile of a block-diagonal call): the
// checks of check_varlen_lengths as asserts the compiled graph runs, as the
// offsets have no values yet. aten::_assert_async raises RuntimeError on the
// CPU; its message cannot carry the offending values, so it says where to find
// them. Not on CUDA: there a failed assert is a device-side abort.
void assert_varlen_lengths(const VarlenCall& c) {
  const auto lengths = [](const char* name, const at::Tensor& cu, const c10::SymInt& total,
                          const c10::SymInt& max_len) {
    const std::string where = std::string("openwam::sdpa_varlen: ") + name;
    const std::string replay = " (checked in the compiled graph; an eager call names the values)";
    const at::Tensor offsets = cu.to(at::kLong);
    // Each offset less the one before, 0 for the first: of the offsets' own length, where
    // diff()'s n - 1 made a one-sequence batch compile a graph of its own.
    const at::Tensor first = at::arange(c10::Scalar(offsets.sym_size(0)), offsets.options()).eq(0);
    const at::Tensor steps = (offsets - offsets.roll(1)).masked_fill(first, 0);
    at::_assert_async(offsets.select(0, 0).eq(0), where + "[0] must be 0" + replay);
    at::_assert_async(steps.ge(0).all(), where + " must not decrease" + replay);
    at::_assert_async(steps.le(c10::Scalar(max_len)).all(),
                      where + ": a sequence has more tokens than the max_seqlen given" + replay);
    at::_assert_async(offsets.select(0, -1).eq(c10::Scalar(total)),
                      where + "[-1] must be the total length" + replay);
  };
  lengths("cu_seqlens_q", c.cu_seqlens_q, c.query.sym_size(0), c.max_seqlen_q);
  lengths("cu_seqlens_k", c.cu_seqlens_k, c.key.sym_size(0), c.max_seqlen_k);
}

at::Tensor sdpa_varlen(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                       c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, bool is_causal,
                       std::optional<double> scale, double dropout_p, bool enable_gqa) {
  const VarlenCall call{query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, is_causal, scale, dropout_p, enable_gqa};
  check_varlen_arguments(call);
  const VarlenDecision d = decide_varlen(call);
  if (d.rule != nullptr) {
    warn_once(*d.rule);
  }
  if (d.backend == VarlenBackend::kBlockDiagonal) {
    if (offsets_on_host(call)) {
      // As the CPU reference checks them (OPENWAM_SDPA_VARLEN=block_diagonal
      // on the CPU had run bad offsets). On CUDA reading them would be a host
      // sync; under a tracer they have no values.
      check_varlen_lengths(cu_seqlens_q, cu_seqlens_k, query.size(0), key.size(0),
                           max_seqlen_q.expect_int(), max_seqlen_k.expect_int());
    } else if (cu_seqlens_q.device().is_cpu()) {
      assert_varlen_lengths(call);
    }
    return block_diagonal(call);
  }
  return std::get<0>(ops::sdpa_varlen_forward().call(
      query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
      is_causal, scale, static_cast<int64_t>(d.backend), call.takes_training_forward()));
}

// Autocast: as openwam::sdpa (F.sdpa is on autocast's lower-precision list).
template <c10::DeviceType device_type>
at::Tensor sdpa_varlen_autocast(const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const at::Tensor& cu_seqlens_q,
                                const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q,
                                c10::SymInt max_seqlen_k, bool is_causal,
                                std::optional<double> scale, double dropout_p,
                                bool enable_gqa) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  const at::ScalarType to = at::autocast::get_lower_precision_fp_from_device_type(device_type);
  return ops::sdpa_varlen().call(at::autocast::cached_cast(to, query, device_type),
                                 at::autocast::cached_cast(to, key, device_type),
                                 at::autocast::cached_cast(to, value, device_type),
                                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 is_causal, scale, dropout_p, enable_gqa);
}

// explain_varlen(): the decision in words, from the same decide_varlen().
std::tuple<std::string, std::string, std::string, std::string, std::string, std::string>
explain_varlen(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
               c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, bool is_causal,
               std::optional<double> scale, double dropout_p, bool enable_gqa) {
  const VarlenCall call{query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, is_causal, scale, dropout_p, enable_gqa};
  check_varlen_arguments(call);
  const VarlenDecision d = decide_varlen(call);
  const char* flash_no = flash_varlen_rejects(call);
  const char* cudnn_no = cudnn_ragged_rejects(call);
  std::string rule = d.rule == nullptr ? "" : d.rule->name;
  if (d.rule_overridden) rule += " (overridden by OPENWAM_SDPA_VARLEN=cudnn)";
  return {to_string(d.backend), d.reason, rule, to_string(varlen_preference()),
          flash_no == nullptr ? "" : flash_no, cudnn_no == nullptr ? "" : cudnn_no};
}

std::string reload_varlen_settings() { return to_string(reload_varlen_preference()); }
std::string varlen_settings() { return to_string(varlen_preference()); }

}  // namespace
}  // namespace openwam

TORCH_LIBRARY_FRAGMENT(openwam, m) {
  // Padding-free attention over packed sequences (flash-attn's varlen API).
  m.def(
      "sdpa_varlen(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, *, "
      "bool is_causal=False, float? scale=None, float dropout_p=0.0, "
      "bool enable_gqa=False) -> Tensor");
  // Its leaf ops (torch.compile keeps them whole): `backend` is a
  // VarlenBackend; logsumexp and the rng state are laid out as the engine
  // gives them (the Meta kernel knows each). Without compute_log_sumexp (a
  // call nothing will differentiate) the logsumexp is empty and cuDNN's
  // ragged engine runs its inference graph (no statistics, no backward graph
  // prepared). Seeded, as openwam::_cudnn_sdpa (registration.cpp says why).
  m.def(
      "_sdpa_varlen(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, "
      "bool is_causal, float? scale, int backend, bool compute_log_sumexp=True) -> "
      "(Tensor out, Tensor logsumexp, Tensor rng_state, Tensor rng_offset)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "_sdpa_varlen_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
      "Tensor out, Tensor logsumexp, Tensor rng_state, Tensor rng_offset, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
      "float dropout_p, bool is_causal, float? scale, int backend) -> (Tensor grad_query, "
      "Tensor grad_key, Tensor grad_value)");
  // explain_varlen() and the OPENWAM_SDPA_VARLEN setting, for Python.
  m.def(
      "_sdpa_varlen_explain(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, bool is_causal, "
      "float? scale, float dropout_p, bool enable_gqa) -> (str backend, str reason, "
      "str rule, str setting, str flash_rejects, str cudnn_rejects)");
  m.def("_sdpa_varlen_settings(bool reload) -> str", [](bool reload) {
    return reload ? openwam::reload_varlen_settings() : openwam::varlen_settings();
  });
}

TORCH_LIBRARY_IMPL(openwam, CompositeImplicitAutograd, m) {
  m.impl("sdpa_varlen", &openwam::sdpa_varlen);
  m.impl("_sdpa_varlen_explain", &openwam::explain_varlen);
}
TORCH_LIBRARY_IMPL(openwam, AutocastCUDA, m) {
  m.impl("sdpa_varlen", &openwam::sdpa_varlen_autocast<c10::DeviceType::CUDA>);
}
TORCH_LIBRARY_IMPL(openwam, AutocastCPU, m) {
  m.impl("sdpa_varlen", &openwam::sdpa_varlen_autocast<c10::DeviceType::CPU>);
}

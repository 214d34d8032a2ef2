"""Python entry points: thin wrappers over the ops the C++ library registers."""

import sys
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from . import _arguments, _compile_cache
from ._extension import _C
from . import distributed

# Bound at import, before patch() can replace it: the inputs the op does not
# serve itself go here.
_PYTORCH_SDPA = F.scaled_dot_product_attention
_SDPA_OP = torch.ops.openwam.sdpa.default
_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling
_handle_torch_function = torch.overrides.handle_torch_function
_has_torch_function = torch.overrides.has_torch_function
_torch_function_mode_on = torch._C._is_torch_function_mode_enabled


# The defaults and catch-alls of query, key, value, *extra and **unknown only
# mark a call that misses an argument, passes too many or an unknown keyword:
# it goes to F.sdpa, whose parser words the error (as Python's own binding
# would not). __signature__ below is F.sdpa's.
_REQUIRED = _arguments.REQUIRED


def sdpa(
    query: torch.Tensor = _REQUIRED,
    key: torch.Tensor = _REQUIRED,
    value: torch.Tensor = _REQUIRED,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *extra,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    **unknown,
) -> torch.Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention.

    Same arguments, results and errors. Calls that run on cuDNN carry the fix
    for its backward defects (see README); everything else is PyTorch's own
    implementation. Nested tensors and torch.nn.attention.bias masks go to
    PyTorch's function as they are, so their own handling applies.
    """
    if value is _REQUIRED or key is _REQUIRED or query is _REQUIRED or extra or unknown:
        return _arguments.call_misbound(_PYTORCH_SDPA, query, key, value, attn_mask, dropout_p,
                                        is_causal, extra, scale, enable_gqa, unknown)
    if not (type(dropout_p) is float and type(is_causal) is bool and type(enable_gqa) is bool
            and (scale is None or type(scale) is float)):
        # An int dropout_p, a NumPy scale...: the op's types, as F.sdpa reads
        # them. What F.sdpa rejects goes to it for its TypeError (and what
        # this reading of its parser missed, it serves itself).
        floats = _arguments.scalars(dropout_p, is_causal, scale, enable_gqa)
        if floats is None:
            return _PYTORCH_SDPA(query, key, value, attn_mask=attn_mask, **_arguments.keywords(
                dropout_p, is_causal, scale, enable_gqa))
        dropout_p, scale = floats
    if (type(query) is _Tensor and type(key) is _Tensor and type(value) is _Tensor
            and (attn_mask is None or type(attn_mask) is _Tensor) and not _compiling()
            and not query.is_nested and not _torch_function_mode_on()):
        # Plain tensors (the common case, checked first: this runs on every
        # call): one pybind call into the dispatcher.
        _refuse_context_parallel_wrapper()
        return _C.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is not None and type(attn_mask) is not _Tensor and _is_causal_bias(attn_mask):
        # torch.nn.attention.bias masks override F.sdpa through
        # __torch_function__, recognising it as whatever
        # F.scaled_dot_product_attention is now (patched or not).
        return _handle_torch_function(
            F.scaled_dot_product_attention, (query, key, value, attn_mask),
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if not isinstance(query, _Tensor) and _has_torch_function((query, key, value, attn_mask)):
        # torch.fx's Proxy (symbolic_trace, Hugging Face's fx tracing): a node
        # that calls this function. F.sdpa's own would record PyTorch's,
        # without the fix (found in review).
        return _handle_torch_function(
            sdpa, (query, key, value, attn_mask), query, key, value, attn_mask=attn_mask,
            dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if not isinstance(query, _Tensor) or any(
            isinstance(t, _Tensor) and t.is_nested for t in (query, key, value, attn_mask)):
        # Nested (jagged) tensors have kernels of their own behind PyTorch's
        # builtin, and its errors for a nested key, value or mask beside a
        # dense query; what is no tensor at all gets its TypeError there
        # (worded as below).
        return _PYTORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if not (isinstance(key, _Tensor) and isinstance(value, _Tensor)
            and (attn_mask is None or isinstance(attn_mask, _Tensor))):
        # Its TypeError, worded for query, key and value by position and
        # attn_mask by keyword, as they are commonly passed (whether this
        # caller did cannot be seen from here).
        return _PYTORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    # Tracers (torch.compile, torch.export, make_fx), tensor subclasses such
    # as DTensor, and __torch_function__ modes: the op through torch.ops.
    if type(query) is _Tensor and not _compiling():
        _refuse_context_parallel_wrapper()  # under a mode: torch.device("cuda")
    if distributed.DTENSOR_MODULE in sys.modules:
        distributed.refuse_under_context_parallel(query, key, value, lambda: _C.explain(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)["backend"])
    return _SDPA_OP(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _refuse_context_parallel_wrapper() -> None:
    """A plain-tensor call under context_parallel's monkey-patch mode would
    bypass its sequence sharding: its wrapper then stands in F.sdpa
    (unpatched, F holds PyTorch's own). DTensor calls, which the wrapper
    makes, are distributed.refuse_under_context_parallel's."""
    current = F.scaled_dot_product_attention
    if current is not _PYTORCH_SDPA:  # unpatched and no context_parallel: nothing to look up
        distributed.refuse_context_parallel_wrapper(current)


sdpa.__signature__ = _arguments.SIGNATURE
# torch.jit.script resolves a call of sdpa by identity, as it does F.sdpa:
# the op, whose schema is F.sdpa's (its Python body, with **unknown, does not
# script). patching.py does the same for the patched F.sdpa.
torch.jit._builtins._register_builtin(sdpa, "openwam::sdpa")


def _is_causal_bias(mask) -> bool:
    # Without torch.nn.attention.bias imported there is no such mask, and
    # importing it here would cost `import openwam_sdpa` seconds (it loads
    # torch._dynamo).
    bias = sys.modules.get("torch.nn.attention.bias")
    return bias is not None and isinstance(mask, bias.CausalBias)


def pad_keys(
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    multiple: int = 128,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero keys/values up to a multiple of `multiple`, hidden by the mask.

    Returns (key, value, mask): the mask is False (bool) or -inf (additive) on
    the padded keys; with no mask, a new bool key-padding mask [1, S_padded].
    Attention over the result equals attention over the inputs.
    """
    return torch.ops.openwam.pad_keys(key, value, attn_mask, multiple)


def explain(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> dict:
    """What sdpa() would do with these inputs: route, backend, plan, guard rule.
    F.sdpa's arguments, or the op's (all eight by position, as
    torch.ops.openwam.sdpa takes them). Inputs the op hands to PyTorch are
    explained as such, not checked: F.sdpa's error for them comes from the
    call itself."""
    floats = _arguments.scalars(dropout_p, is_causal, scale, enable_gqa)
    if floats is None or not all(isinstance(t, _Tensor) for t in (query, key, value)) or not (
            attn_mask is None or isinstance(attn_mask, _Tensor)):
        # F.sdpa raises its TypeError for these (pybind's would print the tensors).
        _PYTORCH_SDPA(query, key, value, attn_mask,
                      **_arguments.keywords(dropout_p, is_causal, scale, enable_gqa))
        raise TypeError("explain() takes the arguments of F.scaled_dot_product_attention "
                        "as tensors, floats and bools")
    dropout_p, scale = floats
    return _C.explain(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def settings() -> dict:
    """The dense op's OPENWAM_SDPA_* settings in force (CUDNN, PAD, FRONTEND,
    CHECK_FINITE): read from the environment once, at the first call, and
    cached. varlen_sdpa's engine setting, OPENWAM_SDPA_VARLEN, is in
    varlen_settings(); OPENWAM_SDPA_UNPAD is read per call by the transformers
    integration."""
    return _C.settings()


def reload_settings() -> dict:
    """Re-read the OPENWAM_SDPA_* environment variables (after changing
    os.environ), OPENWAM_SDPA_VARLEN included; returns the dense op's new
    settings (varlen_settings() shows OPENWAM_SDPA_VARLEN's). A bad
    value raises here, and every call raises until it is fixed. Reload between
    steps, not between a forward and its backward. A graph that torch.compile
    traced before keeps the route and plan it was traced with (OPENWAM_SDPA_CUDNN,
    _PAD, _VARLEN): call torch._dynamo.reset() too (torch.compile's on-disk caches
    key their graphs on these settings, and miss); _FRONTEND and _CHECK_FINITE are
    read as the kernels run."""
    settings = _C.reload_settings()
    torch.ops.openwam._sdpa_varlen_settings(True)
    _compile_cache.retag_settings()
    return settings


def frontend_stats(reset: bool = False) -> dict:
    """Counters of the op's cuDNN graphs: graphs built (forward, backward),
    configurations that could not be built (each such call runs on ATen's
    cuDNN attention with padded inputs; the list names the first 64), graphs
    evicted from the cache, calls that took that fallback, backward calls
    that ran with cuDNN's padding mask (the fix without a bool mask), those of
    them that wrote the mask's lengths for the call alone (a new configuration
    inside a CUDA-graph capture, or the device's table of lengths full;
    otherwise a configuration writes them once), and calls whose backward
    runs on shifted scores (a bool mask's fix; counted where the shift runs:
    a key mask's in its training forward, any other mask's in the backward).
    Host counters: reading them
    never synchronises; a CUDA graph replay counts nothing. reset=True zeroes
    them (not the list)."""
    return _C.frontend_stats(reset)


def clear_graph_cache() -> None:
    """Drop every cached cuDNN graph: the next call of each configuration
    builds its graphs again (for measuring the first call of a shape)."""
    _C.clear_graph_cache()


def build_info() -> dict:
    """torch version built against, CUDA support, compiled/runtime cuDNN."""
    return _C.build_info()


def guard_rules() -> list:
    """The guard table of known cuDNN attention defects (name, versions, ...)."""
    return _C.guard_rules()


def key_tail_defect(
    cudnn_version: int, s_kv: int, head_dim: int, is_causal: bool = False
) -> bool:
    """Whether the guard table marks this cuDNN version / key length affected.
    cudnn_version is cuDNN's encoding, as torch.backends.cudnn.version() gives
    it: 91900 for 9.19.0."""
    return _C.key_tail_defect(cudnn_version, s_kv, head_dim, is_causal)

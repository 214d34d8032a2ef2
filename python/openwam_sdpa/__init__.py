"""openwam_sdpa: cuDNN SDPA without the backward NaN.

`import openwam_sdpa` registers torch.ops.openwam.sdpa, a drop-in for
torch.nn.functional.scaled_dot_product_attention. See README.md.
"""

from . import adversarial
from ._extension import _C  # noqa: F401  (loads and registers the ops)
from ._compile_cache import tag_compile_caches as _tag_compile_caches
from . import distributed  # noqa: F401  (DTensor sharding rules of the cuDNN path's leaf ops)
from .ops import (build_info, clear_graph_cache, explain, frontend_stats, guard_rules,
                  key_tail_defect, pad_keys, reload_settings, sdpa, settings)
from .patching import is_patched, patch, patched, unpatch
from .transformers_integration import register_when_imported as _register_transformers
from .varlen import explain_varlen, varlen_sdpa, varlen_settings

__version__ = "0.2.0"

# torch.compile's cached graphs are this build's own (_compile_cache.py says why).
_tag_compile_caches(_C.__file__)

# "openwam_sdpa" as a transformers attn_implementation, once transformers is imported.
_register_transformers()

__all__ = [
    "sdpa",
    "pad_keys",
    "explain",
    "settings",
    "reload_settings",
    "frontend_stats",
    "clear_graph_cache",
    "build_info",
    "guard_rules",
    "key_tail_defect",
    "patch",
    "unpatch",
    "patched",
    "is_patched",
    "adversarial",
    "varlen_sdpa",
    "explain_varlen",
    "varlen_settings",
]

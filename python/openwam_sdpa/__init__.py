"""openwam_sdpa: cuDNN SDPA without the key-tail NaN in dQ.

`import openwam_sdpa` registers torch.ops.openwam.sdpa, a drop-in for
torch.nn.functional.scaled_dot_product_attention. See README.md.
"""

from ._extension import _C  # noqa: F401  (loads and registers the ops)
from .ops import build_info, explain, guard_rules, key_tail_defect, pad_keys, sdpa
from .patching import is_patched, patch, patched, unpatch
from .transformers_integration import register as _register_transformers

__version__ = "0.1.0"

# "openwam_sdpa" as a transformers attn_implementation, when transformers is there.
_register_transformers()

__all__ = [
    "sdpa",
    "pad_keys",
    "explain",
    "build_info",
    "guard_rules",
    "key_tail_defect",
    "patch",
    "unpatch",
    "patched",
    "is_patched",
]

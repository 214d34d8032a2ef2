"""Registers "openwam_sdpa" as a Hugging Face transformers attention backend.

`AutoModel.from_pretrained(..., attn_implementation="openwam_sdpa")` then
runs transformers' own "sdpa" attention and mask code with the op in place of
F.scaled_dot_product_attention. Registered when transformers is imported
(`import openwam_sdpa` does not import it: that would cost seconds).
"""

import importlib.util

from ._import_hooks import after_import
from .patching import patch

NAME = "openwam_sdpa"


def register() -> bool:
    """Register the backend; False when transformers is not installed."""
    if importlib.util.find_spec("transformers") is None:
        return False
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False

    def openwam_attention_forward(module, query, key, value, attention_mask, **kwargs):
        # transformers' "sdpa" attention, which calls
        # F.scaled_dot_product_attention, with the op patched in for the call.
        with patch():
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(NAME, openwam_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return True


def register_when_imported() -> None:
    if importlib.util.find_spec("transformers") is not None:
        after_import("transformers", register)

"""Route existing code's F.scaled_dot_product_attention calls through the op.

`patch()` replaces torch.nn.functional.scaled_dot_product_attention, which is
what custom models, nn.MultiheadAttention's non-fast path and Hugging Face
transformers' "sdpa" attention call. Code that bound the function to a name of
its own before patch() (`from torch.nn.functional import ...`) keeps the
original. The switch is process-wide, like torch's own backend switches.
"""

import contextlib
import functools

import torch
import torch.nn.functional as F

from .ops import sdpa

_ORIGINAL = F.scaled_dot_product_attention


@functools.wraps(_ORIGINAL)
def _patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0,
                  is_causal=False, scale=None, enable_gqa=False):
    # The op does not differentiate a mask (learned relative-position biases
    # do need it): such calls keep PyTorch's own implementation.
    if isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad:
        return _ORIGINAL(query, key, value, attn_mask, dropout_p, is_causal,
                         scale=scale, enable_gqa=enable_gqa)
    return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale,
                enable_gqa)


def patch() -> None:
    """Send torch.nn.functional.scaled_dot_product_attention to openwam_sdpa."""
    F.scaled_dot_product_attention = _patched_sdpa


def unpatch() -> None:
    """Restore PyTorch's own scaled_dot_product_attention."""
    F.scaled_dot_product_attention = _ORIGINAL


def is_patched() -> bool:
    return F.scaled_dot_product_attention is _patched_sdpa


@contextlib.contextmanager
def patched():
    """`with openwam_sdpa.patched(): ...` patches for the block, then restores."""
    was_patched = is_patched()
    patch()
    try:
        yield
    finally:
        if not was_patched:
            unpatch()

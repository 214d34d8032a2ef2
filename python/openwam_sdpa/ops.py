"""Python entry points: thin wrappers over the ops the C++ library registers."""

from typing import Optional, Tuple

import torch

from ._extension import _C

# The resolved overload, not the packet: torch.ops.openwam.sdpa(...) picks its
# overload on every call, a few microseconds of host time per attention call
# (measured on CPU, torch 2.13) that a short cuDNN forward does not hide.
_SDPA = torch.ops.openwam.sdpa.default


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention.

    Same arguments and result. Calls that run on cuDNN go through the padding
    shim / dQ repair, so their gradients carry no NaN from cuDNN's key-tail
    defect. Settings: OPENWAM_SDPA_CUDNN, OPENWAM_SDPA_PAD (see README).
    """
    return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


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
    """What sdpa() would do with these inputs: backend, plan, guard rule."""
    return _C.explain(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    )


def build_info() -> dict:
    """torch version built against, CUDA support, compiled/runtime cuDNN."""
    return _C.build_info()


def guard_rules() -> list:
    """The guard table of known cuDNN attention defects (name, versions, ...)."""
    return _C.guard_rules()


def key_tail_defect(
    cudnn_version: int, s_kv: int, head_dim: int, is_causal: bool = False
) -> bool:
    """Whether the guard table marks this cuDNN version / key length affected."""
    return _C.key_tail_defect(cudnn_version, s_kv, head_dim, is_causal)

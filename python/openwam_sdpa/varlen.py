"""Padding-free attention over packed sequences: thin wrappers over
torch.ops.openwam.sdpa_varlen (csrc/varlen*.cpp) and its helpers.

The layout is flash-attn's varlen one: the sequences of a batch lie back to
back, query [total_q, H, E], key/value [total_k, H_kv, E], and int32
cu_seqlens [B + 1] hold where each sequence starts (cu[0] == 0, cu[B] == total).
"""

import operator
from typing import Optional, Sequence, Tuple

import torch

from . import _arguments
from . import varlen_distributed  # (and the DTensor rules of the leaf ops)
from ._extension import _C  # noqa: F401  (registers the ops)

_OP = torch.ops.openwam.sdpa_varlen.default
_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling


def _parsed(function, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, is_causal, scale, dropout_p, enable_gqa):
    """The arguments as the op takes them, read as F.sdpa's parser reads
    arguments of their types. torch.ops' own binding is looser (None and 1
    pass as bools) and its errors quote the op's schema."""
    if (type(max_seqlen_q) is int and type(max_seqlen_k) is int
            # (a traced int is symbolic: its range is the tracer's to know)
            and (_compiling() or (max_seqlen_q in _arguments.INT64 and max_seqlen_k in _arguments.INT64))
            and type(is_causal) is bool
            and type(enable_gqa) is bool and type(dropout_p) is float
            and (scale is None or type(scale) is float)
            and all(type(t) is _Tensor for t in (query, key, value, cu_seqlens_q, cu_seqlens_k))):
        return (query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                is_causal, scale, dropout_p, enable_gqa)
    return _arguments.parse(function, (
        ("query", query, "Tensor"), ("key", key, "Tensor"), ("value", value, "Tensor"),
        ("cu_seqlens_q", cu_seqlens_q, "Tensor"), ("cu_seqlens_k", cu_seqlens_k, "Tensor"),
        ("max_seqlen_q", max_seqlen_q, "int"), ("max_seqlen_k", max_seqlen_k, "int"),
        ("is_causal", is_causal, "bool"), ("scale", scale, "float?"),
        ("dropout_p", dropout_p, "float"), ("enable_gqa", enable_gqa, "bool")))


def varlen_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention of each packed sequence over its own keys only.

    Equals F.scaled_dot_product_attention applied to every sequence alone
    (output [total_q, H, Ev]), without computing or storing anything for
    padding. ``max_seqlen_q/k`` must be at least the longest sequence: they
    are the caller's to know (flash-attn's convention; reading them from
    cu_seqlens would synchronise with the GPU). ``is_causal`` is aligned
    top-left per sequence, as F.sdpa's: query row i of a sequence sees its
    keys 0..i. Where a sequence's s_q != s_k that differs from flash-attn's
    bottom-right alignment, so FlashAttention-2 serves causal calls only where
    cu_seqlens_q and cu_seqlens_k are one tensor (every sequence square).

    The engine is chosen per call (explain_varlen() says which). On CUDA, for
    fp16/bf16: cuDNN's ragged layout on the op's own graphs (Hopper, head_dim
    a multiple of 16 up to 256) where the guard table lets it run (the cuDNN
    this project measured, at head_dim 64, 128 and 256 unless FlashAttention-2
    cannot serve), else ATen's FlashAttention-2 varlen (head_dim a
    multiple of 8 up to 256); otherwise openwam_sdpa.sdpa over the packed
    batch with a block-diagonal mask (O(total_q * total_k) memory). On the
    CPU an exact per-sequence reference; dropout_p > 0 raises there.

    Arguments of the wrong type raise F.sdpa's TypeError for them (is_causal
    must be a bool, max_seqlen_q an int, cu_seqlens_q a tensor...).
    """
    (query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
     scale, dropout_p, enable_gqa) = _parsed(
        "varlen_sdpa", query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, is_causal, scale, dropout_p, enable_gqa)
    if type(query) is not _Tensor and varlen_distributed.is_dtensor(query):
        out = varlen_distributed.block_diagonal_on_shards(
            query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            is_causal, scale, dropout_p, enable_gqa)
        if out is not None:
            return out
    return _OP(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               is_causal=is_causal, scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa)


def explain_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> dict:
    """What varlen_sdpa() would do with these inputs: the engine, why, the
    guard row involved, the setting, and why each fused engine would not
    serve ('' where it would). The same decision function as the op's; the
    checks of cu_seqlens' values (and the CPU's refusal of dropout) run in
    the call itself, so an answer here does not mean the call is valid."""
    (query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
     scale, dropout_p, enable_gqa) = _parsed(
        "explain_varlen", query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, is_causal, scale, dropout_p, enable_gqa)
    backend, reason, rule, setting, flash_no, cudnn_no = torch.ops.openwam._sdpa_varlen_explain(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
        scale, dropout_p, enable_gqa)
    return {"backend": backend, "reason": reason, "rule": rule,
            "settings": {"varlen": setting}, "flash_rejects": flash_no,
            "cudnn_rejects": cudnn_no}


def varlen_settings(reload: bool = False) -> dict:
    """OPENWAM_SDPA_VARLEN in force ('auto', 'flash', 'cudnn' or
    'block_diagonal'), read once and cached; reload=True re-reads the
    environment."""
    return {"varlen": torch.ops.openwam._sdpa_varlen_settings(reload)}


def cu_seqlens_from_lengths(lengths: Sequence[int], device=None) -> Tuple[torch.Tensor, int]:
    """(cu_seqlens int32 [B + 1], max_seqlen) for these sequence lengths:
    integers (Python or 0-dim tensors) >= 0 whose total fits int32, else
    TypeError or ValueError (on CUDA nothing checks the offsets later)."""
    lengths = [operator.index(n) for n in lengths]  # TypeError for 2.7, True stays 1
    if any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens_from_lengths: lengths must be >= 0, got {lengths}")
    if sum(lengths) > torch.iinfo(torch.int32).max:
        raise ValueError(f"cu_seqlens_from_lengths: the total length {sum(lengths)} does not "
                         f"fit cu_seqlens' int32")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return cu.to(device) if device is not None else cu, max(lengths, default=0)


def unpad(hidden: torch.Tensor, attention_mask: torch.Tensor):
    """A right- or left-padded batch [B, S, ...] with its bool/0-1 key mask
    [B, S] as packed rows [total, ...], with (indices, cu_seqlens, max_seqlen).
    Reads the mask on the host (one sync per batch, not per layer)."""
    keep = attention_mask.to(torch.bool)
    lengths = keep.sum(-1)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    packed = hidden.reshape(-1, *hidden.shape[2:]).index_select(0, indices)
    return packed, indices, cu, int(lengths.max().item()) if lengths.numel() else 0


def pad(packed: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of unpad(): rows back to [batch, seqlen, ...], zeros elsewhere."""
    out = packed.new_zeros((batch * seqlen,) + tuple(packed.shape[1:]))
    out = out.index_copy(0, indices, packed)
    return out.view(batch, seqlen, *packed.shape[1:])

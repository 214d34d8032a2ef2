"""Registers "openwam_sdpa" as a Hugging Face transformers attention backend.

`AutoModel.from_pretrained(..., attn_implementation="openwam_sdpa")` then
runs transformers' own "sdpa" attention and mask code with the op in place of
F.scaled_dot_product_attention. Registered when transformers is imported
(`import openwam_sdpa` does not import it: that would cost seconds).

Packed batches (padding-free training) run on openwam_sdpa.varlen_sdpa
instead, each sequence attending to itself only, without the dense
block-diagonal mask "sdpa" would use:
  - with the keyword arguments DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    gives (cu_seq_lens_q/k, max_length_q/k): no host sync;
  - with position_ids that restart at 0 (DataCollatorWithFlattening's
    default): the boundaries are read from them once per forward (one host
    sync). Unlike transformers' own backends, which look for packing only
    without a cache, this holds whatever use_cache says.
OPENWAM_SDPA_UNPAD=1 unpads a padded batch the same way (causal or
bidirectional full-attention layers; sliding-window layers keep the padded
path): the key padding is read from the mask once per forward (one host sync).
"""

import importlib.util
import os
import threading
import weakref

from ._import_hooks import after_import
from .patching import patched_while_inside

NAME = "openwam_sdpa"

# Keyword arguments whose semantics the varlen path does not implement: a call
# with any of them set takes transformers' "sdpa" path as before.
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias", "sliding_window")


def unpad_enabled() -> bool:
    """OPENWAM_SDPA_UNPAD=1: padded batches run padding-free (read per call:
    a Python string lookup per layer, nothing on the device)."""
    value = os.environ.get("OPENWAM_SDPA_UNPAD", "0")
    if value not in ("", "0", "1"):
        raise ValueError(f"OPENWAM_SDPA_UNPAD must be unset, '0' or '1', got {value!r}")
    return value == "1"


class _PerForward:
    """One result per forward for the tensor that every layer of it receives
    (the mask or the position_ids): computed at the forward's first layer,
    reused by the layers after it.

    A forward runs its layers in ascending `layer_idx`, so a call at a layer
    no later than the one that computed the result starts a new forward and
    computes afresh: a tensor refilled between forwards without a version
    bump (through .data, a numpy view, or an inference tensor, which has no
    version counter) is read again. Gradient checkpointing's recomputation
    (later layers, the same tensor) reuses it. A module without `layer_idx`
    computes on every call. Thread-local: two threads' forwards do not mix.
    """

    def __init__(self):
        self._local = threading.local()

    def get(self, tensor, module, compute):
        layer = getattr(module, "layer_idx", None)
        version = None if tensor.is_inference() else tensor._version
        entry = getattr(self._local, "entry", None)
        if (entry is not None and layer is not None and entry[0]() is tensor
                and entry[1] == version and layer > entry[2]):
            return entry[3]
        value = compute(tensor)
        if layer is not None:
            self._local.entry = (weakref.ref(tensor), version, layer, value)
        return value


_from_position_ids = _PerForward()
_from_mask = _PerForward()


def _boundaries_from_position_ids(position_ids):
    """(cu_seqlens int32, max_seqlen) of a [1, T] position_ids that packs
    several sequences (it starts at 0, and every next position is 0, a new
    sequence, or one more than the last), or None otherwise: one sequence,
    or positions of another kind, such as generate()'s left padding
    ([1, 1, 0, 1, 2]), which the attention mask then describes."""
    import torch

    pos = position_ids.reshape(-1)
    first = pos == 0
    packs = first[0] & (first[1:] | (pos[1:] == pos[:-1] + 1)).all()
    starts = torch.nonzero(first, as_tuple=False).flatten()
    if starts.numel() <= 1:
        return None
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
    packs, max_len = torch.stack([packs.to(cu.dtype), cu.diff().max()]).tolist()
    return (cu, max_len) if packs else None


def _rows_from_mask(mask, is_causal):
    """(indices of the real tokens in [B * S], cu_seqlens, max_seqlen) of a
    4-D [B, 1, Q, K] bool self-attention mask that is key padding alone
    (causal or not), or None for any other mask. A key is real where the last
    query row sees it (causal and key padding: the last row sees every real
    key); every other row must then see exactly the real keys (up to itself,
    if causal), or be a padding query's. Other masks, such as the block-diagonal mask of
    packed rows (position_ids restarting inside each row), keep the "sdpa"
    path: read as key padding they had lost all but each row's last
    sequence."""
    import torch

    allowed = mask[:, 0]
    keep = allowed[:, -1, :]
    expected = keep[:, None, :].expand_as(allowed)
    if is_causal:
        expected = expected & torch.ones(allowed.shape[-2:], dtype=torch.bool,
                                         device=allowed.device).tril()
    # A padding query's row is dropped (its output is zero): it may see
    # nothing (left padding), everything (PyTorch < 2.5's fix in
    # transformers) or what a real row would (right padding).
    padding_row = ~keep & (~allowed.any(-1) | allowed.all(-1))
    matches = ((allowed == expected).all(-1) | padding_row).all()
    lengths = keep.sum(-1)
    matches, max_len = torch.stack([matches.to(lengths.dtype), lengths.max()]).tolist()
    if not matches:
        return None
    indices = torch.nonzero(keep.reshape(-1), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return indices, cu, max_len


def _is_causal(module, kwargs):
    """transformers' rule: the call's is_causal, else the module's (default True)."""
    is_causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)


def _varlen(module, query, key, value, cu, max_len, kwargs):
    """[B, H, S, E] (B * S packed rows, or rows of a packed [1, T] batch)
    through varlen_sdpa; returns [rows, H, Ev]."""
    from .varlen import varlen_sdpa

    q = query.transpose(1, 2).reshape(-1, query.shape[1], query.shape[3])
    k = key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[3])
    v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[3])
    return q, k, v, dict(cu=cu, max_len=max_len, is_causal=_is_causal(module, kwargs),
                         scale=kwargs.get("scaling"), dropout_p=kwargs.get("dropout", 0.0),
                         enable_gqa=query.shape[1] != key.shape[1], fn=varlen_sdpa)


def _run(q, k, v, a):
    return a["fn"](q, k, v, a["cu"], a["cu"], a["max_len"], a["max_len"],
                   is_causal=a["is_causal"], scale=a["scale"], dropout_p=a["dropout_p"],
                   enable_gqa=a["enable_gqa"])


def packed_attention(module, query, key, value, attention_mask, **kwargs):
    """The varlen path for this call, or None when it does not apply.
    Returns (attn_output [B, S, H, Ev], None) as transformers' attention
    functions do."""
    import torch

    if any(kwargs.get(name) is not None for name in _UNSUPPORTED):
        return None
    if getattr(module, "sliding_window", None) is not None:
        return None
    # A float mask may carry a bias (Falcon's ALiBi), which varlen_sdpa has no
    # place for; transformers' own sdpa masks are bool.
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return None
    # varlen_sdpa's CPU reference has no dropout; "sdpa" trains with it there.
    if kwargs.get("dropout", 0.0) and not query.is_cuda:
        return None
    batch, _, q_len, _ = query.shape
    # Self-attention over the same tokens: queries and keys share boundaries
    # (one cu_seqlens tensor, so FlashAttention-2 may serve causal calls).
    if q_len != key.shape[2]:
        return None
    cu = kwargs.get("cu_seq_lens_q")
    max_len = kwargs.get("max_length_q")
    if batch == 1 and cu is not None and max_len is not None:
        cu = cu.to(device=query.device, dtype=torch.int32)
        max_len = int(max_len)
    elif batch == 1 and kwargs.get("position_ids") is not None:
        found = _from_position_ids.get(kwargs["position_ids"], module,
                                       _boundaries_from_position_ids)
        if found is None:
            return None
        cu, max_len = found
    elif batch > 1 and attention_mask is not None and attention_mask.dim() == 4 \
            and unpad_enabled():
        causal = _is_causal(module, kwargs)
        rows = _from_mask.get(attention_mask, module, lambda m: _rows_from_mask(m, causal))
        if rows is None:
            return None
        indices, cu, max_len = rows
        q, k, v, a = _varlen(module, query, key, value, cu, max_len, kwargs)
        out = _run(q.index_select(0, indices), k.index_select(0, indices),
                   v.index_select(0, indices), a)
        full = out.new_zeros((batch * q_len,) + tuple(out.shape[1:])).index_copy(0, indices, out)
        return full.view(batch, q_len, *out.shape[1:]), None
    else:
        return None
    q, k, v, a = _varlen(module, query, key, value, cu, max_len, kwargs)
    out = _run(q, k, v, a)
    return out.view(batch, q_len, *out.shape[1:]), None


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
        packed = packed_attention(module, query, key, value, attention_mask, **kwargs)
        if packed is not None:
            return packed
        # transformers' "sdpa" attention, which calls
        # F.scaled_dot_product_attention, with the op patched in for the call
        # (patching.py says why not patch() itself).
        with patched_while_inside():
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(NAME, openwam_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return True


def register_when_imported() -> None:
    if importlib.util.find_spec("transformers") is not None:
        after_import("transformers", register)

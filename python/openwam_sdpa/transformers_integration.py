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
    without a cache, this holds whatever use_cache says, in a batch of one
    row whose model passes position_ids on to its attention (GPT-BigCode's
    and ModernBERT's do not).
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
    """One result per forward for the tensors that every layer of it receives
    (the mask, the position_ids, cu_seqlens): computed at the forward's first
    layer, reused by the layers after it.

    A forward runs its layers in ascending `layer_idx`, so a call at a layer
    no later than the one that computed the result starts a new forward and
    computes afresh: a tensor refilled between forwards without a version
    bump (through .data, a numpy view, or an inference tensor, which has no
    version counter) is read again. Gradient checkpointing's recomputation
    (later layers, the same tensors) reuses it. A module without `layer_idx`
    computes on every call. Thread-local: two threads' forwards do not mix.
    One entry per set of tensors: layers that alternate between two masks
    (Llama 4's chunked and full layers) read each once, where one entry for
    all had read them at every switch. Entries whose tensors are gone (the
    last forward's masks) are dropped.
    """

    def __init__(self):
        self._local = threading.local()

    def get(self, tensors, module, compute, also=()):
        """compute(*tensors), or this forward's earlier result for the same
        tensors (a tuple; None entries allowed) and the same `also` (what
        else compute reads, such as causality: one mask serves causal and
        bidirectional layers alike, and reads differently in each)."""
        layer = getattr(module, "layer_idx", None)
        versions = tuple(None if t is None or t.is_inference() else t._version for t in tensors)
        entries = self._local.__dict__.setdefault("entries", {})
        key = (tuple(id(t) for t in tensors), also)
        entry = entries.get(key)
        if (entry is not None and layer is not None and layer > entry[2]
                and entry[1] == versions
                and all((r() if r is not None else None) is t for r, t in zip(entry[0], tensors))):
            return entry[3]
        value = compute(*tensors)
        if layer is not None:
            for stale in [k for k, e in entries.items()
                          if any(r is not None and r() is None for r in e[0])]:
                del entries[stale]
            refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
            entries[key] = (refs, versions, layer, value)
        return value


_from_position_ids = _PerForward()
_from_mask = _PerForward()
_mask_check = _PerForward()
_apart = _PerForward()


def _boundaries_from_position_ids(position_ids):
    """(cu_seqlens int32, max_seqlen) of a [1, T] position_ids that packs
    several sequences (it starts at 0, and every next position is 0, a new
    sequence, or one more than the last), or None otherwise: one sequence,
    or positions of another kind, such as [1, 1, 0, 1, 2] (left padding
    filled with 1), which the attention mask then describes. generate()'s
    padded prompts (transformers 5.25 fills the padding with 0) do read as
    packings; their padding queries keep transformers' mask
    (_within_sequences)."""
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


def _same_sequence(cu, total, mask=None):
    """[T, T] bool: whether packed rows i and j lie in one sequence of `cu`
    (no host sync). With the row's bool mask [1, 1|H, T, T], a sequence that
    starts at a padding token (one whose own key the mask hides from it)
    continues the one before: generate() gives padding position 0, so a
    right-padded prompt followed by new tokens (generate(use_cache=False))
    reads as a sequence starting in the padding, whose real queries had lost
    the prompt (greedy tokens unlike "sdpa"'s; found in review)."""
    import torch

    rows = torch.arange(total, device=cu.device, dtype=cu.dtype)
    sequence = torch.searchsorted(cu[1:].contiguous(), rows, right=True)
    if mask is not None:
        padding = ~mask.diagonal(dim1=-2, dim2=-1).any(-2).reshape(-1)
        starts = torch.ones_like(padding)
        starts[1:] = (sequence[1:] != sequence[:-1]) & ~padding[1:]
        sequence = torch.cumsum(starts, 0)
    return sequence[:, None] == sequence[None, :]


def _within_sequences(mask, same, is_causal):
    """A packed row's bool mask [1, 1|H, T, T] restricted to each sequence
    (`same`: _same_sequence's);
    for no mask (causal, or full if not), the causal or full mask of each
    sequence. A padding query (one that does not see its own key) keeps its
    row: generate() gives a padded prompt position 0 at every padding token,
    which reads as a packing, and a right-padded prompt's last row, which
    picks the next token, had seen its own padding token alone (greedy
    tokens unlike "sdpa"'s)."""
    if mask is None:
        return (same.tril() if is_causal else same)[None, None]
    padding_query = ~mask.diagonal(dim1=-2, dim2=-1)
    return mask & (same | padding_query[..., :, None])


def _mask_beyond_packing(mask, cu, is_causal, cu_k=None):
    """None where the bool mask [1, 1|H, T, T] that transformers built for a
    packed row lets every query see exactly what varlen_sdpa gives it within
    its own sequence (its keys, up to itself if causal), as a plain
    packing's mask does. Else the mask the "sdpa" path takes instead: this
    one restricted to each sequence. A mask can ask more than the packing:
    Gemma 3's and PaliGemma's bidirectional image blocks, a custom 4-D mask
    (a prefix-LM's), padding inside the row. The packed route had dropped it
    (a prefix-LM mask: logits off by 0.33). Outside the sequences the mask
    may say anything: where transformers does not see the packing (with a
    cache) its mask crosses them. `cu_k`, where the caller gave keys their
    own cu_seqlens, must equal `cu` (else the mask as it is). One host sync."""
    import torch

    same = _same_sequence(cu, mask.shape[-1], mask)
    # In place: three [T, T] bools at most (T = 16k: 0.8 GB for a moment).
    beyond = torch.logical_xor(mask, same.tril() if is_causal else same)
    beyond &= same
    agrees = ~beyond.any()
    del beyond
    one_packing = agrees.new_ones(())
    if cu_k is not None:
        one_packing = (cu_k.to(cu) == cu).all() if cu_k.shape == cu.shape else ~one_packing
    agrees, one_packing = torch.stack([agrees, one_packing]).tolist()
    if not one_packing:
        return mask
    return None if agrees else _within_sequences(mask, same, is_causal)


def _cross_attention(module) -> bool:
    """Whether `module` attends to another sequence's keys (an encoder's).
    transformers marks it in several ways: a class of its own (BERT's
    BertCrossAttention), an is_cross_attention flag, or a decoder's
    attention that is not causal (BART's, Whisper's encoder_attn). Queries
    and keys of one length do not tell it apart from self-attention, and
    read as one packing they had split the encoder's keys by the decoder's
    sequences (logits off by 4.8e-3), or under OPENWAM_SDPA_UNPAD=1
    gathered the decoder's rows by the encoder's padding (off by 10). Some
    mark none of these, not even is_decoder (Moonshine's encoder_attn, off by
    1.8; found in review): in an encoder-decoder model such an attention
    that is not causal is taken for one, the encoder's own included, which
    then keeps "sdpa"."""
    if "CrossAttention" in type(module).__name__ or getattr(module, "is_cross_attention", False):
        return True
    not_causal = not getattr(module, "is_causal", True)
    if hasattr(module, "is_decoder"):
        return bool(module.is_decoder) and not_causal
    config = getattr(module, "config", None)
    return not_causal and bool(getattr(config, "is_encoder_decoder", False))


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
    """The attention of a packed row (varlen_sdpa, or "sdpa" with its
    sequences kept apart where varlen_sdpa does not compute the layer), or
    of a padded batch under OPENWAM_SDPA_UNPAD; None where transformers'
    "sdpa" applies as it is. Returns (attn_output [B, S, H, Ev], None) as
    transformers' attention functions do."""
    import torch

    # A float mask may carry a bias (Falcon's ALiBi), which varlen_sdpa has no
    # place for; transformers' own sdpa masks are bool.
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return None
    batch, _, q_len, _ = query.shape
    # Self-attention over the same tokens: queries and keys share boundaries
    # (one cu_seqlens tensor, so FlashAttention-2 may serve causal calls).
    if q_len != key.shape[2] or _cross_attention(module):
        return None
    # What varlen_sdpa does not compute: softcapping, sinks, a sliding window,
    # and dropout on the CPU (its reference has none there; "sdpa" trains
    # with it). A packed row takes "sdpa" then, its sequences kept apart.
    varlen_computes = not (any(kwargs.get(name) is not None for name in _UNSUPPORTED)
                           or getattr(module, "sliding_window", None) is not None
                           or (kwargs.get("dropout", 0.0) and not query.is_cuda))
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_len = kwargs.get("max_length_q")
    if batch == 1 and cu_q is not None and max_len is not None:
        max_len = int(max_len)
        # Keys packed otherwise than queries: "sdpa", which reads the mask.
        if kwargs.get("max_length_k") is not None and int(kwargs["max_length_k"]) != max_len:
            return None
        cu = cu_q.to(device=query.device, dtype=torch.int32)
        source, cu_k = (cu_q, cu_k), (None if cu_k is None or cu_k is cu_q else cu_k)
    elif batch == 1 and kwargs.get("position_ids") is not None \
            and kwargs["position_ids"].numel() == q_len:
        # One position a token: multimodal rotary positions ([3, B, T] in
        # Qwen2-VL and Ernie 4.5-VL) had read as three sequences of T rows
        # (found in review).
        found = _from_position_ids.get((kwargs["position_ids"],), module,
                                       _boundaries_from_position_ids)
        if found is None:
            return None
        cu, max_len = found
        source, cu_k = (cu,), None
    elif batch > 1 and attention_mask is not None and attention_mask.dim() == 4 \
            and varlen_computes and unpad_enabled():
        causal = _is_causal(module, kwargs)
        rows = _from_mask.get((attention_mask,), module, lambda m: _rows_from_mask(m, causal),
                              also=causal)
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
    if attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[0] != 1
                                       or attention_mask.shape[-2:] != (q_len, q_len)):
        return None
    causal = _is_causal(module, kwargs)
    if not varlen_computes:
        # transformers' own mask crosses the sequences where it does not see
        # the packing (with a cache): restricted to each sequence, as the
        # varlen path attends.
        mask = _apart.get((attention_mask,) + source, module,
                          lambda *_: _within_sequences(
                              attention_mask, _same_sequence(cu, q_len, attention_mask), causal),
                          also=causal)
        return sdpa_path(module, query, key, value, mask, **kwargs)
    if attention_mask is not None:
        dense = _mask_check.get((attention_mask,) + source, module,
                                lambda *_: _mask_beyond_packing(attention_mask, cu, causal, cu_k),
                                also=causal)
        if dense is not None:
            return sdpa_path(module, query, key, value, dense, **kwargs)
    q, k, v, a = _varlen(module, query, key, value, cu, max_len, kwargs)
    out = _run(q, k, v, a)
    return out.view(batch, q_len, *out.shape[1:]), None


_sdpa_attention_forward = None  # transformers', set by register()


def _sparse_selection_as_mask(module, query, key, attention_mask, kwargs):
    """The mask with a sparse-attention model's selection in it, as
    transformers builds it for "sdpa". DeepSeek-V3.2-style models (an indexer
    picks each query's top-k keys: deepseek_v32, glm_moe_dsa, mistral_large4
    and others) apply the selection as a mask only for a backend named
    "eager" or "sdpa"; any other gets it as `indices=` for kernels that read
    it, and had attended densely (logits off by 0.1; found in review).
    MiniMax-M3's block selection (`block_indices=`) is built by its indexer
    with inputs the backend does not get: refused rather than dropped. A
    packed row of such a model attends as "sdpa" does (across its sequences
    with a cache)."""
    import torch

    if kwargs.get("block_indices") is not None:
        raise NotImplementedError(
            f"attn_implementation={NAME!r}: {type(module).__name__} selects key blocks per query "
            "(block_indices), which transformers applies as a mask only for a backend named "
            "'sdpa' or 'eager'; load this model with attn_implementation='sdpa' and call "
            "openwam_sdpa.patch() for the op.")
    indices = kwargs.pop("indices", None)
    if indices is None:
        return attention_mask
    batch, _, q_len, _ = query.shape
    hidden = indices.new_ones((batch, q_len, key.shape[2]), dtype=torch.bool).scatter(
        -1, indices.long(), False).unsqueeze(1)
    if attention_mask is None:
        return ~hidden
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~hidden
    return attention_mask.masked_fill(hidden, torch.finfo(query.dtype).min)


def _last_queries_causal(module, query, key, attention_mask, kwargs):
    """Gemma 4's KV-shared layers keep only the last logits_to_keep queries
    for every backend but one named "sdpa" (transformers 5.25 tests the
    name), and pass no mask where is_causal served the whole sequence: the
    kept queries attended top-left (a tiny Gemma 4's last logits off by 0.34;
    found in review). Each sees the keys up to its own position: its
    position_ids, which index the cache's slots where no mask was needed (no
    padding), also in a static cache longer than the sequence; else the
    last positions (bottom-right). Only there: elsewhere a causal call
    without a mask and with fewer queries than keys is a static cache's
    prefill, its queries the first ones."""
    import torch

    q_len, kv_len = query.shape[2], key.shape[2]
    if (attention_mask is not None or not 1 < q_len < kv_len
            or not getattr(module, "is_kv_shared_layer", False)
            or not _is_causal(module, kwargs)):
        return attention_mask
    keys = torch.arange(kv_len, device=query.device)
    positions = kwargs.get("position_ids")
    if positions is None or positions.dim() != 2 or positions.shape[-1] < q_len:
        positions = torch.arange(kv_len - q_len, kv_len, device=query.device)[None]
    return (keys <= positions[:, -q_len:, None].to(query.device))[:, None]


def sdpa_path(module, query, key, value, attention_mask, **kwargs):
    """transformers' "sdpa" attention, which calls
    F.scaled_dot_product_attention, with the op patched in for the call
    (patching.py says why not patch() itself)."""
    with patched_while_inside():
        return _sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


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
    global _sdpa_attention_forward
    _sdpa_attention_forward = sdpa_attention_forward

    def openwam_attention_forward(module, query, key, value, attention_mask, **kwargs):
        if kwargs.get("indices") is not None or kwargs.get("block_indices") is not None:
            # A sparse model's selection: "sdpa"'s mask and path as they are
            # (the packed routes read a padding token from the mask's
            # diagonal, which the selection may clear for a real query).
            attention_mask = _sparse_selection_as_mask(module, query, key, attention_mask, kwargs)
            return sdpa_path(module, query, key, value, attention_mask, **kwargs)
        packed = packed_attention(module, query, key, value, attention_mask, **kwargs)
        if packed is not None:
            return packed
        attention_mask = _last_queries_causal(module, query, key, attention_mask, kwargs)
        return sdpa_path(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(NAME, openwam_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return True


def register_when_imported() -> None:
    if importlib.util.find_spec("transformers") is not None:
        after_import("transformers", register)

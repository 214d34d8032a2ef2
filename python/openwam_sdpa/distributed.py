"""DTensor sharding rules for the guarded cuDNN path's two leaf ops (and the
op that turns a bool mask into their bias).

openwam::sdpa is CompositeImplicitAutograd, so DTensor's __torch_dispatch__
never sees it: it sees what the op calls, either PyTorch's own attention ops
(DTensor has rules for those) or openwam::_cudnn_sdpa and
openwam::_cudnn_sdpa_backward, whose rules are registered here with
torch.distributed.tensor.experimental.register_sharding.

What the rules allow, on each mesh dimension:
- q, k, v (and grad_out, out, logsumexp in the backward) sharded on the batch
  dim, Shard(0), or the head dim, Shard(1): every rank runs its shard locally,
  with no communication, and the outputs keep the placement (the philox
  seed/offset are Replicate). That is what tensor parallelism does to
  attention. attn_bias follows: Shard(d) where it has that dim, Replicate
  where it broadcasts over it (size 1).
- everything Replicate: every rank runs the whole call.
Any other placement is redistributed by DTensor to the cheapest of these, as
PyTorch's own attention ops list the same three: a sequence-sharded q, k or v
(Shard(2)) is gathered, as stock F.sdpa gathers it. Under context
parallelism, whose sequence shards are no plain split, it raises instead:
see _refuse_sequence_sharding.

The refusals under context parallelism live here too (both of its forms:
the F.sdpa wrapper of monkey-patch mode, DTensor's handlers otherwise).

Importing torch.distributed.tensor takes seconds, and most users of the op
never need it: importing this module registers the rules at once when
DTensor is already loaded, and otherwise right after its first import.
"""

from __future__ import annotations

import math
import sys

import torch

from ._import_hooks import after_import

DTENSOR_MODULE = "torch.distributed.tensor"
_registered = False

# Positions in the leaf ops' schemas (csrc/registration.cpp).
_FORWARD_DROPOUT_P = 4
_SEQUENCE_DIM = 2


def _chunk_sizes(size: int, parts: int) -> list:
    """The local sizes of a dim of `size` under Shard on `parts` ranks
    (torch.chunk semantics, as DTensor shards)."""
    chunk = math.ceil(size / parts) if size else 0
    return [max(0, min(chunk, size - r * chunk)) for r in range(parts)]


def _sharded_dims(query, key) -> list:
    """The dims (0 = batch, 1 = heads) on which the call may run shard-local.

    The plan int in the call was decided for the global shapes; a shard must
    not change which guard rule applies. The rules read the batch and head
    counts only for one query row (s_q == 1: cudnn-frontend #1071/#1072 fire
    at batch 1, and #1071 at batch = heads = 1), so there a shard must keep
    them above 1 where the global call had them there. Empty shards are
    refused too (cuDNN is never handed an empty input).
    """
    batch, heads, s_q = query.tensor_meta.shape[:3]
    kv_heads = key.tensor_meta.shape[1]
    # Every rank of the mesh: a dim may be sharded over all its mesh dims.
    ranks = query.mesh.size()
    one_row = s_q == 1
    dims = []
    local_batch = min(_chunk_sizes(batch, ranks))
    if local_batch >= 1 and not (one_row and local_batch == 1 and batch > 1):
        dims.append(0)
    local_heads = min(_chunk_sizes(heads, ranks))
    # GQA: query head h reads kv head h // (heads / kv_heads); the shards
    # line up only where the kv heads divide evenly.
    gqa_even = kv_heads == heads or kv_heads % ranks == 0
    if (local_heads >= 1 and gqa_even
            and not (one_row and batch == 1 and local_heads == 1 and heads > 1)):
        dims.append(1)
    return dims


def _bias_placement(attn_bias, dim: int):
    from torch.distributed.tensor import Replicate, Shard

    if attn_bias is None:
        return None
    # The bias lines up with q from the right (the leaf op takes 2-D and 3-D
    # ones too): q's dim `dim` is the bias's dim `dim - (4 - rank)`, absent
    # (broadcast) where that is negative. Counting from the left split an
    # [H, L, S] bias on its heads for a batch-sharded q: silently wrong.
    shape = attn_bias.tensor_meta.shape
    own = dim - (4 - len(shape))
    return Replicate() if own < 0 or shape[own] == 1 else Shard(own)


# ---- Context parallelism, detected in its two forms ----
# Under torch.distributed.tensor.experimental.context_parallel only PyTorch's
# own SDPA ops become ring attention; the guarded cuDNN path has none.

# What the user does about it, in both refusals.
_RING_ATTENTION_ADVICE = (
    "set OPENWAM_SDPA_CUDNN=0 (then openwam_sdpa.reload_settings()): the op hands the "
    "calls to PyTorch's flash and efficient attention, which context_parallel runs as ring "
    "attention and which lack the cuDNN defects.")

# Monkey-patch mode replaces F.scaled_dot_product_attention by a wrapper it
# keeps in this module's _replaced_functions (torch 2.11-2.14 put the module
# at either path): plain tensors reach the op through it.
_CONTEXT_PARALLEL_MODULES = (
    "torch.distributed.tensor.experimental._context_parallel._attention",
    "torch.distributed.tensor.experimental._attention",
)
CONTEXT_PARALLEL_MESSAGE = (
    "openwam_sdpa: torch.distributed.tensor.experimental.context_parallel is active, and it "
    "turns only F.scaled_dot_product_attention into ring attention: this call would attend "
    "within this rank's chunk of the sequence only. Call openwam_sdpa.patch() before "
    "entering context_parallel and " + _RING_ATTENTION_ADVICE)


def is_context_parallel_wrapper(fn) -> bool:
    """Whether `fn` is context_parallel's stand-in for F.sdpa (it is active)."""
    for name in _CONTEXT_PARALLEL_MODULES:
        replaced = getattr(sys.modules.get(name), "_replaced_functions", None)
        if replaced and fn in replaced:
            return True
    return False


def refuse_context_parallel_wrapper(fn) -> None:
    """Raises where `fn`, the F.sdpa a call would have gone through, is
    context_parallel's stand-in: the op or patch() in front of it would skip
    its ring (both refusals of monkey-patch mode)."""
    if is_context_parallel_wrapper(fn):
        raise NotImplementedError(CONTEXT_PARALLEL_MESSAGE)


# DTensor inputs: PyTorch's attention ops that context parallelism runs as
# ring attention.
_CONTEXT_PARALLEL_OPS = ("_scaled_dot_product_flash_attention",
                         "_scaled_dot_product_efficient_attention",
                         "_scaled_dot_product_cudnn_attention")


def context_parallel_active() -> bool:
    """Whether torch's context parallelism is on. Each of its forms
    (context_parallel() in either dispatch mode, _enable_context_parallel_
    dispatcher) gives DTensor handlers of its own for PyTorch's attention ops
    while it is on (torch 2.11-2.15 alike)."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    return any(getattr(torch.ops.aten, name).default in handlers
               for name in _CONTEXT_PARALLEL_OPS)


def sequence_sharded(tensor) -> bool:
    placements = getattr(tensor, "placements", ())
    return any(p.is_shard(_SEQUENCE_DIM) for p in placements)


def context_parallel_refusal(op_name: str, name: str, placements) -> NotImplementedError:
    return NotImplementedError(
        f"openwam::{op_name}: {name} is sharded on the sequence dim (placements "
        f"{tuple(placements)}) under context parallelism; the guarded cuDNN path has no "
        "ring attention: torch.distributed.tensor.experimental.context_parallel rewrites "
        "only PyTorch's own SDPA ops into it. Under context_parallel " + _RING_ATTENTION_ADVICE)


def _refuse_sequence_sharding(op_name: str, **tensors) -> None:
    """A q, k or v sharded on the sequence under context parallelism.
    Gathering it would be wrong, not just slow: context_parallel reorders the
    sequence for load balance (head-tail chunks), so a causal call on the
    gathered sequence masks the wrong keys, and it reads the output back with
    to_local() as if it were still sequence-sharded. Outside context
    parallelism the shards are a plain split, and DTensor gathers them, as
    for stock F.sdpa.

    DTensor caches the decision per call signature, so a signature first seen
    outside context parallelism is not checked again under it here: the
    drop-in entry (openwam_sdpa.sdpa, the patched F.sdpa) checks every call,
    refuse_under_context_parallel below."""
    if not context_parallel_active():
        return
    for name, spec in tensors.items():
        if sequence_sharded(spec):
            raise context_parallel_refusal(op_name, name, spec.placements)


def refuse_under_context_parallel(query, key, value, route) -> None:
    """The drop-in entry's per-call check of a DTensor call (see
    _refuse_sequence_sharding): under context parallelism a sequence-sharded
    call that the cuDNN path would take raises. `route()` gives that path
    (openwam_sdpa.explain's "backend"); asked only for such calls. A call
    the op hands to PyTorch's attention is context_parallel's own."""
    tensors = {"query": query, "key": key, "value": value}
    sharded = [name for name, t in tensors.items() if sequence_sharded(t)]
    if sharded and context_parallel_active() and route() == "cudnn":
        raise context_parallel_refusal("sdpa", sharded[0], tensors[sharded[0]].placements)


def _cudnn_sdpa_rule(query, key, value, attn_bias, dropout_p, is_causal, scale,
                     compute_log_sumexp, plan):
    from torch.distributed.tensor import Replicate, Shard

    _refuse_sequence_sharding("_cudnn_sdpa", query=query, key=key, value=value)
    rest = [None] * 5  # dropout_p, is_causal, scale, compute_log_sumexp, plan
    # outputs: out, logsumexp, philox_seed, philox_offset, raised_bias;
    # inputs: q, k, v, bias, ...
    bias = Replicate() if attn_bias is not None else None
    strategies = [([Replicate()] * 5, [Replicate()] * 3 + [bias] + rest)]
    for dim in _sharded_dims(query, key):
        # An empty logsumexp (compute_log_sumexp=False) has no dim to shard.
        lse = Shard(dim) if compute_log_sumexp else Replicate()
        # raised_bias has the bias's dims (its keys maybe 0), [0] without one.
        # A replicated key mask under a head-sharded q is raised by each
        # rank's own heads (score_shift.h): the replicas may differ, and
        # each rank's backward reads only its own.
        on_bias = _bias_placement(attn_bias, dim)
        strategies.append((
            [Shard(dim), lse, Replicate(), Replicate(), on_bias or Replicate()],
            [Shard(dim)] * 3 + [on_bias] + rest))
    return strategies


def _cudnn_sdpa_backward_rule(grad_out, query, key, value, attn_bias, out, logsumexp,
                              philox_seed, philox_offset, dropout_p, is_causal,
                              scale, plan):
    from torch.distributed.tensor import Replicate, Shard

    rest = [None] * 4  # dropout_p, is_causal, scale, plan
    bias = Replicate() if attn_bias is not None else None
    # outputs: grad_query, grad_key, grad_value; inputs: grad_out, q, k, v,
    # bias, out, logsumexp, philox_seed, philox_offset, ...
    strategies = [([Replicate()] * 3, [Replicate()] * 4 + [bias] + [Replicate()] * 4 + rest)]
    for dim in _sharded_dims(query, key):
        strategies.append((
            [Shard(dim)] * 3,
            [Shard(dim)] * 4 + [_bias_placement(attn_bias, dim)]
            + [Shard(dim)] * 2 + [Replicate()] * 2 + rest))
    return strategies


def _mask_bias_rule(mask, dtype, s_kv, s_kv_padded):
    """openwam::_mask_bias (a bool mask as cuDNN's bias, its keys maybe grown):
    elementwise along every dim but the keys, which it may grow. openwam::sdpa
    calls it with the mask of a tensor-parallel call (a bool mask on the cuDNN
    path); without a rule DTensor refused the call."""
    from torch.distributed.tensor import Replicate, Shard

    rest = [None] * 3  # dtype, s_kv, s_kv_padded
    strategies = [([Replicate()], [Replicate()] + rest)]
    for dim in range(len(mask.tensor_meta.shape) - 1):
        strategies.append(([Shard(dim)], [Shard(dim)] + rest))
    return strategies


def register_sharding_rules() -> None:
    """Register the DTensor rules of the leaf ops (idempotent). Called for you
    when this module is imported (at `import openwam_sdpa`) and DTensor is
    loaded, or right after DTensor's first import."""
    global _registered
    if _registered:
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental import register_sharding

    forward = torch.ops.openwam._cudnn_sdpa.default
    backward = torch.ops.openwam._cudnn_sdpa_backward.default
    register_sharding(forward)(_cudnn_sdpa_rule)
    register_sharding(backward)(_cudnn_sdpa_backward_rule)
    register_sharding(torch.ops.openwam._mask_bias.default)(_mask_bias_rule)
    # register_sharding keys DTensor's cache of sharding decisions on the
    # tensors' specs and the arguments from the first int on (`plan`); the
    # outputs' specs also depend on dropout_p and compute_log_sumexp, which
    # come before it. Without this, a call with compute_log_sumexp=False after
    # one with True (eval after train) reused the cached specs of a
    # [B, H, L, 1] logsumexp for an empty one, and a call with dropout after
    # one without those of empty philox tensors for 0-dim ones.
    DTensor._op_dispatcher.sharding_propagator.op_to_schema_info[forward] = (
        RuntimeSchemaInfo(static_argnum=_FORWARD_DROPOUT_P, needs_pytree=True))
    _registered = True


if torch.distributed.is_available():
    after_import(DTENSOR_MODULE, register_sharding_rules)

"""DTensor sharding rules for sdpa_varlen's two leaf ops (openwam::_sdpa_varlen,
openwam::_sdpa_varlen_backward); openwam::sdpa_varlen itself is
CompositeImplicitAutograd, so DTensor sees the leaf ops it calls.

On each mesh dimension the rules allow:
- q, k, v (and grad_out, out, logsumexp in the backward) sharded on the head
  dim, Shard(1), cu_seqlens replicated: every rank attends its heads of every
  sequence, with no communication, and the outputs keep the placement (the
  logsumexp is sharded on its head dim: 0 for the reference and
  FlashAttention-2, [heads, total_q]; 1 for cuDNN's ragged layout,
  [total_q, heads, 1]; replicated where it is empty, in a call nothing will
  differentiate). That is what tensor parallelism does to attention.
  The head counts must divide evenly (grouped-query attention keeps its
  ratio on every rank).
- everything Replicate.
There is no batch sharding: the packed dim mixes the sequences of the batch
(shard the batch before packing, as data parallelism does). Other placements
are redistributed by DTensor to the cheaper of these.
"""

from __future__ import annotations

import torch

from ._import_hooks import after_import

_registered = False
_CUDNN_RAGGED = 2  # VarlenBackend::kCudnnRagged (csrc/varlen.h)


def _head_dims_ok(query, key) -> bool:
    heads = query.tensor_meta.shape[1]
    kv_heads = key.tensor_meta.shape[1]
    ranks = query.mesh.size()
    return heads % ranks == 0 and kv_heads % ranks == 0


def _lse_dim(backend) -> int:
    return 1 if backend == _CUDNN_RAGGED else 0


def _forward_rule(query, key, value, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale,
                  backend, compute_log_sumexp=True):
    from torch.distributed.tensor import Replicate, Shard

    # max_q, max_k, dropout_p, is_causal, scale, backend, compute_log_sumexp
    rest = [None] * 7
    strategies = [([Replicate()] * 4, [Replicate()] * 5 + rest)]
    if _head_dims_ok(query, key):
        # Without compute_log_sumexp the logsumexp is empty on every rank.
        lse = Shard(_lse_dim(backend)) if compute_log_sumexp else Replicate()
        strategies.append(([Shard(1), lse, Replicate(), Replicate()],
                           [Shard(1)] * 3 + [Replicate()] * 2 + rest))
    return strategies


def _backward_rule(grad_out, query, key, value, out, logsumexp, rng_state, rng_offset, cu_q,
                   cu_k, max_q, max_k, dropout_p, is_causal, scale, backend):
    from torch.distributed.tensor import Replicate, Shard

    rest = [None] * 6
    strategies = [([Replicate()] * 3, [Replicate()] * 10 + rest)]
    if _head_dims_ok(query, key):
        strategies.append(([Shard(1)] * 3,
                           [Shard(1)] * 5 + [Shard(_lse_dim(backend))] + [Replicate()] * 4
                           + rest))
    return strategies


def register_sharding_rules() -> None:
    """Register the rules (idempotent): at import when DTensor is loaded, else
    right after its first import."""
    global _registered
    if _registered:
        return
    from torch.distributed.tensor.experimental import register_sharding

    register_sharding(torch.ops.openwam._sdpa_varlen.default)(_forward_rule)
    register_sharding(torch.ops.openwam._sdpa_varlen_backward.default)(_backward_rule)
    _registered = True


if torch.distributed.is_available():
    # Hooked on the experimental module (register_sharding's home), not on
    # torch.distributed.tensor: _import_hooks keeps one hook per module, and
    # distributed.py holds that one (its rules import this module).
    after_import("torch.distributed.tensor.experimental", register_sharding_rules)

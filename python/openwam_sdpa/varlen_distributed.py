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

import math
import sys

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


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor (without importing DTensor's module)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def block_diagonal_on_shards(query, key, value, cu_q, cu_k, max_q, max_k, is_causal, scale,
                             dropout_p, enable_gqa):
    """sdpa_varlen of DTensor q, k, v whose engine is the block-diagonal
    fallback, run on each rank's shard; None for any other call.

    The fallback is no leaf op: it builds its block-diagonal mask from
    cu_seqlens with fresh tensors, which DTensor refuses to mix with its own
    (fp32 on CUDA, head_dim over 256, causal calls with distinct
    cu_seqlens, empty inputs had raised). Under the placements the leaf ops'
    rules run shard-local (q, k, v all Shard(1) with the head counts
    dividing evenly, or all Replicate; cu_seqlens replicated), each rank
    computes its heads and the output keeps q's placement."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh, placements = query.device_mesh, query.placements
    if not all(isinstance(t, DTensor) and t.device_mesh == mesh and t.placements == placements
               for t in (key, value)):
        return None
    if not all(p in (Shard(1), Replicate()) for p in placements):
        return None
    ranks = math.prod(n for n, p in zip(mesh.shape, placements) if p == Shard(1))
    if query.shape[1] % ranks or key.shape[1] % ranks:
        return None
    local_cu = []
    for cu in (cu_q, cu_k):
        if is_dtensor(cu):
            if cu.device_mesh != mesh or any(p != Replicate() for p in cu.placements):
                return None
            cu = cu.to_local()
        local_cu.append(cu)
    if cu_k is cu_q:
        local_cu[1] = local_cu[0]  # one tensor: FlashAttention-2 may serve causal calls
    local = [t.to_local() for t in (query, key, value)]
    args = (*local, *local_cu, max_q, max_k)
    backend = torch.ops.openwam._sdpa_varlen_explain(*args, is_causal, scale, dropout_p,
                                                     enable_gqa)[0]
    if backend != "block_diagonal":
        return None
    out = torch.ops.openwam.sdpa_varlen.default(*args, is_causal=is_causal, scale=scale,
                                                dropout_p=dropout_p, enable_gqa=enable_gqa)
    shape = (query.shape[0], query.shape[1], value.shape[2])
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=shape,
                              stride=(shape[1] * shape[2], shape[2], 1))


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

"""Activation checkpointing through the op's two autograd nodes, on the CPU.

Non-reentrant torch.utils.checkpoint recomputes the checkpointed forward when
the backward first unpacks a saved tensor, inside the node's apply(). The
nodes unpack before they drop below autograd for the backward op; before
that order, the recompute saved nothing and checkpoint raised ("a different
number of tensors was saved"). The CPU kernels stand in for cuDNN: the nodes
are the same on every device (tests/gpu checks the real path)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import openwam_sdpa
from openwam_sdpa.varlen import cu_seqlens_from_lengths
from support import run_by_backward

FWD = torch.ops.openwam._cudnn_sdpa.default
KEY_TAIL = 1 | 2  # padding_mask + pad_keys_backward (csrc/plan.cpp)


def grads(fn, leaves, use_reentrant):
    """fn's output and its gradients for a fixed upstream gradient, through
    checkpoint (use_reentrant True/False) or directly (None)."""
    call = fn if use_reentrant is None else (
        lambda *xs: checkpoint(fn, *xs, use_reentrant=use_reentrant))
    go = torch.linspace(-1, 1, leaves[0].numel()).view(leaves[0].shape)
    return run_by_backward(call, *leaves, go)


def assert_same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("plan", [0, KEY_TAIL], ids=["none", "key_tail"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_dense_leaf(bias, plan, use_reentrant):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 16, generator=g, requires_grad=True) for _ in range(3))
    b = torch.zeros(2, 1, 6, 6).masked_fill(torch.rand(2, 1, 6, 6, generator=g) < 0.3,
                                            -math.inf) if bias else None
    if b is not None:
        b[..., 0] = 0.0  # every row sees a key

    def fn(q, k, v):
        return FWD(q, k, v, b, 0.0, False, None, True, plan)[0]

    assert_same(grads(fn, (q, k, v), use_reentrant), grads(fn, (q, k, v), None))


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_varlen(is_causal, use_reentrant):
    g = torch.Generator().manual_seed(1)
    cu, longest = cu_seqlens_from_lengths([3, 1, 5])
    q, k, v = (torch.randn(9, 2, 8, generator=g, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        return openwam_sdpa.varlen_sdpa(q, k, v, cu, cu, longest, longest, is_causal=is_causal)

    assert_same(grads(fn, (q, k, v), use_reentrant), grads(fn, (q, k, v), None))


def backward_graph_of_checkpointed(fn, *leaves):
    """The backward graph torch.compile builds for fn under non-reentrant
    checkpoint (the partitioner recomputes the checkpointed forward there)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return make_boxed_func(graph)

    torch._dynamo.reset()
    compiled = torch.compile(lambda *xs: checkpoint(fn, *xs, use_reentrant=False),
                             backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                             fullgraph=True)
    compiled(*leaves).sum().backward()
    torch._dynamo.reset()
    assert len(graphs) == 2, graphs
    return graphs[1]


def test_forward_leaf_ops_are_seeded():
    """The forward leaf ops draw their dropout from the generator: tagged
    nondeterministic_seeded, as ATen's attention ops are, so that a compiled
    graph's checkpoint recomputes them with the forward's generator state.
    The backward ops replay the state they are given: untagged."""
    seeded = torch.Tag.nondeterministic_seeded
    assert seeded in torch.ops.openwam._cudnn_sdpa.default.tags
    assert seeded in torch.ops.openwam._sdpa_varlen.default.tags
    assert seeded not in torch.ops.openwam._cudnn_sdpa_backward.default.tags
    assert seeded not in torch.ops.openwam._sdpa_varlen_backward.default.tags


def _partitioner_replays_zero_dropout():
    """torch 2.14 and later replay a recomputed op with a dropout_p argument
    only where dropout_p may be non-zero; the CPU kernels have no dropout."""
    from torch._functorch import partitioners

    return not hasattr(partitioners, "is_nonzero_dropout_sdpa")


@pytest.mark.skipif(not _partitioner_replays_zero_dropout(),
                    reason="this torch replays a recomputed op only with dropout, which the CPU "
                           "kernels lack: tests/gpu/test_compile_gpu.py checks the replay there")
@pytest.mark.parametrize("op", ["dense", "varlen"])
def test_compiled_recompute_replays_the_forward_generator_state(op):
    """Recomputed under a compiled graph's checkpoint, a forward leaf op runs
    with the generator state the forward saved (run_with_rng_state). Untagged,
    the backward differentiated a fresh dropout pattern (found in review; the
    CPU kernels have no dropout, so the graph is what shows it here)."""
    g = torch.Generator().manual_seed(2)
    if op == "dense":
        leaves = [torch.randn(2, 3, 6, 16, generator=g, requires_grad=True) for _ in range(3)]

        def fn(q, k, v):
            return FWD(q, k, v, None, 0.0, False, None, True, 0)[0]
    else:
        cu, longest = cu_seqlens_from_lengths([3, 1, 5])
        leaves = [torch.randn(9, 2, 8, generator=g, requires_grad=True) for _ in range(3)]

        def fn(q, k, v):
            return openwam_sdpa.varlen_sdpa(q, k, v, cu, cu, longest, longest)

    leaf = {"dense": "openwam._cudnn_sdpa", "varlen": "openwam._sdpa_varlen"}[op]
    code = backward_graph_of_checkpointed(fn, *leaves).code
    recompute = [line for line in code.splitlines() if leaf + "." in line]
    assert recompute, code
    assert all("run_with_rng_state" in line for line in recompute), "\n".join(recompute)

"""A forward+backward through openwam_sdpa captured in a CUDA graph replays
correctly: the fix (auto plan, affected s_kv = 704, adversarial rows) makes
no host synchronisation and no data-dependent host decision, so the captured
graph fixes whatever data it is replayed on. The padding mask's lengths come
from the device's table or, for a configuration new to the capture, from a
write of the capture's own.

Capture follows PyTorch's "whole network capture" recipe: warm up on a side
stream, set grads to None, capture forward and backward.
"""

from __future__ import annotations

import pytest
import torch

from support import assert_within_stock, nonfinite, nonfinite_grads, reference, run

from .conftest import (GPU_MARKS, cuda_adversarial_qkv, cuda_mask, cuda_randn, key_tail_plan,
                       low_row_problem)

pytestmark = GPU_MARKS

B, H, S_Q, S_KV, D = 2, 4, 256, 704, 128
LOW_ROWS = (3, 200)


def _inputs(seed, batch=B):
    q, k, v = cuda_adversarial_qkv(batch, H, S_Q, S_KV, D, LOW_ROWS, seed=seed,
                                   requires_grad=False)
    go = cuda_randn(*q.shape, seed=seed + 1)
    return q, k, v, go


@pytest.mark.parametrize("mask_kind", ["none", "bool"])
@pytest.mark.parametrize("warm_up", ["forward_backward", "forward"])
def test_forward_backward_replays_in_cuda_graph(warm_up, mask_kind, ow, settings):
    """Without a mask: warmed up with a backward, the capture reads the padding
    mask's lengths from the device's table; warmed up with a forward only
    (graphs built, no lengths yet), it writes its own into the graph's pool.
    With a bool mask the backward runs on shifted scores, whose shift the
    capture computes on the device from each replay's logsumexp. Each
    replays."""
    settings(cudnn="1", pad="auto")
    # The forward-only case needs a configuration new to the process's table
    # of lengths (keyed by the batch rounded up to 4, s_q and s_kv): batch 5.
    batch = B if warm_up == "forward_backward" else 5
    mask = cuda_mask(mask_kind, batch, 1, S_Q, S_KV, seed=3)
    static_q, static_k, static_v, static_go = (t.clone() for t in _inputs(10, batch))
    for t in (static_q, static_k, static_v):
        t.requires_grad_()
    plan = ow.explain(static_q, static_k, static_v, attn_mask=mask)["plan"]
    assert plan == key_tail_plan(mask_kind), plan

    def step():
        out = ow.sdpa(static_q, static_k, static_v, attn_mask=mask)
        out.backward(static_go)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for t in (static_q, static_k, static_v):
                t.grad = None
            if warm_up == "forward":
                ow.sdpa(static_q, static_k, static_v, attn_mask=mask)
            else:
                step()
    torch.cuda.current_stream().wait_stream(side)

    for t in (static_q, static_k, static_v):
        t.grad = None
    per_call = ow.frontend_stats()["lengths_written_per_call"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    written = ow.frontend_stats()["lengths_written_per_call"] - per_call
    shifted = plan == "shift_scores"  # no padding mask, no lengths to write
    assert written == (0 if warm_up == "forward_backward" or shifted else 1), written

    # Replay on fresh data, twice, each time against eager on the same data.
    for seed in (20, 30):
        q, k, v, go = _inputs(seed, batch)
        for dst, src in ((static_q, q), (static_k, k), (static_v, v), (static_go, go)):
            with torch.no_grad():
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        replayed = (static_out.detach().clone(), static_q.grad.clone(),
                    static_k.grad.clone(), static_v.grad.clone())
        assert sum(nonfinite(t) for t in replayed) == 0, "graph replay gave non-finite values"

        eager_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        eager = run(ow.sdpa, *eager_inputs, go, attn_mask=mask)
        assert nonfinite(eager.out) + nonfinite_grads(eager) == 0
        # The forward has no atomics: bit-identical to eager.
        assert torch.equal(replayed[0], eager.out)
        # dQ accumulates over key tiles with atomics: compare both to the
        # reference instead, replay within twice eager's error.
        ref, _ = reference(*eager_inputs, go, attn_mask=mask)
        graph_result = type(eager)(*replayed)
        assert_within_stock(graph_result, eager, ref, torch.bfloat16)
        problem = low_row_problem(graph_result.dq, ref.dq, LOW_ROWS, eager.dq)
        assert problem is None, problem


def test_graphs_first_built_inside_a_capture(ow):
    """A configuration met for the first time inside a capture builds its
    cuDNN graphs there (in relaxed capture mode: the build allocates and loads
    modules, which the global mode forbids) and replays as eager computes it.
    Warmed up on a side stream with another batch size (cuDNN's handles exist
    then on both threads, as PyTorch's recipe wants), then the graph cache is
    emptied: only the op's graph builds are new to the capture."""
    q, k, v, go = _inputs(30, 2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(ow.sdpa, *(t.clone().requires_grad_() for t in (q, k, v)), go)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    ow.clear_graph_cache()
    static_q, static_k, static_v, static_go = (t.clone() for t in _inputs(40, 3))
    for t in (static_q, static_k, static_v):
        t.requires_grad_()
    assert ow.explain(static_q, static_k, static_v)["engine"] == "cudnn_frontend"
    built = ow.frontend_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ow.sdpa(static_q, static_k, static_v)
        static_out.backward(static_go)
    stats = ow.frontend_stats()
    assert stats["forward_graphs_built"] > built["forward_graphs_built"]
    assert stats["backward_graphs_built"] > built["backward_graphs_built"]
    q, k, v, go = _inputs(50, 3)
    for dst, src in ((static_q, q), (static_k, k), (static_v, v), (static_go, go)):
        with torch.no_grad():
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    eager = run(ow.sdpa, *(t.clone().requires_grad_() for t in (q, k, v)), go)
    assert torch.equal(static_out.detach(), eager.out)
    ref, _ = reference(q, k, v, go)
    replayed = type(eager)(static_out.detach(), static_q.grad, static_k.grad, static_v.grad)
    assert_within_stock(replayed, eager, ref, torch.bfloat16)

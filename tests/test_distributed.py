"""openwam_sdpa under torch.distributed on the CPU: the DTensor sharding rules
of the cuDNN path's leaf ops (python/openwam_sdpa/distributed.py), tensor
parallelism through them, and DDP.

A gloo process group of two spawned processes rather than a fake process
group: a fake group runs no collective, so it could show the placements the
rules choose but not that the values are right where DTensor has to
redistribute, nor DDP's gradient all-reduce. Every case runs in one spawn
(each worker imports openwam_sdpa once, which takes seconds); the tests
below read each case's outcome on both ranks. On the CPU the leaf ops run
their fp32 reference kernels, with the plan honoured and no dropout.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import subprocess
import sys
import textwrap
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from support import spawn_gloo_workers

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available")

WORLD = 2
SPAWN_TIMEOUT_S = 300  # the cases take ~30 s; the margin is for a loaded machine

# Plan bits of the leaf ops' `plan` argument (csrc/plan.cpp).
PADDING_MASK, PAD_KEYS_BACKWARD, SHIFT_SCORES = 1, 2, 16

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


# ------------------------------------------------------------ case helpers

def _forward(q, k, v, bias=None, compute_lse=True, plan=0):
    """out, lse, philox seed and offset (the raised bias: key_mask_shifted_in_the_forward)."""
    return torch.ops.openwam._cudnn_sdpa(q, k, v, bias, 0.0, False, None, compute_lse, plan)[:4]


def _inputs(B=2, H=4, L=24, S=40, D=16, Hkv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    Hkv = H if Hkv is None else Hkv
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    grad_out = torch.randn(B, H, L, D, generator=g).to(dtype)
    return q, k, v, grad_out


def _bias(kind, B=2, H=4, L=24, S=40, dtype=torch.float32, seed=5):
    """An additive bias of shape kind ("bhls", "b1ls", "1hls", "11ls"), -inf
    on a few keys of every row (each row keeps most keys)."""
    if kind is None:
        return None
    shape = [B if kind[0] == "b" else 1, H if kind[1] == "h" else 1, L, S]
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(shape, generator=g)
    return bias.masked_fill(torch.rand(shape, generator=g) < 0.2, float("-inf")).to(dtype)


def _reference(q, k, v, grad_out, bias=None, plan=0):
    """The single-process op on the whole tensors: out, lse, dq, dk, dv."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse, _, _ = _forward(q, k, v, bias, plan=plan)
    out.backward(grad_out)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _distributed(mesh, placements, *tensors, leaves=0):
    """Each tensor as a DTensor with its placement; the first `leaves` of
    them as leaves that require grad (q, k, v)."""
    from torch.distributed.tensor import distribute_tensor

    return [distribute_tensor(t, mesh, [p]).requires_grad_(i < leaves)
            for i, (t, p) in enumerate(zip(tensors, placements))]


def _assert_same(got, want, what, **tolerance):
    from torch.distributed.tensor import DTensor

    if isinstance(got, DTensor):
        got = got.full_tensor()
    torch.testing.assert_close(got, want, **tolerance, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------- cases

def _shard_runs_locally(mesh, dim):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    q, k, v, grad_out = _inputs()
    for kind in (None, "bhls", "b1ls", "1hls", "11ls"):
        bias = _bias(kind)
        want = _reference(q, k, v, grad_out, bias)
        dq, dk, dv, dgrad = _distributed(mesh, [Shard(dim)] * 4, q, k, v, grad_out, leaves=3)
        dbias = None
        if bias is not None:
            dbias = _distributed(mesh, [Replicate()], bias)[0]
        with CommDebugMode() as comm:
            out, lse, seed, offset = _forward(dq, dk, dv, dbias)
            out.backward(dgrad)
        # A bias with this dim must arrive sharded like q: that one
        # redistribution (a local slice of a replicated tensor) moves no data.
        assert comm.get_total_counts() == 0, (kind, comm.get_comm_counts())
        assert out.placements == (Shard(dim),), (kind, out.placements)
        assert lse.placements == (Shard(dim),), (kind, lse.placements)
        assert seed.placements == offset.placements == (Replicate(),), kind
        for t in (dq, dk, dv):
            assert t.grad.placements == (Shard(dim),), (kind, t.grad.placements)
        for got, ref, name in zip((out, lse, dq.grad, dk.grad, dv.grad), want,
                                  ("out", "logsumexp", "dq", "dk", "dv")):
            _assert_same(got, ref, f"bias {kind}: {name}")


@case
def batch_sharded(mesh):
    _shard_runs_locally(mesh, 0)


@case
def heads_sharded(mesh):
    _shard_runs_locally(mesh, 1)


@case
def bf16_heads_sharded_with_plans(mesh):
    """bf16, as training runs it, and the plans passed through to the shards
    (the padding mask, and the key-tail plan whose K/V padding the CPU kernel
    carries out as the GPU's ATen fallback does)."""
    from torch.distributed.tensor import Shard

    q, k, v, grad_out = _inputs(S=40, dtype=torch.bfloat16)
    for plan in (PADDING_MASK, PADDING_MASK | PAD_KEYS_BACKWARD):
        want = _reference(q, k, v, grad_out, plan=plan)
        dq, dk, dv, dgrad = _distributed(mesh, [Shard(1)] * 4, q, k, v, grad_out, leaves=3)
        out, lse, _, _ = _forward(dq, dk, dv, plan=plan)
        out.backward(dgrad)
        assert out.placements == (Shard(1),) and dq.grad.placements == (Shard(1),)
        for got, ref, name in zip((out, dq.grad, dk.grad, dv.grad),
                                  (want[0],) + want[2:], ("out", "dq", "dk", "dv")):
            _assert_same(got, ref, f"plan {plan}: {name}")


@case
def key_mask_shifted_in_the_forward(mesh):
    """plan shift_scores with a key mask [B, 1, 1, S] (csrc/score_shift.h):
    the forward's raised bias is placed as the bias is, sharded with a
    batch-sharded q and replicated for a head-sharded one, and the backward
    that reads it gives the single process's gradients. Batch-sharded, the
    shifted logsumexp is the single process's too; head-sharded, each rank
    takes c from its own heads (the local replicas of the raised bias may
    differ: only that rank's backward reads its own). A row shifted by
    another c rounds its scores s + c at another magnitude (fp32 ulps of
    c), so head-sharded gradients agree to that, not to the bit."""
    from torch.distributed.tensor import Replicate, Shard

    q, k, v, grad_out = _inputs()
    keep = torch.rand(2, 1, 1, 40, generator=torch.Generator().manual_seed(6)) < 0.8
    keep[..., 0] = True
    bias = torch.zeros(2, 1, 1, 40).masked_fill(~keep, float("-inf"))
    with torch.no_grad():  # rows whose logsumexp is about -100, for c = 128
        k.add_(4.0)
        q[0, 1, 3] = -6.0
        q[1, 2, 5] = -6.0
    want = _reference(q, k, v, grad_out, bias, plan=SHIFT_SCORES)
    assert float(want[1].min()) >= 0  # the forward shifted every row it had to
    tolerance = {0: {}, 1: dict(atol=1e-4, rtol=1e-3)}
    for dim in (0, 1):
        dq, dk, dv, dgrad = _distributed(mesh, [Shard(dim)] * 4, q, k, v, grad_out, leaves=3)
        dbias = _distributed(mesh, [Replicate()], bias)[0]
        out, lse, _, _, raised = torch.ops.openwam._cudnn_sdpa(
            dq, dk, dv, dbias, 0.0, False, None, True, SHIFT_SCORES)
        assert raised.placements == ((Shard(0),) if dim == 0 else (Replicate(),)), dim
        assert tuple(raised.shape) == tuple(bias.shape), dim
        out.backward(dgrad)
        _assert_same(out, want[0], f"out, dim {dim}")
        if dim == 0:
            _assert_same(lse, want[1], "shifted lse, batch-sharded")
        for name, t, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want[2:]):
            _assert_same(t.grad, w, f"{name}, dim {dim}", **tolerance[dim])


@case
def replicated(mesh):
    from torch.distributed.tensor import Replicate

    q, k, v, grad_out = _inputs()
    bias = _bias("b1ls")
    want = _reference(q, k, v, grad_out, bias)
    dq, dk, dv, dgrad, dbias = _distributed(mesh, [Replicate()] * 5, q, k, v, grad_out, bias,
                                            leaves=3)
    out, lse, _, _ = _forward(dq, dk, dv, dbias)
    out.backward(dgrad)
    assert out.placements == lse.placements == dq.grad.placements == (Replicate(),)
    for got, ref, name in zip((out, lse, dq.grad, dk.grad, dv.grad), want,
                              ("out", "logsumexp", "dq", "dk", "dv")):
        _assert_same(got, ref, name)


@case
def other_placements_redistributed(mesh):
    """Placements the rules do not list (head_dim sharding, q/k/v that
    disagree, a Partial bias) are redistributed by DTensor: the values are
    the single-process op's and the outputs carry a listed placement."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    q, k, v, grad_out = _inputs()
    bias = _bias("bhls").nan_to_num(neginf=-30.0)  # finite: half of it on each rank
    want = _reference(q, k, v, grad_out, bias)
    dq, dk, dv = _distributed(mesh, [Shard(3), Shard(0), Replicate()], q, k, v, leaves=3)
    dbias = DTensor.from_local(bias / WORLD, mesh, [Partial()], run_check=False)
    out, lse, _, _ = _forward(dq, dk, dv, dbias)
    out.backward(_distributed(mesh, [Shard(2)], grad_out)[0])
    listed = {(Shard(0),), (Shard(1),), (Replicate(),)}
    assert out.placements in listed, out.placements
    assert dq.grad.placements in listed | {(Shard(3),)}, dq.grad.placements
    for got, ref, name in zip((out, lse, dq.grad, dk.grad, dv.grad), want,
                              ("out", "logsumexp", "dq", "dk", "dv")):
        _assert_same(got, ref, name)


@case
def sequence_sharded_gathered_outside_context_parallel(mesh):
    """q, k or v sharded on the sequence, with no context parallelism on: a
    plain split, which DTensor gathers for the leaf ops as for PyTorch's own
    attention ops (stock F.sdpa). The values are the single-process op's."""
    import openwam_sdpa
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard

    q, k, v, grad_out = _inputs()
    want = _reference(q, k, v, grad_out)
    for placements in ([Shard(2)] * 4, [Shard(1), Shard(2), Shard(1), Shard(2)]):
        dq, dk, dv, dgrad = _distributed(mesh, placements, q, k, v, grad_out, leaves=3)
        out, lse, _, _ = _forward(dq, dk, dv)
        out.backward(dgrad)
        for got, ref, name in zip((out, lse, dq.grad, dk.grad, dv.grad), want,
                                  ("out", "logsumexp", "dq", "dk", "dv")):
            _assert_same(got, ref, f"{placements}: {name}")
        # The drop-in entry: stock's values and placement.
        got = openwam_sdpa.sdpa(dq, dk, dv)
        stock = F.scaled_dot_product_attention(dq, dk, dv)
        assert got.placements == stock.placements, (placements, got.placements, stock.placements)
        _assert_same(got, stock.full_tensor(), f"{placements}: openwam_sdpa.sdpa")


@contextlib.contextmanager
def _context_parallel_dispatcher():
    """Context parallelism's DTensor dispatch on, as context_parallel() turns
    it on (the ring attention itself needs CUDA; the leaf op refuses first)."""
    for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "_enable_cp_dtensor_dispatcher"):
            module._enable_cp_dtensor_dispatcher()
            try:
                yield
            finally:
                module._disable_cp_dtensor_dispatcher()
            return
    raise AssertionError("this torch has no context parallel dispatcher")


@case
def sequence_sharded_refused_under_context_parallel(mesh):
    """Under context parallelism a sequence shard is no plain split (it is
    reordered for load balance, and read back as sequence-sharded): the leaf
    op raises, naming the way out. The drop-in entry checks each call (DTensor
    caches the leaf op's decision per signature): a call the cuDNN path would
    take raises, one PyTorch's attention takes (context_parallel's own) does
    not."""
    from torch.distributed.tensor import Shard

    from openwam_sdpa import distributed as rules

    q, k, v, _ = _inputs(L=20)  # a signature no other case has cached
    assert not rules.context_parallel_active()
    with _context_parallel_dispatcher():
        assert rules.context_parallel_active()
        for placements in ([Shard(2)] * 3, [Shard(1), Shard(2), Shard(1)]):
            dq, dk, dv = _distributed(mesh, placements, q, k, v)
            try:
                _forward(dq, dk, dv)
            except NotImplementedError as exc:
                message = str(exc)
            else:
                raise AssertionError(f"{placements}: no error")
            name = "query" if placements[0] == Shard(2) else "key"
            for part in (f"{name} is sharded on the sequence dim", "Shard(dim=2)",
                         "context_parallel", "OPENWAM_SDPA_CUDNN=0"):
                assert part in message, (part, message)
            try:
                rules.refuse_under_context_parallel(dq, dk, dv, lambda: "cudnn")
            except NotImplementedError as exc:
                assert f"{name} is sharded on the sequence dim" in str(exc), str(exc)
            else:
                raise AssertionError(f"{placements}: the entry's check let a cuDNN call by")
            rules.refuse_under_context_parallel(dq, dk, dv, lambda: "pytorch")
        replicated = _distributed(mesh, [Shard(1)] * 3, q, k, v)
        rules.refuse_under_context_parallel(*replicated, lambda: "cudnn")
    assert not rules.context_parallel_active()


@case
def logsumexp_skipped_after_computed(mesh):
    """The sharding decision is cached per call signature: one without the
    logsumexp (inference) after one with it must not reuse the latter's
    [B, H, L, 1] logsumexp spec for an empty tensor."""
    from torch.distributed.tensor import Replicate, Shard

    q, k, v, _ = _inputs()
    dq, dk, dv = _distributed(mesh, [Shard(1)] * 3, q, k, v)
    _, lse, _, _ = _forward(dq, dk, dv, compute_lse=True)
    assert lse.placements == (Shard(1),) and lse.shape == (2, 4, 24, 1)
    out, lse, _, _ = _forward(dq, dk, dv, compute_lse=False)
    assert lse.placements == (Replicate(),) and lse.shape == (0,), (lse.placements, lse.shape)
    assert lse.to_local().shape == (0,)
    _assert_same(out, _forward(q, k, v, compute_lse=False)[0], "out")


@case
def dropout_after_none_takes_its_own_philox_specs(mesh):
    """The cached decision covers dropout_p too: the philox seed and offset
    are empty without dropout and 0-dim with it. On meta tensors (the CPU
    kernel has no dropout), one order and the other, each on a fresh shape:
    the specs had been the first call's (found in review)."""
    from torch.distributed.tensor import DTensor, Shard

    def forward(L, p):
        q, k, v = (DTensor.from_local(torch.empty(2, 2, L, 16, device="meta"), mesh,
                                      [Shard(1)], run_check=False) for _ in range(3))
        return torch.ops.openwam._cudnn_sdpa(q, k, v, None, p, False, None, True, 0)

    for L, order in ((5, (0.0, 0.125)), (6, (0.125, 0.0))):
        for p in order:
            for t in forward(L, p)[2:4]:  # the philox state
                assert t.shape == t.to_local().shape == ((0,) if p == 0.0 else ()), \
                    (order, p, t.shape, t.to_local().shape)


@case
def grouped_query_attention(mesh):
    """Heads shard locally when the kv heads divide evenly over the ranks
    (query head h reads kv head h // group); 6 query heads over 3 kv heads
    would put query heads 0-2 with kv heads 0-1 on rank 0: redistributed."""
    from torch.distributed.tensor import Shard

    for heads, kv_heads, local in ((4, 2, True), (6, 3, False)):
        q, k, v, grad_out = _inputs(H=heads, Hkv=kv_heads)
        want = _reference(q, k, v, grad_out)
        dq, dk, dv, dgrad = _distributed(mesh, [Shard(1)] * 4, q, k, v, grad_out, leaves=3)
        out, lse, _, _ = _forward(dq, dk, dv)
        out.backward(dgrad)
        assert (out.placements == (Shard(1),)) == local, (kv_heads, out.placements)
        for got, ref, name in zip((out, dq.grad, dk.grad, dv.grad),
                                  (want[0],) + want[2:], ("out", "dq", "dk", "dv")):
            _assert_same(got, ref, f"kv_heads {kv_heads}: {name}")


@case
def single_query_row_keeps_batch_whole(mesh):
    """With one query row the guard table reads the batch size (batch 1 hits
    cudnn-frontend #1072), and the plan was chosen for the global batch of 2:
    a batch shard of 1 is not offered, so DTensor redistributes."""
    from torch.distributed.tensor import Shard

    q, k, v, grad_out = _inputs(L=1)
    want = _reference(q, k, v, grad_out)
    dq, dk, dv, dgrad = _distributed(mesh, [Shard(0)] * 4, q, k, v, grad_out, leaves=3)
    out, _, _, _ = _forward(dq, dk, dv)
    out.backward(dgrad)
    assert out.placements != (Shard(0),), out.placements
    _assert_same(out, want[0], "out")
    _assert_same(dq.grad, want[2], "dq")


@case
def low_rank_bias_lines_up_from_the_right(mesh):
    """A 3-D [H, L, S] or 2-D [L, S] bias (the leaf op right-aligns it) with q
    sharded on batch or heads: the rule reads the bias's dims from the right.
    Read from the left, [H, L, S] was split on its heads for a batch-sharded
    q and [L, S] on its rows, silently wrong (found in review)."""
    from torch.distributed.tensor import Replicate, Shard

    q, k, v, grad_out = _inputs()
    full = _bias("1hls")
    for bias in (full[0], full[0, 0]):
        want = _reference(q, k, v, grad_out, bias)
        for dim in (0, 1):
            dq, dk, dv, dgrad = _distributed(mesh, [Shard(dim)] * 4, q, k, v, grad_out,
                                             leaves=3)
            dbias = _distributed(mesh, [Replicate()], bias)[0]
            out, _, _, _ = _forward(dq, dk, dv, dbias)
            out.backward(dgrad)
            for got, ref, name in zip((out, dq.grad, dk.grad, dv.grad), (want[0],) + want[2:],
                                      ("out", "dq", "dk", "dv")):
                _assert_same(got, ref, f"bias {tuple(bias.shape)}, q Shard({dim}): {name}")


@case
def mask_bias_keeps_the_mask_placement(mesh):
    """openwam::_mask_bias, which turns the bool mask of a tensor-parallel call
    into cuDNN's bias on the GPU: sharded along any dim but the keys it
    grows, or replicated. Without a rule DTensor refused it."""
    from torch.distributed.tensor import Replicate, Shard

    mask = torch.rand(2, 1, 24, 40, generator=torch.Generator().manual_seed(3)) < 0.8
    want = torch.ops.openwam._mask_bias(mask, torch.float32, 40, 128)
    for placement in (Replicate(), Shard(0), Shard(2)):
        dmask = _distributed(mesh, [placement], mask)[0]
        got = torch.ops.openwam._mask_bias(dmask, torch.float32, 40, 128)
        assert got.placements == (placement,), (placement, got.placements)
        _assert_same(got, want, f"mask {placement}")


@case
def tensor_parallel_attention(mesh):
    """parallelize_module over an attention block whose projections are
    Colwise/Rowwise: the leaf op sees head-sharded q/k/v and the gradients
    of every weight equal the single-process block's."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    class Block(torch.nn.Module):
        def __init__(self, dim=32, heads=4):
            super().__init__()
            self.heads = heads
            self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False)
                                              for _ in range(4))
            self.seen = None

        def forward(self, x, bias):
            b, s, _ = x.shape
            q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2)
                       for p in (self.q, self.k, self.v))
            if isinstance(q, DTensor):
                bias = DTensor.from_local(bias, q.device_mesh, [Replicate()], run_check=False)
            out = _forward(q, k, v, bias)[0]
            self.seen = (getattr(q, "placements", None), getattr(out, "placements", None))
            return self.o(out.transpose(1, 2).reshape(b, s, -1))

    torch.manual_seed(0)
    single = Block()
    tp = Block()
    tp.load_state_dict(single.state_dict())
    parallelize_module(tp, mesh, {"q": ColwiseParallel(use_local_output=False),
                                  "k": ColwiseParallel(use_local_output=False),
                                  "v": ColwiseParallel(use_local_output=False),
                                  "o": RowwiseParallel()})
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    bias = torch.zeros(2, 1, 12, 12).masked_fill(
        torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    single(x, bias).square().sum().backward()
    tp(x, bias).square().sum().backward()
    assert tp.seen == ((Shard(1),), (Shard(1),)), tp.seen
    for name, p in single.named_parameters():
        _assert_same(dict(tp.named_parameters())[name].grad, p.grad, f"grad of {name}")


@case
def ddp_gradients(mesh):
    """A model calling openwam_sdpa.sdpa, wrapped in DDP: each rank takes half
    the batch, and the averaged gradients equal the single-process model's
    on the whole batch."""
    import openwam_sdpa
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Attention(torch.nn.Module):
        def __init__(self, dim=32, heads=4):
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.o = torch.nn.Linear(dim, dim)

        def forward(self, x, mask):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            return self.o(openwam_sdpa.sdpa(q, k, v, attn_mask=mask)
                          .transpose(1, 2).reshape(b, s, -1))

    torch.manual_seed(0)
    single = Attention()
    model = Attention()
    model.load_state_dict(single.state_dict())
    ddp = DDP(model)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 10, 32, generator=g)
    mask = torch.rand(4, 1, 10, 10, generator=g) > 0.3
    mask |= torch.eye(10, dtype=torch.bool)  # every query sees a key
    single(x, mask).square().mean().backward()
    rank, half = dist.get_rank(), x.shape[0] // WORLD
    rows = slice(rank * half, (rank + 1) * half)
    ddp(x[rows], mask[rows]).square().mean().backward()
    for (name, p), (_, want) in zip(model.named_parameters(), single.named_parameters()):
        torch.testing.assert_close(p.grad, want.grad, msg=lambda m: f"grad of {name}: {m}")


# ----------------------------------------------------------------- harness

def _worker(rank: int, store_path: str, out_dir: str) -> None:
    # Both ranks share the machine's two cores with each other.
    torch.set_num_threads(1)
    import openwam_sdpa  # noqa: F401  (the ops)
    import openwam_sdpa.distributed  # noqa: F401  (the rules)
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (WORLD,))
    outcomes = {}
    for name, fn in CASES.items():
        start = time.perf_counter()
        try:
            fn(mesh)
            outcomes[name] = {"error": None}
        except Exception:
            outcomes[name] = {"error": traceback.format_exc()}
        outcomes[name]["seconds"] = time.perf_counter() - start
        # A case that failed on one rank only must not leave the other
        # waiting in a collective of the next case.
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcomes, f)
    dist.barrier()  # both results written before either rank tears gloo down
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """{case: [outcome on rank 0, outcome on rank 1]}, from one spawn."""
    out_dir = tmp_path_factory.mktemp("distributed")
    spawn_gloo_workers(_worker, (str(out_dir / "store"), str(out_dir)), WORLD,
                       [str(out_dir / f"rank{r}.json") for r in range(WORLD)], SPAWN_TIMEOUT_S)
    per_rank = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {name: [ranks[name] for ranks in per_rank] for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_case(outcomes, name):
    errors = [f"rank {r}:\n{o['error']}" for r, o in enumerate(outcomes[name]) if o["error"]]
    assert not errors, "\n".join(errors)


def test_rules_register_when_dtensor_is_imported_later():
    """`import openwam_sdpa` does not load DTensor (it costs seconds) and
    registers the rules right after torch.distributed.tensor's first import.
    (A fresh interpreter: this one has loaded DTensor already.)"""
    script = textwrap.dedent("""
        import sys
        import torch
        if "torch.distributed.tensor" in sys.modules:
            sys.exit(3)  # this torch loads DTensor itself: nothing to defer
        import openwam_sdpa
        from openwam_sdpa import distributed as rules
        assert "torch.distributed.tensor" not in sys.modules
        assert not rules._registered
        from torch.distributed.tensor import DTensor
        assert rules._registered
        strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
        assert torch.ops.openwam._cudnn_sdpa.default in strategies
        assert torch.ops.openwam._cudnn_sdpa_backward.default in strategies
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                            text=True, timeout=120)
    if result.returncode == 3:
        pytest.skip("import torch loads torch.distributed.tensor itself")
    assert result.returncode == 0, result.stderr[-3000:]

"""torch.compile keeps the fix, on the GPU, at every setting.

Adversarial inputs (s_kv = 192, one query row per head with a logsumexp near
-115, bf16) through the op compiled with backend aot_eager and inductor,
fullgraph=True, dynamic and static shapes, at default settings (no
OPENWAM_SDPA_* variable) and at each OPENWAM_SDPA_CUDNN value, with and
without a mask: zero non-finite gradient elements, and gradients within the
error rule of eager's. Before the op became a leaf, default settings gave
1024 non-finite dQ elements under both backends (stock's NaN): the decision
was traced into the graph as aten calls, PyTorch's selector included, and
took another path than in eager.

Then the graphs themselves: the forward graph holds openwam::_cudnn_sdpa and
the backward graph openwam::_cudnn_sdpa_backward with the padding-mask plan, and
CUDA graphs (mode="reduce-overhead") replay the fix.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch

from openwam_sdpa.adversarial import adversarial_inputs

from support import Attn, assert_within_stock, call_targets, nonfinite, reference, traced_graphs

from .conftest import GPU_MARKS, cuda_mask, key_tail_plan

pytestmark = GPU_MARKS

B, H, S_Q, S_KV, D = 2, 4, 128, 192, 128
TARGET = -115.0 - math.log(S_KV)  # every logit of the affected row: lse about -115


def inputs(mask_kind):
    a = adversarial_inputs(B, H, S_Q, S_KV, D, rows="first", target=TARGET,
                           dtype=torch.bfloat16, device="cuda", seed=11)
    return a, cuda_mask(mask_kind, B, 1, S_Q, S_KV, seed=12)


def attention(q, k, v, mask):
    import openwam_sdpa

    return openwam_sdpa.sdpa(q, k, v, attn_mask=mask)


def grads_of(fn, a, mask):
    q, k, v = (t.detach().clone().requires_grad_() for t in (a.query, a.key, a.value))
    out = fn(q, k, v, mask)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), a.grad_out)
    return Attn(out.detach(), dq, dk, dv)


CUDNN_SETTINGS = {"default": None, "cudnn=1": "1", "cudnn=0": "0"}


@pytest.mark.parametrize("mask_kind", ["none", "bool"])
@pytest.mark.parametrize("setting", CUDNN_SETTINGS)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_op_has_no_nonfinite_gradient(backend, dynamic, setting, mask_kind, ow,
                                               settings, suite_results):
    settings(cudnn=CUDNN_SETTINGS[setting])
    torch._dynamo.reset()
    a, mask = inputs(mask_kind)
    eager = grads_of(attention, a, mask)
    compiled = grads_of(torch.compile(attention, backend=backend, fullgraph=True,
                                      dynamic=dynamic), a, mask)
    torch._dynamo.reset()
    bad = {name: nonfinite(getattr(compiled, name)) for name in ("out", "dq", "dk", "dv")}
    suite_results.put("compile", f"{backend} {'dynamic' if dynamic else 'static'} {setting} "
                      f"mask={mask_kind}", **bad)
    assert sum(bad.values()) == 0, bad
    assert nonfinite(eager.dq) == 0
    ref, _ = reference(a.query, a.key, a.value, a.grad_out, attn_mask=mask)
    assert_within_stock(compiled, eager, ref, torch.bfloat16, names="out dq dk dv")


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"],
                         ids=["eager", "aot_eager", "inductor"])
def test_checkpoint_recompute_keeps_the_dropout_pattern(backend, ow):
    """Under activation checkpointing the backward recomputes the forward, and
    must draw the forward's dropout pattern again. With V the identity
    (S_kv == head_dim), out is the dropped and rescaled attention P', and
    dV = P'^T grad_out = out^T grad_out: a fresh pattern in the recompute
    breaks that by the share of entries it drops differently. Compiled, the
    partitioner replays the generator state only for ops tagged
    nondeterministic_seeded (the leaf op is; before, it was not)."""
    from torch.utils.checkpoint import checkpoint

    g = torch.Generator(device="cuda").manual_seed(5)
    b, h, s_q, s = 2, 4, 64, 128
    q, k = (torch.randn(b, h, s_q if i == 0 else s, s, generator=g, device="cuda",
                        dtype=torch.bfloat16).requires_grad_() for i in range(2))
    v = torch.eye(s, device="cuda", dtype=torch.bfloat16).expand(b, h, s, s).clone()
    v.requires_grad_()
    go = torch.randn(b, h, s_q, s, generator=g, device="cuda", dtype=torch.bfloat16)

    def block(q, k, v):
        return ow.sdpa(q, k, v, dropout_p=0.25)

    def checkpointed(q, k, v):
        return checkpoint(block, q, k, v, use_reentrant=False)

    info = ow.explain(q, k, v, dropout_p=0.25)
    assert info["route"] == "cudnn", info
    torch._dynamo.reset()
    fn = checkpointed if backend is None else torch.compile(checkpointed, backend=backend,
                                                             fullgraph=True)
    out = fn(q, k, v)
    (dv,) = torch.autograd.grad(out, (v,), go)
    torch._dynamo.reset()
    want = out.float().transpose(-2, -1) @ go.float()
    error = (dv.float() - want).norm() / want.norm()
    assert error < 0.02, f"dV against out^T grad_out: normalised error {error:.3f}"


def test_graphs_hold_the_ops_forward_and_backward(ow):
    """What AOTAutograd traces at default settings on an affected key length:
    the leaf ops, the plan as an argument, no aten cuDNN attention and no
    selector."""
    a, mask = inputs("bool")
    q, k, v = (t.detach().clone().requires_grad_() for t in (a.query, a.key, a.value))
    graphs = traced_graphs(attention, q, k, v, mask, grad_out=a.grad_out)
    info = ow.explain(q, k, v, attn_mask=mask)
    fwd, bwd = call_targets(graphs["forward"]), call_targets(graphs["backward"])
    assert info["route"] == "cudnn" and info["plan"] == key_tail_plan("bool"), info
    assert "openwam._cudnn_sdpa.default" in fwd
    assert "openwam._cudnn_sdpa_backward.default" in bwd
    assert not any("_fused_sdp_choice" in t or "aten._scaled_dot_product" in t
                   for t in fwd + bwd), fwd + bwd


@pytest.mark.parametrize("mask_kind", ["none", "bool"])
def test_reduce_overhead_replays_the_fix(mask_kind, ow, suite_results):
    """mode="reduce-overhead" captures the step in a CUDA graph: replays must
    carry the fix too (the padding mask's lengths are captured with the graph;
    nothing synchronises with the host)."""
    torch._dynamo.reset()
    a, mask = inputs(mask_kind)
    compiled = torch.compile(attention, mode="reduce-overhead", fullgraph=True)
    counts = []
    for _ in range(4):  # warm-up, record, replays
        r = grads_of(compiled, a, mask)
        counts.append(nonfinite(r.dq) + nonfinite(r.dk) + nonfinite(r.dv))
    torch._dynamo.reset()
    suite_results.put("compile", f"reduce-overhead mask={mask_kind}", nonfinite_per_call=counts)
    assert counts == [0, 0, 0, 0]


_FIRST_FIX_CHILD = """
import math, torch
import openwam_sdpa
from openwam_sdpa.adversarial import adversarial_inputs
a = adversarial_inputs(2, 4, 128, 192, 128, rows="first", target=-115.0 - math.log(192),
                       dtype=torch.bfloat16, device="cuda", seed=11)
f = torch.compile(lambda q, k, v: openwam_sdpa.sdpa(q, k, v), mode="reduce-overhead",
                  fullgraph=True)
bad = []
for _ in range(4):
    q, k, v = (t.detach().clone().requires_grad_() for t in (a.query, a.key, a.value))
    grads = torch.autograd.grad(f(q, k, v), (q, k, v), a.grad_out)
    bad.append(sum(int((~g.isfinite()).sum()) for g in grads))
stats = openwam_sdpa.frontend_stats()
print("NONFINITE", bad, "PADDING_MASK", stats["padding_mask_backwards"],
      "FALLBACK", stats["aten_fallback_calls"])
"""


def test_first_fix_of_the_process_under_reduce_overhead(ow):
    """The padding mask's full-length tensors are cached per stream, but never
    from inside a CUDA graph capture (its fill would only run at replay). A
    fresh process whose first fixed backward runs in torch.compile's
    CUDA-graph warm-up, then in the recording and the replays: every step
    finite, on the frontend."""
    child = subprocess.run([sys.executable, "-c", _FIRST_FIX_CHILD], capture_output=True,
                           text=True, timeout=300)
    log = f"exit {child.returncode}\nstdout:\n{child.stdout}\nstderr:\n{child.stderr[-3000:]}"
    assert child.returncode == 0, log
    # Host counters: the warm-up and the recording count, a replay does not.
    m = re.search(r"NONFINITE \[0, 0, 0, 0\] PADDING_MASK (\d+) FALLBACK 0", child.stdout)
    assert m is not None and int(m.group(1)) >= 1, log

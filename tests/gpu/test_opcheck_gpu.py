"""torch.library.opcheck of every op the package registers, on CUDA tensors:
schema, autograd registration, fake (meta) kernels and AOT dispatch, for each
mask kind, with and without requires_grad, at default settings. s_kv = 704 is
a key length the guard table marks affected on cuDNN 9.19, so the
differentiated calls take the padding-mask plan through the cuDNN path's leaf
ops, which are also checked on their own, plan by plan: their Meta kernels
must describe what cuDNN really returns.
"""

from __future__ import annotations

import math

import pytest
import torch

from .conftest import GPU_MARKS, cuda_adversarial_qkv, cuda_mask, cuda_qkv, cuda_randn

pytestmark = GPU_MARKS

B, H, S_Q, S_KV, D = 1, 2, 128, 704, 64


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_opcheck_sdpa(mask_kind, requires_grad, ow):
    q, k, v = cuda_qkv(B, H, S_Q, S_KV, D, seed=5, requires_grad=requires_grad)
    mask = cuda_mask(mask_kind, B, 1, S_Q, S_KV)
    torch.library.opcheck(torch.ops.openwam.sdpa.default, (q, k, v, mask))


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_opcheck_pad_keys(mask_kind, ow):
    _, k, v = cuda_qkv(B, H, S_Q, S_KV, D, seed=6)
    mask = cuda_mask(mask_kind, B, 1, S_Q, S_KV)
    torch.library.opcheck(torch.ops.openwam.pad_keys.default, (k, v, mask, 128))


# Plan bits (csrc/plan.cpp): padding_mask 1, pad_keys_backward 2, pad_query_backward 8.
SHIFT_SCORES = 16
LEAF_CASES = {"none": (0, 128, 1), "padding_mask": (1, 128, 1),
              "padding_mask+pad_keys_backward": (3, 128, 1),
              "padding_mask+pad_query_backward": (9, 1, 1), "gqa": (1, 128, 2)}


@pytest.mark.parametrize("case", LEAF_CASES.values(), ids=LEAF_CASES.keys())
@pytest.mark.parametrize("mask_kind", ["none", "additive"])
def test_opcheck_cudnn_leaf_ops(case, mask_kind, ow):
    plan, s_q, groups = case
    q, _, _ = cuda_qkv(B, H * groups, s_q, S_KV, D, seed=8)
    _, k, v = cuda_qkv(B, H, s_q, S_KV, D, seed=9)
    mask = cuda_mask(mask_kind, B, 1, s_q, S_KV)
    bias = None if mask is None else mask.expand(B, 1, s_q, S_KV)
    fwd = torch.ops.openwam._cudnn_sdpa.default
    torch.library.opcheck(fwd, (q, k, v, bias, 0.0, False, None, True, plan))
    out, lse, seed, offset, _ = fwd(q.detach(), k.detach(), v.detach(), bias, 0.0, False, None,
                                    True, plan)
    torch.library.opcheck(torch.ops.openwam._cudnn_sdpa_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), bias,
                           out, lse, seed, offset, 0.0, False, None, plan))


def test_opcheck_key_mask_shifted_in_the_forward(ow):
    """A bool key mask on the key tail (plan shift_scores, on cuDNN 9.19.0):
    the forward shifts (csrc/score_shift.h), its fifth output the raised bias
    as the Meta kernel lays it out, and the backward reads that bias with a
    plan that no longer shifts. Through the public op too."""
    q, k, v = cuda_qkv(B, H, S_Q, S_KV, D, seed=12, requires_grad=True)
    keep = torch.rand(B, 1, 1, S_KV, device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(13)) < 0.8
    keep[..., 0] = True
    torch.library.opcheck(torch.ops.openwam.sdpa.default, (q, k, v, keep))
    bias = torch.zeros(B, 1, 1, S_KV, device="cuda", dtype=q.dtype).masked_fill(~keep, -math.inf)
    fwd = torch.ops.openwam._cudnn_sdpa.default
    torch.library.opcheck(fwd, (q, k, v, bias, 0.0, False, None, True, SHIFT_SCORES))
    out, lse, seed, offset, raised = fwd(q.detach(), k.detach(), v.detach(), bias, 0.0, False,
                                         None, True, SHIFT_SCORES)
    assert raised.shape == bias.shape
    torch.library.opcheck(torch.ops.openwam._cudnn_sdpa_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), raised,
                           out, lse, seed, offset, 0.0, False, None, 0))


@pytest.mark.parametrize("shape", [(B, 1, S_Q, 1), (1, 1, 1, 1), (B, H, S_Q, 1)])
def test_leaf_op_bias_broadcast_along_the_keys(shape, ow):
    """A direct call of the leaf op may pass a bias whose key axis is 1. The
    engines describe the bias to cuDNN with a contiguous key axis, so it is
    materialised (bias_keys); an expand's stride 0 went to cuDNN before. A
    bias constant along the keys cannot change the softmax: the call equals
    the call without one. s_kv = 704 and plan padding_mask, as the op runs it."""
    q, k, v = cuda_qkv(B, H, S_Q, S_KV, D, seed=10, requires_grad=True)
    g = torch.Generator(device="cuda").manual_seed(11)
    bias = 3.0 * torch.randn(*shape, device="cuda", dtype=q.dtype, generator=g)
    go = torch.randn(B, H, S_Q, D, device="cuda", dtype=q.dtype, generator=g)

    def run(b):
        out = torch.ops.openwam._cudnn_sdpa(q, k, v, b, 0.0, False, None, True, 1)[0]
        return [out.detach(), *torch.autograd.grad(out, (q, k, v), go)]

    for name, x, ref in zip(("out", "dq", "dk", "dv"), run(bias), run(None)):
        err = float((x.double() - ref.double()).abs().max() / ref.double().abs().max())
        assert err < 2e-2, (shape, name, err)


def test_a_program_exported_without_gradients_trains_with_the_fix(ow):
    """An exported program holds the choice its trace made: after
    run_decompositions(), for a trace without gradients, the cuDNN leaf op
    with compute_log_sumexp=False and no plan. Trained on adversarial rows
    at s_kv = 704 (cuDNN 9.19's key-tail defect), the leaf op takes the
    training forward and the plan decide() gives: finite gradients, equal to
    the op's own. It had raised."""
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return ow.sdpa(q, k, v)

    q, k, v = cuda_adversarial_qkv(B, H, S_Q, S_KV, D, low_rows=range(0, S_Q, 8), seed=12)
    with torch.no_grad():
        exported = torch.export.export(Attention(), (q.detach(), k.detach(), v.detach()))
    decomposed = exported.run_decompositions()
    targets = {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    assert any("_cudnn_sdpa" in t for t in targets), targets
    go = cuda_randn(B, H, S_Q, D, seed=13)
    out = decomposed.module()(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref = torch.autograd.grad(ow.sdpa(q, k, v), (q, k, v), go)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert torch.isfinite(g).all(), name
        err = float((g.double() - r.double()).abs().max() / r.double().abs().max())
        assert err < 1e-2, (name, err)
